"""``baton simulate``'s arguments and handler (stdlib argparse: the planner stays pure).

``cli/main.py`` registers it with ``add_simulate_parser(subparsers)``."""

from __future__ import annotations

import argparse
import json
import math
import sys

from baton.planner.layout import parse_layout
from baton.planner.profile import Profile
from baton.planner.sim_result import SimResult, parse_slo
from baton.planner.simulate import REMOTE_PREFILL_THRESHOLD, simulate
from baton.planner.workload import Workload, load_trace, parse_lengths


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate",
        help="replay a workload through a discrete-event model of the gateway and both pools",
        description="Predict TTFT, TPOT, SLO attainment and goodput of a layout from a profile "
        "(`baton profile`). Lengths: N, uniform:LO:HI or geometric:MEAN.",
    )
    p.add_argument("--profile", required=True, help="a profile JSON written by `baton profile`")
    p.add_argument("--layout", required=True, help="colocated, colocated:N or <N>p<M>d (e.g. 1p1d, 300p700d)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default 1000; a trace: all rows)")
    p.add_argument("--input-len", default="256", help="prompt tokens: N, uniform:LO:HI or geometric:MEAN")
    p.add_argument("--output-len", default="128", help="output tokens: N, uniform:LO:HI or geometric:MEAN")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--cv", type=float, default=1.0, help="gaps' coefficient of variation (gamma)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace", default=None, help="JSONL or CSV of timestamp,input_len,output_len to replay (no rate)"
    )
    p.add_argument("--slo", nargs="+", default=[], metavar="ttft:MS|tpot:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--transport", default=None, help="the profile's transfer model to use (default ucx)")
    p.add_argument("--remote-prefill-threshold", type=int, default=REMOTE_PREFILL_THRESHOLD)
    p.add_argument("--per-worker", action="store_true", help="with --json: each worker's utilisation")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_simulate)
    return p


def run_simulate(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(a.profile)
        layout = parse_layout(a.layout)
        slo = parse_slo(a.slo)
        trace = load_trace(a.trace) if a.trace else None
        workload = Workload(
            rate=a.rate,
            num_prompts=a.num_prompts if a.num_prompts is not None else (0 if trace else 1000),
            input_len=parse_lengths(a.input_len),
            output_len=parse_lengths(a.output_len),
            arrival=a.arrival,
            cv=a.cv,
            trace=trace,
        )
        result = simulate(
            profile,
            layout,
            workload,
            slo,
            a.seed,
            transport=a.transport,
            remote_prefill_threshold=a.remote_prefill_threshold,
        )
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton simulate: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(_finite(result.to_dict(per_worker=a.per_worker))))
    else:
        print(format_table(result))
    return 0


def _finite(d: dict) -> dict:
    """NaN and infinity as null: strict JSON has neither."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def format_table(r: SimResult) -> str:
    rows = [
        f"layout {r.layout}: {r.completed}/{r.num_requests} requests over {r.window_s:.1f} s "
        f"(finished at {r.makespan_s:.1f} s), {r.rejected} rejected",
        f"{'':8}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    for name, d in (("TTFT ms", r.ttft_ms), ("TPOT ms", r.tpot_ms), ("E2E ms", r.e2e_ms)):
        rows.append(f"{name:8}{d.p50:>10.1f}{d.p90:>10.1f}{d.p99:>10.1f}{d.mean:>10.1f}")
    pools = ", ".join(f"{k} {v:.0%}" for k, v in r.pool_utilisation.items())
    rows += [
        f"SLO attainment {r.slo_attainment:.1%}, goodput {r.goodput_req_s:.2f} req/s, "
        f"throughput {r.throughput_req_s:.2f} req/s ({r.output_tok_s:.0f} output tok/s)",
        f"busy: {pools}; preemptions {r.preemptions}; remote prefills {r.remote_prefills}",
        f"simulated {r.events} events in {r.wall_s:.2f} s",
    ]
    return "\n".join(rows)
