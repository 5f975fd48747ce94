"""The gateway's router over a real Redis registry: a decode worker that failed a call is left out
while another is left, and chosen again, not refused, when it is the only one; a registry refilled
after a reset one heartbeat at a time keeps each role's workers last seen until they are back."""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.common.index.client import connect
from baton.common.index.registry import WorkerInfo, WorkerRegistry
from baton.services.gateway.router import NoWorkerError, Router


def _decode(worker_id: str, port: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", f"127.0.0.1:{port}", "", f"http://127.0.0.1:{port}/metrics")


def _pick(router: Router, exclude=()) -> str:
    return asyncio.run(router.pick_decode(exclude=exclude)).id


@pytest.fixture()
def registry(redis_server, client):
    conn = connect(redis_server.url)
    try:
        yield WorkerRegistry(conn, "m", ttl_s=30.0)
    finally:
        conn.close()


def test_a_failed_worker_is_left_out_while_another_is_left(registry):
    registry.register(_decode("a", 1001))
    registry.register(_decode("b", 1002))
    router = Router(registry, refresh_s=0.0)
    router.mark_failed("127.0.0.1:1001")
    assert {_pick(router) for _ in range(4)} == {"b"}
    router.forget("127.0.0.1:1002")  # b failed a call too: both lately failed, neither refused
    assert _pick(router) in {"a", "b"}
    assert _pick(router, exclude=["127.0.0.1:1001"]) == "b"
    with pytest.raises(NoWorkerError):
        _pick(router, exclude=["127.0.0.1:1001", "127.0.0.1:1002"])


def test_the_only_worker_is_tried_again_after_a_failed_stream_not_refused(registry):
    registry.register(_decode("only", 1003))
    router = Router(registry, refresh_s=0.0)
    assert _pick(router) == "only"
    router.mark_failed("127.0.0.1:1003")  # e.g. a keepalive starved on a busy host cut one stream
    assert _pick(router) == "only"  # was a 503 "no decode worker is available" for 10 s
    router.forget("127.0.0.1:1003")
    assert _pick(router) == "only"
    with pytest.raises(NoWorkerError):  # the request that failed there excludes it itself
        _pick(router, exclude=["127.0.0.1:1003"])


def test_a_worker_that_replaced_every_failed_one_is_found_before_the_request_is_refused(registry):
    """A CI run (stop 42) answered 503 with a decode worker registered: the request's list named
    only the worker that had left (connection refused), and the read that would have found its
    successor was in the background."""
    registry.register(_decode("old", 1004))
    router = Router(registry, refresh_s=3600.0)  # no routine refresh: only the request's own read
    assert _pick(router) == "old"
    registry.deregister("old")
    registry.register(_decode("new", 1005))
    assert _pick(router, exclude=["127.0.0.1:1004"]) == "new"
    registry.deregister("new")
    with pytest.raises(NoWorkerError):  # a read that finds none left refuses it, as before
        _pick(router, exclude=["127.0.0.1:1005"])


def test_a_gateway_back_from_idle_routes_on_a_list_read_now_and_with_traffic_on_the_one_it_has(registry):
    registry.register(_decode("first", 1006))
    router = Router(registry, refresh_s=0.0)
    assert _pick(router) == "first"
    registry.deregister("first")
    registry.register(_decode("second", 1007))
    # Within IDLE_READ_S of the last read the list at hand routes the request (the read that
    # replaces it runs beside), so traffic never waits on Redis ...
    assert _pick(router) == "first"
    # ... but a list whose last read is older (a gateway without traffic) is read again first.
    router.IDLE_READ_S = 0.0
    assert _pick(router) == "second"


def _prefill(worker_id: str, port: int) -> WorkerInfo:
    return WorkerInfo(worker_id, "prefill", f"127.0.0.1:{port}", "", f"http://127.0.0.1:{port}/metrics")


def test_a_registry_refilled_one_worker_at_a_time_keeps_the_decode_workers_last_seen(
    registry, client, monkeypatch
):
    """CI stop 46: after `docker compose restart redis` the prefill worker's heartbeat came back
    before either decode worker's, and every request of those seconds got a 503 'no decode worker
    is available': the hold through a reset applied only to a read that found no worker at all."""
    monkeypatch.setattr(Router, "REGISTRY_RESET_HOLD_S", 1.0)
    monkeypatch.setattr(Router, "IDLE_READ_S", 0.0)  # each pick routes on a list read for it
    registry.register(_prefill("p", 1010))
    registry.register(_decode("d1", 1011))
    registry.register(_decode("d2", 1012))
    router = Router(registry, refresh_s=0.0)
    assert _pick(router) in {"d1", "d2"}
    client.flushdb()  # Redis restarted empty ...
    registry.register(_prefill("p", 1010))  # ... and the prefill worker beat first
    assert _pick(router, exclude=["127.0.0.1:1011"]) == "d2"  # was the 503
    registry.register(_decode("d1", 1011))  # one decode worker back: listed once, not twice
    assert sorted(w.id for w in asyncio.run(router.decode_workers())) == ["d1", "d2"]
    deadline = time.monotonic() + 10
    while "d2" in {w.id for w in asyncio.run(router.decode_workers())}:  # d2 never came back
        assert time.monotonic() < deadline, "the decode worker that never came back was held past its hold"
        time.sleep(0.05)
    assert _pick(router) == "d1"
    assert [w.id for w in router.prefill_workers] == ["p"]
