"""A speed probe: how fast the served layout runs now against the profile that predicts it (pure:
no torch).

A profile describes the machine when it was taken, and a shared host does not stay there: a 2-core
Zen 3 host decoded 1.24x slower than its profile 80 minutes after taking it, and about 2x slower
six hours later, at the same boot (``docs/bench/journal.md``). A fidelity run an hour into its matrix
is then predicted for a machine that is gone, and its error is the host's drift as much as the
simulator's. ``baton bench fidelity`` sends this probe through the layout before each run: prompts
alone (``PROMPTS``: prefill and the hand-off) and streams started together (``STREAMS``: decode
steps), laid out as the calibration's segments are (``served.in_turn``), each request's TTFT and
TPOT against the profile's simulation of the same trace. The medians of measured / predicted are
the machine's speed of the moment in the profile's terms, and ``at_speed`` is the profile run at
that speed: a second prediction of the run that knows nothing of it but how fast the machine was
just before it. Where the two predictions differ from the measurement by as much, the error is
the simulator's; where the second is close and the first is not, the host had moved.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from baton.planner.layout import Layout
from baton.planner.profile import Linear, Profile
from baton.planner.served import MIN_TPOT_TOKENS, Row, groups, in_turn, predicted, sorted_pairs

PROMPTS = ((512, 2), (512, 2))
"""(prompt, output) tokens of the prompts sent one at a time."""
STREAMS = (128, 48, 4)
"""Prompt and output tokens of the streams sent together, and how many."""
RATIO_BOUNDS = (0.25, 4.0)
"""A ratio outside these is clamped: a probe that says the machine is 10x off says something broke."""


@dataclasses.dataclass(frozen=True)
class Speed:
    """Measured / predicted on the probe: ``prefill`` from the lone prompts' TTFTs, ``decode`` from
    the streams' TPOTs (1.0: as the profile says)."""

    prefill: float
    decode: float


def probe_trace(profile: Profile, layout: Layout) -> list[Row]:
    """The probe's requests: each lone prompt, then the streams, as segments in turn. The prompts
    are capped at four of the engine's prefill chunks."""
    cap = 4 * profile.engine.max_num_batched_tokens
    prompt, out, n = STREAMS
    segments = [[(0.0, min(p, cap), o)] for p, o in PROMPTS]
    segments.append([(0.001 * i, prompt, out) for i in range(n)])
    return in_turn(profile, layout, segments)


def probe_speed(
    profile: Profile,
    layout: Layout,
    rows: Sequence[Row],
    ttft_ms: Sequence[float | None],
    tpot_ms: Sequence[float | None],
) -> Speed:
    """The probe's ratios, each the median of measured / predicted over its requests (paired in
    sorted order within each group sent together, as the calibration's fit pairs them; a failed
    request, None, left out)."""
    pred_ttft, pred_tpot = predicted(profile, layout, rows)
    prefill, decode = [], []
    for group in groups(rows):
        lone = [i for i in group if rows[i][2] < MIN_TPOT_TOKENS]
        streams = [i for i in group if rows[i][2] >= MIN_TPOT_TOKENS]
        prefill += [m / p for p, m in sorted_pairs(lone, pred_ttft, ttft_ms)]
        decode += [m / p for p, m in sorted_pairs(streams, pred_tpot, tpot_ms)]
    if not prefill or not decode:
        raise ValueError("the probe measured no lone prompt or no stream: no speed to read")
    return Speed(_clamp(statistics.median(prefill)), _clamp(statistics.median(decode)))


def at_speed(profile: Profile, speed: Speed) -> Profile:
    """``profile`` at ``speed``: the prefill model times ``speed.prefill``; the decode model (its
    served costs included) and the host's cost a streamed token times ``speed.decode``."""
    p, d = profile.prefill, profile.decode
    return dataclasses.replace(
        profile,
        prefill=Linear(p.a * speed.prefill, p.b * speed.prefill, p.c * speed.prefill),
        decode=Linear(d.a * speed.decode, d.b * speed.decode, d.c * speed.decode),
        host_ms=profile.host_ms * speed.decode,
    )


def _clamp(ratio: float) -> float:
    return min(RATIO_BOUNDS[1], max(RATIO_BOUNDS[0], ratio))
