"""``baton bench decisions``: does the layout the simulator ranks first serve the most, measured?

    baton bench decisions --profile colocated=P2.json 1p1d=P1.json colocated:2=P1.json \\
        --mix uniform:128:384/uniform:64:192 --arrivals poisson,gamma:2 \\
        --slo ttft:2000 tpot:100 --output-jsonl D.jsonl

Issue 30's decision bar: on each scenario (a length mix and an arrival process, under the SLOs) the
layout the plan picks serves within 5% of the best measured goodput. Every candidate layout here
takes the same machine (``baton up --layout`` on all its cores), so the plan's pick is the layout
of the highest predicted goodput (``baton plan``'s objective, goodput per core, at a fixed budget),
each layout predicted from its own profile (a served profile: ``bench served-profile``).

Measured goodput, as ``bench goodput`` measures it: the highest rate at which at least 90% of the
requests meet both SLOs, before the first rate that fails. The rates are one grid per scenario,
shared by every layout (``rate_grid``: ``GRID_STEP`` apart, from ``GRID_FROM`` of the lowest
prediction to ``GRID_TO`` of the highest), and a rate's requests are the same for every layout (drawn
once with the scenario's seed; each layout's prompts are ids of their own, so no prefix is cached
from an earlier run). Each layout climbs the grid from the highest point at or below ``START`` of its
own prediction (down first, where that fails) and stops at its first failure above a pass. A
shortfall under one grid step is within the grid's resolution; the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from baton.bench.breakdown import start_cluster, stop_cluster
from baton.bench.fidelity import Mix, parse_arrival, parse_arrivals, parse_mix, predicted_capacity
from baton.bench.fidelity_report import parse_profile_overrides
from baton.bench.serve import BenchConfig, run_benchmark
from baton.planner.layout import parse_layout
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO, parse_slo
from baton.planner.workload import Workload, draw

TARGET = 0.9
GRID_STEP = 1.08
GRID_FROM, GRID_TO = 0.6, 1.4
START = 0.85
WITHIN = 0.05
MIN_PROMPTS = 16


# -- the plan and the grid (pure) -----------------------------------------------------------------
def rate_grid(predicted: Sequence[float]) -> list[float]:
    """Rates ``GRID_STEP`` apart from ``GRID_FROM`` x the lowest prediction to ``GRID_TO`` x the
    highest (rounded to 4 digits: the same rate in every layout's run)."""
    lo, hi = GRID_FROM * min(predicted), GRID_TO * max(predicted)
    if lo <= 0:
        raise ValueError("every layout needs a positive predicted goodput")
    n = math.ceil(math.log(hi / lo) / math.log(GRID_STEP))
    return [round(lo * GRID_STEP**i, 4) for i in range(n + 1)]


def start_index(grid: Sequence[float], predicted: float) -> int:
    """The highest grid rate at or below ``START`` x ``predicted`` (the lowest where none is)."""
    return max(0, bisect.bisect_right(grid, START * predicted) - 1)


def climb(grid: Sequence[float], start: int, passes: Callable[[float], bool]) -> float:
    """The highest grid rate that passes before the first failure above it, ``passes`` called on
    as few rates as that takes: from ``start`` up while it passes, or down until one does (0.0
    when none does)."""
    i = start
    if not passes(grid[i]):
        while i > 0:
            i -= 1
            if passes(grid[i]):
                return grid[i]
        return 0.0
    while i + 1 < len(grid) and passes(grid[i + 1]):
        i += 1
    return grid[i]


def verdict(predicted: dict[str, float], measured: dict[str, float]) -> dict:
    """The plan's pick (highest predicted), the best measured, and whether the pick is within
    ``WITHIN`` of it."""
    pick = max(predicted, key=lambda k: (predicted[k], k))
    best = max(measured, key=lambda k: (measured[k], k))
    top = measured[best]
    shortfall = 0.0 if top <= 0 else max(0.0, 1.0 - measured[pick] / top)
    return {
        "pick": pick,
        "best": best,
        "shortfall": shortfall,
        "within": shortfall <= WITHIN,
        "within_a_grid_step": shortfall <= 1.0 - 1.0 / GRID_STEP + 1e-9,
    }


def rate_seed(mix: str, arrival: str, rate: float, seed: int) -> int:
    """The requests of one scenario at one rate: the same for every layout."""
    return zlib.crc32(f"{mix}|{arrival}|{rate:.4f}|{seed}".encode())


# -- measuring --------------------------------------------------------------------------------------
def attainment(
    base_url: str, layout: str, mix: Mix, arrival: str, rate: float, slo: SLO, seed: int, window: float
):
    """One rate's requests replayed through the running layout: (share within both SLOs, raw)."""
    kind, cv = parse_arrival(arrival)
    n = max(MIN_PROMPTS, round(rate * window))
    s = rate_seed(mix.text, arrival, rate, seed)
    r = draw(Workload(rate, n, mix.input_len, mix.output_len, kind, cv), s)
    t0 = r.arrival_s[0]
    rows = [(t - t0, i, o) for t, i, o in zip(r.arrival_s, r.input_len, r.output_len)]
    goodput = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms}
    prompts = zlib.crc32(f"{layout}|{s}".encode())
    bench = BenchConfig(base_url, trace=rows, goodput=goodput, seed=prompts, progress=False, timeout_s=1800.0)
    measured = asyncio.run(run_benchmark(bench))
    return (measured["num_good"] or 0) / n, measured


