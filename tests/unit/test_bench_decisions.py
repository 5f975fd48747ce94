"""``baton bench decisions``' pure parts: the shared rate grid, the climb to a layout's measured
goodput, and the verdict on the plan's pick."""

from __future__ import annotations

import pytest

from baton.bench.decisions import (
    GRID_FROM,
    GRID_STEP,
    GRID_TO,
    climb,
    format_report,
    rate_grid,
    rate_seed,
    start_index,
    verdict,
)


def test_the_grid_spans_every_layouts_prediction_in_equal_steps():
    grid = rate_grid([1.0, 2.5])
    assert grid[0] == pytest.approx(GRID_FROM * 1.0)
    assert grid[-1] >= GRID_TO * 2.5 > grid[-2]
    ratios = [b / a for a, b in zip(grid, grid[1:])]
    assert all(r == pytest.approx(GRID_STEP, rel=1e-3) for r in ratios)
    with pytest.raises(ValueError, match="positive"):
        rate_grid([0.0, 1.0])


def test_the_climb_stops_at_the_first_failure_and_tries_few_rates():
    grid = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    tried = []

    def capacity(limit):
        def passes(rate):
            tried.append(rate)
            return rate <= limit

        return passes

    assert climb(grid, 1, capacity(1.3)) == 1.3
    assert tried == [1.1, 1.2, 1.3, 1.4]
    tried.clear()
    # the start fails: down until one passes
    assert climb(grid, 3, capacity(1.1)) == 1.1
    assert tried == [1.3, 1.2, 1.1]
    tried.clear()
    assert climb(grid, 2, capacity(0.5)) == 0.0
    # a pass above a failure does not count: the goodput is below the first failure
    flaky = {1.0: True, 1.1: True, 1.2: False, 1.3: True}
    assert climb(grid, 0, lambda r: flaky.get(r, False)) == 1.1
    assert climb(grid, 5, lambda r: True) == 1.5


def test_each_layout_starts_below_its_own_prediction():
    grid = rate_grid([1.0, 2.0])
    i = start_index(grid, 2.0)
    assert grid[i] <= 0.85 * 2.0 < grid[i + 1]
    assert start_index(grid, 0.1) == 0


def test_the_verdict_compares_the_pick_with_the_best_measured():
    v = verdict({"colocated:1": 3.0, "1p1d": 2.0}, {"colocated:1": 2.9, "1p1d": 3.0})
    assert (v["pick"], v["best"], v["within"]) == ("colocated:1", "1p1d", True)
    assert v["shortfall"] == pytest.approx(1 / 30)
    v = verdict({"colocated:1": 3.0, "1p1d": 2.0}, {"colocated:1": 2.0, "1p1d": 3.0})
    assert not v["within"] and not v["within_a_grid_step"]
    assert verdict({"a": 1.0}, {"a": 0.0})["within"]


def test_the_same_rate_draws_the_same_requests_for_every_layout():
    assert rate_seed("256/128", "poisson", 1.2345, 0) == rate_seed("256/128", "poisson", 1.23451, 0)
    assert rate_seed("256/128", "poisson", 1.2345, 0) != rate_seed("256/128", "gamma:2", 1.2345, 0)


def test_the_report_counts_scenarios_within_the_bar():
    def line(layout, mix, pred, meas):
        return {
            "layout": layout,
            "mix": mix,
            "arrival": "poisson",
            "predicted_goodput": pred,
            "measured_goodput": meas,
        }

    text = format_report(
        [line("colocated:1", "a", 3.0, 3.0), line("1p1d", "a", 2.0, 2.5), line("colocated:1", "b", 1.0, 1.0),
         line("1p1d", "b", 2.0, 0.5)]
    )  # fmt: skip
    assert "1 of 2 scenarios" in text
    assert (
        "| a | poisson | colocated:1 3.00 / 3.00, 1p1d 2.00 / 2.50 | colocated:1 | colocated:1 | 0% |" in text
    )
