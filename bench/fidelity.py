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

``baton bench fidelity-report RUNS.jsonl ...`` prints the runs and the errors: attainment in points
(every run), P90 TTFT and TPOT in percent (runs whose measured attainment is at least 50%); where a
scenario was run more than once (the same command again, into another file), each such scenario's
measured runs, their mean and spread, and the prediction against them (``repeats``).

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
from baton.bench.serve import BenchConfig, run_benchmark
from baton.planner.capacity import capacity
from baton.planner.layout import Layout, parse_layout
from baton.planner.plan import Search, max_rate
from baton.planner.probe import Speed, at_speed, probe_speed, probe_trace
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


def _nan_to_none(x: float) -> float | None:
    return None if x != x else x


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
    return _at_probe_speed(profile, layout, rows, slo, _record(trace, m))


def _at_probe_speed(profile: Profile, layout: Layout, rows, slo: SLO, requests: dict) -> dict:
    """The probe's record: its speed against ``profile`` and the run's ``rows`` predicted at it."""
    trace = list(zip(requests["arrival_s"], requests["input_len"], requests["output_len"]))
    ok = [not e for e in requests["error"]]
    ttft = [t if good else None for t, good in zip(requests["ttft_ms"], ok)]
    tpot = [
        t if good and o > 1 else None for t, o, good in zip(requests["tpot_ms"], requests["output_len"], ok)
    ]
    speed: Speed = probe_speed(profile, layout, trace, ttft, tpot)
    again = simulate(at_speed(profile, speed), layout, Workload(trace=tuple(rows), num_prompts=0), slo)
    return {
        "prefill_ratio": speed.prefill,
        "decode_ratio": speed.decode,
        "predicted_attainment": again.slo_attainment,
        "predicted_p90_ttft_ms": _nan_to_none(again.ttft_ms.p90),
        "predicted_p90_tpot_ms": _nan_to_none(again.tpot_ms.p90),
        "requests": requests,
    }


# -- the report --------------------------------------------------------------------------------------
def errors(runs: Sequence[dict]) -> dict[str, float | int | None]:
    """Attainment errors in points (simulator and baseline) over every run; P90 latency errors in
    percent of the measured over runs whose measured attainment is at least 50%."""

    def pct(pred: float | None, meas: float | None) -> float | None:
        if pred is None or meas is None or meas <= 0:
            return None
        return abs(pred - meas) / meas * 100.0

    att = [abs(r["predicted_attainment"] - r["measured_attainment"]) * 100.0 for r in runs]
    base = [abs(r["baseline_attainment"] - r["measured_attainment"]) * 100.0 for r in runs]
    served = [r for r in runs if r["measured_attainment"] >= 0.5]
    ttft = [
        e for r in served if (e := pct(r["predicted_p90_ttft_ms"], r["measured_p90_ttft_ms"])) is not None
    ]
    tpot = [
        e for r in served if (e := pct(r["predicted_p90_tpot_ms"], r["measured_p90_tpot_ms"])) is not None
    ]
    return {
        "runs": len(runs),
        "attainment_mean_pts": float(np.mean(att)) if att else None,
        "attainment_max_pts": max(att, default=None),
        "runs_within_5_pts": sum(a <= 5.0 for a in att),
        "baseline_mean_pts": float(np.mean(base)) if base else None,
        "baseline_max_pts": max(base, default=None),
        "latency_runs": len(served),
        "p90_ttft_mean_pct": float(np.mean(ttft)) if ttft else None,
        "p90_ttft_max_pct": max(ttft, default=None),
        "p90_ttft_within_15": sum(e <= 15.0 for e in ttft),
        "p90_tpot_mean_pct": float(np.mean(tpot)) if tpot else None,
        "p90_tpot_max_pct": max(tpot, default=None),
        "p90_tpot_within_15": sum(e <= 15.0 for e in tpot),
    }


def at_probe_speed(runs: Sequence[dict]) -> list[dict]:
    """The probed runs with their predictions at the probe's speed in place of the profile's."""
    keys = ("predicted_attainment", "predicted_p90_ttft_ms", "predicted_p90_tpot_ms")
    return [{**r, **{k: r["probe"][k] for k in keys}} for r in runs if r.get("probe")]


