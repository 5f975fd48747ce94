"""``baton bench fidelity``: the simulator's predictions against real runs of the same requests.

For one layout and a profile, it starts ``baton up --layout L`` (any further ``baton up`` flags after
``--``), and for each length mix:

1. the predicted capacity: the highest rate whose simulated SLO attainment reaches 90% (``baton
   plan``'s bisection, on 400 Poisson requests of the mix);
2. for each load (a fraction of that capacity) and arrival process, one set of requests drawn with the
   seed (``planner.workload.draw``) is simulated and sent to the cluster at the same times with the
   same lengths (``bench serve``'s trace replay): so a run and its prediction differ only in what the
   machine did;
3. one JSON line a run: predicted and measured SLO attainment, P90 TTFT and TPOT, and the closed-form
   rule's attainment (a layout serves ``min(1, capacity / rate)`` of requests, its capacity the
   profiled per-worker throughput times the workers: ``planner.capacity``) as a baseline.

``baton bench fidelity-report RUNS.jsonl ...`` (``bench/fidelity_report.py``) prints the runs and
their errors.

Before each run a speed probe (``planner.probe``, off with ``--no-probe``) sends a few fixed
requests through the layout and reads how fast the machine serves against the profile; the run is
then predicted a second time with the profile at that speed (``probe`` in its line), and the report
gives that prediction's errors beside the profile's own. The first is the figure a profile earns;
the second tells how much of its error was the host drifting since the profile was taken.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from baton.bench.breakdown import start_cluster, stop_cluster
from baton.bench.fidelity_report import cmd_fidelity_report, format_report, nan_to_none, probe_record
from baton.bench.serve import BenchConfig, run_benchmark
from baton.planner.capacity import capacity
from baton.planner.layout import Layout, parse_layout
from baton.planner.plan import Search, max_rate
from baton.planner.probe import probe_trace
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO, parse_slo
from baton.planner.simulate import simulate
from baton.planner.workload import Lengths, Workload, draw, parse_lengths

ATTAINMENT_TARGET = 0.9
"""The attainment that defines a layout's predicted capacity (P90, as ``baton plan``)."""
CAPACITY_PROMPTS = 400
"""Requests per simulation of the capacity search (steady state, not the run's own window)."""
MIN_PROMPTS = 16


@dataclass(frozen=True)
class Mix:
    """A length mix, ``IN/OUT`` in the simulator's syntax (``128``, ``uniform:64:256``)."""

    text: str
    input_len: Lengths
    output_len: Lengths


def parse_mix(text: str) -> Mix:
    """``uniform:64:256/uniform:32:96`` -> the prompt and output length distributions."""
    inp, sep, out = text.partition("/")
    if not sep:
        raise ValueError(f"mix {text!r}: expected IN/OUT, e.g. 256/128 or uniform:64:256/geometric:64")
    return Mix(text, parse_lengths(inp), parse_lengths(out))


def parse_arrival(text: str) -> tuple[str, float]:
    """``poisson`` or ``gamma:CV`` -> (arrival, cv)."""
    name, _, cv = text.partition(":")
    if name == "poisson" and not cv:
        return "poisson", 1.0
    if name == "gamma" and cv:
        try:
            value = float(cv)
        except ValueError:
            value = -1.0
        if value > 0:
            return "gamma", value
    raise ValueError(f"arrival {text!r}: expected poisson or gamma:CV (CV > 0)")


def parse_arrivals(text: str) -> list[str]:
    """A comma-separated list of arrivals (``poisson,gamma:2``), each checked by ``parse_arrival``."""
    arrivals = text.split(",")
    for arrival in arrivals:
        parse_arrival(arrival)
    return arrivals


@dataclass
class Run:
    """One real run beside its prediction (latencies in ms)."""

    layout: str
    mix: str
    arrival: str
    load: float
    """The rate as a fraction of the predicted capacity."""
    rate: float
    capacity: float
    num_prompts: int
    seed: int
    slo: dict[str, float]
    predicted_attainment: float
    measured_attainment: float
    baseline_attainment: float
    predicted_p90_ttft_ms: float
    measured_p90_ttft_ms: float
    predicted_p90_tpot_ms: float
    measured_p90_tpot_ms: float
    failed: int
    cached_tokens: int
    """Prompt tokens the prefix cache served (random prompts of their own: 0 but by chance)."""
    duration_s: float
    machine: str
    taken_at: str
    requests: dict[str, list]
    """Each request as sent and measured: ``arrival_s``, ``input_len``, ``output_len``, ``ttft_ms``,
    ``tpot_ms``, ``error``."""
    probe: dict | None = None
    """The speed probe sent just before the run (None: not probed): ``prefill_ratio`` and
    ``decode_ratio`` (measured / predicted), the run predicted again at that speed
    (``predicted_attainment``, ``predicted_p90_ttft_ms``, ``predicted_p90_tpot_ms``), and the
    probe's own requests as ``requests`` records them."""


