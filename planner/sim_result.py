"""What a simulation reports: latency distributions, SLO attainment, goodput and utilisation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = float("inf")
    tpot_ms: float = float("inf")


def parse_slo(items: Sequence[str]) -> SLO:
    """``["ttft:500", "tpot:50"]`` (milliseconds); a bound left out is no bound."""
    bounds: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot") or not value:
            raise ValueError(f"SLO {item!r}: expected ttft:MS or tpot:MS")
        try:
            bounds[f"{name}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
    return SLO(**bounds)


@dataclass(frozen=True)
class Dist:
    """A latency distribution in ms (linear interpolation between order statistics)."""

    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, nan)
        v = sorted(values)
        return cls(_quantile(v, 0.5), _quantile(v, 0.9), _quantile(v, 0.99), sum(v) / len(v))


def _quantile(v: list[float], q: float) -> float:
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass(frozen=True)
class SimResult:
    """One simulated run. Latencies in ms; TTFT counts from the request's arrival at the gateway,
    TPOT is ``(e2e - ttft) / (output tokens - 1)`` (requests of one output token have none)."""

    layout: str
    num_requests: int
    completed: int
    rejected: int
    """Requests whose prompt and output could never fit one worker's KV cache (never served)."""
    window_s: float
    """The arrival window: first to last arrival."""
    makespan_s: float
    """Until the last request finished."""
    ttft_ms: Dist
    tpot_ms: Dist
    e2e_ms: Dist
    slo_attainment: float
    """Share of all requests meeting both the TTFT and the TPOT SLO."""
    goodput_req_s: float
    """Requests meeting both SLOs per second of the arrival window."""
    throughput_req_s: float
    output_tok_s: float
    utilisation: dict[str, float]
    """Worker name -> busy fraction of the makespan."""
    preemptions: int
    remote_prefills: int
    """Prompts prefilled by a prefill worker (the rest by their decode worker)."""
    events: int
    wall_s: float
    """The simulator's own run time."""
    pool_utilisation: dict[str, float] = field(default_factory=dict)
    """Pool ("prefill", "decode", "colocated") -> mean busy fraction."""

    def to_dict(self, per_worker: bool = False) -> dict:
        """Flat JSON-ready fields (``p90_ttft_ms``, ...); per-worker utilisation on request."""
        d = asdict(self)
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            dist = d.pop(name)
            base = name[: -len("_ms")]
            for k, v in dist.items():
                d[f"{k}_{base}_ms"] = v
        if not per_worker:
            d.pop("utilisation")
        return d