def format_report(runs: Sequence[dict]) -> str:
    """A markdown table of the runs, then the error summary."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    rows = [
        "| layout | mix | arrivals | load | req/s | n | attainment sim / real / rule | P90 TTFT ms sim / real | P90 TPOT ms sim / real |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r['layout']} | {r['mix']} | {r['arrival']} | {r['load']:.0%} | {r['rate']:.2f} | {r['num_prompts']} "
            f"| {r['predicted_attainment']:.0%} / {r['measured_attainment']:.0%} / {r['baseline_attainment']:.0%} "
            f"| {ms(r['predicted_p90_ttft_ms'])} / {ms(r['measured_p90_ttft_ms'])} "
            f"| {ms(r['predicted_p90_tpot_ms'])} / {ms(r['measured_p90_tpot_ms'])} |"
        )
    e = errors(runs)

    def f(x: float | int | None, unit: str) -> str:
        return "-" if x is None else f"{x:.1f}{unit}"

    rows += [
        "",
        f"{e['runs']} runs. SLO attainment, simulator: mean error {f(e['attainment_mean_pts'], ' pts')}, "
        f"max {f(e['attainment_max_pts'], ' pts')}, {e['runs_within_5_pts']} of {e['runs']} within 5 pts; "
        f"closed-form rule: mean {f(e['baseline_mean_pts'], ' pts')}, max {f(e['baseline_max_pts'], ' pts')}.",
        f"P90 over the {e['latency_runs']} runs with measured attainment >= 50%: TTFT mean error "
        f"{f(e['p90_ttft_mean_pct'], '%')} (max {f(e['p90_ttft_max_pct'], '%')}, {e['p90_ttft_within_15']} within 15%), "
        f"TPOT mean {f(e['p90_tpot_mean_pct'], '%')} (max {f(e['p90_tpot_max_pct'], '%')}, "
        f"{e['p90_tpot_within_15']} within 15%).",
    ]
    probed = at_probe_speed(runs)
    if probed:
        c = errors(probed)
        ratios = [(r["probe"]["prefill_ratio"], r["probe"]["decode_ratio"]) for r in runs if r.get("probe")]
        rows.append(
            f"At the speed probed before each run ({len(probed)} probed; measured / profile: prefill "
            f"{min(p for p, _ in ratios):.2f}-{max(p for p, _ in ratios):.2f}x, decode "
            f"{min(d for _, d in ratios):.2f}-{max(d for _, d in ratios):.2f}x): attainment mean error "
            f"{f(c['attainment_mean_pts'], ' pts')}, max {f(c['attainment_max_pts'], ' pts')}, "
            f"{c['runs_within_5_pts']} of {c['runs']} within 5 pts; P90 TTFT mean {f(c['p90_ttft_mean_pct'], '%')} "
            f"({c['p90_ttft_within_15']} within 15%), TPOT mean {f(c['p90_tpot_mean_pct'], '%')} "
            f"({c['p90_tpot_within_15']} within 15%)."
        )
    return "\n".join(rows)


def scenario_key(run: dict) -> tuple:
    """What makes two runs the same scenario: the same requests (layout, mix, arrivals, load,
    count and seed) sent to the same layout."""
    return (
        run["layout"],
        run["mix"],
        run["arrival"],
        round(run["load"], 6),
        run["num_prompts"],
        run.get("seed", 0),
    )


def repeats(runs: Sequence[dict]) -> list[dict]:
    """Scenarios run more than once, in first-seen order: the measured attainment of each run,
    their mean and spread (max - min), and the prediction's distance from the mean and from the
    measured range (0 where it lies inside it). A bursty run near capacity measured 16 points apart
    between two identical runs here: a single run's attainment carries that noise, the mean of
    repeats less of it, and a prediction inside the measured range is as close as any can be."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(scenario_key(r), []).append(r)
    out = []
    for group in groups.values():
        if len(group) < 2:
            continue
        measured = [r["measured_attainment"] for r in group]
        pred = float(np.mean([r["predicted_attainment"] for r in group]))
        lo, hi = min(measured), max(measured)
        mean = float(np.mean(measured))
        first = group[0]
        out.append(
            {
                "layout": first["layout"],
                "mix": first["mix"],
                "arrival": first["arrival"],
                "load": first["load"],
                "num_prompts": first["num_prompts"],
                "predicted_attainment": pred,
                "measured_attainment": measured,
                "measured_mean": mean,
                "measured_spread_pts": (hi - lo) * 100.0,
                "error_vs_mean_pts": abs(pred - mean) * 100.0,
                "outside_range_pts": max(lo - pred, pred - hi, 0.0) * 100.0,
            }
        )
    return out


