"""What the simulator replays: arrival times and each request's prompt and output lengths.

Arrivals are Poisson (exponential gaps), Gamma with a given coefficient of variation (gaps of shape
``1 / cv^2``: CV 1 is Poisson, above 1 bursty, below 1 smoother), or a trace. Lengths are fixed or
drawn from a distribution (``parse_lengths``). Everything is drawn from one seeded generator, so a
seed gives the same requests on every run.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: ``fixed`` (a), ``uniform`` (a..b inclusive) or ``geometric``
    (mean a, support 1, 2, ...)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.a <= 1:
            return 1
        # Inverse transform of the geometric law with success probability 1 / mean.
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / self.a))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else max(self.a, 1.0)


def parse_lengths(text: str | int) -> Lengths:
    """``128`` (fixed), ``uniform:64:256`` or ``geometric:128`` (mean)."""
    s = str(text).strip().lower()
    parts = s.split(":")
    try:
        if len(parts) == 1:
            out = Lengths("fixed", int(parts[0]))
        elif parts[0] == "uniform" and len(parts) == 3:
            out = Lengths("uniform", int(parts[1]), int(parts[2]))
        elif parts[0] == "geometric" and len(parts) == 2:
            out = Lengths("geometric", float(parts[1]))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"lengths {text!r}: expected N, 'uniform:LO:HI' or 'geometric:MEAN'") from None
    if out.a < 1 or (out.kind == "uniform" and out.b < out.a):
        raise ValueError(f"lengths {text!r}: lengths are at least 1 token (and LO <= HI)")
    return out


@dataclass(frozen=True)
class Workload:
    rate: float = 1.0
    """Requests per second (ignored with a trace)."""
    num_prompts: int = 1000
    """Requests to send; with a trace, at most this many of its rows (0: all)."""
    input_len: Lengths = Lengths("fixed", 256)
    output_len: Lengths = Lengths("fixed", 128)
    arrival: str = "poisson"
    """``poisson`` or ``gamma``."""
    cv: float = 1.0
    """Coefficient of variation of the gaps between arrivals (``gamma``)."""
    trace: tuple[tuple[float, int, int], ...] | None = None
    """(seconds since the first row, prompt tokens, output tokens) to replay as they are."""


@dataclass(frozen=True)
class Requests:
    """The drawn workload, in arrival order (seconds from the first arrival's window start)."""

    arrival_s: list[float]
    input_len: list[int]
    output_len: list[int]

    def __len__(self) -> int:
        return len(self.arrival_s)


def draw(workload: Workload, seed: int = 0) -> Requests:
    """The requests of ``workload``: a trace replayed exactly, or arrivals and lengths drawn with
    ``seed``."""
    w = workload
    if w.trace is not None:
        rows = list(w.trace[: w.num_prompts] if w.num_prompts else w.trace)
        return Requests([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    if w.rate <= 0 or w.num_prompts < 0:
        raise ValueError("the rate must be positive and the number of prompts not negative")
    rng = random.Random(seed)
    if w.arrival == "poisson":
        gaps = [rng.expovariate(w.rate) for _ in range(w.num_prompts)]
    elif w.arrival == "gamma":
        if w.cv <= 0:
            raise ValueError(f"gamma arrivals need a positive CV, got {w.cv}")
        shape = 1.0 / (w.cv * w.cv)
        gaps = [rng.gammavariate(shape, 1.0 / (w.rate * shape)) for _ in range(w.num_prompts)]
    else:
        raise ValueError(f"arrival {w.arrival!r}: expected 'poisson' or 'gamma'")
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
    ins = [w.input_len.sample(rng) for _ in range(w.num_prompts)]
    outs = [w.output_len.sample(rng) for _ in range(w.num_prompts)]
    return Requests(times, ins, outs)


def load_trace(path: str | Path) -> tuple[tuple[float, int, int], ...]:
    """Rows of a JSONL (one object a line) or CSV (with a header) trace, each with ``timestamp``
    (seconds), ``input_len`` and ``output_len``; times are made relative to the first row."""
    p = Path(path)
    text = p.read_text()
    if p.suffix.lower() == ".csv":
        records = list(csv.DictReader(text.splitlines()))
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    try:
        rows = [(float(r["timestamp"]), int(r["input_len"]), int(r["output_len"])) for r in records]
    except (KeyError, ValueError) as e:
        raise ValueError(f"trace {p}: each row needs timestamp, input_len and output_len ({e})") from None
    if not rows:
        raise ValueError(f"trace {p} has no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return tuple((t - t0, i, o) for t, i, o in rows)
