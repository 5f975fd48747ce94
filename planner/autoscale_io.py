"""What the autoscaler reads and says (pure: no torch): its settings, one interval's observation,
its decision, and the noise-aware rate tests that decide when a surge cannot wait. The decision
itself is ``autoscale.py``'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DISAGGREGATED_POOLS = ("prefill", "decode")
COLOCATED_POOLS = ("colocated",)


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 10.0
    """Seconds between decisions."""
    cold_start_s: float = 30.0
    """From asking for a worker to its serving: the forecast looks this far (+ one interval) ahead."""
    min_replicas: int = 1
    max_replicas: int = 8
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Pool -> (min, max) where it differs from ``min_replicas``/``max_replicas``."""
    target_utilisation: float = 0.8
    """Closed-form sizing keeps each replica's load under this share of its SLO capacity."""
    headroom: float = 0.7
    """A scale-down must leave the lower count's utilisation under this."""
    stable_intervals: int = 3
    """Intervals the lower count must have been enough before a scale-down."""
    cooldown_s: float = 60.0
    """No scale-down this soon after a pool's last change; no forecast-only reversal either."""
    reversal_memory_s: float = 600.0
    """A pool scaled up from N does not go back down to N for this long unless its load (the
    smoothed arrival rate) fell by ``reversal_margin`` since: at constant load the observed/expected correction measured at N+1
    says N is enough and the one measured at N says it is not (emulated workers on 2 cores went
    3 -> 4 -> 3 six times in 10 minutes), so only a change of load may undo a scale-up."""
    reversal_margin: float = 0.2
    drain_s: float = 10.0
    """The backlog is sized to drain within ``max(TTFT SLO, drain_s)``."""
    attainment: float = 0.9
    """Share of requests within both SLOs the simulator must predict (the SLOs are p90s)."""
    holt_alpha: float = 0.3
    holt_beta: float = 0.1
    noise_sigmas: float = 1.0
    """The rate just seen counts, against the forecast, less this many Poisson standard deviations
    (``sqrt(arrivals) / interval``): a 2x step clears it at once, a noisy interval does not."""
    surge_sigmas: float = 2.0
    """A half interval is a surge when its rate, less this many Poisson standard deviations, is over
    the rate the last decision sized for. Stricter than ``noise_sigmas``: it is tested twice as
    often, on half the arrivals, and a surge decision sizes for more than the last one by
    construction. Sized for a constant 5 req/s (25 arrivals in 5 s), 1 sigma fires on 1 half
    interval in 7, 2 sigmas on 1 in 100; a 2x step (50 arrivals in 5 s) clears 2 sigmas 97 times in
    100 (Poisson tails)."""
    correction_alpha: float = 0.3
    """Weight of the newest observed/expected ratio (in its load bucket)."""
    correction_spacing: float = 1.25
    """Per-replica loads within this factor of each other share a correction bucket."""
    correction_max_age_s: float = 1800.0
    """A bucket not updated for this long is dropped: a ratio measured half an hour ago at another
    load speaks of a machine (its neighbours, its clocks) and a length mix that may be gone."""
    correction_range: tuple[float, float] = (0.5, 4.0)
    correction_tolerance: float = 0.15
    """A ratio within ``1 +- this`` counts as 1: the simulator's own error at p90 (15%) is no
    evidence against the profile, and chasing it makes capacity, and so the counts, jitter."""
    warmup_s: float = 20.0
    """After a pool's ready count rises, its latency samples are not used for this long."""
    min_samples: int = 20
    """Fewest arrivals in an interval for its latencies to correct the profile."""
    sim_window_s: float = 60.0
    """Seconds of traffic the simulator replays per check."""
    simulate: bool = True
    """Check the closed-form counts with the simulator (off: closed form alone)."""

    def bounds_of(self, pool: str) -> tuple[int, int]:
        return self.bounds.get(pool, (self.min_replicas, self.max_replicas))


@dataclass(frozen=True)
class PoolObservation:
    ready: int
    """Replicas serving."""
    starting: int = 0
    """Replicas asked for and not yet serving."""
    waiting: int = 0
    """Requests queued in the pool (the workers' ``num_requests_waiting``)."""
    queued_tokens: int = 0
    """Prompt tokens queued for prefill (prefill workers' ``queued_prefill_tokens``)."""


@dataclass(frozen=True)
class Observation:
    """One interval, as the metrics showed it."""

    t_s: float
    arrivals: int
    """Requests that arrived in the interval."""
    input_len: float
    """Mean prompt tokens of the interval's requests (0: none seen)."""
    output_len: float
    """Mean output tokens (0: none seen)."""
    pools: dict[str, PoolObservation]
    p90_ttft_ms: float | None = None
    p90_tpot_ms: float | None = None
    interval_s: float = 10.0
    recent_arrivals: int | None = None
    """Requests that arrived in the last ``recent_s`` of the interval (its second half, where the
    service scraped half-way): a step late in the interval shows in it undiluted."""
    recent_s: float = 0.0
    surge: bool = False
    """Decided out of turn, on a surge (``surged``) since the last decision: it may scale up or
    hold, never down (scale-downs wait for a whole interval)."""


def seen_rate(arrivals: int, seconds: float, sigmas: float) -> float:
    """Requests/s in ``seconds``, less ``sigmas`` Poisson standard deviations
    (``sqrt(arrivals) / seconds``): what the arrivals show for sure; 0 for no time."""
    if seconds <= 0:
        return 0.0
    return max(0.0, (arrivals - sigmas * math.sqrt(arrivals)) / seconds)


def surged(arrivals: int, seconds: float, sized_for: float, sigmas: float) -> bool:
    """Whether ``arrivals`` in the last ``seconds`` exceed the rate the last decision sized for by
    more than the noise allowance: a load the next regular decision must not wait for."""
    return seen_rate(arrivals, seconds, sigmas) > sized_for


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    """Ready plus starting."""
    needed: int
    """What the sizing asked for, within the bounds."""
    desired: int
    """What the pool should have: the needed count after hysteresis."""
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        arrow = "=" if self.desired == self.current else "->"
        return f"{self.pool} {self.current} {arrow} {self.desired} ({'; '.join(self.reasons)})"


@dataclass(frozen=True)
class Decision:
    t_s: float
    rate: float
    """Requests/s seen in the interval."""
    sizing_rate: float
    """Requests/s the pools were sized for."""
    correction: tuple[float, float]
    """(prefill, decode) step-cost factors at the desired counts' per-replica loads."""
    notes: tuple[str, ...]
    pools: dict[str, PoolDecision]
    correction_load: tuple[float, float] | None = None
    """The per-replica loads (req/s) the factors were read at."""

    @property
    def desired(self) -> dict[str, int]:
        return {name: d.desired for name, d in self.pools.items()}

    def __str__(self) -> str:
        k = f"correction prefill x{self.correction[0]:.2f} decode x{self.correction[1]:.2f}"
        if self.correction_load is not None:
            k += f" (at {self.correction_load[0]:.2f} and {self.correction_load[1]:.2f} req/s a replica)"
        head = f"t={self.t_s:.0f}s rate {self.rate:.2f} req/s, sized for {self.sizing_rate:.2f}; {k}"
        return "; ".join([head, *self.notes, *(str(p) for p in self.pools.values())])
