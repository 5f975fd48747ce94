"""``baton profile``'s prefill rounds (bench/profile_engine.py): a short point is run once untimed
and then timed ``repeats`` times; a point whose first step takes ``LONG_STEP_MS`` or more keeps that
step and is not run again, nor is the chunked prompt once a step of it is that long. The engine is
a stand-in that answers each step's time from the point's size."""

from __future__ import annotations

from collections import Counter

import pytest

from baton.bench import profile_engine
from baton.bench.profile_engine import LONG_STEP_MS, PrefillPoint, measure_prefill


class _Runner:
    """Answers each step with ``ms_per_token`` a token; counts the steps run."""

    def __init__(self, ms_per_token: float) -> None:
        self.ms_per_token = ms_per_token
        self.runs: Counter = Counter()
        self.first: set = set()

    def once(self, point: PrefillPoint):
        self.runs[point] += 1
        ms = point.tokens * self.ms_per_token
        if point not in self.first:  # a first run pays a shape's one-time cost
            self.first.add(point)
            ms += 7.0
        return ms, [(point.tokens, point.prior)] * point.pieces

    def chunked(self, prompt_len: int):
        self.runs["chunked"] += 1
        return [
            (prompt_len / 2 * self.ms_per_token, [(prompt_len // 2, i * prompt_len // 2)]) for i in range(2)
        ]


class _Engine:
    on_step_computed = None


@pytest.fixture
def runner(monkeypatch):
    made = []

    def make(ms_per_token):
        def factory(engine, prompts):
            made.append(_Runner(ms_per_token))
            return made[-1]

        monkeypatch.setattr(profile_engine, "PrefillRunner", factory)
        return made

    return make


def test_short_points_are_warmed_once_then_timed_each_round(runner):
    made = runner(0.5)  # 16 and 256 tokens: 8 and 128 ms, far below a second
    points = [PrefillPoint(1, 16, 0), PrefillPoint(1, 256, 0)]
    out = measure_prefill(_Engine(), points, 512, 3, prompts=None)
    assert made[0].runs == {points[0]: 4, points[1]: 4, "chunked": 3}
    assert [p["ms"] for p in out[:2]] == [8.0, 128.0]  # the warm-up's one-time cost not kept
    assert len(out) == 4 and all(p.get("chunked") for p in out[2:])


def test_a_point_whose_first_step_is_long_keeps_it_and_runs_no_more(runner):
    long_ = PrefillPoint(1, 2048, 0)
    made = runner(LONG_STEP_MS / 1024)  # 2048 tokens: two seconds; the chunked prompt's steps too
    short = PrefillPoint(1, 16, 0)
    out = measure_prefill(_Engine(), [short, long_], 4096, 3, prompts=None)
    assert made[0].runs == {short: 4, long_: 1, "chunked": 1}
    by_tokens = {p["tokens"]: p for p in out if not p.get("chunked")}
    assert by_tokens[2048]["ms"] == pytest.approx(2 * LONG_STEP_MS + 7.0)  # its one step, kept
    assert by_tokens[2048]["prior"] == 0 and by_tokens[2048]["pieces"] == 1
    assert [p["ms"] for p in out if p.get("chunked")] == pytest.approx([2 * LONG_STEP_MS] * 2)
