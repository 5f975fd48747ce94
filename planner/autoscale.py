"""The autoscaler's decision: each pool's replicas for the next interval, from what the last one
showed (pure: no torch; ``services/autoscaler.py`` feeds it live metrics, ``autoscale_sim.py`` a
simulation).

Each interval (``decide``):

1. **Forecast.** Holt's linear smoothing of the arrival rate (``forecast.py``), read ``cold_start_s +
   interval_s`` ahead: a worker asked for now is capacity only after its cold start, so it must fit
   the load of then. The sizing rate is ``max(forecast, the rate just seen)``, the rate seen being
   the higher of the interval's and, where the observation has it, its last half's, each less its
   own Poisson noise allowance: a step up is acted on in the interval that shows it, whatever the
   smoothing still believes, and a step late in the interval is not halved. A scale-down is checked
   against the interval's rate undiscounted. Between decisions the service tests each half interval
   for a surge (``surged``) and decides out of turn on one (``Observation.surge``).
2. **Correct.** The profile's prefill and decode step costs are multiplied by smoothed, clamped
   ratios of measured p90 TTFT and TPOT to what the simulator predicts for the ready layout at the
   observed rate, kept by the per-replica load they were measured at (``correction.py``: the
   overhead of serving is more additive than multiplicative, so a ratio measured with few replicas
   overstates it at many). A sample is used only in steady state: enough requests, no replica
   starting or within ``warmup_s`` of becoming ready (a cold worker's first requests are slow, and
   Dynamo's planner over-scaled on them), and no backlog (queueing is the next step's business, not
   the profile's; counting it twice made Dynamo blind in one place and would make this over-react).
3. **Size.** Per pool, the fewest replicas whose capacity (``capacity.py``), with the corrections at
   the per-replica load of that count, carries ``rate + backlog / drain`` at
   ``target_utilisation``: the backlog (waiting requests; the prefill pool's queued prompt tokens)
   must drain within ``max(TTFT SLO, drain_s)`` on top of the arrivals. Then the simulator checks
   the steady state at the sizing rate (corrected at the candidate layout's loads) and adds a
   replica to the pool whose SLO it misses until the layout meets ``attainment`` (TTFT missed:
   prefill; TPOT missed: decode).
4. **Hysteresis.** Up at once (replicas starting count as current: they are not asked for twice).
   Down only when every count needed in the last ``stable_intervals`` was lower, nothing is
   starting, ``cooldown_s`` has passed since the pool's last change and since a replica of it
   last became ready (one not yet seen at work is no evidence of surplus), and the lower count's
   utilisation stays under ``headroom`` (below ``target_utilisation``: a dead band where neither way
   moves), at the highest demand of the last ``cooldown_s`` (one quiet interval in a noisy
   load is no surplus). Up within ``cooldown_s`` of a scale-down (a reversal) only when the backlog or a measured
   p90 over its SLO demands it, not on the forecast alone. A surge decision never scales down. Then
   ``[min, max]`` per pool.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from baton.planner.autoscale_io import (
    COLOCATED_POOLS,
    DISAGGREGATED_POOLS,
    AutoscaleConfig,
    Decision,
    Observation,
    PoolDecision,
    PoolObservation,
    seen_rate,
    surged,
)
from baton.planner.capacity import Capacity, capacity, scaled
from baton.planner.correction import LoadCorrection
from baton.planner.forecast import Ewma, Holt
from baton.planner.layout import Layout
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import simulate
from baton.planner.workload import Lengths, Workload

__all__ = [
    "COLOCATED_POOLS",
    "DISAGGREGATED_POOLS",
    "AutoscaleConfig",
    "Autoscaler",
    "Decision",
    "Observation",
    "PoolDecision",
    "PoolObservation",
    "seen_rate",
    "surged",
]


@dataclass
class _PoolState:
    needed: deque[int]
    demand: deque[float]
    """Recent intervals' demand (req/s): a scale-down is checked against their highest."""
    last_change_s: float = -math.inf
    last_direction: int = 0
    ready: int = 0
    ready_rose_s: float = -math.inf
    raised_from: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Count -> (when, demand) of the latest scale-up from it (``reversal_memory_s``)."""


class Autoscaler:
    """Decides each interval; keeps the forecast, corrections and hysteresis state between calls."""

    def __init__(self, profile: Profile, slo: SLO, colocated: bool, config: AutoscaleConfig | None = None):
        self.profile, self.slo, self.colocated = profile, slo, colocated
        self.config = cfg = config or AutoscaleConfig()
        self.pools = COLOCATED_POOLS if colocated else DISAGGREGATED_POOLS
        self.rate = Holt(cfg.holt_alpha, cfg.holt_beta)
        self.input_len, self.output_len = Ewma(0.5), Ewma(0.5)
        age = cfg.correction_max_age_s
        self.k_prefill = LoadCorrection(cfg.correction_alpha, cfg.correction_spacing, age)
        self.k_decode = LoadCorrection(cfg.correction_alpha, cfg.correction_spacing, age)
        # The pools whose per-replica load indexes the prefill and the decode factor.
        self.load_pools = ("colocated", "colocated") if colocated else ("prefill", "decode")
        self.correction: tuple[float, float] = (1.0, 1.0)
        """The (prefill, decode) factors of the last decision, at its desired counts."""
        self.level = 0.0
        """The smoothed arrival rate after the last decision (the reversal guard's load)."""
        window = max(cfg.stable_intervals, math.ceil(cfg.cooldown_s / cfg.interval_s))
        self.state = {
            p: _PoolState(deque(maxlen=cfg.stable_intervals), deque(maxlen=window)) for p in self.pools
        }
        self._sim_cache: dict[tuple, tuple[float, float, float, dict[str, float]]] = {}

    # -- the decision ----------------------------------------------------------------------------
    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        missing = [p for p in self.pools if p not in obs.pools]
        if missing:
            raise ValueError(f"the observation has no {', '.join(missing)} pool")
        rate = obs.arrivals / obs.interval_s
        level = self.rate.level
        self.rate.update(rate)  # a surge's shorter interval counts as one: its rate is no less real
        self.level = self.rate.level if self.rate.level is not None else rate
        if obs.arrivals:
            self.input_len.update(obs.input_len)
            self.output_len.update(obs.output_len)
        self._track_ready(obs)
        notes = [f"surge: decided {obs.interval_s:.1f} s after the last"] if obs.surge else []
        notes.append(self._correct(obs, rate, level))
        steps = (cfg.cold_start_s + cfg.interval_s) / cfg.interval_s
        seen = seen_rate(obs.arrivals, obs.interval_s, cfg.noise_sigmas)
        if obs.recent_arrivals is not None and obs.recent_s > 0:
            recent = seen_rate(obs.recent_arrivals, obs.recent_s, cfg.noise_sigmas)
            notes.append(f"last {obs.recent_s:.1f} s at {obs.recent_arrivals / obs.recent_s:.2f} req/s")
            seen = max(seen, recent)
        sizing = max(self.rate.forecast(steps), seen)
        holding = max(self.rate.forecast(steps), rate)  # what a scale-down must still carry
        notes.append(f"forecast {self.rate.forecast(steps):.2f} req/s in {steps * cfg.interval_s:.0f} s")
        needed, why = self._size(sizing, obs)
        pools = {
            p: self._hysteresis(p, obs, needed[p], why[p], self._demand(p, holding, obs)) for p in self.pools
        }
        loads = self._loads({p: d.desired for p, d in pools.items()}, sizing, obs)
        self.correction = self._factors(loads)
        if why_not := self._capacity(self.correction).why_not:
            notes.append(f"no count meets the SLO: {why_not}")
        return Decision(obs.t_s, rate, sizing, self.correction, tuple(notes), pools, loads)

    @property
    def mean_input(self) -> float:
        return self.input_len.value or 1.0

    @property
    def mean_output(self) -> float:
        return self.output_len.value or 1.0

    def _loads(self, counts: dict[str, int], rate: float, obs: Observation) -> tuple[float, float]:
        """Per-replica demand (req/s) of the pools the prefill and the decode factor correct."""
        pp, dp = self.load_pools
        prefill = self._demand(pp, rate, obs) / max(1, counts[pp])
        return prefill, self._demand(dp, rate, obs) / max(1, counts[dp])

    def _factors(self, loads: tuple[float, float]) -> tuple[float, float]:
        """The (prefill, decode) factors at these per-replica loads."""
        return self.k_prefill.at(loads[0]), self.k_decode.at(loads[1])

    def _capacity(self, factors: tuple[float, float]) -> Capacity:
        """Per-replica capacity with the step costs corrected by ``factors``. Not cached: one call is
        ~13 us (a binary search of ~8 decode steps), a decision makes a few dozen."""
        return capacity(scaled(self.profile, *factors), self.mean_input, self.mean_output, self.slo)

    def _per_replica(self, pool: str, n: int, demand: float) -> float:
        """Requests/s one of ``n`` replicas of ``pool`` serves at the SLO, corrected at the load
        ``demand / n`` (each factor at its own pool's load: one pool kind a count here)."""
        load = demand / max(1, n)
        return self._capacity(self._factors((load, load))).of(pool)

    def _fewest(self, pool: str, demand: float, share: float, hi: int) -> int | None:
        """The fewest replicas, up to ``hi``, that carry ``demand`` at ``share`` of their corrected
        capacity; None when ``hi`` do not (or no count meets the SLO). Scanned: the capacity
        depends on the count."""
        for n in range(1, hi + 1):
            per = self._per_replica(pool, n, demand)
            if per > 0 and demand <= n * per * share + 1e-9:
                return n
        return None

    # -- step 2: observed / expected -------------------------------------------------------------
    def _track_ready(self, obs: Observation) -> None:
        for p in self.pools:
            st, ready = self.state[p], obs.pools[p].ready
            if ready > st.ready:
                st.ready_rose_s = obs.t_s
            st.ready = ready

    def _correct(self, obs: Observation, rate: float, level: float | None) -> str:
        cfg = self.config
        for k in (self.k_prefill, self.k_decode):
            k.expire(obs.t_s)
        why_not = self._unsteady(obs)
        noise = 2.0 * math.sqrt(max(obs.arrivals, 1)) / obs.interval_s
        if not why_not and level is not None and abs(rate - level) > noise:
            why_not = f"rate moving ({level:.2f} -> {rate:.2f} req/s)"
        if why_not:
            return f"correction kept ({why_not})"
        layout = self.layout_of({p: obs.pools[p].ready for p in self.pools})
        ttft, tpot, _, _ = self._simulated(self.profile, layout, rate, round_up=False)
        if ttft > self.slo.ttft_ms or tpot > self.slo.tpot_ms:
            # Past its SLO the simulated queue grows with the replayed window: no reference.
            return f"correction kept (the ready layout is predicted over the SLO at {rate:.2f} req/s)"
        lo, hi = cfg.correction_range
        parts = []
        for name, measured, expected, k, pool in (
            ("ttft", obs.p90_ttft_ms, ttft, self.k_prefill, self.load_pools[0]),
            ("tpot", obs.p90_tpot_ms, tpot, self.k_decode, self.load_pools[1]),
        ):
            if measured is not None and expected > 0 and math.isfinite(expected):
                ratio = min(hi, max(lo, measured / expected))
                ratio = 1.0 if abs(ratio - 1.0) <= cfg.correction_tolerance else ratio
                load = rate / obs.pools[pool].ready  # steady: at least one ready
                k.update(load, ratio, obs.t_s)
                parts.append(f"{name} {measured:.0f}/{expected:.0f} ms at {load:.2f} req/s a {pool} replica")
        return f"correction updated ({', '.join(parts) or 'no latency samples'})"

    def _unsteady(self, obs: Observation) -> str:
        """Why this interval's latencies must not correct the profile, or ''."""
        if obs.arrivals < self.config.min_samples:
            return f"{obs.arrivals} requests < {self.config.min_samples}"
        for p in self.pools:
            po, st = obs.pools[p], self.state[p]
            if po.starting:
                return f"{po.starting} {p} replica(s) starting"
            if obs.t_s - st.ready_rose_s < self.config.warmup_s:
                return f"{p} replica(s) warming up"
            if po.ready < 1:
                return f"no {p} replica ready"
            if self._backlog(p, obs) > po.ready:
                return f"{p} backlog of {self._backlog(p, obs):.0f} requests"
        return ""

    # -- step 3: sizing --------------------------------------------------------------------------
    def _backlog(self, pool: str, obs: Observation) -> float:
        """Requests queued in ``pool`` (queued prompt tokens count in mean prompts)."""
        po = obs.pools[pool]
        tokens = po.queued_tokens / self.mean_input if pool != "decode" else 0.0
        return max(float(po.waiting), tokens)

    def _demand(self, pool: str, rate: float, obs: Observation) -> float:
        """Requests/s the pool must serve: arrivals plus its backlog drained within the horizon."""
        horizon = max(self.slo.ttft_ms / 1000.0, self.config.drain_s)
        return rate + self._backlog(pool, obs) / horizon

    def _size(self, rate: float, obs: Observation) -> tuple[dict[str, int], dict[str, list[str]]]:
        cfg = self.config
        needed: dict[str, int] = {}
        why: dict[str, list[str]] = {}
        for p in self.pools:
            lo, hi = cfg.bounds_of(p)
            demand = self._demand(p, rate, obs)
            fits = self._fewest(p, demand, cfg.target_utilisation, hi)
            at = fits or hi
            per = self._per_replica(p, at, demand)
            n = fits or (hi if per <= 0 else math.ceil(demand / (per * cfg.target_utilisation) - 1e-9))
            kp, kd = self._factors((demand / at, demand / at))
            factor = {"prefill": f"x{kp:.2f}", "decode": f"x{kd:.2f}"}.get(p, f"x{kp:.2f}/{kd:.2f}")
            why[p] = [f"closed form {n} for {demand:.2f} req/s at {per:.2f} req/s a replica ({factor})"]
            if not lo <= n <= hi:
                why[p].append(f"bounds [{lo}, {hi}]")
            needed[p] = min(hi, max(lo, n))
        if cfg.simulate and rate > 0:
            self._check_by_simulation(rate, obs, needed, why)
        return needed, why

    def _model_at(self, counts: dict[str, int], rate: float, obs: Observation) -> Profile | None:
        """The profile corrected at ``counts``' per-replica loads; None where no count meets the SLO."""
        factors = self._factors(self._loads(counts, rate, obs))
        return None if self._capacity(factors).why_not else scaled(self.profile, *factors)

    def _check_by_simulation(
        self, rate: float, obs: Observation, needed: dict[str, int], why: dict[str, list[str]]
    ) -> None:
        """Add replicas where the simulated steady state at ``rate`` misses the SLO."""
        cfg = self.config
        while True:
            model = self._model_at(needed, rate, obs)
            if model is None:
                return
            ttft, tpot, att, util = self._simulated(model, self.layout_of(needed), rate)
            if att >= cfg.attainment:
                return
            grow = self._pools_missing(ttft, tpot, util)
            grow = [p for p in grow if needed[p] < cfg.bounds_of(p)[1]]
            if not grow:
                for p in self.pools:
                    why[p].append(f"simulated attainment {att:.0%} even at the bound")
                return
            for p in grow:
                needed[p] += 1
                why[p].append(f"simulator: attainment {att:.0%} (p90 TTFT {ttft:.0f}, TPOT {tpot:.0f} ms)")

    def _pools_missing(self, ttft: float, tpot: float, util: dict[str, float]) -> list[str]:
        if self.colocated:
            return ["colocated"]
        grow = [
            p for p, bad in (("prefill", ttft > self.slo.ttft_ms), ("decode", tpot > self.slo.tpot_ms)) if bad
        ]
        return grow or [max(("prefill", "decode"), key=lambda p: util.get(p, 0.0))]

    def layout_of(self, counts: dict[str, int]) -> Layout:
        """The simulator's layout for pool counts (at least one replica a pool)."""
        if self.colocated:
            return Layout(0, max(1, counts["colocated"]), True)
        return Layout(max(1, counts["prefill"]), max(1, counts["decode"]), False)

    def _simulated(
        self, model: Profile, layout: Layout, rate: float, round_up: bool = True
    ) -> tuple[float, float, float, dict[str, float]]:
        """(p90 TTFT, p90 TPOT, attainment, pool utilisation) of ``layout`` at ``rate`` (Poisson,
        the mean lengths). The rate is put on a 5% grid (up when sizing) so that nearby rates share
        a cached run."""
        step = math.log(1.05)
        grid = (math.ceil if round_up else round)(math.log(max(rate, 1e-3)) / step)
        r = math.exp(grid * step)
        i, o = max(1, round(self.mean_input)), max(1, round(self.mean_output))
        key = (model.prefill, model.decode, str(layout), grid, i, o)
        if key not in self._sim_cache:
            n = min(5000, max(50, math.ceil(r * self.config.sim_window_s)))
            w = Workload(rate=r, num_prompts=n, input_len=Lengths("fixed", i), output_len=Lengths("fixed", o))
            res = simulate(model, layout, w, self.slo, seed=0)
            if len(self._sim_cache) > 4096:
                self._sim_cache.clear()
            pu = res.pool_utilisation
            self._sim_cache[key] = (res.ttft_ms.p90, res.tpot_ms.p90, res.slo_attainment, pu)
        return self._sim_cache[key]

    # -- step 4: hysteresis and bounds -----------------------------------------------------------
    def _hysteresis(
        self, pool: str, obs: Observation, needed: int, why: list[str], demand: float
    ) -> PoolDecision:
        cfg, st, po = self.config, self.state[pool], obs.pools[pool]
        lo, hi = cfg.bounds_of(pool)
        current = po.ready + po.starting
        st.needed.append(needed)
        st.demand.append(demand)
        since = obs.t_s - st.last_change_s
        desired, reasons = current, list(why)
        if needed > current:
            urgent = self._urgent(pool, obs, demand, current)
            if st.last_direction < 0 and since < cfg.cooldown_s and not urgent:
                reasons.append(f"hold: scaled down {since:.0f} s ago, no backlog or SLO miss to reverse for")
            else:
                desired = needed
                reasons.append("up now" + (f" ({urgent})" if urgent else ""))
        elif needed < current and obs.surge:
            reasons.append("hold: scale-downs wait for a regular decision")
        elif needed < current:
            # A replica that just became ready has not been seen at work yet: it counts as a change.
            settled = obs.t_s - max(st.last_change_s, st.ready_rose_s)
            desired, why_not = self._scale_down(pool, current, demand, settled, po.starting, obs.t_s)
            reasons.append(why_not)
        if not lo <= desired <= hi:
            desired = min(hi, max(lo, desired))
            reasons.append(f"bounds [{lo}, {hi}]")
        if desired != current:
            st.last_change_s, st.last_direction = obs.t_s, (1 if desired > current else -1)
        if desired > current:
            st.raised_from[current] = (obs.t_s, self.level)
        return PoolDecision(pool, current, needed, desired, tuple(reasons))

    def _urgent(self, pool: str, obs: Observation, demand: float, current: int) -> str:
        """Why a scale-up cannot wait: a backlog the current count cannot drain, or a measured
        p90 over its SLO; ''."""
        backlog = self._backlog(pool, obs)
        per_replica = self._per_replica(pool, current, demand)
        if (
            backlog > 0
            and per_replica > 0
            and demand > current * per_replica * self.config.target_utilisation
        ):
            return f"backlog of {backlog:.0f} requests"
        ttft, tpot = obs.p90_ttft_ms, obs.p90_tpot_ms
        if pool != "decode" and ttft is not None and ttft > self.slo.ttft_ms:
            return f"measured p90 TTFT {ttft:.0f} ms over the SLO"
        if pool != "prefill" and tpot is not None and tpot > self.slo.tpot_ms:
            return f"measured p90 TPOT {tpot:.0f} ms over the SLO"
        return ""

    def _undoes_a_scale_up(self, st: _PoolState, target: int, level: float, now: float) -> str:
        """Why going down to ``target`` would undo a recent scale-up at the same load; ''. The
        load is the smoothed arrival rate (Holt's level), not the interval's rate or its backlog:
        at 5 req/s an interval's rate alone wanders +-20% (61 arrivals in 10 s scaled prefill up
        on a backlog, 47 a little later let it down, and the next surge up again)."""
        cfg = self.config
        for count, (when, then) in st.raised_from.items():
            if (
                count >= target
                and now - when < cfg.reversal_memory_s
                and level > then * (1 - cfg.reversal_margin)
            ):
                return (
                    f"hold: scaled up from {count} {now - when:.0f} s ago at a load of {then:.2f} req/s, "
                    f"now {level:.2f} req/s: not {cfg.reversal_margin:.0%} less"
                )
        return ""

    def _scale_down(
        self,
        pool: str,
        current: int,
        demand: float,
        since: float,
        starting: int,
        now: float,
    ) -> tuple[int, str]:
        cfg, st = self.config, self.state[pool]
        if starting:
            return current, f"hold: {starting} replica(s) still starting"
        if len(st.needed) < cfg.stable_intervals or max(st.needed) >= current:
            run = _trailing_below(st.needed, current)
            return current, f"hold: lower for {run}/{cfg.stable_intervals} intervals"
        if since < cfg.cooldown_s:
            return (
                current,
                f"hold: last change or replica ready {since:.0f} s ago (cooldown {cfg.cooldown_s:.0f} s)",
            )
        demand = max(st.demand)  # the load of the last cooldown, not one quiet interval
        fits = self._fewest(pool, demand, cfg.headroom, current - 1)
        if fits is None:
            per_replica = self._per_replica(pool, current - 1, demand)
            if per_replica <= 0 or current <= 1:
                return current, "hold: no capacity figure"
            util = demand / ((current - 1) * per_replica)
            return current, f"hold: {current - 1} would run at {util:.0%} (headroom {cfg.headroom:.0%})"
        floor = max(max(st.needed), fits)
        if held := self._undoes_a_scale_up(st, floor, self.level, now):
            return current, held
        busy = demand / (floor * self._per_replica(pool, floor, demand))
        return floor, f"down: lower for {cfg.stable_intervals} intervals, {busy:.0%} busy"


def _trailing_below(values: deque[int], current: int) -> int:
    """How many of the latest ``values`` in a row are below ``current``."""
    run = 0
    for n in reversed(values):
        if n >= current:
            break
        run += 1
    return run