def format_repeats(groups: Sequence[dict]) -> str:
    """The repeated scenarios as a markdown table, then their summary."""
    rows = [
        "| layout | mix | arrivals | load | n | predicted | measured, run by run | mean | spread | pred - mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        runs = " / ".join(f"{m:.0%}" for m in g["measured_attainment"])
        rows.append(
            f"| {g['layout']} | {g['mix']} | {g['arrival']} | {g['load']:.0%} | {g['num_prompts']} "
            f"| {g['predicted_attainment']:.0%} | {runs} | {g['measured_mean']:.1%} "
            f"| {g['measured_spread_pts']:.1f} pts | {(g['predicted_attainment'] - g['measured_mean']) * 100:+.1f} pts |"
        )
    err = [g["error_vs_mean_pts"] for g in groups]
    spread = [g["measured_spread_pts"] for g in groups]
    rows += [
        "",
        f"{len(groups)} scenarios run {min(len(g['measured_attainment']) for g in groups)} or more times. "
        f"Against the mean of each scenario's runs: mean error {np.mean(err):.1f} pts, max {max(err):.1f} pts, "
        f"{sum(e <= 5.0 for e in err)} of {len(groups)} within 5 pts; the runs' own spread: mean "
        f"{np.mean(spread):.1f} pts, max {max(spread):.1f} pts; "
        f"{sum(g['outside_range_pts'] <= 0.0 for g in groups)} predictions inside the measured range, "
        f"{sum(g['outside_range_pts'] <= 5.0 for g in groups)} within 5 pts of it.",
    ]
    return "\n".join(rows)


def load_runs(paths: Sequence[str]) -> list[dict]:
    return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]


def repredict(run: dict, profile: Profile) -> dict:
    """``run`` with its predictions remade by ``profile`` from the requests it records (the same
    arrivals and lengths): another profile's answer on the same real run."""
    req = run["requests"]
    rows = tuple(zip(req["arrival_s"], req["input_len"], req["output_len"]))
    slo = SLO(run["slo"]["ttft"], run["slo"]["tpot"])
    layout = parse_layout(run["layout"])
    predicted = simulate(profile, layout, Workload(trace=rows, num_prompts=0), slo)
    probe = run.get("probe")
    return {
        **run,
        "predicted_attainment": predicted.slo_attainment,
        "predicted_p90_ttft_ms": _nan_to_none(predicted.ttft_ms.p90),
        "predicted_p90_tpot_ms": _nan_to_none(predicted.tpot_ms.p90),
        "probe": _at_probe_speed(profile, layout, rows, slo, probe["requests"]) if probe else None,
    }


def parse_profile_overrides(items: Sequence[str]) -> dict[str, Profile]:
    """``LAYOUT=PROFILE.json`` items -> the profile that predicts each layout's runs."""
    out = {}
    for item in items:
        layout, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected LAYOUT=PROFILE.json")
        out[str(parse_layout(layout))] = Profile.load(path)
    return out


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
                            {
                                k: _nan_to_none(v) if isinstance(v, float) else v
                                for k, v in asdict(run).items()
                            }
                        )
                        with open(a.output_jsonl, "a") as f:
                            f.write(line + "\n")
                        print(format_report([json.loads(line)]).splitlines()[2], flush=True)
        finally:
            stop_cluster(proc)
    return 0


def cmd_fidelity_report(a: argparse.Namespace) -> int:
    runs = load_runs(a.runs)
    try:
        profiles = parse_profile_overrides(a.profile)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton bench fidelity-report: {e}", file=sys.stderr)
        return 2
    runs = [repredict(r, profiles[r["layout"]]) if r["layout"] in profiles else r for r in runs]
    groups = repeats(runs)
    if a.json:
        probed = at_probe_speed(runs)
        at_speed_errors = errors(probed) if probed else None
        print(json.dumps({**errors(runs), "repeated": groups, "at_probe_speed": at_speed_errors}))
        return 0
    print(format_report(runs))
    if groups:
        print("\nScenarios run more than once (the same requests at the same times):\n")
        print(format_repeats(groups))
    return 0
