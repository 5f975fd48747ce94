"""The figures of issue 30's autoscaler bar from one run's record (pure: no torch, no client).

``baton bench autoscale`` (``autoscale_emulated.py``) records what ``baton up --autoscale`` logged,
each line stamped with the seconds since the load began, and every request's arrival, TTFT and
TPOT; this turns them into the three figures:

1. **decision delay**: seconds from the rate step to the first decision that adds a replica to
   some pool (``desired > current``), against one interval; with which decision after the step it
   was and how far into an interval the step fell (a step just before a decision shows in it only
   in part: the next one is the first to see a whole interval of it);
2. **reversals**: changes of direction of a pool's moves (up then down, or down then up), counted as
   ``planner/autoscale_sim.py``'s ``AutoscaledRun.reversals`` counts them, over the constant phase
   and scaled to 10 minutes, against one;
3. **out of SLO after the step**: requests that arrived after it and failed, or missed the TTFT or
   the TPOT SLO, against ``(cold start + 10 s) x the rate after the step``.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

_POOL = re.compile(r"\b(prefill|decode|colocated) (\d+) (=|->) (\d+) \(")
_HEAD = re.compile(r"\bt=(\d+)s rate ([0-9.]+) req/s, sized for ([0-9.]+)")


@dataclass(frozen=True)
class LoggedDecision:
    """One decision as ``baton up`` logged it (``planner.autoscale.Decision.__str__``)."""

    t_s: float
    """When the line was read, in seconds since the load began."""
    rate: float
    """Requests/s the autoscaler saw in its interval."""
    sizing_rate: float
    pools: dict[str, tuple[int, int]]
    """Pool -> (current: ready plus starting, desired)."""
    text: str

    def adds(self) -> bool:
        return any(want > have for have, want in self.pools.values())


@dataclass(frozen=True)
class RequestRecord:
    """One request as sent and measured (``ttft_ms``/``tpot_ms`` are 0 for a failed one)."""

    arrival_s: float
    """Seconds since the load began."""
    ttft_ms: float
    tpot_ms: float
    output_len: int
    error: str = ""

    def in_slo(self, ttft_ms: float, tpot_ms: float) -> bool:
        if self.error:
            return False
        return self.ttft_ms <= ttft_ms and (self.output_len <= 1 or self.tpot_ms <= tpot_ms)


def step_trace(
    rate: float, constant_s: float, after_s: float, input_len: int, output_len: int, seed: int
) -> list[tuple[float, int, int]]:
    """Poisson arrivals at ``rate`` for ``constant_s`` seconds, then at ``2 x rate`` for ``after_s``:
    rows ``(seconds since the first, prompt tokens, output tokens)`` as ``bench serve --trace`` reads."""
    rng, rows, t = random.Random(f"autoscale-{seed}"), [], 0.0
    for start, end, r in ((0.0, constant_s, rate), (constant_s, constant_s + after_s, 2 * rate)):
        t = start + rng.expovariate(r)
        while t < end:
            rows.append((t, input_len, output_len))
            t += rng.expovariate(r)
    return rows


def parse_decision(line: str, t_s: float) -> LoggedDecision | None:
    """The decision a log line states, or None for any other line."""
    head = _HEAD.search(line)
    pools = {m[1]: (int(m[2]), int(m[4])) for m in _POOL.finditer(line)}
    if head is None or not pools:
        return None
    return LoggedDecision(t_s, float(head[2]), float(head[3]), pools, line.rstrip("\n"))


def reversals(
    decisions: Sequence[LoggedDecision], pool: str, start_s: float = -math.inf, end_s: float = math.inf
) -> int:
    """Changes of direction of ``pool``'s moves among the decisions in ``[start_s, end_s)``."""
    moves = [
        d.pools[pool][1] - d.pools[pool][0] for d in decisions if start_s <= d.t_s < end_s and pool in d.pools
    ]
    signs = [1 if m > 0 else -1 for m in moves if m]
    return sum(1 for a, b in zip(signs, signs[1:]) if a != b)


def decision_delay(decisions: Sequence[LoggedDecision], step_s: float) -> tuple[float, int] | None:
    """Seconds from ``step_s`` to the first decision at or after it that adds a replica, and which
    decision after the step that was (1: the first); None if none did."""
    after = [d for d in decisions if d.t_s >= step_s]
    return next(((d.t_s - step_s, k) for k, d in enumerate(after, 1) if d.adds()), None)


def out_of_slo(
    requests: Sequence[RequestRecord], ttft_ms: float, tpot_ms: float, start_s: float, end_s: float
) -> int:
    """Requests that arrived in ``[start_s, end_s)`` and failed or missed an SLO."""
    return sum(1 for r in requests if start_s <= r.arrival_s < end_s and not r.in_slo(ttft_ms, tpot_ms))


@dataclass(frozen=True)
class Phases:
    """The run's shape: a constant rate until ``step_s``, twice it until ``end_s``."""

    step_s: float
    end_s: float
    rate_after: float
    """Requests/s after the step."""
    settle_s: float = 0.0
    """Reversals of the constant phase are counted from here (the first moves from the starting
    layout to the one the rate needs are no reversal, but an overshoot may be)."""


def figures(
    decisions: Sequence[LoggedDecision],
    requests: Sequence[RequestRecord],
    phases: Phases,
    slo: tuple[float, float],
    interval_s: float,
    cold_start_s: float,
) -> dict:
    """The three figures and their bars; ``slo`` is (TTFT, TPOT) in ms."""
    pools = sorted({p for d in decisions for p in d.pools})
    constant_s = phases.step_s - phases.settle_s
    per_pool = {p: reversals(decisions, p, phases.settle_s, phases.step_s) for p in pools}
    worst = max(per_pool.values(), default=0)
    per_10min = worst * 600.0 / constant_s if constant_s > 0 else None
    delay, nth = decision_delay(decisions, phases.step_s) or (None, None)
    before = [d.t_s for d in decisions if d.t_s < phases.step_s]
    bad_after = out_of_slo(requests, *slo, phases.step_s, phases.end_s)
    bar = (cold_start_s + 10.0) * phases.rate_after
    return {
        "decision_delay_s": None if delay is None else round(delay, 3),
        "decision_delay_bar_s": interval_s,
        "decision_delay_met": delay is not None and delay <= interval_s,
        "decision_delay_nth": nth,
        "step_after_last_decision_s": round(phases.step_s - before[-1], 3) if before else None,
        "reversals_constant_phase": per_pool,
        "constant_phase_s": constant_s,
        "reversals_per_10min": None if per_10min is None else round(per_10min, 3),
        "reversals_met": per_10min is not None and per_10min <= 1.0,
        "reversals_whole_run": {p: reversals(decisions, p) for p in pools},
        "out_of_slo_after_step": bad_after,
        "requests_after_step": sum(1 for r in requests if phases.step_s <= r.arrival_s < phases.end_s),
        "out_of_slo_before_step": out_of_slo(requests, *slo, 0.0, phases.step_s),
        "out_of_slo_bar": bar,
        "out_of_slo_met": bad_after <= bar,
    }
