"""Redis can go away: every call is bounded, a worker's heartbeat outlives the outage and registers
again when Redis comes back empty, and the cache publisher neither stalls nor piles up while Redis
is away and publishes the whole prefix cache again once it is back.

A real redis-server on a fixed port, "black-holed" with SIGSTOP (connections open, nothing
answers) and restarted empty (stop, start on the same port). Each test leaves it running."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.hashing import BlockHasher
from baton.common.index.client import RedisClientConfig, connect
from baton.common.index.locations import BlockLocations, LocationRecorder
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.publisher import CachePublisher
from baton.common.index.registry import Heartbeat, WorkerInfo, WorkerRegistry
from baton.common.index.server import EmbeddedRedis, EmbeddedRedisConfig
from baton.common.net import free_port

from .helpers import pid_alive, wait_until

MODEL = "away-model"
WORST_S = RedisClientConfig().worst_case_s  # 2 s: one retry of connect + read, 0.5 s each


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    redis = EmbeddedRedis(EmbeddedRedisConfig(port=free_port()))
    redis.start()
    try:
        yield redis
    finally:
        pid = redis.pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)  # a test that failed while it was stopped
        redis.stop()
        assert pid is None or not pid_alive(pid)


@pytest.fixture()
def client(server):
    conn = connect(server.url)
    conn.flushdb()
    yield conn
    conn.close()


@contextmanager
def black_holed(server: EmbeddedRedis) -> Iterator[None]:
    """The server stopped: the kernel still accepts connections, nothing ever answers."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def _restart_empty(server: EmbeddedRedis) -> None:
    """Stop and start again on the same port, with nothing in it (no persistence)."""
    server.stop()
    server.start()


