"""The pods' gRPC TLS as k8s/ sets it up, against a real gRPC server: one certificate for one name
(no pod IP in it), dialled by IP with ``--grpc-tls-server-name``; and the exec probe
(``python -m baton.services.health_probe``) that stands in for the kubelet's plaintext gRPC probe,
run as the kubelet runs it, with the pod's own certificate folder."""

from __future__ import annotations

import os
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.launch import python_module
from baton.services.grpc_tls import GrpcTLS
from baton.services.health_probe import check
from tests.e2e.pod_certs import NAME, write_tls_dir


def _tls(folder: Path, server_name: str | None = NAME) -> GrpcTLS:
    return GrpcTLS(str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt"), server_name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A gRPC health server on 127.0.0.1 with the shared identity, requiring client certificates."""
    folder = write_tls_dir(tmp_path_factory.mktemp("grpc-tls"))
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_secure_port("127.0.0.1:0", _tls(folder).server_credentials())
    srv.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield folder, port, servicer
    srv.stop(0)


def test_one_certificate_for_one_name_serves_callers_that_dial_an_ip(server):
    folder, port, _ = server
    address = f"127.0.0.1:{port}"
    assert check(address, _tls(folder), 10) == "SERVING"
    # The certificate names no IP: checked against the address dialled, it is refused.
    assert check(address, _tls(folder, server_name=None), 10) == "UNAVAILABLE"
    assert check(address, _tls(folder, server_name="someone-else"), 10) == "UNAVAILABLE"


def test_the_server_name_needs_a_tls_identity():
    with pytest.raises(ValueError, match="--grpc-tls-server-name needs"):
        GrpcTLS(server_name=NAME)


def _probe(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_module("baton.services.health_probe"), "--port", str(port), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_exec_probe_passes_only_on_serving_over_the_pods_certificate(server, tmp_path):
    folder, port, servicer = server
    # As the pods run it: the Secret's folder, the name from the ConfigMap's GRPC_TLS_SERVER_NAME.
    ok = _probe(port, "--tls-dir", str(folder), env={"GRPC_TLS_SERVER_NAME": NAME})
    assert ok.returncode == 0, ok.stderr
    stranger = write_tls_dir(tmp_path / "other-ca")  # the right name, another CA
    refused = _probe(port, "--tls-dir", str(stranger), "--server-name", NAME)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr
    plaintext = _probe(port)  # what the kubelet's own grpc probe would do
    assert plaintext.returncode == 1
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining worker
    try:
        draining = _probe(port, "--tls-dir", str(folder), "--server-name", NAME)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stderr
    finally:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
