"""``baton secrets``: what compose.yaml's services share, made once and kept (services/secrets.py)."""

from __future__ import annotations

import stat
import subprocess
import sys
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.services import secrets

FILES = {"redis.conf", "redis-password", "cluster-secret", "ca.crt", "tls.crt", "tls.key"}


def test_init_writes_each_file_once_private_where_secret(tmp_path):
    assert set(secrets.init(tmp_path)) == FILES
    assert {p.name for p in tmp_path.iterdir()} == FILES  # no temporary file left behind
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["tls.key"] == modes["cluster-secret"] == 0o600
    password = (tmp_path / "redis-password").read_text()
    assert len(password) >= 32
    assert f'requirepass "{password}"' in (tmp_path / "redis.conf").read_text()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert secrets.init(tmp_path) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_cli_reports_what_it_wrote(tmp_path):
    run = [sys.executable, "-m", "baton.services.cli", "secrets", str(tmp_path / "s")]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert "wrote redis.conf" in first.stdout and "all there, kept" in again.stdout


def test_the_identity_passes_a_real_mutual_tls_handshake_by_name(tmp_path):
    secrets.init(tmp_path)
    ca, cert, key = ((tmp_path / n).read_bytes() for n in ("ca.crt", "tls.crt", "tls.key"))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True),
    )
    server.start()
    try:
        override = [("grpc.ssl_target_name_override", secrets.SERVER_NAME)]
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=override) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # A client without the identity is refused (the server requires a client certificate).
        with grpc.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca), options=override
        ) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                raise AssertionError("a client with no certificate was served")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
