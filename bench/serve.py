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
- ``w4``: multi-turn conversations (16 × 4 turns; each turn appends 64 user tokens and the previous
  reply's token ids to the history); reports the KV bytes that Baton moved per turn against the
  bytes of the turn's new tokens (``usage.kv_transfer_bytes``, a Baton extension) and needs the
  server to return token ids (``return_token_ids``, as vLLM does).

TTFT is the time to the first chunk that carries a token; TPOT = (E2E − TTFT) / (output tokens − 1);
ITL = the gaps between chunks that carry tokens. Goodput counts requests per second that meet every
``--goodput`` SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("w2", "w3", "w4")
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
TOKEN_RANGE = (100, 40000)
"""Random prompt ids are drawn from this range (BENCHMARKS.md)."""


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    output_len: int
    group: int = -1
    """W3: the prefix group; W4: the conversation."""
    turn: int = 0
    """W4: the turn (0-based); W3: the request's position in its group's send order."""
    shared_len: int = 0
    """W3: the group's prefix length (the tokens a cache could serve); W4: the history length."""
    new_len: int = 0
    """W4: the tokens this turn added (the user's)."""


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    cached_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_bytes_per_token: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    group: int = -1
    turn: int = 0
    shared_len: int = 0
    new_len: int = 0

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


# -- workloads --------------------------------------------------------------------------------------
def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def w2_requests(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(f"w2-{seed}")
    return [RequestSpec(_random_ids(rng, input_len), output_len) for _ in range(num_prompts)]


def w3_requests(
    num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: int, seed: int
) -> list[RequestSpec]:
    """``num_prompts`` requests in ``num_groups`` groups sharing a prefix, in a shuffled order."""
    rng = random.Random(f"w3-{seed}")
    prefixes = [_random_ids(rng, prefix_len) for _ in range(num_groups)]
    groups = [i % num_groups for i in range(num_prompts)]
    rng.shuffle(groups)
    seen: dict[int, int] = {}
    out = []
    for g in groups:
        turn = seen[g] = seen.get(g, -1) + 1
        ids = prefixes[g] + _random_ids(rng, suffix_len)
        out.append(RequestSpec(ids, output_len, group=g, turn=turn, shared_len=prefix_len))
    return out


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each of ``n`` requests: gamma(shape=burstiness, mean=1/rate), 0 at an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


# -- the client ---------------------------------------------------------------------------------------
async def _sse_data(response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        line = line.strip()
        if line.startswith("data:"):
            yield line[5:].strip()


async def send_request(client, url: str, model: str, spec: RequestSpec, want_ids: bool) -> RequestResult:
    """Stream one completion and time it."""
    body = {
        "model": model,
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if want_ids:
        body["return_token_ids"] = True
    r = RequestResult(
        prompt_len=len(spec.prompt_token_ids),
        group=spec.group,
        turn=spec.turn,
        shared_len=spec.shared_len,
        new_len=spec.new_len,
    )
    st = r.start = time.perf_counter()
    last = st
    chunks_with_tokens = 0
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for data in _sse_data(resp):
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    r.error = json.dumps(msg["error"])[:300]
                    return r
                now = time.perf_counter()
                for choice in msg.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    r.output_token_ids.extend(ids)
                    if choice.get("text") or ids:
                        if chunks_with_tokens == 0:
                            r.ttft = now - st
                        else:
                            r.itl.append(now - last)
                        last = now
                        chunks_with_tokens += 1
                usage = msg.get("usage")
                if usage:
                    r.output_len = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    r.cached_tokens = int(details.get("cached_tokens") or 0)
                    r.kv_transfer_bytes = int(usage.get("kv_transfer_bytes") or 0)
                    r.kv_bytes_per_token = int(usage.get("kv_bytes_per_token") or 0)
        r.latency = time.perf_counter() - st
        if not done:
            r.error = "the stream ended without [DONE]"
        elif chunks_with_tokens == 0:
            r.error = "no tokens in the stream"
        else:
            r.output_len = r.output_len or chunks_with_tokens
            r.success = True
    except Exception as e:  # noqa: BLE001 - every failure is a failed request, counted and shown
        r.error = f"{type(e).__name__}: {e}"
    return r


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


WORKLOAD_DEFAULTS = {
    # num_prompts, input_len (W3: unique suffix; W4: user tokens per turn), output_len
    "w2": (64, 256, 256),
    "w3": (64, 64, 64),
    "w4": (64, 64, 64),
}


async def _discover_model(client, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_benchmark(cfg: BenchConfig) -> dict:
    import httpx
    from tqdm import tqdm

    if cfg.workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {cfg.workload!r}")
    d_num, d_in, d_out = WORKLOAD_DEFAULTS[cfg.workload]
    num = cfg.num_prompts or d_num
    in_len = cfg.input_len or d_in
    out_len = cfg.output_len or d_out
    base = cfg.base_url.rstrip("/")
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await _discover_model(client, base)
        # One request of the workload's prompt length first (its own random ids, so it warms no
        # prefix): the server answers, and connections are made and code compiled off the clock.
        warm_len = in_len + (cfg.prefix_len if cfg.workload == "w3" else 0)
        warm_spec = RequestSpec(_random_ids(random.Random(f"warm-{cfg.seed}"), warm_len), 4)
        warm = await send_request(client, url, model, warm_spec, cfg.workload == "w4")
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        if cfg.workload == "w4" and len(warm.output_token_ids) != warm.output_len:
            raise RuntimeError("w4 needs the server to return token ids (return_token_ids)")

        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=num, disable=not cfg.progress, desc=f"bench serve {cfg.workload}", unit="req")
        results: list[RequestResult] = []

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                res = await send_request(client, url, model, spec, cfg.workload == "w4")
            else:
                async with sem:
                    res = await send_request(client, url, model, spec, cfg.workload == "w4")
            results.append(res)
            bar.update(1)
            return res

        start = time.perf_counter()
        if cfg.workload == "w4":
            num_convs = max(1, num // cfg.num_turns)
            bar.total = num_convs * cfg.num_turns
            await _run_conversations(one, num_convs, cfg, in_len, out_len)
        else:
            if cfg.workload == "w2":
                specs = w2_requests(num, in_len, out_len, cfg.seed)
            else:
                specs = w3_requests(num, cfg.num_groups, cfg.prefix_len, in_len, out_len, cfg.seed)
            tasks = []
            for spec, delay in zip(
                specs, arrival_delays(len(specs), cfg.request_rate, cfg.burstiness, cfg.seed)
            ):
                await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(spec)))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    results.sort(key=lambda r: r.start)
    out = summarize(results, duration, cfg.goodput)
    out.update(
        label=cfg.label,
        base_url=cfg.base_url,
        model=model,
        workload=cfg.workload,
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


async def _run_conversations(one, num_convs: int, cfg: BenchConfig, user_len: int, out_len: int) -> None:
    """Each conversation starts at its arrival time and sends its turns one after another; each turn's
    prompt is the history (earlier prompts and replies, as token ids) plus ``user_len`` new tokens."""
    rng = random.Random(f"w4-{cfg.seed}")
    users = [[_random_ids(rng, user_len) for _ in range(cfg.num_turns)] for _ in range(num_convs)]

    async def conversation(c: int) -> None:
        history: list[int] = []
        for t in range(cfg.num_turns):
            spec = RequestSpec(history + users[c][t], out_len, group=c, turn=t, shared_len=len(history))
            spec.new_len = user_len
            res = await one(spec)
            if not res.success:
                return
            history = spec.prompt_token_ids + res.output_token_ids

    tasks = []
    for c, delay in enumerate(arrival_delays(num_convs, cfg.request_rate, cfg.burstiness, cfg.seed)):
        await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(conversation(c)))
    await asyncio.gather(*tasks)


# -- figures -----------------------------------------------------------------------------------------
def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p90_{name}_ms": float(np.percentile(ms, 90)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return r.success and all(values[k] * 1000.0 <= v for k, v in slos.items())


def summarize(results: Sequence[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(is_good(r, slos) for r in ok) if slos else len(ok)
    summary: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput_slos_ms": dict(slos),
        "num_good": good if slos else None,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    summary |= _stats("tpot", [r.tpot for r in ok if r.output_len > 1])
    summary |= _stats("itl", [x for r in ok for x in r.itl])
    summary |= _stats("e2el", [r.latency for r in ok])
    summary |= {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "tpots": [r.tpot for r in results],
        "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "errors": [r.error for r in results],
    }
    return summary


def summarize_w3(results: Sequence[RequestResult]) -> dict:
    """Hit rate of the shared prefixes against the best possible (every request after its group's
    first), and the TTFT of hits against the groups' first requests."""
    ok = [r for r in results if r.success]
    later = [r for r in ok if r.turn > 0]
    cacheable = sum(r.shared_len for r in later)
    served = sum(min(r.cached_tokens, r.shared_len) for r in later)
    hits = [r.ttft for r in later if r.cached_tokens >= r.shared_len]
    cold = [r.ttft for r in ok if r.turn == 0]
    mean_hit = float(np.mean(hits)) * 1000 if hits else None
    mean_cold = float(np.mean(cold)) * 1000 if cold else None
    return {
        "cacheable_prefix_tokens": cacheable,
        "cached_prefix_tokens": served,
        "prefix_hit_rate": served / cacheable if cacheable else None,
        "num_hits": len(hits),
        "num_cold": len(cold),
        "mean_ttft_hit_ms": mean_hit,
        "median_ttft_hit_ms": float(np.median(hits)) * 1000 if hits else None,
        "mean_ttft_cold_ms": mean_cold,
        "median_ttft_cold_ms": float(np.median(cold)) * 1000 if cold else None,
        "cold_over_hit_ttft": mean_cold / mean_hit if mean_hit and mean_cold else None,
    }


def summarize_w4(results: Sequence[RequestResult]) -> dict:
    """KV bytes moved per turn against the bytes of the turn's new tokens."""
    ok = [r for r in results if r.success]
    turns = sorted({r.turn for r in ok})
    per_turn = {}
    for t in turns:
        rs = [r for r in ok if r.turn == t]
        moved = float(np.mean([r.kv_transfer_bytes for r in rs]))
        bpt = max((r.kv_bytes_per_token for r in rs), default=0)
        delta = float(np.mean([r.new_len for r in rs])) * bpt
        per_turn[str(t + 1)] = {
            "requests": len(rs),
            "mean_kv_bytes": moved,
            "new_token_bytes": delta,
            "bytes_over_delta": moved / delta if delta else None,
            "mean_cached_tokens": float(np.mean([r.cached_tokens for r in rs])),
            "mean_prompt_tokens": float(np.mean([r.prompt_len for r in rs])),
        }
    bpt = max((r.kv_bytes_per_token for r in ok), default=0)
    moved_all = sum(r.kv_transfer_bytes for r in ok)
    delta_all = sum(r.new_len for r in ok) * bpt
    return {
        "kv_bytes_per_token": bpt,
        "per_turn": per_turn,
        "total_kv_bytes": moved_all,
        "bytes_over_delta": moved_all / delta_all if delta_all else None,
    }


def format_table(s: dict) -> str:
    """The result as ``vllm bench serve`` prints it."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(name: str, value, fmt: str = ".2f") -> None:
        v = "-" if value is None else format(value, fmt) if not isinstance(value, str) else value
        lines.append(f"{name:<40}{v:<10}")

    row("Successful requests:", s["completed"], "d")
    row("Failed requests:", s["failed"], "d")
    if s.get("max_concurrency"):
        row("Maximum request concurrency:", s["max_concurrency"], "d")
    rate = s.get("request_rate")
    row("Request rate configured (RPS):", rate if isinstance(rate, str) else float(rate or 0))
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"], "d")
    if s.get("total_cached_tokens"):
        # A server's prefix cache turns prefills into hits: say so, or a rerun with the same --seed
        # quietly measures another workload.
        row("Input tokens from cache:", s["total_cached_tokens"], "d")
    row("Total generated tokens:", s["total_output_tokens"], "d")
    row("Request throughput (req/s):", s["request_throughput"])
    if s.get("request_goodput") is not None:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        short = key.upper() if key != "e2el" else "E2EL"
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", s[f"{stat}_{key}_ms"])
    if "w3" in s:
        w3 = s["w3"]
        lines.append("{s:{c}^{n}}".format(s="Shared prefixes (W3)", n=w, c="-"))
        row("Prefix tokens served from cache:", w3["cached_prefix_tokens"], "d")
        row("Cacheable prefix tokens:", w3["cacheable_prefix_tokens"], "d")
        row("Prefix hit rate:", w3["prefix_hit_rate"], ".3f")
        row("Mean TTFT, hits (ms):", w3["mean_ttft_hit_ms"])
        row("Mean TTFT, cold (ms):", w3["mean_ttft_cold_ms"])
        row("Cold / hit TTFT:", w3["cold_over_hit_ttft"])
    if "w4" in s:
        w4 = s["w4"]
        lines.append("{s:{c}^{n}}".format(s="Multi-turn KV movement (W4)", n=w, c="-"))
        row("KV bytes per token:", w4["kv_bytes_per_token"], "d")
        for t, pt in w4["per_turn"].items():
            row(f"Turn {t}: KV bytes moved / new tokens' bytes:", pt["bytes_over_delta"], ".3f")
        row("All turns: moved / new tokens' bytes:", w4["bytes_over_delta"], ".3f")
    lines.append("=" * w)
    return "\n".join(lines)


def plot(results: Sequence[dict], path: str, slos: dict[str, float] | None = None) -> None:
    """The distributions (CDFs) of TTFT, TPOT, ITL and E2E latency of one or more runs, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        ("ttfts", "TTFT", "ttft"),
        ("tpots", "TPOT", "tpot"),
        ("itls", "ITL", None),
        ("e2els", "E2E latency", "e2el"),
    )
    for ax, (key, title, slo_key) in zip(axes.flat, panels):
        for res in results:
            ok = [e == "" for e in res["errors"]]
            vals = res[key]
            if key == "itls":
                xs = [x for v, good in zip(vals, ok) if good for x in v]
            else:
                xs = [v for v, good in zip(vals, ok) if good]
            if not xs:
                continue
            xs = np.sort(np.asarray(xs) * 1000.0)
            ys = np.arange(1, len(xs) + 1) / len(xs)
            name = res.get("label") or res.get("base_url", "")
            ax.step(xs, ys, where="post", label=f"{name} (p99 {np.percentile(xs, 99):.0f} ms)")
        if slos and slo_key in (slos or {}):
            ax.axvline(
                slos[slo_key], color="red", linestyle="--", linewidth=1, label=f"SLO {slos[slo_key]:.0f} ms"
            )
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itls" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = results[0]
    rate = first.get("request_rate")
    fig.suptitle(f"{first.get('workload', '').upper()} at {rate} req/s, {first.get('num_prompts')} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    )
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (RuntimeError, OSError) as e:
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
