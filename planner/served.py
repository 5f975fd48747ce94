"""The served path's costs on top of the engine's (pure: no torch).

``baton profile`` times the engine alone. Served, every token also costs CPU outside the engine's
step: the worker's gRPC send, the gateway's server-sent event, the client's parse. Where those
processes share the workers' cores (one machine, as ``baton up`` runs), that CPU comes out of the
engine's steps; and a prompt's first token also waits for the gateway and, disaggregated, the
hand-off. Measured on 2 cores, served TPOT was 1.1-1.3x the engine profile's at low load and up to
1.7x past capacity, and the simulator was optimistic near capacity by as much.

So a layout's **served profile** is its engine profile with four factors fitted on a calibration
trace replayed through the real layout (``bench/served_profile.py``) and simulated beside it:

- ``step_ms``: ms each decode step costs more, whatever its batch (the decode model's fixed
  cost grows by it: the step's hand-off to the worker's event loop and gRPC streams);
- ``stream_ms``: CPU ms each streamed token costs the decoding worker's step (the decode model's
  per-sequence coefficient grows by it: a step of ``B`` sequences pays ``B * stream_ms`` more);
- ``prefill_scale``: the prefill model's costs times this (the prompt's path through the served
  layout against the engine alone);
- ``mixed_scale``: a prefill piece in a step that also decodes costs this much more again
  (``Profile.mixed_prefill_scale``). On 2 cores a prompt prefilled alone took what the engine
  profile says (within 3% from 128 to 1,536 tokens) and one beside a decoding batch 15-23% more.

A fifth, ``host_ms``, is measured (``bench/served_profile.py``): the CPU ms the processes outside
the workers (the gateway, Redis, the client) spend a streamed token over the calibration, less what
they spend idle. The simulator takes it from an idle worker's core first and from the busy
workers' steps only when none is idle (``Profile.host_ms``, ``Simulator.pace``); the fit keeps the
share of it (``HOST_SHARES``) that best explains the calibration. Why: ``1p1d``'s decode-only
segments leave the prefill worker's core idle for the gateway, so a calibration at low load fitted
no per-token cost there, while the same layout at 120% load, both cores busy, decoded 19% slower
than predicted (Intel, 2026-12-06; the host measured 0.38 ms a streamed token). One worker on
both cores took less of it than the measurement says (its steps leave a core idle in their
single-threaded parts), hence a share and not the whole. Once the calibration has its loaded
segment (below), the fitted factors catch most of the same slowdown: on the Intel matrix of
2026-12-06 refitting without the host cost predicted as well (``docs/benchmarks.md``).

The calibration trace (``calibration_trace``) is built to tell them apart and is none of the runs
a prediction is later checked on: prompts alone (prefill), batches of streams started together
(decode at batch 1-16), prompts arriving while a batch decodes (the two at once), and steady
Poisson streams of 256 -> 128-token requests at 60% and 75% of the layout's simulated throughput
(the mixed steps of continuous batching; at 75% every worker is busy). The fit (``fit_served``)
searches the four on grids, coarse once, then fine for each share of the host cost, minimizing the
squared log error of every request's TTFT and TPOT, the simulator replaying the same trace for
each candidate. Requests sent together are told apart by order only: within each group of equal
lengths sent within ``GROUP_S``, predicted and measured values are paired in sorted order (the
client's start order is not the trace's at a millisecond).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from baton.planner.layout import Layout
from baton.planner.profile import Linear, Profile
from baton.planner.sim_result import SLO
from baton.planner.simulate import Simulator
from baton.planner.workload import Requests

Row = tuple[float, int, int]
"""``(seconds since the trace's start, prompt tokens, output tokens)``."""

PREFILL_SCALES = tuple(round(0.8 + 0.05 * i, 2) for i in range(25))  # 0.80 .. 2.00
STEP_MS = tuple(round(0.5 * i, 1) for i in range(21))  # 0 .. 10 ms a step
STREAM_MS = tuple(round(0.1 * i, 1) for i in range(31))  # 0 .. 3 ms a token
COARSE = ((0.9, 1.0, 1.1, 1.2, 1.35, 1.5), 2, 3)
"""The coarse search: these prefill (and mixed) scales, every 2nd step cost, every 3rd token cost."""
SPARSE = 2
"""The coarse search takes the decode costs at every ``SPARSE``-th point of its own grid first, then
the coarse points around the best of those (6 x 6 and 8 points, not 11 x 11, a prefill scale)."""
STARTS = 3
"""The best coarse points the fine search starts from."""
GAP_S = 1.0
"""Idle seconds between the trace's segments, on top of each segment's predicted length."""
GROUP_S = 0.1
MIN_TPOT_TOKENS = 8
"""TPOTs of requests with fewer output tokens are not fitted (one gap is noise)."""
STEADY_LOADS = (0.6, 0.75)
"""The steady segments' loads: the second keeps every worker busy, where the host's work
(``host_ms``) has no idle core to go to."""
STEADY_S = 20.0
HOST_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The shares of the measured host cost the fit tries."""
_ANY_SLO = SLO(1e12, 1e12)


@dataclass(frozen=True)
class Served:
    """A layout's fitted served-path factors (kept in the served profile's ``served`` field)."""

    layout: str
    prefill_scale: float
    step_ms: float
    stream_ms: float
    mixed_scale: float
    host_ms: float
    """The host's CPU a streamed token that slows the workers (``Profile.host_ms``): the measured
    cost times ``host_share``."""
    host_share: float
    """The share of the measured host cost the fit kept (``HOST_SHARES``)."""
    error: float
    """The fit's root mean squared log error over TTFTs and TPOTs (0.1: about 10%)."""
    engine_error: float
    """The same error with the engine profile alone (scales 1, costs 0)."""
    requests: int


