"""The autoscaler's load forecast: Holt's linear smoothing (a level and a trend) of the rate seen
each interval.

Why Holt and not a plain EWMA or ARIMA/Prophet (Dynamo's choices): the autoscaler must plan for the
load ``cold start + one interval`` ahead, and a ramp's slope is what carries it there; an EWMA lags
a ramp by ``1 / alpha`` intervals and never catches up with it. ARIMA and Prophet need a history of
hours and a library each; Holt's two numbers are updated in O(1) and start from one sample.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Holt:
    """``level`` and ``trend`` (per interval) of a series; ``alpha`` weighs the newest sample in the
    level, ``beta`` the newest slope in the trend."""

    alpha: float = 0.5
    beta: float = 0.2
    level: float | None = None
    trend: float = 0.0

    def update(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        prev = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (prev + self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.trend

    def forecast(self, steps: float) -> float:
        """The series ``steps`` intervals ahead (never below zero); 0 before any sample."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + steps * self.trend)


@dataclass
class Ewma:
    """An exponentially weighted mean; ``value`` is None before the first sample."""

    alpha: float = 0.3
    value: float | None = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value
