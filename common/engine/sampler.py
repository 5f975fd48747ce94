"""Turns a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton.common.engine.sampling_params import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask out tokens outside the top-k and the top-p nucleus of one row of logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [M, V] fp32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float] | None]:
    """One token per row, and the model's log-probability of it when any row asks for it."""
    if all(p.greedy for p in params):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        for i, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                tokens[i] = logits[i].argmax()
                continue
            row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = logits.log_softmax(-1).gather(1, tokens.view(-1, 1)).view(-1).tolist()
    return tokens.tolist(), logprobs
