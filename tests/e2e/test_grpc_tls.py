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


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    """Redis, a prefill and a decode worker (a tiny random Llama) and a gateway, every gRPC hop
    over mutual TLS with the module's CA."""
    import threading

    from baton.common.engine.config import EngineConfig
    from baton.common.index.server import EmbeddedRedis
    from baton.common.net import free_port
    from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
    from baton.services.gateway.app import GatewayConfig
    from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig
    from tests.e2e.tiny_gateway import build_tiny_llama, gateway

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    redis = EmbeddedRedis()
    url = redis.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(model=str(model), dtype="float32", kv_cache_gib=0.02, max_model_len=256)
    prefill = PrefillWorker(PrefillWorkerConfig(engine=engine, redis_url=url, grpc_tls=pki["server"]))
    decode = DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=url, grpc_tls=pki["server"]))
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=120)  # noqa: E731
    try:
        run(prefill.start())
        run(decode.start())
        config = GatewayConfig(
            model=str(model), port=free_port(), redis_url=url, grpc_tls=pki["client"], log_level="warning"
        )
        with gateway(config) as base:
            yield base, decode, prefill, url, model
    finally:
        for w in (decode, prefill):
            run(w.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        redis.stop()


def test_every_hop_over_mutual_tls(tls_cluster):
    import httpx

    base, decode, prefill, _, _ = tls_cluster
    assert decode._connected  # the decode worker reached the prefill worker over TLS
    body = {"prompt": list(range(100, 164)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["kv_transfer_bytes"] > 0  # prefilled on the prefill worker: that hop was TLS too


def test_a_gateway_without_a_certificate_reaches_no_worker(tls_cluster):
    import threading

    import httpx

    from baton.common.net import free_port
    from baton.services.gateway.app import GatewayConfig, make_server
    from tests.e2e.tiny_gateway import wait_for

    _, _, _, url, model = tls_cluster
    config = GatewayConfig(model=str(model), port=free_port(), redis_url=url, log_level="warning")
    server = make_server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{config.port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 60, "the plaintext gateway to answer /health")
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] in ("worker_unavailable", "no_decode_worker")
        assert httpx.get(f"{base}/ready", timeout=30).status_code == 503  # it can reach no decode worker
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.parametrize("role", ["decode", "gateway"])
def test_the_command_line_refuses_half_a_tls_identity(role, pki):
    import subprocess
    import sys

    args = [sys.executable, "-m", "baton.cli", role, "--grpc-tls-cert", pki["client"].cert]
    if role == "gateway":
        args += ["--redis-url", "redis://127.0.0.1:1"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--grpc-tls-cert and --grpc-tls-key go together" in out.stderr
