"""The speed probe (planner/probe.py): it reads back the speed its measurements were made at, on
every kind of layout; it leaves failed requests out and refuses a probe with nothing to read; and
the profile at that speed is the profile's models scaled, served costs included."""

from __future__ import annotations

import pytest

from baton.planner.layout import parse_layout
from baton.planner.probe import PROMPTS, STREAMS, Speed, at_speed, probe_speed, probe_trace
from baton.planner.profile import Linear
from baton.planner.served import predicted, served_profile
from tests.planner_profiles import synthetic_profile


def _profile():
    return synthetic_profile(
        Linear(20.0, 0.4, 2e-5),
        Linear(10.0, 0.6, 0.002),
        transfer={"ucx": Linear(2.0, 0.01)},
        max_num_batched_tokens=512,
    )


@pytest.mark.parametrize("layout", ["colocated", "1p1d", "colocated:2"])
@pytest.mark.parametrize("speed", [Speed(1.0, 1.0), Speed(1.3, 1.6), Speed(0.8, 1.2)])
def test_the_probe_reads_the_speed_its_measurements_were_made_at(layout, speed):
    profile, lay = served_profile(_profile(), 1.1, 1.0, 0.3, host_ms=0.2), parse_layout(layout)
    rows = probe_trace(profile, lay)
    # the lone prompts one at a time, then the streams together, none overlapping the one before
    assert [(i, o) for _, i, o in rows] == [*PROMPTS, *[STREAMS[:2]] * STREAMS[2]]
    assert rows[0][0] < rows[1][0] < rows[2][0]
    ttft, tpot = predicted(at_speed(profile, speed), lay, rows)
    got = probe_speed(profile, lay, rows, ttft, tpot)
    # TTFT carries the gateway's and the hand-off's fixed costs, which the probe does not scale
    assert got.prefill == pytest.approx(speed.prefill, rel=0.02)
    assert got.decode == pytest.approx(speed.decode, rel=0.03)


def test_failed_requests_are_left_out_and_a_probe_with_nothing_to_read_raises():
    profile, lay = _profile(), parse_layout("colocated")
    rows = probe_trace(profile, lay)
    ttft, tpot = predicted(at_speed(profile, Speed(2.0, 1.5)), lay, rows)
    ttft[0], tpot[2] = None, None  # a lone prompt and a stream failed
    got = probe_speed(profile, lay, rows, ttft, tpot)
    assert (got.prefill, got.decode) == pytest.approx((2.0, 1.5), rel=0.03)
    with pytest.raises(ValueError, match="no speed to read"):
        probe_speed(profile, lay, rows, ttft, [None] * len(rows))
    # ten times slower says something broke, not how fast the machine is: clamped
    ten = [None if t is None else 10 * t for t in ttft]
    assert probe_speed(profile, lay, rows, ten, tpot).prefill == 4.0


def test_the_profile_at_a_speed_scales_every_model_it_runs_on():
    profile = served_profile(_profile(), 1.0, 2.0, 0.5, host_ms=0.4)
    fast = at_speed(profile, Speed(0.5, 2.0))
    assert (fast.prefill.a, fast.prefill.b, fast.prefill.c) == pytest.approx((10.0, 0.2, 1e-5))
    # the served costs are in the decode model: a step of 8 costs twice what it did
    assert fast.decode_ms(8, 1000) == pytest.approx(2.0 * profile.decode_ms(8, 1000))
    assert fast.host_ms == pytest.approx(0.8)
    assert fast.transfer == profile.transfer and fast.gateway_ms == profile.gateway_ms
    assert at_speed(profile, Speed(1.0, 1.0)) == profile
