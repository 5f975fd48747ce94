"""Redis can go away (issue 10, part 4): the gateway goes on routing on the workers it last read, by
its own load counts, ``/ready`` stays 200 while those workers answer, no request waits on Redis;
when Redis comes back empty, the workers register again and republish the blocks they cache, and
prefix-aware routing works again without a restart.

Real parts: a real redis-server on a fixed port, black-holed (SIGSTOP: connections open, nothing
answers), then down (stopped: connections refused), then started again empty; the real gateway
over HTTP; two colocated decode workers of a tiny random Llama over real gRPC.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from baton.common.engine.config import EngineConfig
from baton.common.engine.hashing import BlockHasher
from baton.common.index.client import connect
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.registry import WorkerRegistry
from baton.common.index.server import EmbeddedRedis, EmbeddedRedisConfig
from baton.common.net import free_port
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.gateway.app import GatewayConfig, create_app

from .fault_cluster import ENGINE_FLAGS, GatewayThread, LoopThread, tiny_model, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.serial]

BS = 16
MAX_REQUEST_S = 1.5
"""Bound on one short request while Redis is away: no request may wait on it (its calls time out
after 0.5 s, twice with the retry; a tiny model answers in tens of milliseconds)."""


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def cluster():
    model = tiny_model()
    redis = EmbeddedRedis(EmbeddedRedisConfig(port=free_port()))  # fixed: it restarts on it
    url = redis.start()
    loop = LoopThread()
    engine = EngineConfig(model=str(model), **ENGINE_FLAGS)
    workers = [
        DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=url, colocated=True, heartbeat_ttl_s=3.0))
        for _ in range(2)
    ]
    gateway = None
    try:
        for w in workers:
            loop.run(w.start())
        config = GatewayConfig(port=free_port(), model=str(model), redis_url=url, log_level="warning")
        gateway = GatewayThread(config)
        wait_for(
            lambda: _ready(gateway.url).get("decode_workers") == 2, 60, "the gateway to see both workers"
        )
        yield {"redis": redis, "url": url, "gateway": gateway, "workers": workers, "model": model}
    finally:
        if redis.pid is not None:
            os.kill(redis.pid, signal.SIGCONT)
        if gateway is not None:
            gateway.stop()
        for w in workers:
            loop.run(w.stop(), 60)
        loop.close()
        redis.stop()


def _ready(url: str) -> dict:
    try:
        r = httpx.get(f"{url}/ready", timeout=5)
    except httpx.HTTPError:
        return {}
    return r.json() | {"http_status": r.status_code}


def _complete(url: str, ids: list[int], max_tokens: int = 8) -> tuple[httpx.Response, float]:
    body = {
        "model": "tiny-llama",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # httpx never retries
    return r, time.monotonic() - started


def _generated(workers) -> list[int]:
    return [w.engine.engine.num_generated_tokens_total for w in workers]


def _serves_throughout(url: str, ids: list[int], text: str, seconds: float) -> list[float]:
    """Requests one after another for ``seconds``: each answered, right, within the bound."""
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r, took = _complete(url, ids)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        latencies.append(took)
        assert _ready(url)["http_status"] == 200
    assert max(latencies) < MAX_REQUEST_S, latencies
    return latencies


def test_served_while_redis_is_black_holed_then_down(cluster):
    url, redis, workers = cluster["gateway"].url, cluster["redis"], cluster["workers"]
    ids = _prompt(1, 100)
    first, _ = _complete(url, ids)
    assert first.status_code == 200
    text = first.json()["choices"][0]["text"]
    cluster["short"] = (ids, text)
    # The holder of a long prompt, for the next test: the worker with the larger id, which the
    # gateway would not pick on a tie (sent straight to it, not through the gateway).
    cluster["long"] = _prompt(2, 50 * BS)
    holder = max(workers, key=lambda w: w.worker_id)
    _decode_directly(holder, cluster["long"])

    os.kill(redis.pid, signal.SIGSTOP)
    try:
        black_holed = _serves_throughout(url, ids, text, seconds=3.0)
        assert _ready(url)["registry"] == "unreachable"
        # With the registry away, the gateway weighs workers by its own in-flight counts (their
        # reported loads are stale): requests at once go to both workers.
        before = _generated(workers)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: _complete(url, _prompt(10 + i, 100), 48)[0], range(4)))
        assert [r.status_code for r in results] == [200] * 4
        assert all(after > b for after, b in zip(_generated(workers), before)), "one worker got them all"
    finally:
        os.kill(redis.pid, signal.SIGCONT)
    redis.stop()  # now refused
    refused = _serves_throughout(url, ids, text, seconds=2.0)
    print(f"\nRedis black-holed: {len(black_holed)} requests, slowest {max(black_holed):.2f} s; "
          f"refused: {len(refused)} requests, slowest {max(refused):.2f} s")  # fmt: skip
    # A gateway that never read the registry has nothing to route on: 503, bounded, in the API's shape.
    with TestClient(
        create_app(GatewayConfig(model=str(cluster["model"]), redis_url=cluster["url"]))
    ) as fresh:
        started = time.monotonic()
        assert fresh.get("/ready").status_code == 503
        r = fresh.post("/v1/completions", json={"model": "tiny-llama", "prompt": ids, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_worker"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert time.monotonic() - started < 6.0


def test_redis_restarted_empty_gets_workers_and_their_cached_blocks_back(cluster):
    url, redis, workers = cluster["gateway"].url, cluster["redis"], cluster["workers"]
    long = cluster.get("long")
    assert long is not None, "needs the previous test"
    holder = max(workers, key=lambda w: w.worker_id)
    hashes = BlockHasher(BS).hash_blocks(long)
    assert holder.engine.engine.pool.get_cached_block(hashes[-1]) is not None
    if redis.pid is None:
        redis.start()  # empty: nothing persists
    restarted = time.monotonic()
    # The gateway reads an empty registry until each worker's next heartbeat: it routes on the
    # workers it last saw meanwhile, so no request meets a 503 (a Redis restart costs no request).
    empty = _serves_throughout(url, *cluster["short"], seconds=2.0)
    client = connect(cluster["url"])
    model = holder.engine.engine.model_name
    registry = WorkerRegistry(client, model, ttl_s=3.0)
    ids = {w.worker_id for w in workers}
    wait_for(lambda: {w.id for w in registry.list("decode")} == ids, 10, "both workers to register again")
    registered = time.monotonic() - restarted
    index = PrefixIndex(client, model, max_entries=1_000_000)
    wait_for(
        lambda: index.longest_prefix(hashes).get(holder.worker_id) == len(hashes), 10, "the holder's blocks"
    )
    republished = time.monotonic() - restarted
    wait_for(lambda: _ready(url).get("registry") == "ok", 10, "the gateway to read the registry again")
    print(f"\nRedis restarted empty: {len(empty)} requests served meanwhile, slowest {max(empty):.2f} s; "
          f"workers registered after {registered:.2f} s, cached blocks republished "
          f"after {republished:.2f} s")  # fmt: skip
    # Prefix routing is back: the long prompt goes to the worker that caches it, though the other
    # one would win the tie without the index.
    r, _ = _complete(url, long)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(hashes) - 1) * BS


def _decode_directly(worker: DecodeWorker, ids: list[int]) -> None:
    """One request straight to a worker's gRPC (its prompt is then in that worker's cache)."""
    import grpc

    from baton.common.api.convert import params_to_proto
    from baton.common.llm import SamplingParams
    from baton.protos import baton_pb2, baton_pb2_grpc

    params = params_to_proto(SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        request = baton_pb2.GenerateRequest(
            request_id=f"direct-{time.monotonic()}", prompt_token_ids=ids, params=params
        )
        assert [c for c in baton_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60)]
