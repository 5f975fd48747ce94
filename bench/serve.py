"""``baton bench serve``: latency under load against any OpenAI-compatible server, in the manner of
``vllm bench serve``.

Requests go to ``/v1/completions`` as lists of token ids (so every server sees exactly the same
prompt lengths), streamed, with ``ignore_eos`` so that every server does the same work. Arrivals are
a gamma process of the given rate (Poisson at ``burstiness`` 1), optionally capped at
``max_concurrency`` requests in flight. Workloads (``../shared/BENCHMARKS.md``):

- ``w2``: independent random prompts (default 64 × 256 prompt tokens, 256 output tokens).
- ``w3``: groups of prompts sharing a prefix (8 groups × 1,024-token prefix + 64 unique tokens,
  64 output tokens); reports the prefix-cache hit rate against the best possible and the TTFT of
  hits against the group's first (cold) request, from ``usage.prompt_tokens_details.cached_tokens``.
- a trace (``--trace``, the JSONL or CSV ``baton simulate --trace`` reads: ``timestamp``,
  ``input_len``, ``output_len``): each row sent at its time with a random prompt of its length, so
  that a real run and a simulation replay the same requests (``bench fidelity``).
- ``w4``: multi-turn conversations (16 × 4 turns; each turn appends 64 user tokens and the previous
  reply's token ids to the history); reports the KV bytes that Baton moved per turn against the
  bytes of the turn's new tokens (``usage.kv_transfer_bytes``, a Baton extension) and needs the
  server to return token ids (``return_token_ids``, as vLLM does).

TTFT is the time to the first chunk that carries a token; TPOT = (E2E − TTFT) / (output tokens − 1);
ITL = the gaps between chunks that carry tokens. Goodput counts requests per second that meet every
``--goodput`` SLO.

Here: the run (``run_benchmark``) and the command line. The workloads' requests and arrivals are
``serve_workload``'s, the client that sends and times them ``serve_client``'s, the summary, the
table and the plot ``serve_report``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.bench.serve_client import (
    RequestResult,
    discover_model,
    run_conversations,
    send_request,
    start_at_arrivals,
)
from baton.bench.serve_report import format_table, plot, summarize, summarize_w3, summarize_w4
from baton.bench.serve_workload import (
    WORKLOAD_DEFAULTS,
    WORKLOADS,
    RequestSpec,
    arrival_delays,
    trace_requests,
    w2_requests,
    w3_requests,
    w4_user_turns,
    warm_up_request,
)
from baton.planner.workload import load_trace

SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    workload: str = "w2"
    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)
    """SLOs in ms, keyed ``ttft``, ``tpot``, ``e2el``."""
    num_groups: int = 8
    prefix_len: int = 1024
    num_turns: int = 4
    timeout_s: float = 600.0
    progress: bool = True
    label: str = ""
    trace: list[tuple[float, int, int]] | None = None
    """Rows ``(seconds since the first, prompt tokens, output tokens)`` to replay instead of the
    workload's requests and arrivals (``w2`` prompts)."""


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Warm the server with one request, send the workload (at its arrival times, at most
    ``max_concurrency`` in flight), and summarize the results."""
    import httpx
    from tqdm import tqdm

    if cfg.trace is not None and (cfg.workload != "w2" or not cfg.trace):
        raise ValueError("a trace replays w2's kind of requests, and needs at least one row")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {cfg.workload!r}")
    d_num, d_in, d_out = WORKLOAD_DEFAULTS[cfg.workload]
    num = len(cfg.trace) if cfg.trace else cfg.num_prompts or d_num
    in_len = cfg.trace[0][1] if cfg.trace else cfg.input_len or d_in
    out_len = cfg.output_len or d_out
    base = cfg.base_url.rstrip("/")
    url = f"{base}/v1/completions"
    want_ids = cfg.workload == "w4"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await discover_model(client, base)
        await _warm_up(client, url, model, cfg, in_len)

        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=num, disable=not cfg.progress, desc=f"bench serve {cfg.workload}", unit="req")
        results: list[RequestResult] = []

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                res = await send_request(client, url, model, spec, want_ids)
            else:
                async with sem:
                    res = await send_request(client, url, model, spec, want_ids)
            results.append(res)
            bar.update(1)
            return res

        start = time.perf_counter()
        if cfg.workload == "w4":
            num_convs = max(1, num // cfg.num_turns)
            bar.total = num_convs * cfg.num_turns
            users = w4_user_turns(num_convs, cfg.num_turns, in_len, cfg.seed)
            await run_conversations(one, users, out_len, _delays(cfg, num_convs))
        elif cfg.trace:
            specs, delays = trace_requests(cfg.trace, cfg.seed)
            await start_at_arrivals(lambda i: one(specs[i]), delays)
        else:
            specs = _open_loop_requests(cfg, num, in_len, out_len)
            await start_at_arrivals(lambda i: one(specs[i]), _delays(cfg, len(specs)))
        duration = time.perf_counter() - start
        bar.close()
    results.sort(key=lambda r: r.start)
    return _result(cfg, model, results, duration)


async def _warm_up(client, url: str, model: str, cfg: BenchConfig, in_len: int) -> None:
    """One request of the workload's prompt length first: the server answers, and connections are
    made and code compiled off the clock."""
    warm_len = in_len + (cfg.prefix_len if cfg.workload == "w3" else 0)
    warm = await send_request(client, url, model, warm_up_request(warm_len, cfg.seed), cfg.workload == "w4")
    if not warm.success:
        raise RuntimeError(f"the warm-up request failed: {warm.error}")
    if cfg.workload == "w4" and len(warm.output_token_ids) != warm.output_len:
        raise RuntimeError("w4 needs the server to return token ids (return_token_ids)")


def _delays(cfg: BenchConfig, n: int) -> list[float]:
    return arrival_delays(n, cfg.request_rate, cfg.burstiness, cfg.seed)


def _open_loop_requests(cfg: BenchConfig, num: int, in_len: int, out_len: int) -> list[RequestSpec]:
    """W2's or W3's requests (W4's depend on the replies: ``run_conversations``)."""
    if cfg.workload == "w2":
        return w2_requests(num, in_len, out_len, cfg.seed)
    return w3_requests(num, cfg.num_groups, cfg.prefix_len, in_len, out_len, cfg.seed)


def _result(cfg: BenchConfig, model: str, results: Sequence[RequestResult], duration: float) -> dict:
    """The summary of a run, with the run's settings (and W3's or W4's own figures)."""
    out = summarize(results, duration, cfg.goodput)
    out.update(
        label=cfg.label,
        base_url=cfg.base_url,
        model=model,
        workload="trace" if cfg.trace else cfg.workload,
        request_rate=cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        burstiness=cfg.burstiness,
        max_concurrency=cfg.max_concurrency,
        num_prompts=len(results),
        seed=cfg.seed,
    )
    if cfg.workload == "w3":
        out["w3"] = summarize_w3(results)
    if cfg.workload == "w4":
        out["w4"] = summarize_w4(results)
    return out


# -- command line ------------------------------------------------------------------------------------
def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:1500", "tpot:60"]`` -> ``{"ttft": 1500.0, "tpot": 60.0}`` (ms)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {sorted(SLO_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return slos


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="W2/W3/W4: latency under load against an OpenAI server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--workload", default="w2", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=None, help="requests (W4: conversations × turns)")
    p.add_argument(
        "--input-len", type=int, default=None, help="prompt tokens (W3: unique suffix; W4: per turn)"
    )
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (W4: conversations/s)"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="replay a JSONL or CSV of timestamp,input_len,output_len (as baton simulate --trace) instead"
        " of the workload's arrivals and lengths",
    )
    p.add_argument("--num-groups", type=int, default=8, help="W3: prefix groups")
    p.add_argument("--prefix-len", type=int, default=1024, help="W3: shared prefix tokens")
    p.add_argument("--num-turns", type=int, default=4, help="W4: turns per conversation")
    p.add_argument("--label", default="", help="this run's name in the JSON and the plot")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the latency distributions")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=cmd_bench_serve)

    pl = bench_subparsers.add_parser("plot", help="overlay the latency distributions of bench serve JSONs")
    pl.add_argument("results", nargs="+", help="--output-json files of baton bench serve")
    pl.add_argument("--output", required=True, metavar="FILE.png")
    pl.set_defaults(func=cmd_bench_plot)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import sys

    try:
        slos = parse_goodput(a.goodput)
        trace = list(load_trace(a.trace)) if a.trace else None
        if a.request_rate <= 0 or a.burstiness <= 0:
            raise ValueError("--request-rate and --burstiness must be positive")
        for name in ("num_prompts", "input_len", "output_len", "max_concurrency"):
            v = getattr(a, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        base_url=a.base_url,
        model=a.model,
        workload=a.workload,
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        request_rate=a.request_rate,
        burstiness=a.burstiness,
        max_concurrency=a.max_concurrency,
        seed=a.seed,
        goodput=slos,
        num_groups=a.num_groups,
        prefix_len=a.prefix_len,
        num_turns=a.num_turns,
        timeout_s=a.timeout,
        progress=not a.disable_tqdm,
        label=a.label,
        trace=trace,
    )
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (RuntimeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f)
    if a.plot:
        plot([result], a.plot, slos)
    return 0 if result["failed"] == 0 else 1


def cmd_bench_plot(a: argparse.Namespace) -> int:
    results = []
    for path in a.results:
        with open(path) as f:
            results.append(json.load(f))
    plot(results, a.output, results[0].get("goodput_slos_ms") or None)
    return 0
