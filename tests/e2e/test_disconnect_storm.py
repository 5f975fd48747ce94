"""A disconnect storm through ``baton up`` with a prefill and a decode worker: 1,000 streams that
clients abandon at random points (queued, prefilling, mid-transfer, mid-decode) leave no KV block
held on either worker, by the engines' own block accounting in their ``/metrics``, and every
engine idle again; the cluster then serves a request as before. First, its locked doors (issue
28): ``baton up`` was ready only once its gateway counted the prefill worker, and a prefill worker
forged into Redis without the cluster secret gets no connection from the decode worker."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.e2e.forged_worker import (
    cluster_redis,
    gateway_pid,
    recording_server,
    service_flag,
    write_forgeries,
)
from tests.e2e.up_process import start_up, stop_up

pytestmark = [pytest.mark.slow, pytest.mark.serial]

NUM_STREAMS = 1000
CONCURRENCY = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("storm-logs")
    port, proc = start_up(["--prefill", "1", "--decode", "1", "--kv-cache-gib", "0.5"], logs)
    base = f"http://127.0.0.1:{port}"
    # What the gateway answered when baton up said it was ready (its /ready is cached for 1 s).
    ready = httpx.get(f"{base}/ready", timeout=10).json()
    yield {"base": base, "proc": proc, "ready_at_start": ready}
    stop_up(proc)


def _gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _abandon(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One request given up at a random moment: where it was when its client left. A quarter
    leave at once or within 50 ms (queued), a quarter of the streams after a random number of
    tokens (mid-decode: a slow machine, whose first tokens come late, still sees streams left
    mid-way), the rest after a random time (queued, prefilling, mid-transfer or mid-decode)."""
    prompt = [rng.randrange(200, 40000) for _ in range(rng.randrange(8, 160))]
    stream = rng.random() < 0.9
    body = {"prompt": prompt, "max_tokens": 96, "ignore_eos": True, "stream": stream}
    leave_at_token = None
    if i % 4 == 0:
        leave_after = rng.choice([0.0, 0.01, 0.05])
    elif i % 4 == 1 and stream:
        leave_after, leave_at_token = 60.0, rng.randrange(1, 16)
    else:
        leave_after = rng.uniform(0.0, 1.5)
    got = {"tokens": 0}

    async def consume() -> str:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got["tokens"] += 1
                    if got["tokens"] == leave_at_token:
                        return "mid-stream"  # leaving the block closes the connection
        return "finished"

    try:
        return await asyncio.wait_for(consume(), leave_after)
    except asyncio.TimeoutError:
        return "before the first token" if got["tokens"] == 0 else "mid-stream"


async def _storm(base: str) -> dict[str, int]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
    counts: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        sem = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> None:
            async with sem:
                where = await _abandon(client, rng, i)
                counts[where] = counts.get(where, 0) + 1

        await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))
    return counts


def test_ready_once_the_gateway_routes_to_the_prefill_worker(cluster):
    """``baton up`` waits on the gateway's ``/ready``, which with ``--expect-prefill 1`` counts the
    prefill worker in the router's own list: a gateway that was ready with no prefill worker listed
    named none in its first requests."""
    assert service_flag(gateway_pid(cluster["proc"].pid), "--expect-prefill") == "1"
    assert cluster["ready_at_start"]["status"] == "ready"
    assert cluster["ready_at_start"]["prefill_workers"] == 1


def test_a_forged_prefill_worker_gets_no_connection(cluster):
    base, redis = cluster["base"], cluster_redis(cluster["proc"].pid)
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    decode = next(
        w for w in httpx.get(f"{base}/workers", timeout=10).json()["workers"] if w["role"] == "decode"
    )
    with recording_server() as (address, calls):
        forged = write_forgeries(redis, model, address)
        try:
            time.sleep(2.0)  # the decode worker reads the prefill workers every 0.5 s
            body = {"prompt": list(range(1000, 1100)), "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["kv_transfer_bytes"] > 0, r.text
            rejected = "baton:registry_rejected_records_total"
            assert _gauges(httpx.get(decode["metrics_url"], timeout=10).text, (rejected,))[rejected] > 0
        finally:
            redis.delete(*forged)
    assert calls == []


def test_a_disconnect_storm_leaks_no_kv_block(cluster):
    base = cluster["base"]
    counts = asyncio.run(_storm(base))
    assert sum(counts.values()) == NUM_STREAMS
    assert counts.get("before the first token", 0) > 50 and counts.get("mid-stream", 0) > 50, counts

    workers = httpx.get(f"{base}/workers", timeout=10).json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    names = ("baton:kv_cache_usage_perc", "baton:num_requests_running", "baton:num_requests_waiting")
    deadline = time.monotonic() + 90  # a prefill worker frees blocks held for a dead transfer by then
    while True:
        seen = {w["role"]: _gauges(httpx.get(w["metrics_url"], timeout=10).text, names) for w in workers}
        if all(v == 0.0 for g in seen.values() for v in g.values()):
            break
        assert time.monotonic() < deadline, f"blocks or requests still held after the storm: {seen}"
        time.sleep(0.5)
    assert all(set(g) == set(names) for g in seen.values()), seen
    decode = next(w for w in workers if w["role"] == "decode")
    moved = _gauges(httpx.get(decode["metrics_url"], timeout=10).text, ("baton:kv_transfer_bytes_total",))
    assert moved.get("baton:kv_transfer_bytes_total", 0) > 0  # KV crossed from the prefill worker
    in_flight = _gauges(httpx.get(f"{base}/metrics", timeout=10).text, ("baton:gateway_requests_in_flight",))
    assert in_flight == {"baton:gateway_requests_in_flight": 0.0}

    r = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
