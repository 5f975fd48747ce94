"""The gateway's choice of a prefill worker over a real Redis registry and prefix index: the worker
caching a prompt's prefix wins unless its queue is longer than what the prefix saves, and a queue
it published before this gateway's prompt there finished does not send the next turn away."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.engine.hashing import BlockHasher
from baton.common.index.client import connect
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.registry import WorkerInfo, WorkerRegistry
from baton.services.gateway.router import Router

PREFIX = list(range(1000, 1160))  # 10 blocks of 16
PROMPT = PREFIX + [7] * 48  # 208 tokens: 48 past the prefix


def _prefill(worker_id: str, port: int, queued: float) -> WorkerInfo:
    info = WorkerInfo(worker_id, "prefill", f"127.0.0.1:{port}", "", f"http://127.0.0.1:{port}/metrics")
    return info.with_load(queued_prefill_tokens=queued)


@pytest.fixture()
def conn(redis_server, client):
    c = connect(redis_server.url)
    try:
        yield c
    finally:
        c.close()


def _router(conn, queued_a: float, queued_b: float = 0.0) -> Router:
    registry = WorkerRegistry(conn, "m", ttl_s=30.0)
    registry.register(_prefill("a", 2001, queued_a))
    registry.register(_prefill("b", 2002, queued_b))
    index = PrefixIndex(conn, "m", max_entries=1000)
    index.add("a", BlockHasher(16).hash_blocks(PREFIX))
    return Router(registry, refresh_s=3600.0, prefix_index=index, lookup_timeout_s=5.0)


async def _pick(router: Router) -> tuple[str, int]:
    choice = await router.pick_prefill(PROMPT)
    assert choice is not None
    return choice.worker.id, choice.uncached_tokens


def test_the_worker_caching_the_prefix_wins_and_computes_only_the_rest(conn):
    assert asyncio.run(_pick(_router(conn, queued_a=0))) == ("a", 48)


def test_a_queue_longer_than_the_prefix_saves_sends_the_prompt_elsewhere(conn):
    # a: 48 to compute + 200 queued > b: 208 to compute.
    assert asyncio.run(_pick(_router(conn, queued_a=200))) == ("b", 208)


def test_a_queue_published_before_this_gateways_prompt_finished_there_is_taken_off(conn):
    router = _router(conn, queued_a=200)

    async def run() -> list[tuple[str, int]]:
        picks = [await _pick(router)]  # reads the registry: a still reports 200 queued
        with router.track_prefill("127.0.0.1:2001", 200):  # this gateway's 200 there, now finished
            pass
        picks.append(await _pick(router))  # the same read: its 200 are this gateway's, done
        return picks

    assert asyncio.run(run()) == [("b", 208), ("a", 48)]


def test_this_gateways_own_queue_counts_while_the_prompt_runs(conn):
    router = _router(conn, queued_a=0)

    async def run() -> list[str]:
        first = await _pick(router)
        with router.track_prefill("127.0.0.1:2001", 200):  # in flight: not reported yet
            during = await _pick(router)
        return [first[0], during[0]]

    assert asyncio.run(run()) == ["a", "b"]
