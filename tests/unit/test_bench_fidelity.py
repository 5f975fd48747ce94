"""``baton bench fidelity``'s pure parts: mixes, arrivals, the predicted capacity and the report."""

from __future__ import annotations

import argparse
import io
import types
from pathlib import Path

import pytest

from baton.bench import fidelity
from baton.bench.fidelity import (
    closed_form_capacity,
    parse_arrival,
    parse_arrivals,
    parse_mix,
    predicted_capacity,
    run_seed,
)
from baton.bench.fidelity_report import (
    at_probe_speed,
    errors,
    format_repeats,
    format_report,
    parse_profile_overrides,
    repeats,
    repredict,
)
from baton.planner.layout import parse_layout
from baton.planner.probe import Speed, at_speed, probe_trace
from baton.planner.profile import Profile
from baton.planner.served import predicted, served_profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import simulate
from baton.planner.workload import Workload, draw

PROFILE = Path(__file__).resolve().parents[2] / "docs/bench/profiles/zen4-avx512bf16-bf16.json"


def test_mixes_and_arrivals_parse_or_say_why():
    m = parse_mix("uniform:64:256/32")
    assert (m.input_len.kind, m.input_len.a, m.input_len.b, m.output_len.a) == ("uniform", 64, 256, 32)
    assert parse_arrival("poisson") == ("poisson", 1.0)
    assert parse_arrival("gamma:2") == ("gamma", 2.0)
    for bad in ("256", "256/x"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    for bad in ("gamma", "gamma:0", "gamma:x", "poisson:2", "burst"):
        with pytest.raises(ValueError, match="poisson or gamma"):
            parse_arrival(bad)
    assert parse_arrivals("poisson,gamma:2") == ["poisson", "gamma:2"]
    with pytest.raises(ValueError, match="poisson or gamma"):
        parse_arrivals("poisson,burst")


def test_the_predicted_capacity_is_where_simulated_attainment_crosses_90_percent():
    profile = Profile.load(PROFILE)
    slo, mix = SLO(1500.0, 60.0), parse_mix("256/64")
    for text in ("colocated", "1p1d"):
        layout = parse_layout(text)
        cap = predicted_capacity(profile, layout, mix, slo, seed=0)
        assert cap > 0
        at = simulate(profile, layout, Workload(cap, 400, mix.input_len, mix.output_len), slo)
        over = simulate(profile, layout, Workload(1.5 * cap, 400, mix.input_len, mix.output_len), slo)
        assert at.slo_attainment >= 0.9 > over.slo_attainment, (text, cap)
        assert closed_form_capacity(profile, layout, mix, slo) > 0


def _run(pred: float, meas: float, rule: float, ttft=(100.0, 100.0), tpot=(50.0, 50.0)) -> dict:
    return dict(
        layout="1p1d", mix="256/64", arrival="poisson", load=0.6, rate=1.0, num_prompts=40,
        predicted_attainment=pred, measured_attainment=meas, baseline_attainment=rule,
        predicted_p90_ttft_ms=ttft[0], measured_p90_ttft_ms=ttft[1],
        predicted_p90_tpot_ms=tpot[0], measured_p90_tpot_ms=tpot[1],
    )  # fmt: skip


def test_errors_count_points_on_every_run_and_latency_only_where_half_is_served():
    runs = [
        _run(0.95, 0.90, 1.0, ttft=(110.0, 100.0), tpot=(40.0, 50.0)),
        _run(0.20, 0.40, 0.8, ttft=(9e9, 1.0), tpot=(9e9, 1.0)),  # under 50%: no latency error
    ]
    e = errors(runs)
    assert e["attainment_mean_pts"] == pytest.approx(12.5)
    assert e["attainment_max_pts"] == pytest.approx(20.0)
    assert e["runs_within_5_pts"] == 1
    assert e["baseline_mean_pts"] == pytest.approx(25.0)
    assert e["latency_runs"] == 1
    assert e["p90_ttft_mean_pct"] == pytest.approx(10.0)
    assert e["p90_tpot_max_pct"] == pytest.approx(20.0)
    assert (e["p90_ttft_within_15"], e["p90_tpot_within_15"]) == (1, 0)
    text = format_report(runs)
    assert "| 1p1d | 256/64 | poisson | 60% |" in text and "2 runs." in text


def test_repeated_scenarios_are_set_against_their_mean_and_their_spread():
    a = dict(_run(0.91, 0.84, 1.0), arrival="gamma:2", load=0.9)
    runs = [
        a,
        _run(0.5, 0.5, 1.0),  # another scenario, run once: not a repeat
        dict(a, measured_attainment=0.68),
        dict(a, measured_attainment=0.76),
        dict(_run(0.40, 0.35, 0.9), load=1.2),
        dict(_run(0.40, 0.50, 0.9), load=1.2),
    ]
    groups = repeats(runs)
    assert [(g["load"], g["measured_attainment"]) for g in groups] == [
        (0.9, [0.84, 0.68, 0.76]),
        (1.2, [0.35, 0.50]),
    ]
    g, h = groups
    assert g["measured_mean"] == pytest.approx(0.76)
    assert g["measured_spread_pts"] == pytest.approx(16.0)
    assert g["error_vs_mean_pts"] == pytest.approx(15.0)
    assert g["outside_range_pts"] == pytest.approx(7.0)  # 91% against 68-84%
    assert h["outside_range_pts"] == 0.0 and h["error_vs_mean_pts"] == pytest.approx(2.5)
    text = format_repeats(groups)
    assert "| 84% / 68% / 76% | 76.0% | 16.0 pts | +15.0 pts |" in text
    assert "1 of 2 within 5 pts" in text and "1 predictions inside the measured range" in text
    assert repeats(runs[:2]) == []


def test_every_scenario_sends_prompts_of_its_own():
    layout, mix = parse_layout("1p1d"), parse_mix("256/64")
    seeds = {
        run_seed(layout, mix, arrival, load, 0) for arrival in ("poisson", "gamma:2") for load in (0.3, 0.6)
    }
    seeds.add(run_seed(parse_layout("colocated"), mix, "poisson", 0.3, 0))
    assert len(seeds) == 5
    assert run_seed(layout, mix, "poisson", 0.3, 0) == run_seed(layout, mix, "poisson", 0.3, 0)


def test_a_run_is_predicted_again_from_another_profile_on_its_own_requests(tmp_path):
    profile, slo = Profile.load(PROFILE), SLO(2000.0, 100.0)
    w = Workload(3.0, 40, parse_mix("256/64").input_len, parse_mix("256/64").output_len)
    r = draw(w, seed=1)
    t0 = r.arrival_s[0]
    rows = [(t - t0, i, o) for t, i, o in zip(r.arrival_s, r.input_len, r.output_len)]
    first = simulate(profile, "colocated", Workload(trace=tuple(rows), num_prompts=0), slo)
    run = dict(
        _run(first.slo_attainment, 0.9, 1.0, (first.ttft_ms.p90, 300.0), (first.tpot_ms.p90, 40.0)),
        layout="colocated:1", slo={"ttft": 2000.0, "tpot": 100.0},
        requests={"arrival_s": [x[0] for x in rows], "input_len": [x[1] for x in rows],
                  "output_len": [x[2] for x in rows]},
    )  # fmt: skip
    same = repredict(run, profile)
    assert same["predicted_p90_ttft_ms"] == pytest.approx(run["predicted_p90_ttft_ms"])
    assert same["predicted_attainment"] == run["predicted_attainment"]
    # a slower served path: later first tokens and slower tokens, the measured values untouched
    slower = served_profile(profile, 1.5, 5.0, 1.0)
    (tmp_path / "served.json").write_text(slower.to_json())
    overrides = parse_profile_overrides([f"colocated={tmp_path / 'served.json'}"])
    assert list(overrides) == ["colocated:1"]
    again = repredict(run, overrides["colocated:1"])
    assert again["predicted_p90_ttft_ms"] > run["predicted_p90_ttft_ms"]
    assert again["predicted_p90_tpot_ms"] > run["predicted_p90_tpot_ms"]
    assert again["measured_p90_ttft_ms"] == 300.0
    with pytest.raises(ValueError, match="LAYOUT=PROFILE"):
        parse_profile_overrides(["colocated"])


def test_a_mix_no_rate_can_serve_is_skipped_and_the_next_one_runs(monkeypatch, tmp_path, capsys):
    # TTFT 200 ms: no 1,536-token prompt meets it at any rate (capacity 0, and every run's rate a
    # fraction of it); the 16-token mix does. The cluster is not what is tested: a stand-in.
    class Ran(Exception):
        pass

    def run_one(url, profile, layout, mix, *args, **kw):
        raise Ran(mix.text)

    monkeypatch.setattr(
        fidelity, "start_cluster", lambda *a: (types.SimpleNamespace(stdout=io.StringIO()), 1)
    )
    monkeypatch.setattr(fidelity, "stop_cluster", lambda proc: None)
    monkeypatch.setattr(fidelity, "run_one", run_one)
    a = argparse.Namespace(
        profile=str(PROFILE), layout="colocated", slo=["ttft:200", "tpot:100"], mix=["1536/16", "16/16"],
        loads="0.5", arrivals="poisson", up_args=[], seed=0, window=10.0, probe=False,
        output_jsonl=str(tmp_path / "runs.jsonl"),
    )  # fmt: skip
    with pytest.raises(Ran, match="16/16"):
        fidelity.cmd_fidelity(a)
    out = capsys.readouterr().out
    assert "1536/16: predicted capacity 0.000" in out and "1536/16: skipped, no rate meets the SLOs" in out


def test_a_probed_run_is_predicted_again_at_the_speed_its_probe_read():
    profile, slo, layout = Profile.load(PROFILE), SLO(2000.0, 100.0), parse_layout("1p1d")
    w = Workload(2.0, 40, parse_mix("256/64").input_len, parse_mix("256/64").output_len)
    r = draw(w, seed=2)
    rows = [(t - r.arrival_s[0], i, o) for t, i, o in zip(r.arrival_s, r.input_len, r.output_len)]
    first = simulate(profile, layout, Workload(trace=tuple(rows), num_prompts=0), slo)
    # the probe as a machine 1.5x slower at decoding than the profile would measure it
    slow = at_speed(profile, Speed(1.0, 1.5))
    probe_rows = probe_trace(profile, layout)
    ttft, tpot = predicted(slow, layout, probe_rows)
    probe = {"requests": {
        "arrival_s": [x[0] for x in probe_rows], "input_len": [x[1] for x in probe_rows],
        "output_len": [x[2] for x in probe_rows], "ttft_ms": ttft, "tpot_ms": [t or 0.0 for t in tpot],
        "error": [""] * len(probe_rows),
    }}  # fmt: skip
    run = dict(
        _run(first.slo_attainment, 0.9, 1.0, (first.ttft_ms.p90, 300.0), (first.tpot_ms.p90, 40.0)),
        slo={"ttft": 2000.0, "tpot": 100.0}, probe=probe,
        requests={"arrival_s": [x[0] for x in rows], "input_len": [x[1] for x in rows],
                  "output_len": [x[2] for x in rows]},
    )  # fmt: skip
    again = repredict(run, profile)
    assert again["probe"]["decode_ratio"] == pytest.approx(1.5, rel=0.02)
    assert again["probe"]["prefill_ratio"] == pytest.approx(1.0, rel=0.02)
    at_slow = simulate(slow, layout, Workload(trace=tuple(rows), num_prompts=0), slo)
    assert again["probe"]["predicted_p90_tpot_ms"] == pytest.approx(at_slow.tpot_ms.p90, rel=0.02)
    assert again["predicted_p90_tpot_ms"] == pytest.approx(first.tpot_ms.p90)  # the profile's own stays
    # the report: the profile's errors, then the same runs' at the probed speed; unprobed runs left out
    runs = [again, _run(0.5, 0.5, 1.0)]
    assert [r["predicted_p90_tpot_ms"] for r in at_probe_speed(runs)] == [
        again["probe"]["predicted_p90_tpot_ms"]
    ]
    text = format_report(runs)
    assert (
        "At the speed probed before each run (1 probed; measured / profile: prefill 1.00-1.00x, decode 1.5"
        in text
    )


def test_a_probe_whose_every_request_failed_leaves_the_run_unprobed(monkeypatch, capsys):
    # the fault injected: every probe request refused (the cluster down); the run goes on unprobed
    async def refused(cfg):
        n = len(cfg.trace)
        return {
            "errors": ["connection refused"] * n,
            "output_lens": [0] * n,
            "ttfts": [0.0] * n,
            "tpots": [0.0] * n,
        }

    monkeypatch.setattr(fidelity, "run_benchmark", refused)
    profile, layout = Profile.load(PROFILE), parse_layout("colocated")
    assert (
        fidelity.send_probe("http://127.0.0.1:9", profile, layout, [(0.0, 64, 16)], SLO(2000.0, 100.0), 1)
        is None
    )
    assert "the speed probe failed (connection refused): this run is not probed" in capsys.readouterr().out