# -- predictions -------------------------------------------------------------------------------------
def predicted_capacity(
    profile: Profile, layout: Layout, mix: Mix, slo: SLO, seed: int, arrival: str = "poisson"
) -> float:
    """The highest rate of ``arrival`` (``poisson`` or ``gamma:CV``) at which ``layout`` meets the
    SLO for 90% of requests (simulated)."""
    kind, cv = parse_arrival(arrival)
    ceiling = 4.0 * max(closed_form_capacity(profile, layout, mix, slo), 0.05)
    workload = Workload(ceiling, CAPACITY_PROMPTS, mix.input_len, mix.output_len, kind, cv)
    search = Search(profile, workload, slo, ATTAINMENT_TARGET, seed)
    best = max_rate(search, layout, profile.engine.max_num_batched_tokens)
    return best.rate if best.attainment >= ATTAINMENT_TARGET else 0.0


def closed_form_capacity(profile: Profile, layout: Layout, mix: Mix, slo: SLO) -> float:
    """Requests/s by the closed-form rule: each pool's profiled per-worker rate times its workers."""
    c = capacity(profile, mix.input_len.mean, mix.output_len.mean, slo)
    if layout.colocated:
        return layout.decode * c.colocated
    return min(layout.prefill * c.prefill, layout.decode * c.decode)


def run_seed(layout: Layout, mix: Mix, arrival: str, load: float, seed: int) -> int:
    """The seed of one run's prompt ids: its own for every scenario, so that no run's prompts share
    a prefix with an earlier run's (the server's prefix cache would serve it: the simulator has none)."""
    return zlib.crc32(f"{layout}|{mix.text}|{arrival}|{load}|{seed}".encode())


# -- one run -----------------------------------------------------------------------------------------
def run_one(
    base_url: str, profile: Profile, layout: Layout, mix: Mix, arrival: str, load: float, cap: float, **kw
) -> Run:
    """Draw the run's requests, simulate them, send them, and set the two side by side."""
    slo: SLO = kw["slo"]
    seed, window = kw["seed"], kw["window_s"]
    kind, cv = parse_arrival(arrival)
    rate = load * cap
    n = max(MIN_PROMPTS, round(rate * window))
    requests = draw(Workload(rate, n, mix.input_len, mix.output_len, kind, cv), seed)
    t0 = requests.arrival_s[0]
    rows = [(t - t0, i, o) for t, i, o in zip(requests.arrival_s, requests.input_len, requests.output_len)]
    predicted = simulate(profile, layout, Workload(trace=tuple(rows), num_prompts=0), slo)
    goodput = {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms}
    prompts_seed = run_seed(layout, mix, arrival, load, seed)
    bench = BenchConfig(
        base_url, trace=rows, goodput=goodput, seed=prompts_seed, progress=False, timeout_s=1800.0
    )
    probe = send_probe(base_url, profile, layout, rows, slo, prompts_seed) if kw.get("probe") else None
    measured = asyncio.run(run_benchmark(bench))
    ok_ttft = [t * 1000.0 for t, e in zip(measured["ttfts"], measured["errors"]) if not e]
    ok_tpot = [
        t * 1000.0
        for t, o, e in zip(measured["tpots"], measured["output_lens"], measured["errors"])
        if not e and o > 1
    ]
    baseline = closed_form_capacity(profile, layout, mix, slo)
    return Run(
        layout=str(layout),
        mix=mix.text,
        arrival=arrival,
        load=load,
        rate=rate,
        capacity=cap,
        num_prompts=n,
        seed=seed,
        slo=goodput,
        predicted_attainment=predicted.slo_attainment,
        measured_attainment=(measured["num_good"] or 0) / n,
        baseline_attainment=min(1.0, baseline / rate) if rate > 0 else 1.0,
        predicted_p90_ttft_ms=predicted.ttft_ms.p90,
        measured_p90_ttft_ms=float(np.percentile(ok_ttft, 90)) if ok_ttft else float("nan"),
        predicted_p90_tpot_ms=predicted.tpot_ms.p90,
        measured_p90_tpot_ms=float(np.percentile(ok_tpot, 90)) if ok_tpot else float("nan"),
        failed=measured["failed"],
        cached_tokens=measured["total_cached_tokens"],
        duration_s=measured["duration"],
        machine=profile.machine.cpu,
        taken_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        requests=_record(rows, measured),
        probe=probe,
    )


