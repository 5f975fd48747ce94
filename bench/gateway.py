"""``baton bench gateway``: what the gateway costs per streamed token, apart from any engine.

A synthetic decode worker (a real gRPC ``Decode`` server, registered in a real Redis) streams
``--tokens`` one-token chunks per request as fast as gRPC takes them; the real gateway
(``baton gateway`` in its own process) turns them into SSE for ``--streams`` concurrent clients.
Reported: the gateway's CPU time per token (from ``/proc``, which a busy neighbour inflates far
less than wall time) and the tokens per second one gateway process can stream. A served token
costs the machine this much CPU beside the engine's step: on 2 cores, CPU that the engine's
OpenMP threads do not get.

    baton bench gateway --streams 8 --tokens 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from baton.bench import proc_stats


@dataclass
class GatewayCost:
    streams: int
    tokens_per_stream: int
    seconds: float
    tokens_per_s: float
    gateway_cpu_ms_per_token: float
    client_cpu_ms_per_token: float
    """This process's CPU per token: the client and the synthetic worker together."""


class SyntheticDecode:
    """A ``Decode`` servicer that answers every request with one-token chunks, as fast as it can."""

    def __init__(self):
        from baton.protos import baton_pb2, baton_pb2_grpc

        class Servicer(baton_pb2_grpc.DecodeServicer):
            async def Generate(self, request, context):
                n = request.params.max_tokens
                for i in range(n):
                    last = i == n - 1
                    yield baton_pb2.GenerateChunk(
                        request_id=request.request_id,
                        token_ids=[100 + i % 1000],
                        text=" tok",
                        finish_reason="length" if last else "",
                        num_prompt_tokens=len(request.prompt_token_ids),
                    )

            async def Abort(self, request, context):
                return baton_pb2.AbortResponse(num_aborted=0)

        self.servicer = Servicer()


async def _serve_synthetic(host: str, stop: asyncio.Event, ready: threading.Event, out: dict) -> None:
    from baton.protos import baton_pb2_grpc
    from baton.services.worker_base import start_grpc

    server, port = await start_grpc(
        host, 0, lambda srv: baton_pb2_grpc.add_DecodeServicer_to_server(SyntheticDecode().servicer, srv)
    )
    out["port"] = port
    ready.set()
    await stop.wait()
    await server.stop(grace=1.0)


def _stream(base: str, tokens: int) -> int:
    import httpx

    body = {"prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True}
    got = 0
    with httpx.Client(timeout=600) as client:
        with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += json.loads(line[6:]).get("choices") is not None
    return got


@contextmanager
def synthetic_gateway(host: str = "127.0.0.1", model: str | None = None) -> Iterator[tuple[str, int]]:
    """A real Redis, a synthetic decode worker registered in it (a thread of this process) and the
    real gateway in its own process, ready: yields the gateway's base URL and pid, stops all three."""
    from baton.common.index.registry import WorkerInfo, WorkerRegistry
    from baton.common.index.server import EmbeddedRedis
    from baton.common.model.source import ModelSource
    from baton.common.net import free_port
    from baton.services.procs import ProcessGroup, baton_command, wait_http_ok

    redis_server = EmbeddedRedis()
    url = redis_server.start()
    loop = asyncio.new_event_loop()
    stop, ready, out = asyncio.Event(), threading.Event(), {}
    thread = threading.Thread(
        target=loop.run_until_complete, args=(_serve_synthetic(host, stop, ready, out),)
    )
    thread.start()
    group = ProcessGroup()
    try:
        if not ready.wait(30):
            raise TimeoutError("the synthetic decode worker did not start in 30 s")
        import redis

        registry = WorkerRegistry(redis.Redis.from_url(url), ModelSource.resolve(model).name, ttl_s=3600)
        registry.register(WorkerInfo("synthetic", "decode", f"{host}:{out['port']}", "", ""))
        port = free_port(host)
        cmd = [*baton_command(), "gateway", "--host", host, "--port", str(port), "--redis-url", url]
        group.spawn("gateway", cmd + (["--model", model] if model else []))
        base = f"http://{host}:{port}"
        wait_http_ok(f"{base}/ready", group, 120)
        yield base, group.procs[0][1].pid
    finally:
        group.stop()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        redis_server.stop()


def first_token_ms(base: str, prompt: str, requests: int, warmup: int = 3) -> list[float]:
    """Milliseconds from sending each of ``requests`` streamed one-token completions of ``prompt``
    (one at a time, after ``warmup`` untimed) to its first token's SSE event: the gateway's own
    cost per request (validation, tokenizing, hashing, routing, the gRPC call) against a worker
    that answers at once, plus loopback HTTP."""
    import httpx

    body = {"prompt": prompt, "max_tokens": 1, "stream": True}
    samples = []
    with httpx.Client(timeout=60) as client:
        for i in range(warmup + requests):
            started = time.perf_counter()
            first = None
            with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():  # the whole stream, so that the connection is reused
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter()
            if first is None:
                raise RuntimeError("a completion through the gateway streamed no token")
            if i >= warmup:
                samples.append((first - started) * 1e3)
    return samples


def run(streams: int, tokens: int, host: str = "127.0.0.1") -> GatewayCost:
    with synthetic_gateway(host) as (base, pid):
        _stream(base, 50)  # connections and the channel
        before, client_before, t0 = proc_stats.sample(pid), time.process_time(), time.perf_counter()
        results: list[int] = []
        workers = [
            threading.Thread(target=lambda: results.append(_stream(base, tokens))) for _ in range(streams)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        after, client_after = proc_stats.sample(pid), time.process_time()
    total = sum(results)
    if total != streams * tokens:
        raise RuntimeError(f"streamed {total} tokens, expected {streams * tokens}")
    return GatewayCost(
        streams,
        tokens,
        seconds,
        total / seconds,
        1e3 * (after.cpu_s - before.cpu_s) / total,
        1e3 * (client_after - client_before) / total,
    )


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("gateway", help="the gateway's CPU per streamed token, against a synthetic worker")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_gateway_bench)


def cmd_gateway_bench(a: argparse.Namespace) -> int:
    if a.streams < 1 or a.tokens < 1:
        print("error: --streams and --tokens must be at least 1", file=sys.stderr)
        return 2
    try:
        cost = run(a.streams, a.tokens)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"{cost.streams} streams x {cost.tokens_per_stream} tokens in {cost.seconds:.1f} s: "
        f"{cost.tokens_per_s:.0f} tokens/s; gateway CPU {cost.gateway_cpu_ms_per_token:.3f} ms per token "
        f"(client and synthetic worker {cost.client_cpu_ms_per_token:.3f})"
    )
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(json.dumps(asdict(cost)) + "\n")
    return 0
