"""``baton bench serve``'s figures: a run's results summarized (throughput, goodput, TTFT, TPOT,
ITL and E2E latency percentiles; W3's prefix hits, W4's KV bytes per turn), printed as ``vllm bench
serve`` prints them, and their distributions plotted.

TTFT is the time to the first chunk that carries a token; TPOT = (E2E − TTFT) / (output tokens − 1);
ITL = the gaps between chunks that carry tokens. Goodput counts requests per second that meet every
SLO."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from baton.bench.serve_client import RequestResult


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