def _worker(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", "127.0.0.1:1", "", "http://127.0.0.1:2/metrics")


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return BlockHasher(4).hash_blocks([salt * 1000 + i for i in range(4 * n)])


def test_every_call_is_bounded_against_a_black_holed_or_a_refused_redis(server):
    conn = connect(server.url)
    conn.ping()  # a pooled connection exists: the stop hits one in use and new ones alike
    with black_holed(server):
        for call in (conn.ping, lambda: conn.set("k", "v"), lambda: list(conn.scan_iter(match="*"))):
            started = time.monotonic()
            with pytest.raises(Exception, match="[Tt]imeout"):
                call()
            assert time.monotonic() - started < WORST_S + 0.5
    assert conn.ping()  # answers again at once: the pool dropped its dead connections
    refused = connect(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(Exception, match="[Cc]onnect"):
        refused.ping()
    assert time.monotonic() - started < WORST_S


def test_register_says_whether_redis_still_had_the_worker(server, client):
    registry = WorkerRegistry(client, MODEL, ttl_s=30)
    assert registry.register(_worker("d0")) is False  # new
    assert registry.heartbeat(_worker("d0")) is True
    _restart_empty(server)
    assert registry.heartbeat(_worker("d0")) is False  # Redis came back empty: registered again
    assert [w.id for w in registry.list()] == ["d0"]


def test_heartbeat_survives_an_outage_logs_it_once_and_catches_up_after_an_empty_restart(server, caplog):
    caplog.set_level(logging.WARNING, logger="baton.common.index.registry")
    forgotten = []
    registry = WorkerRegistry(connect(server.url), MODEL, ttl_s=0.9)  # a beat every 0.3 s
    heartbeat = Heartbeat(registry, _worker("d1"), on_forgotten=lambda: forgotten.append(time.monotonic()))
    heartbeat.start()
    try:
        with black_holed(server):
            time.sleep(2.5)  # several beats fail (each bounded by the client's timeouts)
        assert heartbeat.running
        warnings = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
        assert len(warnings) == 1 and "unreachable" in warnings[0], warnings
        assert wait_until(lambda: any("reachable again" in r.getMessage() for r in caplog.records), 5)
        # SIGSTOP froze Redis's clock too, but its keys expire by wall time: the record lapsed and
        # the next beat put it back and said so.
        assert wait_until(lambda: registry.get("d1") is not None, 5)
        n = len(forgotten)
        restarted = time.monotonic()
        _restart_empty(server)
        assert wait_until(lambda: len(forgotten) > n, 5), "the heartbeat did not notice the empty restart"
        assert forgotten[-1] - restarted < 2.0 and registry.get("d1") is not None
        assert heartbeat.num_forgotten == len(forgotten)
    finally:
        heartbeat.stop(deregister=False)


def test_cache_publisher_drops_events_while_redis_is_away_and_republishes_everything_after(server, client):
    index = PrefixIndex(connect(server.url), MODEL, max_entries=10_000)
    pool = BlockPool(64)
    publisher = CachePublisher(index, "d2", probe_s=0.1)

    def snapshot() -> None:  # the worker runs this on its engine thread
        publisher.submit_snapshot(pool.cached_hashes())

    publisher.snapshot_source = snapshot
    publisher.start()

    class Events:
        def __init__(self, stored):
            self.stored, self.removed = stored, []

    def cache(hashes: list[bytes]) -> None:
        blocks = pool.get_new_blocks(len(hashes))
        for block, h in zip(blocks, hashes):
            pool.cache_block(block, h)
        pool.free_blocks(blocks)  # free but still cached: they count (a hit revives them)
        publisher.submit(Events(hashes))

    try:
        before, during = _hashes(4, salt=1), _hashes(6, salt=2)
        cache(before)
        assert wait_until(lambda: index.longest_prefix(before) == {"d2": 4}, 5)
        with black_holed(server):
            started = time.monotonic()
            for i in range(200):  # a busy engine keeps submitting: submit never waits
                cache([during[i % 6]]) if i < 6 else publisher.submit(Events([during[0]]))
            assert time.monotonic() - started < 0.5
            assert wait_until(lambda: publisher.num_dropped > 0, 5)
        # Back (its data intact, the events of the outage lost): the whole cache goes out again.
        assert wait_until(lambda: index.longest_prefix(during) == {"d2": 6}, 10), "no resync after the outage"
        # Every event of the outage was dropped, the queued ones in bulk after the first failed
        # write (not one bounded timeout each: that alone would take 200 s). On a loaded machine a
        # write before the outage can outlast the client's 0.5 s read timeout and count as dropped too.
        # The publisher counts a resync once its last write is done: the test may see the hashes first.
        assert wait_until(lambda: publisher.num_resyncs >= 1, 5), "the hashes came back without a resync"
        assert publisher.num_dropped >= 200
        resyncs = publisher.num_resyncs
        _restart_empty(server)
        assert index.longest_prefix(before) == {}
        publisher.resync()  # what the heartbeat does when it finds Redis empty
        assert wait_until(lambda: index.longest_prefix(before) == {"d2": 4}, 5)
        assert index.longest_prefix(during) == {"d2": 6} and publisher.num_resyncs == resyncs + 1
    finally:
        publisher.stop()


def test_block_locations_are_written_off_the_callers_thread_and_dropped_when_redis_is_away(server, client):
    locations = BlockLocations(connect(server.url), MODEL, ttl_s=60)
    recorder = LocationRecorder(locations, max_pending=4)
    recorder.start()
    try:
        recorder.record("r0", "d3", [1, 2], "pending")
        assert wait_until(lambda: locations.get("r0") is not None, 5)
        with black_holed(server):
            started = time.monotonic()
            for i in range(20):
                recorder.record(f"away-{i}", "d3", [i], "pending")
            assert time.monotonic() - started < 0.1  # nobody waits
            assert recorder.num_dropped >= 20 - 4 - 1  # the queue is bounded
        assert wait_until(lambda: recorder.pending == 0, 10)
        recorder.record("r1", "d3", [3], "landed")
        assert wait_until(lambda: locations.get("r1") is not None, 10)
        assert locations.get("r1").state == "landed"
    finally:
        recorder.close()