def served_profile(
    profile: Profile,
    prefill_scale: float,
    step_ms: float,
    stream_ms: float,
    mixed_scale: float = 1.0,
    host_ms: float = 0.0,
) -> Profile:
    """``profile`` with the prefill model times ``prefill_scale`` (and a piece beside a decode
    batch times ``mixed_scale`` again), each decode step costing ``step_ms`` more and
    ``stream_ms`` more a sequence, and the host ``host_ms`` of CPU a streamed token."""
    p, d = profile.prefill, profile.decode
    return dataclasses.replace(
        profile,
        prefill=Linear(p.a * prefill_scale, p.b * prefill_scale, p.c * prefill_scale),
        decode=Linear(d.a + step_ms, d.b + stream_ms, d.c),
        mixed_prefill_scale=profile.mixed_prefill_scale * mixed_scale,
        host_ms=host_ms,
    )


# -- the calibration trace ----------------------------------------------------------------------------
def calibration_segments(chunk: int) -> list[list[Row]]:
    """The trace's segments, each from its own start: prompts alone, batches of streams, and
    prompts during a batch's decoding. ``chunk`` is the engine's prefill token budget (prompts
    up to 4 chunks long)."""
    segments: list[list[Row]] = []
    for tokens in (128, 384, 768, min(1536, 4 * chunk)):
        segments.append([(0.0, tokens, 2)])
    for batch in (1, 4, 8, 16):
        segments.append([(0.001 * i, 128, 96) for i in range(batch)])
    busy = [(0.001 * i, 128, 192) for i in range(8)]
    segments.append(sorted(busy + [(1.0 + 1.0 * i, 512, 2) for i in range(4)]))
    return segments


def steady_segment(profile: Profile, layout: Layout, load: float, seed: int = 0) -> list[Row]:
    """``STEADY_S`` of Poisson arrivals of 256 -> 128-token requests at ``load`` times the
    layout's simulated throughput (64 such requests sent at once, over their makespan)."""
    burst = [(0.0, 256, 128)] * 64
    sim = _simulator(profile, layout, burst)
    sim.run()
    rate = load * 64 / (max(sim.finish) / 1000.0)
    rng, t, rows = random.Random(seed), 0.0, []
    while t < STEADY_S:
        rows.append((round(t, 4), 256, 128))
        t += rng.expovariate(rate)
    return rows


