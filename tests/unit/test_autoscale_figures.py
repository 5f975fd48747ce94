"""``baton bench autoscale``'s pure parts (``bench/autoscale_figures.py``): the decisions read back
from ``baton up``'s log lines, reversals, the delay after the step, requests out of SLO against the
bar, and the stepped Poisson load; fixed inputs, exact answers."""

from __future__ import annotations

from baton.bench.autoscale_figures import (
    LoggedDecision,
    Phases,
    RequestRecord,
    decision_delay,
    figures,
    out_of_slo,
    parse_decision,
    reversals,
    step_trace,
)
from baton.planner.autoscale import Decision, PoolDecision


def _logged(t_s: float, **pools: tuple[int, int]) -> LoggedDecision:
    return LoggedDecision(t_s, 1.0, 1.0, dict(pools), "")


def test_a_logged_decision_reads_back_as_the_autoscaler_wrote_it():
    d = Decision(
        t_s=120.0,
        rate=6.1,
        sizing_rate=6.4,
        correction=(1.0, 1.2),
        notes=("steady",),
        pools={
            "prefill": PoolDecision("prefill", 1, 1, 1, ("closed form 1 for 6.40 req/s; hold",)),
            "decode": PoolDecision("decode", 2, 4, 4, ("closed form 4 for 6.40 req/s (x); up now",)),
        },
    )
    got = parse_decision(f"baton up: {d}\n", 601.5)
    assert got is not None
    assert (got.t_s, got.rate, got.sizing_rate) == (601.5, 6.1, 6.4)
    assert got.pools == {"prefill": (1, 1), "decode": (2, 4)}
    assert got.adds()
    assert parse_decision("baton up: autoscale: started decode-2", 3.0) is None
    assert parse_decision("baton up: decode-2 retired: exited with code 0", 3.0) is None


def test_reversals_count_changes_of_direction_within_the_window():
    ds = [
        _logged(10, decode=(2, 3)),  # up
        _logged(20, decode=(3, 3)),  # hold: no move
        _logged(30, decode=(3, 2)),  # down: 1
        _logged(40, decode=(2, 2)),
        _logged(50, decode=(2, 3)),  # up: 2
        _logged(60, decode=(3, 4)),  # up again: no reversal
        _logged(70, decode=(4, 3), prefill=(1, 2)),  # down: 3
    ]
    assert reversals(ds, "decode") == 3
    assert reversals(ds, "decode", start_s=25) == 2  # down, up, up, down
    assert reversals(ds, "decode", start_s=0, end_s=50) == 1
    assert reversals(ds, "prefill") == 0
    assert reversals(ds, "colocated") == 0


def test_the_delay_is_to_the_first_decision_after_the_step_that_adds_a_replica():
    ds = [
        _logged(595, decode=(2, 3)),  # before the step: not it
        _logged(604, decode=(3, 3)),  # after, but holds
        _logged(612, prefill=(1, 1), decode=(3, 3)),
        _logged(622, prefill=(1, 2), decode=(3, 3)),
        _logged(632, decode=(3, 5)),
    ]
    assert decision_delay(ds, 600.0) == (22.0, 3)
    assert decision_delay(ds, 590.0) == (5.0, 1)
    assert decision_delay(ds[:3], 600.0) is None


def test_a_request_is_out_of_slo_if_it_failed_or_missed_either_slo():
    rs = [
        RequestRecord(1.0, 900, 20, 64),  # in
        RequestRecord(2.0, 1100, 20, 64),  # TTFT miss
        RequestRecord(3.0, 900, 31, 64),  # TPOT miss
        RequestRecord(4.0, 900, 99, 1),  # one token: no TPOT to miss
        RequestRecord(5.0, 0, 0, 0, "HTTP 503"),  # failed
        RequestRecord(9.0, 5000, 500, 64),  # outside the window
    ]
    assert out_of_slo(rs, 1000, 30, 0.0, 6.0) == 3
    assert out_of_slo(rs, 1000, 30, 2.5, 6.0) == 2
    assert [r.in_slo(1000, 30) for r in rs] == [True, False, False, True, False, False]


def test_figures_set_each_against_its_bar():
    ds = [
        _logged(10, decode=(2, 3)),
        _logged(300, decode=(3, 2)),  # a reversal at constant load
        _logged(400, decode=(2, 3)),  # another
        _logged(607, decode=(3, 5)),  # 7 s after the step
    ]
    bad = [RequestRecord(600.0 + i, 5000, 10, 64) for i in range(30)]
    good = [RequestRecord(100.0 + i, 100, 10, 64) for i in range(50)]
    f = figures(ds, [*good, *bad], Phases(600.0, 780.0, 6.0), (1000.0, 30.0), 10.0, 30.0)
    assert (f["decision_delay_s"], f["decision_delay_met"]) == (7.0, True)
    assert f["step_after_last_decision_s"] == 200.0
    assert f["decision_delay_nth"] == 1
    assert f["reversals_constant_phase"] == {"decode": 2}
    assert (f["reversals_per_10min"], f["reversals_met"]) == (2.0, False)
    assert (f["out_of_slo_after_step"], f["requests_after_step"], f["out_of_slo_before_step"]) == (30, 30, 0)
    assert (f["out_of_slo_bar"], f["out_of_slo_met"]) == (240.0, True)
    settled = figures(ds, bad, Phases(600.0, 780.0, 6.0, settle_s=350.0), (1000.0, 30.0), 10.0, 30.0)
    assert settled["reversals_constant_phase"] == {"decode": 0}
    assert settled["reversals_per_10min"] == 0.0 and settled["reversals_met"]
    late = figures(ds[:3], bad, Phases(600.0, 780.0, 6.0), (1000.0, 30.0), 5.0, 1.0)
    assert late["decision_delay_s"] is None and late["decision_delay_nth"] is None
    assert not late["decision_delay_met"]
    assert late["out_of_slo_bar"] == 66.0 and late["out_of_slo_met"]


def test_the_step_trace_doubles_its_poisson_rate_at_the_step_and_is_seeded():
    rows = step_trace(3.0, 600.0, 180.0, 128, 96, seed=0)
    assert rows == step_trace(3.0, 600.0, 180.0, 128, 96, seed=0)
    assert rows != step_trace(3.0, 600.0, 180.0, 128, 96, seed=1)
    times = [t for t, _, _ in rows]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 780.0
    assert {(i, o) for _, i, o in rows} == {(128, 96)}
    before = sum(1 for t in times if t < 600.0)
    after = len(times) - before
    # 1800 and 1080 expected; 4 Poisson standard deviations either way.
    assert abs(before - 1800) < 4 * 1800**0.5 and abs(after - 1080) < 4 * 1080**0.5
