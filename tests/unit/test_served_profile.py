"""The served profile's calibration (planner/served.py): the trace keeps its segments apart, the
fit recovers known factors from the simulator's own answers, pairs requests sent together by order
only, and the factors round-trip through the profile's JSON."""

from __future__ import annotations

import pytest

from baton.bench.served_profile import host_cost
from baton.planner.layout import parse_layout
from baton.planner.profile import Linear, Profile
from baton.planner.served import (
    MIN_TPOT_TOKENS,
    calibration_trace,
    fit_served,
    groups,
    log_error,
    predicted,
    served_profile,
)
from tests.planner_profiles import synthetic_profile


def _profile() -> Profile:
    return synthetic_profile(
        Linear(20.0, 0.4, 2e-5),
        Linear(10.0, 0.6, 0.002),
        transfer={"ucx": Linear(2.0, 0.01)},
        max_num_batched_tokens=512,
    )


def test_the_served_profile_adds_the_decode_terms_and_scales_prefill():
    assert served_profile(_profile(), 1.0, 0.0, 0.0, 1.2).mixed_prefill_scale == 1.2
    p = served_profile(_profile(), 1.5, 3.0, 0.5)
    assert (p.prefill.a, p.prefill.b, p.prefill.c) == pytest.approx((30.0, 0.6, 3e-5))
    assert (p.decode.a, p.decode.b, p.decode.c) == pytest.approx((13.0, 1.1, 0.002))
    # a step of 8 sequences pays 3 ms + 8 x 0.5 ms more
    assert p.decode_ms(8, 1000) - _profile().decode_ms(8, 1000) == pytest.approx(7.0)


@pytest.mark.parametrize("layout", ["colocated", "1p1d", "colocated:2"])
def test_the_calibration_segments_do_not_overlap(layout):
    profile, lay = _profile(), parse_layout(layout)
    rows = calibration_trace(profile, lay)
    assert rows == sorted(rows) and len(rows) > 40
    ttft, _ = predicted(profile, lay, rows)
    assert all(t > 0 for t in ttft)
    # the prompts sent alone come first, each done before the next: TTFT grows with the prompt
    assert [r[2] for r in rows[:4]] == [2, 2, 2, 2]
    assert ttft[0] < ttft[1] < ttft[2] < ttft[3]


@pytest.mark.parametrize(
    "layout, factors, host_ms, share",
    [
        ("colocated", (1.25, 3.0, 0.5, 1.0), 0.0, 0.0),
        ("colocated:2", (0.9, 1.5, 1.2, 1.3), 0.0, 0.0),
        ("1p1d", (1.1, 2.0, 0.3, 1.0), 0.0, 0.0),
        ("1p1d", (1.1, 2.0, 0.3, 1.0), 0.4, 1.0),
        ("colocated:2", (1.0, 1.0, 0.5, 1.2), 0.4, 0.5),
    ],
)
def test_the_fit_recovers_the_factors_the_measurements_were_made_with(layout, factors, host_ms, share):
    # the measurements slowed by ``share`` of the measured host cost ``host_ms``
    profile, lay = _profile(), parse_layout(layout)
    rows = calibration_trace(profile, lay)
    ttft, tpot = predicted(served_profile(profile, *factors, host_ms=share * host_ms), lay, rows)
    fit = fit_served(profile, lay, rows, ttft, tpot, host_ms=host_ms)
    assert (fit.prefill_scale, fit.step_ms, fit.stream_ms, fit.mixed_scale) == pytest.approx(factors)
    assert (fit.host_share, fit.host_ms) == pytest.approx((share, share * host_ms))
    assert fit.error == pytest.approx(0.0, abs=1e-9)
    assert fit.engine_error > 0.01


def test_a_mixed_step_never_seen_keeps_the_engine_profiles_scale():
    # 1p1d's prefill worker never decodes, and no calibration prompt is short enough for its decode
    # worker to prefill: nothing tells the mixed scale, and the fit keeps the engine's 1
    profile, lay = _profile(), parse_layout("1p1d")
    rows = calibration_trace(profile, lay)
    ttft, tpot = predicted(served_profile(profile, 1.0, 0.0, 0.0, 1.4), lay, rows)
    fit = fit_served(profile, lay, rows, ttft, tpot)
    assert (fit.prefill_scale, fit.step_ms, fit.stream_ms, fit.mixed_scale) == (1.0, 0.0, 0.0, 1.0)
    assert fit.error == fit.engine_error == 0.0


def test_requests_sent_together_are_paired_in_sorted_order():
    rows = [(0.0, 128, 96), (0.001, 128, 96), (0.002, 128, 96), (5.0, 128, 96), (5.0, 512, 2)]
    assert groups(rows) == [[0, 1, 2], [3], [4]]
    pred = ([100.0, 300.0, 500.0, 50.0, 80.0], [20.0, 20.0, 20.0, 10.0, None])
    # the client started them in another order: the same values, permuted, are no error
    assert log_error(rows, pred, [500.0, 100.0, 300.0, 50.0, 80.0], [20.0, 20.0, 20.0, 10.0, None]) == 0.0
    # but the one sent alone is its own
    assert log_error(rows, pred, [100.0, 300.0, 500.0, 100.0, 80.0], [20.0, 20.0, 20.0, 10.0, None]) > 0


def test_short_outputs_tpot_and_failures_are_not_fitted():
    rows = [(0.0, 128, 2), (1.0, 128, MIN_TPOT_TOKENS)]
    pred = ([100.0, 100.0], [20.0, 20.0])
    # a two-token request's one gap is noise; a failed request (None) has nothing to compare
    assert log_error(rows, pred, [100.0, 100.0], [1.0, 20.0]) == 0.0
    assert log_error(rows, pred, [None, 100.0], [None, 20.0]) == 0.0
    with pytest.raises(ValueError, match="no request"):
        log_error(rows, pred, [None, None], [None, None])


def test_a_served_profile_round_trips_with_its_factors(tmp_path):
    served = {"layout": "1p1d", "prefill_scale": 1.1, "step_ms": 0.5, "stream_ms": 0.2, "host_ms": 0.3}
    p = served_profile(_profile(), 1.1, 0.5, 0.2, host_ms=0.3)
    p = Profile(**{**p.__dict__, "served": served})
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p and q.served == served
    assert (q.decode.a, q.decode.b, q.decode.c) == pytest.approx((10.5, 0.8, 0.002))
    assert q.host_ms == 0.3


def test_the_host_cost_is_the_replays_cpu_over_idle_per_streamed_token():
    # 3 s idle cost 0.15 s (5% of a core); the 60 s replay cost 9 s, 3 of them idle's: 6 s / 12k
    h = host_cost((0.15, 3.0), (9.0, 60.0), 12_000)
    assert h["host_ms"] == pytest.approx(0.5)
    assert host_cost((0.15, 3.0), (1.0, 60.0), 12_000)["host_ms"] == 0.0  # never below zero
    assert host_cost((0.0, 3.0), (1.0, 60.0), 0)["host_ms"] == 0.0
