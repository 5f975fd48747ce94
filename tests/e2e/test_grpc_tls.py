"""TLS on the internal gRPC, against a real gRPC server: with a CA configured, only a client that
presents a certificate from that CA gets an answer (mutual TLS); plaintext clients and clients with
a certificate from another CA are refused; and a bad configuration is a clear error at start."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.services.grpc_tls import PLAINTEXT, GrpcTLS, add_port, channel
from tests.e2e.tls_certs import make_ca, make_leaf


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "ca"), make_ca(d, "other-ca")
    server = GrpcTLS(*make_leaf(d, ca, "worker"), ca=str(d / "ca.pem"))
    client = GrpcTLS(*make_leaf(d, ca, "gateway"), ca=str(d / "ca.pem"))
    stranger = GrpcTLS(*make_leaf(d, other, "stranger"), ca=str(d / "ca.pem"))
    one_way = GrpcTLS(server.cert, server.key)  # no CA: no client certificate asked
    return {"server": server, "client": client, "stranger": stranger, "one_way": one_way, "dir": d}


async def _check(server_tls: GrpcTLS, client_tls: GrpcTLS) -> str:
    """Health of a real gRPC server bound with ``server_tls``, asked over ``client_tls``: the status
    name, or the gRPC error code's name."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", server_tls)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with channel(f"127.0.0.1:{port}", client_tls) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    finally:
        await server.stop(0)


def test_mutual_tls_admits_only_certificates_from_the_ca(pki):
    assert asyncio.run(_check(pki["server"], pki["client"])) == "SERVING"
    assert asyncio.run(_check(pki["server"], PLAINTEXT)) == "UNAVAILABLE"
    assert asyncio.run(_check(pki["server"], pki["stranger"])) == "UNAVAILABLE"
    # A client that does not know the CA cannot verify the worker either.
    assert asyncio.run(_check(pki["server"], GrpcTLS(pki["client"].cert, pki["client"].key))) == "UNAVAILABLE"


def test_one_way_tls_and_plaintext(pki):
    assert asyncio.run(_check(pki["one_way"], GrpcTLS(*_leaf(pki), ca=pki["server"].ca))) == "SERVING"
    assert asyncio.run(_check(PLAINTEXT, PLAINTEXT)) == "SERVING"
    assert asyncio.run(_check(pki["one_way"], PLAINTEXT)) == "UNAVAILABLE"


def _leaf(pki) -> tuple[str, str]:
    return pki["client"].cert, pki["client"].key


def test_bad_configurations_are_refused_at_start(pki):
    with pytest.raises(ValueError, match="go together"):
        GrpcTLS(cert=pki["client"].cert)
    with pytest.raises(ValueError, match="needs --grpc-tls-cert"):
        GrpcTLS(ca=pki["client"].ca)
    with pytest.raises(ValueError, match="no such file"):
        GrpcTLS(cert=str(pki["dir"] / "missing.crt"), key=pki["client"].key)
