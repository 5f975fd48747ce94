"""The autoscaler's observed/expected correction of a profile's step costs, indexed by per-replica
load (pure).

One factor per pool kind is not enough: the served overhead per token is more additive than
multiplicative, so the ratio of measured to simulated p90 falls as a replica carries fewer requests
(emulated workers at 5.2 req/s: TPOT 44/25 ms with 3 decode replicas, 24/19 ms with 6). A factor
measured at 3 replicas and applied at 6 asked for more replicas still. So the ratios are kept per
log-spaced bucket of per-replica load (requests/s a replica), each an EWMA of the ratio and of the
loads it was measured at; the factor at a load interpolates between the measured buckets (linear in
log load), takes the nearest one outside them, and is 1.0 (the profile) with none. A bucket not
updated for ``max_age_s`` is forgotten (stale evidence: the host or the mix may have moved since).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.planner.forecast import Ewma


@dataclass
class _Bucket:
    load: Ewma
    ratio: Ewma
    updated_s: float


class LoadCorrection:
    """Observed/expected ratios by per-replica load; ``at(load)`` is the factor to use there."""

    def __init__(self, alpha: float, spacing: float = 1.25, max_age_s: float = math.inf):
        """``alpha``: weight of a bucket's newest ratio; ``spacing``: loads within this factor of
        each other share a bucket; ``max_age_s``: a bucket not updated for this long is dropped."""
        if spacing <= 1.0:
            raise ValueError(f"the bucket spacing must be over 1, got {spacing}")
        if max_age_s <= 0:
            raise ValueError(f"the buckets' max age must be positive, got {max_age_s}")
        self.alpha, self.spacing, self.max_age_s = alpha, spacing, max_age_s
        self.buckets: dict[int, _Bucket] = {}

    def update(self, load: float, ratio: float, now_s: float = 0.0) -> float:
        """Take ``ratio`` measured at ``load`` requests/s a replica at time ``now_s``; the factor
        there now. Buckets older than ``max_age_s`` go first.

        A bucket's first ratio is damped like every later one: it moves the factor believed at that
        load before it (the neighbours', or 1.0) by ``alpha``, rather than setting it outright. One
        interval's p90 is one noisy sample (its top tenth is a handful of requests), and taken
        outright the first one (x1.73) asked for 3 -> 5 decode replicas at once, with no second
        sample to temper it. The price: a ratio that persists is reached over a few steady
        intervals (about ``1 / alpha``) instead of one."""
        self.expire(now_s)
        if load <= 0 or not math.isfinite(load):
            return self.at(load)
        key = math.floor(math.log(load) / math.log(self.spacing))
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(Ewma(self.alpha, load), Ewma(self.alpha, self.at(load)), now_s)
        b.load.update(load)
        b.updated_s = now_s
        return b.ratio.update(ratio)

    def expire(self, now_s: float) -> None:
        """Drop the buckets not updated within ``max_age_s`` of ``now_s``."""
        for key in [k for k, b in self.buckets.items() if now_s - b.updated_s > self.max_age_s]:
            del self.buckets[key]

    def at(self, load: float) -> float:
        """The factor at ``load`` requests/s a replica."""
        points = sorted((b.load.value, b.ratio.value) for b in self.buckets.values())
        if not points:
            return 1.0
        if load <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if load <= x1:
                w = math.log(load / x0) / math.log(x1 / x0) if x1 > x0 else 1.0
                return y0 + w * (y1 - y0)
        return points[-1][1]

    def __str__(self) -> str:
        points = sorted((b.load.value, b.ratio.value) for b in self.buckets.values())
        return ", ".join(f"x{k:.2f} at {x:.2f}" for x, k in points) or "none"
