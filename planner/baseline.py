"""The closed-form sizing rule that ``baton plan`` prints beside its simulated choice (pure):
replicas = load / a worker's profiled throughput, with no queueing, bursts or interference in it.

A prefill worker's throughput is its steps full of mean-length prompts (a longer prompt's chunks
one after another); a decode worker's is the largest batch whose step meets the TPOT SLO (within
``max_num_seqs`` and the KV cache) at the mean context (prompt + half the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.planner.profile import Profile


@dataclass(frozen=True)
class ClosedForm:
    prefill_tok_s: float
    """One prefill worker's prompt tokens per second, its steps full of mean-length prompts."""
    decode_tok_s: float
    """One decode worker's output tokens per second at ``decode_batch``."""
    decode_batch: int
    """The largest batch whose step meets the TPOT SLO (within max_num_seqs and the KV cache)."""
    prefill: int
    """Prefill workers: prompt tokens per second over ``prefill_tok_s``, rounded up."""
    decode: int
    """Decode workers: output tokens per second over ``decode_tok_s``, rounded up."""
    colocated: int
    """Colocated workers: the two loads' worker-seconds added, rounded up."""


def closed_form(
    profile: Profile, rate: float, mean_in: float, mean_out: float, tpot_ms: float, chunk: int
) -> ClosedForm:
    pre_ms = prefill_ms_per_prompt(profile, round(mean_in), chunk)
    prefill_tok_s = mean_in / pre_ms * 1000.0 if pre_ms > 0 else math.inf
    context = mean_in + mean_out / 2
    batch = decode_batch(profile, context, tpot_ms)
    step = profile.decode_ms(batch, int(batch * context))
    decode_tok_s = batch / step * 1000.0 if step > 0 else math.inf
    return ClosedForm(
        prefill_tok_s,
        decode_tok_s,
        batch,
        _replicas(rate * mean_in / prefill_tok_s),
        _replicas(rate * mean_out / decode_tok_s),
        _replicas(rate * (mean_in / prefill_tok_s + mean_out / decode_tok_s)),
    )


def decode_batch(profile: Profile, context: float, tpot_ms: float) -> int:
    """The largest batch whose decode step takes at most ``tpot_ms`` at ``context`` tokens a
    sequence, within ``max_num_seqs`` and the KV cache (at least 1)."""
    e = profile.engine
    most = max(1, min(e.max_num_seqs, int(e.kv_capacity_tokens // max(context, 1.0))))
    best = 1
    for b in range(1, most + 1):
        if profile.decode_ms(b, int(b * context)) <= tpot_ms:
            best = b
    return best


def prefill_ms_per_prompt(profile: Profile, tokens: int, chunk: int) -> float:
    """A prompt's share of prefill time: steps full of ``tokens``-long prompts, or its own chunks
    one after another when it is longer than ``chunk``."""
    tokens = max(1, tokens)
    if tokens <= chunk:
        k = chunk // tokens
        return profile.prefill_ms([(tokens, 0)] * k) / k
    done, total = 0, 0.0
    while done < tokens:
        t = min(chunk, tokens - done)
        total += profile.prefill_ms([(t, done)])
        done += t
    return total


def _replicas(load: float) -> int:
    """Workers for ``load`` worker-loads: rounded up, but not for float dust (6.000000001 is 6)."""
    return max(1, math.ceil(load - 1e-9))
