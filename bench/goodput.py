"""``baton bench goodput``: the highest request rate a server serves within its SLOs.

W2's goodput as issue 9 defines it: Poisson arrivals of random 256-token prompts asking for 256
tokens (EOS ignored), ``--num-prompts`` requests per rate, a fresh seed per rate (so that no rate
hits prompts an earlier one left in a prefix cache); a rate passes when at least ``--within`` of
its requests meet every SLO (default TTFT ≤ 1.5 s and TPOT ≤ 60 ms). The rates are tried from the
lowest up; the goodput is the highest rate that passes before the first that does not.

The client is ``baton bench serve`` (``--client baton``) or ``vllm bench serve`` (``--client vllm``
with ``--vllm PATH`` and ``--tokenizer DIR``), so that two servers can be compared under the same
client, either one:

    baton bench goodput --base-url http://127.0.0.1:8000 --rates 0.25,0.35,0.5,0.75,1 \\
        --client vllm --vllm /path/to/venv/bin/vllm --tokenizer /path/to/hf-dir --output-json g.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SearchConfig:
    base_url: str
    rates: tuple[float, ...]
    num_prompts: int = 40
    input_len: int = 256
    output_len: int = 256
    slos: tuple[str, ...] = ("ttft:1500", "tpot:60")
    within: float = 0.9
    """Share of requests that must meet every SLO for a rate to pass."""
    seed: int = 0
    """Rate i (0-based) uses seed ``seed + i``."""
    client: str = "baton"
    """``baton`` or ``vllm``."""
    vllm: str = "vllm"
    """The ``vllm`` executable (``--client vllm``)."""
    tokenizer: str | None = None
    """The Hugging Face tokenizer directory ``vllm bench serve`` needs."""
    model: str = "SmolLM2-135M-Instruct"


@dataclass
class RateResult:
    rate: float
    seed: int
    num_prompts: int
    completed: int
    good: int
    share_good: float
    passed: bool
    median_ttft_ms: float
    median_tpot_ms: float
    p90_tpot_ms: float
    request_throughput: float


@dataclass
class SearchResult:
    config: dict
    rates: list[RateResult] = field(default_factory=list)
    goodput: float = 0.0
    """The highest rate that passed before the first that did not (0: none passed)."""


def rate_result(rate: float, seed: int, cfg: SearchConfig, s: dict) -> RateResult:
    """A rate's verdict from a client's summary (``baton bench serve``'s or ``vllm bench serve``'s
    JSON: both give ``completed``, ``duration`` and ``request_goodput``, good requests per second)."""
    good = round(s["request_goodput"] * s["duration"])
    share = good / cfg.num_prompts
    return RateResult(
        rate=rate,
        seed=seed,
        num_prompts=cfg.num_prompts,
        completed=int(s["completed"]),
        good=good,
        share_good=share,
        passed=share >= cfg.within,
        median_ttft_ms=float(s.get("median_ttft_ms", float("nan"))),
        median_tpot_ms=float(s.get("median_tpot_ms", float("nan"))),
        p90_tpot_ms=float(s.get("p90_tpot_ms", float("nan"))),
        request_throughput=float(s["request_throughput"]),
    )


def highest_passing(results: list[RateResult]) -> float:
    best = 0.0
    for r in sorted(results, key=lambda r: r.rate):
        if not r.passed:
            break
        best = r.rate
    return best


def _run_baton(cfg: SearchConfig, rate: float, seed: int) -> dict:
    from baton.bench.serve import BenchConfig, parse_goodput, run_benchmark

    bench = BenchConfig(
        base_url=cfg.base_url,
        workload="w2",
        num_prompts=cfg.num_prompts,
        input_len=cfg.input_len,
        output_len=cfg.output_len,
        request_rate=rate,
        seed=seed,
        goodput=parse_goodput(list(cfg.slos)),
        progress=False,
    )
    return asyncio.run(run_benchmark(bench))


def vllm_command(cfg: SearchConfig, rate: float, seed: int, result_dir: str, name: str) -> list[str]:
    if not cfg.tokenizer:
        raise ValueError("--client vllm needs --tokenizer (a Hugging Face directory of the model)")
    return [cfg.vllm, "bench", "serve", "--backend", "openai", "--base-url", cfg.base_url,
            "--endpoint", "/v1/completions", "--model", cfg.model, "--tokenizer", cfg.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(cfg.input_len),
            "--random-output-len", str(cfg.output_len), "--num-prompts", str(cfg.num_prompts),
            "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed), "--goodput", *cfg.slos,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", name]  # fmt: skip


def _run_vllm(cfg: SearchConfig, rate: float, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="baton-goodput-") as tmp:
        cmd = vllm_command(cfg, rate, seed, tmp, "result.json")
        env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({run.returncode}): {run.stderr[-3000:]}")
        return json.loads((Path(tmp) / "result.json").read_text())


def search(cfg: SearchConfig, log=print) -> SearchResult:
    out = SearchResult(config=asdict(cfg))
    run = _run_vllm if cfg.client == "vllm" else _run_baton
    for i, rate in enumerate(sorted(cfg.rates)):
        seed = cfg.seed + i
        r = rate_result(rate, seed, cfg, run(cfg, rate, seed))
        out.rates.append(r)
        log(
            f"rate {rate:g} req/s: {r.good}/{r.num_prompts} within the SLOs ({100 * r.share_good:.0f}%), "
            f"median TTFT {r.median_ttft_ms:.0f} ms, median/p90 TPOT {r.median_tpot_ms:.1f}/{r.p90_tpot_ms:.1f} ms"
        )
        if not r.passed:
            break
    out.goodput = highest_passing(out.rates)
    log(f"goodput: {out.goodput:g} req/s (the highest rate with >= {100 * cfg.within:.0f}% within the SLOs)")
    return out


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("goodput", help="W2 goodput: the highest rate served within the SLOs")
    p.add_argument("--base-url", required=True)
    p.add_argument("--rates", default="0.25,0.35,0.5,0.75,1,1.5", help="req/s, tried from the lowest")
    p.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--goodput", nargs="+", default=["ttft:1500", "tpot:60"], metavar="KEY:MS")
    p.add_argument("--within", type=float, default=0.9, help="share of requests within the SLOs to pass")
    p.add_argument("--seed", type=int, default=0, help="rate i uses seed + i")
    p.add_argument("--client", choices=["baton", "vllm"], default="baton")
    p.add_argument("--vllm", default="vllm", help="the vllm executable, for --client vllm")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer dir, for --client vllm")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_goodput)


def cmd_goodput(a: argparse.Namespace) -> int:
    try:
        rates = tuple(float(r) for r in a.rates.split(","))
    except ValueError:
        print(f"error: --rates must be numbers, got {a.rates!r}", file=sys.stderr)
        return 2
    cfg = SearchConfig(
        a.base_url, rates, a.num_prompts, a.input_len, a.output_len, tuple(a.goodput), a.within, a.seed,
        a.client, a.vllm, a.tokenizer, a.model,
    )  # fmt: skip
    try:
        result = search(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0