def calibration_trace(profile: Profile, layout: Layout) -> list[Row]:
    """The segments and the steady segments one after another (``in_turn``)."""
    segments = calibration_segments(profile.engine.max_num_batched_tokens)
    steady = [steady_segment(profile, layout, load, seed) for seed, load in enumerate(STEADY_LOADS)]
    return in_turn(profile, layout, [*segments, *steady])


def in_turn(profile: Profile, layout: Layout, segments: Sequence[Sequence[Row]]) -> list[Row]:
    """``segments`` one after another, each given its predicted length (``profile``'s, x2 for a
    slower served path) and ``GAP_S`` so that they do not overlap."""
    rows: list[Row] = []
    t = 0.0
    for segment in segments:
        rows += [(round(t + s, 4), i, o) for s, i, o in segment]
        sim = _simulator(profile, layout, segment)
        sim.run()
        t += 2.0 * max(sim.finish) / 1000.0 + GAP_S
    return rows


# -- the fit -----------------------------------------------------------------------------------------
def predicted(
    profile: Profile, layout: Layout, rows: Sequence[Row]
) -> tuple[list[float], list[float | None]]:
    """Each request's simulated TTFT and TPOT (None for one output token), in ms."""
    sim = _simulator(profile, layout, rows)
    sim.run()
    ttft, tpot = [], []
    for rid, (arrival, _, out) in enumerate(rows):
        first, end = sim.ttft[rid], sim.finish[rid]
        ttft.append(first)
        tpot.append((end - arrival * 1000.0 - first) / (out - 1) if out > 1 and end >= 0 else None)
    return ttft, tpot


def groups(rows: Sequence[Row]) -> list[list[int]]:
    """Row indices in groups of equal lengths sent within ``GROUP_S`` of the group's first."""
    out: list[list[int]] = []
    open_: dict[tuple[int, int], tuple[float, list[int]]] = {}
    for i, (t, n_in, n_out) in enumerate(rows):
        start, members = open_.get((n_in, n_out), (-math.inf, []))
        if t - start > GROUP_S:
            members = []
            out.append(members)
            open_[(n_in, n_out)] = (t, members)
        members.append(i)
    return out


def log_error(
    rows: Sequence[Row],
    pred: tuple[list[float], list[float | None]],
    ttft_ms: Sequence[float | None],
    tpot_ms: Sequence[float | None],
) -> float:
    """Root mean squared ``log(predicted / measured)`` over every measured TTFT, and every TPOT of
    ``MIN_TPOT_TOKENS`` or more tokens, paired in sorted order within each group (``groups``)."""
    terms = []
    for group in groups(rows):
        pairs = [
            (pred[0], ttft_ms, [i for i in group]),
            (pred[1], tpot_ms, [i for i in group if rows[i][2] >= MIN_TPOT_TOKENS]),
        ]
        for p_all, m_all, idx in pairs:
            terms += [math.log(p / m) ** 2 for p, m in sorted_pairs(idx, p_all, m_all)]
    if not terms:
        raise ValueError("no request of the calibration trace was measured")
    return math.sqrt(sum(terms) / len(terms))


def sorted_pairs(
    idx: Sequence[int], pred: Sequence[float | None], measured: Sequence[float | None]
) -> list[tuple[float, float]]:
    """(predicted, measured) of the requests ``idx`` sent together, paired in sorted order (the
    client's start order is not the trace's at a millisecond); a None (failed, or one output token)
    and a value not above 0 left out."""
    ok = [i for i in idx if measured[i] is not None and pred[i] is not None]
    pairs = zip(sorted(pred[i] for i in ok), sorted(measured[i] for i in ok))  # type: ignore[type-var]
    return [(p, m) for p, m in pairs if p > 0 and m > 0]


