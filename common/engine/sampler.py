"""Turns a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds; the
chosen token's log-probability and the most likely alternatives when a request asks for them.

Sampled rows draw by inverse CDF: the row's probabilities are summed in float64 and one uniform
from the request's generator picks the first token whose cumulative mass reaches it. That is
exact (a token is picked with its probability; a masked one, with none) and costs one random
number per row: ``torch.multinomial`` took ~1.9 ms per 49,152-token row on the development
machine, ~40% of a batch-6 decode step at temperature 1.

Numerically safe: temperatures below ``SAMPLING_EPS`` are greedy (``SamplingParams.greedy``), the
division by a temperature is done in fp32 (no fp32 logit divided by 1e-5 reaches inf), and a row
whose logits hold a NaN or an inf is reported in ``bad_rows`` (its token is meaningless) while the
other rows sample normally.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton.common.engine.outputs import TopLogprobs
from baton.common.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.common.engine.structured import GrammarMask

MAX_TOP_LOGPROBS = 20
"""Most alternatives returned per token (vLLM's default ``max_logprobs``); more asked get this many."""


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    """One token per row (meaningless for ``bad_rows``)."""
    logprobs: list[float] | None = None
    """The chosen token's log-probability per row, when any row asks for logprobs."""
    top_logprobs: list[TopLogprobs | None] | None = None
    """Per row, its ``logprobs`` most likely tokens (None for rows asking none), when any asks > 0."""
    bad_rows: tuple[int, ...] = ()
    """Rows whose logits were not all finite: their requests fail, the other rows are unaffected."""


NUCLEUS_CANDIDATES = (64, 1024)
"""How many of the most likely tokens the top-p nucleus is first looked for among, before a full
sort of the vocabulary: a model's nucleus is almost always small, and ``topk`` of 64 out of 49,152
took ~0.2 ms where the sort took 4-9 ms (one thread, development machine)."""


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask out tokens outside the top-k and the top-p nucleus of one row of logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = _filter_top_p(logits, top_p)
    return logits


def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the nucleus: a token stays while the mass of the tokens more likely than it is below
    ``top_p`` (the most likely always stays). The most likely ``k`` tokens, in order, are what a
    full descending sort starts with, so when their mass reaches ``top_p`` the nucleus is among
    them; only a flatter row sorts the whole vocabulary."""
    probs = logits.softmax(-1)
    for k in (*(k for k in NUCLEUS_CANDIDATES if k < logits.shape[-1]), logits.shape[-1]):
        top, order = probs.topk(k) if k < logits.shape[-1] else torch.sort(probs, descending=True)
        before = top.cumsum(-1) - top  # mass of the more likely tokens
        if k == logits.shape[-1] or before[-1] + top[-1] >= top_p:
            keep = order[before < top_p]
            return torch.full_like(logits, float("-inf")).index_copy_(0, keep, logits[keep])
    raise AssertionError("unreachable: the last candidate count is the whole vocabulary")


def _uniform(gen: torch.Generator | None) -> float:
    """A uniform in (0, 1] from ``gen``: never 0, so the token it picks has positive mass."""
    return 1.0 - torch.rand((), dtype=torch.float64, generator=gen).item()


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[M] bool: rows of ``x`` [M, N] holding no NaN or inf. A row's sum is NaN or inf exactly when
    one of its entries is (finite float32 logits never sum past 3e38): one reduction, ~35 us for
    6 x 49,152 on the development machine, where ``torch.isfinite(x).all(-1)`` took ~1.2 ms."""
    return torch.isfinite(x.sum(dim=-1))


def _finite_rows(logits: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``logits`` with every non-finite row zeroed, and those rows (the copy only when one is bad)."""
    finite = finite_rows(logits)  # [M]
    if bool(finite.all()):
        return logits, ()
    bad = tuple(torch.nonzero(~finite).view(-1).tolist())
    return logits.masked_fill(~finite.view(-1, 1), 0.0), bad


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], gens, rows: list[int]) -> torch.Tensor:
    """The sampled tokens of ``rows`` (non-greedy), by inverse CDF over the filtered softmax."""
    scaled = torch.stack(
        [
            _filter_top_k_top_p(logits[i] / params[i].temperature, params[i].top_k, params[i].top_p)
            for i in rows
        ]
    )  # [R, V] fp32
    cdf = scaled.softmax(-1).to(torch.float64).cumsum_(-1)
    targets = torch.tensor([[_uniform(gens[i])] for i in rows], dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets).view(-1)


def _top(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[TopLogprobs | None] | None:
    """Each row's ``logprobs`` most likely tokens, from one top-k over the batch at the largest k
    asked (None, and no top-k at all, when no row asks for alternatives)."""
    ks = [min(p.logprobs or 0, MAX_TOP_LOGPROBS) for p in params]
    k = min(max(ks), logprobs.shape[-1])
    if k <= 0:
        return None
    values, ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    return [TopLogprobs(tuple(ids[i][:n]), tuple(values[i][:n])) if n else None for i, n in enumerate(ks)]


def sample(
    logits: torch.Tensor,  # [M, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    grammar: GrammarMask | None = None,
) -> SampleResult:
    """One token per row, and the model's log-probabilities when any row asks for them.
    ``grammar`` (structured outputs) rules out the tokens its rows' grammars forbid before any
    choice; the log-probabilities stay the model's own, as vLLM's raw logprobs do."""
    logits, bad = _finite_rows(logits.float())
    raw = logits
    if grammar is not None:
        logits = grammar.apply(logits.clone())
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens[rows] = _draw(logits, params, generators, rows)
    if all(p.logprobs is None for p in params):
        return SampleResult(tokens.tolist(), bad_rows=bad)
    logprobs = raw.log_softmax(-1)  # [M, V], before temperature (vLLM's raw logprobs)
    chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    return SampleResult(tokens.tolist(), chosen, _top(logprobs, params), bad)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[M, V] -> [M, V] fp32: the distribution ``sample`` draws each non-greedy row from, under its
    own ``params`` (temperature, top-k, top-p), for rejection sampling (``rejection``). One softmax
    for all rows: each parallel op costs a thread wake-up, ~15 ms on a loaded 2-core host."""
    rows = [_filter_top_k_top_p(x / p.temperature, p.top_k, p.top_p) for x, p in zip(logits.float(), params)]
    return torch.stack(rows).softmax(-1)


def chosen_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams
) -> tuple[list[float], list[TopLogprobs | None] | None]:
    """Each row's chosen token's log-probability and its alternatives, as ``sample`` reports them."""
    logprobs = logits.float().log_softmax(-1)  # [M, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).view(-1).tolist()
    return chosen, _top(logprobs, [params] * len(tokens))
