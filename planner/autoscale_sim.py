"""An autoscaled simulation: the simulator driven interval by interval, the autoscaler setting each
interval's layout (pure). It tells what a policy does to requests, not only what it decides.

Each interval replays its own arrivals (Poisson at that interval's rate) through the layout ready
then, starting from idle workers. Requests whose first token had not come by the interval's end are
carried into the next one: queued again at its start, their wait so far added to their TTFT (a
carried prompt is prefilled from scratch: this errs towards more requests out of SLO, not fewer).
A replica asked for is ready ``cold_start_s`` later (at the next interval boundary from then); one
removed stops taking requests at once, those it holds finishing (the drain).

Each observation carries its interval's second half's arrivals, as the service's half-way scrape
gives them. Surge decisions at the half interval are not modelled: here the rate steps only at an
interval's start, where the decision at its end sees the whole interval at the new rate, and a
replica asked for half an interval earlier would serve from the same boundary (when the cold start
is a whole number of intervals, as in the tests).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.planner.autoscale import Autoscaler, Decision, Observation, PoolObservation
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import Simulator
from baton.planner.workload import Requests


@dataclass(frozen=True)
class Carried:
    waited_ms: float
    prompt: int
    out: int


@dataclass
class AutoscaledRun:
    """Per interval: the layout ready, the decision taken at its end, the requests out of SLO."""

    ready: list[dict[str, int]] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    out_of_slo: list[int] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)

    def reversals(self, pool: str) -> int:
        """Changes of the desired count's direction (up then down, or down then up)."""
        moves = [d.pools[pool].desired - d.pools[pool].current for d in self.decisions]
        signs = [1 if m > 0 else -1 for m in moves if m]
        return sum(1 for a, b in zip(signs, signs[1:]) if a != b)

    def changes(self, pool: str) -> int:
        return sum(1 for d in self.decisions if d.pools[pool].desired != d.pools[pool].current)


def _arrivals(rng: random.Random, rate: float, interval_s: float) -> list[float]:
    """Poisson arrival times within one interval."""
    times: list[float] = []
    t = rng.expovariate(rate) if rate > 0 else math.inf
    while t < interval_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _window(
    times: list[list[float]], k: int, dt: float, input_len: int, output_len: int, carried: list[Carried]
) -> tuple[Requests, range, list[float]]:
    """Intervals k-1, k and k+1 back to back, the carried requests at interval k's start: the
    neighbours' arrivals only load the workers as they would be (interval k's requests neither start
    with idle workers nor end with a draining one). Returns the requests, the indices of interval
    k's own (carried first), and each one's wait before the interval."""
    before = times[k - 1] if k > 0 else []
    after = [t + 2 * dt for t in times[k + 1]] if k + 1 < len(times) else []
    arrivals = [*before, *([dt] * len(carried)), *(t + dt for t in times[k]), *after]
    n = len(arrivals)
    prompts, outs = [input_len] * n, [output_len] * n
    first = len(before)
    for j, c in enumerate(carried):
        prompts[first + j], outs[first + j] = c.prompt, c.out
    counted = range(first, first + len(carried) + len(times[k]))
    waits = [c.waited_ms for c in carried] + [0.0] * len(times[k])
    return Requests(arrivals, prompts, outs), counted, waits


def run_autoscaled(
    autoscaler: Autoscaler,
    profile: Profile,
    slo: SLO,
    rates: Sequence[float],
    input_len: int,
    output_len: int,
    start: dict[str, int],
    seed: int = 0,
) -> AutoscaledRun:
    """Run ``rates`` (one per interval of ``autoscaler.config.interval_s``) with ``start`` replicas
    per pool ready; ``profile`` is the workers' true cost (the autoscaler may hold another)."""
    cfg = autoscaler.config
    dt, rng = cfg.interval_s, random.Random(seed)
    times = [_arrivals(rng, rate, dt) for rate in rates]
    ready = dict(start)
    pending: list[tuple[float, str]] = []  # (ready at, pool)
    carried: list[Carried] = []
    run = AutoscaledRun()
    for k in range(len(rates)):
        t0 = k * dt
        for at, pool in [x for x in pending if x[0] <= t0 + 1e-9]:
            ready[pool] += 1
            pending.remove((at, pool))
        requests, counted, waits = _window(times, k, dt, input_len, output_len, carried)
        sim = Simulator(profile, autoscaler.layout_of(ready), requests, slo)
        sim.run()
        carried, obs = _observe(
            sim, requests, counted, waits, len(carried), slo, t0 + dt, dt, ready, pending, run
        )
        recent = sum(1 for t in times[k] if t >= dt / 2)
        decision = autoscaler.decide(dataclasses.replace(obs, recent_arrivals=recent, recent_s=dt / 2))
        run.ready.append(dict(ready))
        run.decisions.append(decision)
        for pool, want in decision.desired.items():
            have = ready[pool] + sum(1 for _, p in pending if p == pool)
            for _ in range(want - have):
                pending.append((t0 + dt + cfg.cold_start_s, pool))
            for _ in range(have - want):
                mine = [x for x in pending if x[1] == pool]
                if mine:
                    pending.remove(max(mine))
                else:
                    ready[pool] -= 1
    return run


def _observe(
    sim: Simulator,
    requests: Requests,
    counted: range,
    waits: list[float],
    carried_in: int,
    slo: SLO,
    t_end: float,
    dt: float,
    ready: dict[str, int],
    pending: list[tuple[float, str]],
    run: AutoscaledRun,
) -> tuple[list[Carried], Observation]:
    """What the interval's metrics show, the requests carried on, and its out-of-SLO count."""
    carried: list[Carried] = []
    ttfts, tpots, bad = [], [], 0
    for rid, wait in zip(counted, waits):
        arrive_ms = requests.arrival_s[rid] * 1000.0
        ttft = sim.ttft[rid]
        if ttft < 0 or arrive_ms + ttft > 2 * dt * 1000.0:
            carried.append(
                Carried(wait + dt * 1000.0 - arrive_ms, requests.input_len[rid], requests.output_len[rid])
            )
            continue
        ttft += wait
        out = requests.output_len[rid]
        tpot = (sim.finish[rid] - arrive_ms - sim.ttft[rid]) / (out - 1) if out > 1 else 0.0
        ttfts.append(ttft)
        tpots.append(tpot)
        bad += ttft > slo.ttft_ms or tpot > slo.tpot_ms
    new = len(waits) - carried_in
    run.out_of_slo.append(bad)
    run.arrivals.append(new)
    queued = sum(c.prompt for c in carried)
    pools = {}
    for pool, n in ready.items():
        starting = sum(1 for _, p in pending if p == pool)
        waiting = len(carried) if pool != "decode" else 0
        pools[pool] = PoolObservation(n, starting, waiting, queued if pool != "decode" else 0)
    obs = Observation(
        t_s=t_end,
        arrivals=new,
        input_len=sum(requests.input_len[i] for i in counted) / len(counted) if counted else 0.0,
        output_len=sum(requests.output_len[i] for i in counted) / len(counted) if counted else 0.0,
        pools=pools,
        p90_ttft_ms=_p90(ttfts),
        p90_tpot_ms=_p90(tpots),
        interval_s=dt,
    )
    return carried, obs


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(0.9 * len(v)))]
