"""Two decode workers behind one gateway: a prompt that shares a long prefix with an earlier one
goes to the worker that caches that prefix (its usage reports the cached tokens)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from baton.common.engine.config import EngineConfig
from baton.common.engine.hashing import BlockHasher
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.gateway.app import GatewayConfig, make_server

# Alone (the suite's serial phase): the gateway skips the prefix index when a lookup takes over its
# 0.5 s Redis timeout, by design, and beside another module's cluster on 2 cores one did (CI on a
# Xeon with AMX: a shared prefix routed blind, 0 cached tokens).
pytestmark = pytest.mark.serial

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster():
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048)
    workers = [DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=url)) for _ in range(2)]
    gateway = None
    gthread = None
    try:
        for w in workers:
            asyncio.run_coroutine_threadsafe(w.start(), loop).result(timeout=300)
        port = free_port()
        gateway = make_server(GatewayConfig(port=port, redis_url=url, log_level="warning"))
        gthread = threading.Thread(target=gateway.run, daemon=True)
        gthread.start()
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if len(httpx.get(f"{base}/workers", timeout=2).json()["workers"]) == 2:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.1)
        yield base, workers, url
    finally:
        if gateway is not None:
            gateway.should_exit = True
            gthread.join(timeout=30)
        for w in workers:
            asyncio.run_coroutine_threadsafe(w.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.stop()


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_prefixes_go_to_the_worker_that_caches_them(cluster):
    base, workers, url = cluster
    prefixes = [list(range(1000 + 500 * i, 1000 + 500 * i + 160)) for i in range(4)]  # 10 blocks each
    # First sight of each prefix, sent together so that load spreads them over both workers.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: _complete(base, p + [7]), prefixes))
    computed = [w.engine.engine.num_prompt_tokens_computed_total for w in workers]
    assert all(c > 0 for c in computed), f"load did not spread the first requests: {computed}"
    # The workers publish their hashes off the engine thread: wait (bounded) until all are visible.
    index = PrefixIndex(redis.Redis.from_url(url), MODEL, max_entries=10**6)
    hashes = [BlockHasher(16).hash_blocks(p) for p in prefixes]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(10 in index.longest_prefix(h).values() for h in hashes):
        time.sleep(0.1)

    # ...and until the heartbeats report both workers idle again, so that load does not outweigh
    # the cached prefix (the router charges each queued request as 256 prompt tokens).
    def idle() -> bool:
        loads = [w["load"] for w in httpx.get(f"{base}/workers", timeout=5).json()["workers"]]
        return all(ld.get("num_running", 0) + ld.get("num_waiting", 0) == 0 for ld in loads)

    # The router reuses its worker list for 0.5 s: idle must hold longer than that, or a list read
    # during the burst could still charge the caching worker for requests it has finished.
    deadline = time.monotonic() + 30
    idle_since = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        idle_since = (idle_since or now) if idle() else None
        if idle_since is not None and now - idle_since > 0.6:
            break
        time.sleep(0.1)
    # Each prefix again, one at a time, with a new tail: every one lands where its prefix is cached.
    for p in prefixes:
        usage = _complete(base, p + [9, 9])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 160, usage
