"""What one replica of a pool serves within the SLO, in closed form from a profile (pure).

The autoscaler's first guess of a pool's size and its utilisation figure come from here; the
simulator then checks the guess (``planner/autoscale.py``). Per replica, for prompts of ``I`` and
outputs of ``O`` tokens:

- prefill: requests/s with full steps, ``k = budget // I`` prompts a step (one prompt in chunks
  when it is longer than the budget);
- decode: the largest batch ``B`` whose step stays within the TPOT SLO (and ``max_num_seqs`` and the
  KV cache hold), each request taking ``O`` steps: ``B / (O x step(B))``;
- colocated: one worker does both, so its time per request is the sum of the two shares.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from baton.planner.profile import Linear, Profile
from baton.planner.sim_result import SLO


@dataclass(frozen=True)
class Capacity:
    """Requests/s one replica serves at the SLO; 0 where one replica cannot meet it at all."""

    prefill: float
    decode: float
    colocated: float
    why_not: str = ""
    """Why the SLO is out of reach of any count (a single request already misses it), or ''."""

    def of(self, pool: str) -> float:
        return getattr(self, pool)


def scaled(profile: Profile, prefill: float, decode: float) -> Profile:
    """``profile`` with its prefill step costs times ``prefill`` and decode's times ``decode`` (the
    autoscaler's observed/expected corrections)."""

    def mul(m: Linear, k: float) -> Linear:
        return Linear(m.a * k, m.b * k, m.c * k)

    return dataclasses.replace(
        profile, prefill=mul(profile.prefill, prefill), decode=mul(profile.decode, decode)
    )


def prompt_ms(profile: Profile, tokens: int) -> float:
    """One prompt prefilled alone, chunk by chunk under the step budget."""
    budget, done, ms = profile.engine.max_num_batched_tokens, 0, 0.0
    while done < tokens:
        n = min(budget, tokens - done)
        ms += profile.prefill_ms([(n, done)])
        done += n
    return ms


def prefill_rate(profile: Profile, input_len: int) -> float:
    """Requests/s of back-to-back full prefill steps."""
    budget = profile.engine.max_num_batched_tokens
    if input_len > budget:
        ms = prompt_ms(profile, input_len)
        return 1000.0 / ms if ms > 0 else math.inf
    k = max(1, min(budget // input_len, profile.engine.max_num_seqs))
    ms = profile.prefill_ms([(input_len, 0)] * k)
    return k * 1000.0 / ms if ms > 0 else math.inf


def decode_batch(profile: Profile, input_len: int, output_len: int, tpot_ms: float) -> int:
    """The largest batch whose decode step meets ``tpot_ms`` at the mean context, within
    ``max_num_seqs`` and the KV cache; 0 when a single sequence misses it."""
    e = profile.engine
    ctx = input_len + output_len / 2
    b = min(e.max_num_seqs, e.kv_capacity_tokens // max(1, input_len + output_len))
    lo, hi = 0, b  # the step grows with the batch: binary search the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if profile.decode_ms(mid, int(mid * ctx)) <= tpot_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def capacity(profile: Profile, input_len: float, output_len: float, slo: SLO) -> Capacity:
    """Per-replica requests/s of each pool at ``slo`` for the given mean lengths."""
    i, o = max(1, round(input_len)), max(1, round(output_len))
    why = ""
    if profile.gateway_ms + prompt_ms(profile, i) > slo.ttft_ms:
        why = f"one {i}-token prompt alone takes longer than the TTFT SLO ({slo.ttft_ms:g} ms)"
    p = prefill_rate(profile, i)
    b = decode_batch(profile, i, o, slo.tpot_ms)
    if b == 0:
        why = why or f"one sequence's decode step is over the TPOT SLO ({slo.tpot_ms:g} ms)"
        d = 0.0
    else:
        steps = max(1, o - 1)
        d = b * 1000.0 / (steps * profile.decode_ms(b, int(b * (i + o / 2))))
    c = 1.0 / (1.0 / p + 1.0 / d) if p > 0 and d > 0 else 0.0
    if why:
        return Capacity(0.0, 0.0, 0.0, why)
    return Capacity(p, d, c)