def fit_served(
    profile: Profile,
    layout: Layout,
    rows: Sequence[Row],
    ttft_ms: Sequence[float | None],
    tpot_ms: Sequence[float | None],
    host_ms: float = 0.0,
) -> Served:
    """The factors whose simulation of ``rows`` comes closest to the measured TTFTs and TPOTs
    (None: the request failed, or had one output token), and the share of the measured host cost
    ``host_ms`` that slows the workers (``HOST_SHARES``; ties go to the whole measurement).

    The four factors trade against each other along ridges a local search stalls on, so first a
    coarse search of them all (``COARSE``: every pair of prefill scales, the best decode costs of a
    coarse grid for each, found from the grid's sparse points: ``SPARSE``), once, at the middle
    share; then, at the middle share, from the best ``STARTS`` coarse points, the decode costs on
    their fine grid around the point, each prefill scale on its own, and a descent to the best of
    its neighbours on the four fine grids, until nothing moves; and at every share the same
    descent from where those ended (a nearby share's optimum is near: on the three recorded
    calibrations with a host cost, the same errors for a quarter fewer simulations). Where the
    engine profile's simulation of the trace has no step that prefills beside decodes (a
    disaggregated layout whose decode workers never prefill), the mixed scale cannot be told and
    stays the engine's 1. Ties go to the smaller change from the engine profile. ``engine_error``
    is the engine profile's alone (no host cost)."""
    if not (len(rows) == len(ttft_ms) == len(tpot_ms)):
        raise ValueError("one measured TTFT and TPOT per row of the trace")
    shares = HOST_SHARES if host_ms > 0 else (0.0,)
    mixed = _mixed_matters(profile, layout, rows)
    searches = {
        share: _Search(profile, layout, rows, ttft_ms, tpot_ms, share * host_ms, mixed) for share in shares
    }
    middle = shares[len(shares) // 2]
    ends = searches[middle].descents(searches[middle].coarse())
    fits = {share: search.fine(ends) for share, search in searches.items()}
    share = min(shares, key=lambda k: (fits[k][1], -k))
    (scale, step, stream, mixed_scale), error = fits[share]
    engine = log_error(rows, predicted(profile, layout, rows), ttft_ms, tpot_ms)
    return Served(
        str(layout), scale, step, stream, mixed_scale, share * host_ms, share, error, engine, len(rows)
    )


def _mixed_matters(profile: Profile, layout: Layout, rows: Sequence[Row]) -> bool:
    """Whether the mixed scale changes the simulation of ``rows`` (some step prefills beside
    decodes): the engine profile against it with the largest mixed scale of the grid."""
    widest = served_profile(profile, 1.0, 0.0, 0.0, PREFILL_SCALES[-1])
    return predicted(profile, layout, rows) != predicted(widest, layout, rows)


class _Search:
    """``fit_served``'s search at one host cost: the factors as indices into their grids, each
    candidate simulated once."""

    grids = (PREFILL_SCALES, STEP_MS, STREAM_MS, PREFILL_SCALES)  # the last: mixed_scale

    def __init__(
        self,
        profile: Profile,
        layout: Layout,
        rows: Sequence[Row],
        ttft_ms: Sequence[float | None],
        tpot_ms: Sequence[float | None],
        host_ms: float,
        mixed: bool,
    ) -> None:
        self.profile, self.layout, self.rows, self.host_ms = profile, layout, rows, host_ms
        self.measured = (ttft_ms, tpot_ms)
        self.one = PREFILL_SCALES.index(1.0)
        self.engine = (self.one, 0, 0, self.one)
        self.mixed = range(len(PREFILL_SCALES)) if mixed else range(self.one, self.one + 1)
        self.cache: dict[tuple[int, ...], float] = {}

    def value(self, ix: Sequence[int]) -> float:
        key = tuple(ix)
        if key not in self.cache:
            factors = (g[i] for g, i in zip(self.grids, key))
            pred = predicted(
                served_profile(self.profile, *factors, host_ms=self.host_ms), self.layout, self.rows
            )
            self.cache[key] = log_error(self.rows, pred, *self.measured)
        return self.cache[key]

    def prefer(self, ix: Sequence[int]) -> tuple:
        return (self.value(ix), sum(abs(i - j) for i, j in zip(ix, self.engine)))

    def decode_costs(self, at: list[int], steps: Sequence[int], streams: Sequence[int]) -> list[int]:
        best = min(([a, b] for a in steps for b in streams), key=lambda d: self.prefer([at[0], *d, at[3]]))
        return [at[0], *best, at[3]]

    def coarse(self) -> list[list[int]]:
        """The best ``STARTS`` points of the coarse grids (their decode costs sparse first:
        ``SPARSE``)."""
        scales = [PREFILL_SCALES.index(k) for k in COARSE[0]]
        mixed = [m for m in scales if m in self.mixed]  # 1.0 is one of COARSE[0]
        points = [self._coarse_decode([k, 0, 0, m]) for k in scales for m in mixed]
        return sorted(points, key=self.prefer)[:STARTS]

    def _coarse_decode(self, at: list[int]) -> list[int]:
        """``at`` with the best decode costs of the coarse grid: its every ``SPARSE``-th point, then
        the coarse points around the best of them."""
        wide = (COARSE[1] * SPARSE, COARSE[2] * SPARSE)
        at = self.decode_costs(at, range(0, len(STEP_MS), wide[0]), range(0, len(STREAM_MS), wide[1]))
        return self.decode_costs(
            at,
            range(max(0, at[1] - COARSE[1]), min(len(STEP_MS), at[1] + COARSE[1] + 1), COARSE[1]),
            range(max(0, at[2] - COARSE[2]), min(len(STREAM_MS), at[2] + COARSE[2] + 1), COARSE[2]),
        )

    def descents(self, starts: Sequence[list[int]]) -> list[list[int]]:
        """Where the descent from each of ``starts`` ends."""
        return [self._descend(list(at)) for at in starts]

    def fine(self, starts: Sequence[list[int]]) -> tuple[tuple[float, float, float, float], float]:
        """The four factors and their error, descending from each of ``starts``."""
        at = min(self.descents(starts), key=self.prefer)
        scale, step, stream, mixed = (g[i] for g, i in zip(self.grids, at))
        return (scale, step, stream, mixed), self.value(at)

    def _descend(self, at: list[int]) -> list[int]:
        grids, prefer, value = self.grids, self.prefer, self.value
        for _ in range(6):
            before = list(at)
            near_steps = range(max(0, at[1] - COARSE[1]), min(len(STEP_MS), at[1] + COARSE[1] + 1))
            near_streams = range(max(0, at[2] - COARSE[2]), min(len(STREAM_MS), at[2] + COARSE[2] + 1))
            at = self.decode_costs(at, near_steps, near_streams)
            at[0] = min(range(len(PREFILL_SCALES)), key=lambda k: prefer([k, *at[1:]]))
            at[3] = min(self.mixed, key=lambda k: prefer([*at[:3], k]))
            while True:
                near = [[i + d for i, d in zip(at, ds)] for ds in itertools.product((-1, 0, 1), repeat=4)]
                near = [
                    ix
                    for ix in near
                    if all(0 <= i < len(g) for i, g in zip(ix, grids)) and ix[3] in self.mixed
                ]
                best = min(near, key=lambda ix: (value(ix), ix != at))
                if best == at:
                    break
                at = best
            if at == before:
                break
        return at


def _simulator(profile: Profile, layout: Layout, rows: Sequence[Row]) -> Simulator:
    requests = Requests([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    return Simulator(profile, layout, requests, _ANY_SLO)