def measure_layout(base_url: str, name: str, mix: Mix, arrival: str, pred: dict[str, float], **kw) -> dict:
    """One layout's measured goodput on one scenario's grid (``climb``), with every rate tried."""
    grid = rate_grid(list(pred.values()))
    tried: list[dict] = []

    def passes(rate: float) -> bool:
        share, m = attainment(base_url, name, mix, arrival, rate, kw["slo"], kw["seed"], kw["window"])
        tried.append({"rate": rate, "attainment": share, "failed": m["failed"]})
        print(f"  {name} {mix.text} {arrival} {rate:.3f} req/s: {share:.0%}", flush=True)
        return share >= TARGET

    good = climb(grid, start_index(grid, pred[name]), passes)
    slo: SLO = kw["slo"]
    return {
        "layout": name, "mix": mix.text, "arrival": arrival, "slo": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        "predicted_goodput": pred[name], "predicted": pred, "grid": grid, "measured_goodput": good,
        "tried": tried, "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "decisions",
        help="the simulator's ranking of layouts against their measured goodput (starts baton up)",
    )
    p.add_argument("--profile", nargs="+", required=True, metavar="LAYOUT=PROFILE.json")
    p.add_argument("--mix", nargs="+", default=["256/128"], help="length mixes IN/OUT (simulate's syntax)")
    p.add_argument("--arrivals", default="poisson,gamma:2", help="poisson and/or gamma:CV")
    p.add_argument("--slo", nargs="+", required=True, metavar="ttft:MS|tpot:MS")
    p.add_argument("--window", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-jsonl", required=True, help="one JSON line per scenario and layout")
    p.set_defaults(func=cmd_decisions)
    r = bench.add_parser("decisions-report", help="the verdicts of bench decisions runs")
    r.add_argument("runs", nargs="+")
    r.set_defaults(func=cmd_decisions_report)


def cmd_decisions(a: argparse.Namespace) -> int:
    try:
        profiles: dict[str, Profile] = parse_profile_overrides(a.profile)
        slo = parse_slo(a.slo)
        mixes = [parse_mix(m) for m in a.mix]
        arrivals = parse_arrivals(a.arrivals)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton bench decisions: {e}", file=sys.stderr)
        return 2
    scenarios = [(m, arr) for m in mixes for arr in arrivals]
    predicted = {
        (m.text, arr): {
            name: predicted_capacity(p, parse_layout(name), m, slo, a.seed, arr)
            for name, p in profiles.items()
        }
        for m, arr in scenarios
    }
    for (mix, arr), pred in predicted.items():
        print(
            f"{mix} {arr}: predicted goodput " + ", ".join(f"{k} {v:.3f}" for k, v in pred.items()),
            flush=True,
        )
    for name in profiles:
        with tempfile.TemporaryDirectory(prefix="baton-decisions-") as logs:
            proc, port = start_cluster(("--layout", name), Path(logs), 900.0)
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
            try:
                for mix, arr in scenarios:
                    kw = dict(slo=slo, seed=a.seed, window=a.window)
                    line = measure_layout(
                        f"http://127.0.0.1:{port}", name, mix, arr, predicted[(mix.text, arr)], **kw
                    )
                    line["machine"] = profiles[name].machine.cpu
                    with open(a.output_jsonl, "a") as f:
                        f.write(json.dumps(line) + "\n")
            finally:
                stop_cluster(proc)
    print(format_report(load_lines([a.output_jsonl])))
    return 0


def load_lines(paths: Sequence[str]) -> list[dict]:
    return [json.loads(x) for p in paths for x in Path(p).read_text().splitlines() if x.strip()]


def format_report(lines: Sequence[dict]) -> str:
    """Per scenario: each layout's predicted and measured goodput, the pick, the verdict."""
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for x in lines:
        by.setdefault((x["mix"], x["arrival"]), {})[x["layout"]] = x
    rows = [
        "| mix | arrivals | layout: predicted / measured goodput (req/s) | plan's pick | best measured | shortfall |",
        "|---|---|---|---|---|---|",
    ]
    n = within = 0
    for (mix, arr), layouts in by.items():
        pred = {k: v["predicted_goodput"] for k, v in layouts.items()}
        meas = {k: v["measured_goodput"] for k, v in layouts.items()}
        v = verdict(pred, meas)
        n += 1
        within += v["within"]
        cells = ", ".join(f"{k} {pred[k]:.2f} / {meas[k]:.2f}" for k in layouts)
        rows.append(f"| {mix} | {arr} | {cells} | {v['pick']} | {v['best']} | {v['shortfall']:.0%} |")
    rows += [
        "",
        f"{within} of {n} scenarios: the plan's pick within {WITHIN:.0%} of the best measured goodput.",
    ]
    return "\n".join(rows)


def cmd_decisions_report(a: argparse.Namespace) -> int:
    print(format_report(load_lines(a.runs)))
    return 0
