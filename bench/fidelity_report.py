"""``baton bench fidelity-report``: the errors of ``baton bench fidelity``'s runs (``bench/fidelity.py``).

SLO attainment in points over every run, P90 TTFT and TPOT in percent over runs whose measured
attainment is at least 50%, and the closed-form rule's attainment beside the simulator's; the same
errors at the speed a probe read before each run (``planner.probe``), where the runs were probed;
where a scenario was run more than once (the same command again, into another file), each such
scenario's measured runs, their mean and spread, and the prediction against them (``repeats``);
and any layout's runs predicted again from another profile (``--profile``, ``repredict``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from baton.planner.layout import Layout, parse_layout
from baton.planner.probe import at_speed, probe_speed
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import simulate
from baton.planner.workload import Workload


def nan_to_none(x: float) -> float | None:
    return None if x != x else x


def probe_record(profile: Profile, layout: Layout, rows, slo: SLO, requests: dict) -> dict:
    """The probe's record: its speed against ``profile`` and the run's ``rows`` predicted at it."""
    trace = list(zip(requests["arrival_s"], requests["input_len"], requests["output_len"]))
    ok = [not e for e in requests["error"]]
    ttft = [t if good else None for t, good in zip(requests["ttft_ms"], ok)]
    tpot = [
        t if good and o > 1 else None for t, o, good in zip(requests["tpot_ms"], requests["output_len"], ok)
    ]
    speed = probe_speed(profile, layout, trace, ttft, tpot)
    again = simulate(at_speed(profile, speed), layout, Workload(trace=tuple(rows), num_prompts=0), slo)
    return {
        "prefill_ratio": speed.prefill,
        "decode_ratio": speed.decode,
        "predicted_attainment": again.slo_attainment,
        "predicted_p90_ttft_ms": nan_to_none(again.ttft_ms.p90),
        "predicted_p90_tpot_ms": nan_to_none(again.tpot_ms.p90),
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
        "predicted_p90_ttft_ms": nan_to_none(predicted.ttft_ms.p90),
        "predicted_p90_tpot_ms": nan_to_none(predicted.tpot_ms.p90),
        "probe": probe_record(profile, layout, rows, slo, probe["requests"]) if probe else None,
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
