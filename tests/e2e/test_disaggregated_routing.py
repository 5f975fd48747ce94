"""The gateway over 2 prefill workers and a decode worker: a prompt sharing a long prefix with an
earlier one is prefilled by the prefill worker that caches it, and a follow-up turn moves only the
blocks the decode worker lacks."""

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
from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig

MODEL = "SmolLM2-135M-Instruct"
ENGINE = EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048)


@pytest.fixture(scope="module")
def cluster():
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    prefills = [PrefillWorker(PrefillWorkerConfig(engine=ENGINE, redis_url=url)) for _ in range(2)]
    decode = DecodeWorker(DecodeWorkerConfig(engine=ENGINE, redis_url=url))
    run = lambda coro, t=300: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=t)  # noqa: E731
    gateway = gthread = None
    try:
        for w in (*prefills, decode):
            run(w.start())
        port = free_port()
        # A busy 2-core runner can take longer than the default 0.5 s for a Redis lookup; this test is
        # about where a found prefix routes, not about the lookup's bound (test_gateway_outage's).
        config = GatewayConfig(port=port, redis_url=url, log_level="warning", prefix_lookup_timeout_s=10.0)
        gateway = make_server(config)
        gthread = threading.Thread(target=gateway.run, daemon=True)
        gthread.start()
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if len(httpx.get(f"{base}/workers", timeout=2).json()["workers"]) == 3:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "the 3 workers did not register with the gateway in 60 s"
            time.sleep(0.1)
        yield base, url, prefills, decode
    finally:
        if gateway is not None:
            gateway.should_exit = True
            gthread.join(timeout=30)
        for w in (decode, *prefills):
            run(w.stop(), 60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.stop()


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(base: str) -> None:
    def idle() -> bool:
        workers = httpx.get(f"{base}/workers", timeout=5).json()["workers"]
        return all(
            w["load"].get("num_running", 0)
            + w["load"].get("num_waiting", 0)
            + w["load"].get("queued_prefill_tokens", 0)
            == 0
            for w in workers
        )

    deadline = time.monotonic() + 60
    while not idle():
        assert time.monotonic() < deadline, "the workers still report load 60 s after the last request"
        time.sleep(0.2)


def test_prefix_goes_to_its_prefill_worker_and_turns_move_only_new_blocks(cluster):
    base, url, prefills, decode = cluster
    prefixes = [list(range(5000 + 400 * i, 5000 + 400 * i + 160)) for i in range(4)]  # 10 blocks each
    first_tails = [[11 + i] * 48 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:  # together, so that queued tokens spread them
        list(pool.map(lambda i: _complete(base, prefixes[i] + first_tails[i]), range(4)))
    computed = [p.engine.engine.num_prompt_tokens_computed_total for p in prefills]
    assert all(c > 0 for c in computed), f"the first prompts did not spread over both workers: {computed}"

    index = PrefixIndex(redis.Redis.from_url(url), MODEL, max_entries=10**6)
    ids = {p.worker_id for p in prefills}
    hashes = [BlockHasher(16).hash_blocks(p) for p in prefixes]
    deadline = time.monotonic() + 60
    while not all(any(w in ids and n == 10 for w, n in index.longest_prefix(h).items()) for h in hashes):
        assert time.monotonic() < deadline, "the prefill workers did not index all 4 prefixes in 60 s"
        time.sleep(0.1)
    _wait_idle(base)

    hits_before = sum(p.engine.engine.kv.prefix_cache_hits for p in prefills)
    engine = decode.engine.engine
    block_bytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    bytes_before = decode._receiver.stats().bytes
    remote_before = engine.num_remote_prefills_total
    hits = []
    for i, p in enumerate(prefixes):  # the next turn: same prefix, a new 48-token tail
        before = [w.engine.engine.kv.prefix_cache_hits for w in prefills]
        _complete(base, p + [21 + i] * 48)
        hits.append([w.engine.engine.kv.prefix_cache_hits - b for w, b in zip(prefills, before)])
    # Every second-turn prompt found its 160-token prefix on the prefill worker it was sent to...
    assert all(max(h) >= 160 for h in hits), f"cached tokens found per turn, per prefill worker: {hits}"
    assert sum(p.engine.engine.kv.prefix_cache_hits for p in prefills) - hits_before >= 4 * 160
    # ...was prefilled remotely, and moved only the 3 blocks past the 10 the decode worker holds.
    assert engine.num_remote_prefills_total - remote_before == 4
    assert decode._receiver.stats().bytes - bytes_before == 4 * 3 * block_bytes