def _record(rows: Sequence[tuple[float, int, int]], measured: dict) -> dict[str, list]:
    """Each request of ``rows`` as sent and as ``run_benchmark`` measured it (``Run.requests``)."""
    return {
        "arrival_s": [round(r[0], 4) for r in rows],
        "input_len": [r[1] for r in rows],
        "output_len": measured["output_lens"],
        "ttft_ms": [round(t * 1000.0, 2) for t in measured["ttfts"]],
        "tpot_ms": [round(t * 1000.0, 3) for t in measured["tpots"]],
        "error": measured["errors"],
    }


def send_probe(
    base_url: str, profile: Profile, layout: Layout, rows: list, slo: SLO, seed: int
) -> dict | None:
    """Send the speed probe (``planner.probe``) and predict ``rows`` again at the speed it read
    (None, said, where every probe request failed: the run's own line will show why)."""
    trace = probe_trace(profile, layout)
    bench = BenchConfig(
        base_url,
        trace=trace,
        goodput={"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        seed=zlib.crc32(f"probe|{seed}".encode()),
        progress=False,
        timeout_s=600.0,
    )
    m = asyncio.run(run_benchmark(bench))
    if all(m["errors"]):
        print(f"the speed probe failed ({m['errors'][0]}): this run is not probed", flush=True)
        return None
    return probe_record(profile, layout, rows, slo, _record(trace, m))


# -- command line ------------------------------------------------------------------------------------
def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "fidelity",
        help="the simulator's predictions against real runs of the same requests (starts baton up)",
    )
    p.add_argument("--profile", required=True, help="the `baton profile` JSON of this layout's workers")
    p.add_argument("--layout", required=True, help="colocated[:N] or <N>p<M>d, as baton up --layout")
    p.add_argument("--mix", nargs="+", default=["256/128"], help="length mixes IN/OUT (simulate's syntax)")
    p.add_argument("--loads", default="0.3,0.6,0.9,1.2", help="rates as fractions of the predicted capacity")
    p.add_argument("--arrivals", default="poisson,gamma:2", help="poisson and/or gamma:CV")
    p.add_argument("--window", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--slo", nargs="+", required=True, metavar="ttft:MS|tpot:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-jsonl", required=True, help="one JSON line per run is appended here")
    p.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="send no speed probe before each run (planner/probe.py; ~10 s a run on 2 cores)",
    )
    p.add_argument("up_args", nargs=argparse.REMAINDER, help="-- then further flags for baton up")
    p.set_defaults(func=cmd_fidelity)
    r = bench.add_parser("fidelity-report", help="the table and errors of bench fidelity runs")
    r.add_argument("runs", nargs="+", help="--output-jsonl files of baton bench fidelity")
    r.add_argument("--json", action="store_true", help="print the error summary as JSON")
    r.add_argument(
        "--profile",
        nargs="+",
        default=[],
        metavar="LAYOUT=PROFILE.json",
        help="predict LAYOUT's runs again with this profile (the same requests, simulated anew)",
    )
    r.set_defaults(func=cmd_fidelity_report)


def cmd_fidelity(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(a.profile)
        layout = parse_layout(a.layout)
        slo = parse_slo(a.slo)
        mixes = [parse_mix(m) for m in a.mix]
        loads = [float(x) for x in a.loads.split(",")]
        arrivals = parse_arrivals(a.arrivals)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton bench fidelity: {e}", file=sys.stderr)
        return 2
    up_args = tuple(x for x in a.up_args if x != "--")
    with tempfile.TemporaryDirectory(prefix="baton-fidelity-") as logs:
        proc, port = start_cluster(("--layout", a.layout, *up_args), Path(logs), 900.0)
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
        try:
            for mix in mixes:
                cap = predicted_capacity(profile, layout, mix, slo, a.seed)
                print(f"{layout} {mix.text}: predicted capacity {cap:.3f} req/s", flush=True)
                if cap <= 0:  # its runs' rates are fractions of it: there is nothing to run
                    print(
                        f"{layout} {mix.text}: skipped, no rate meets the SLOs for"
                        f" {ATTAINMENT_TARGET:.0%} of requests on this profile (a lone prompt's"
                        f" TTFT or TPOT past them?)",
                        flush=True,
                    )
                    continue
                for load in loads:
                    for arrival in arrivals:
                        kw = dict(slo=slo, seed=a.seed, window_s=a.window, probe=a.probe)
                        run = run_one(
                            f"http://127.0.0.1:{port}", profile, layout, mix, arrival, load, cap, **kw
                        )
                        line = json.dumps(
                            {k: nan_to_none(v) if isinstance(v, float) else v for k, v in asdict(run).items()}
                        )
                        with open(a.output_jsonl, "a") as f:
                            f.write(line + "\n")
                        print(format_report([json.loads(line)]).splitlines()[2], flush=True)
        finally:
            stop_cluster(proc)
    return 0
