"""Verifying proposed tokens against the target model's logits at every position of a chunk.

A request verified this step ran 1 + k rows: its last token and k proposals d_1..d_k. Row i's
logits give the target's distribution p_i of the token after it. Greedy: d_{i+1} is accepted while
it is row i's argmax, and the first argmax that differs (or row k's, when all were accepted) is
the bonus token, so the output is token for token the one without speculation. Sampled: the
standard rejection sampling (Leviathan et al. 2023, Chen et al. 2023) with the draft's
distribution q_i (one-hot for n-gram proposals): d_{i+1} is accepted with probability
min(1, p_i(d) / q_i(d)); the first rejected one is replaced by a draw from norm(max(0, p_i - q_i));
the tokens then follow the target's distribution exactly. p is the distribution plain sampling
draws from (temperature, top-k, top-p: ``sampler.sampling_probs``), and every uniform comes from
the request's generator, so a seeded request repeats itself.

A grammar (structured outputs) and ``min_tokens`` constrain the rows as they constrain sampled
ones (``StructuredOutputs.verify_mask``): p and the argmaxes are those of the masked logits, so a
proposal the mask rules out is rejected and the bonus token is drawn under the mask; the
log-probabilities stay the model's own, as the sampler's do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton.common.engine.sampler import chosen_logprobs, finite_rows, sampling_probs
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import SampledToken
from baton.common.engine.step_shapes import padded_num_tokens

if TYPE_CHECKING:
    from baton.common.engine.structured import GrammarMask


@dataclass(frozen=True)
class VerifyGroup:
    request_id: str
    first_row: int
    """Row of the request's last token in the step's batch; its proposals follow it."""
    draft: tuple[int, ...]
    """The proposals (k of them)."""

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + len(self.draft) + 1)


def _uniform(gen: torch.Generator | None) -> float:
    """A uniform in (0, 1] (never 0: the token it picks has positive mass)."""
    return 1.0 - torch.rand((), dtype=torch.float64, generator=gen).item()


def inverse_cdf(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """A token drawn with probability proportional to ``weights`` [V], as ``sampler`` draws."""
    cdf = weights.to(torch.float64).cumsum(0)
    target = torch.tensor([_uniform(gen) * cdf[-1].item()], dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, target).item()), weights.shape[0] - 1)


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The accepted prefix and the bonus: ``targets`` are the k + 1 rows' argmax tokens."""
    out = []
    for d, t in zip(draft, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(draft)])
    return out


def rejection_sample(
    p: torch.Tensor,  # [k + 1, V] target probabilities
    draft: Sequence[int],
    q: torch.Tensor | None,  # [k, V] draft probabilities; None: one-hot at the proposals
    gen: torch.Generator | None,
) -> list[int]:
    """The accepted prefix of ``draft`` and one more token, distributed exactly as p's."""
    out = []
    for i, d in enumerate(draft):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        if _uniform(gen) * qd <= pd:  # accepted with probability min(1, p/q)
            out.append(d)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: rejection had no mass
            residual = p[i]
        out.append(inverse_cdf(residual, gen))
        return out
    out.append(inverse_cdf(p[len(draft)], gen))
    return out


def padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [M, hidden] with zero rows after them up to ``padded_num_tokens(M)``: the LM head
    runs at the step shapes' row counts, whose oneDNN primitives warm-up built. A verification's
    row count (each request's 1 + k) changes from step to step, and every new one built a
    primitive for the 576 x 49,152 product while serving (most of a batched offline run's time
    with speculation on, before the first warm run: 34 s against 1.8 s warm, loaded 2-core Xeon)."""
    extra = padded_num_tokens(rows.shape[0]) - rows.shape[0]
    return rows if extra == 0 else torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])


def verify(
    model,
    hidden: torch.Tensor,  # [N, hidden], the step's final hidden states
    groups: Sequence[VerifyGroup],
    requests: Mapping,
    generators: Mapping[str, torch.Generator],
    draft_probs: Mapping[str, torch.Tensor] | None = None,
    mask: GrammarMask | None = None,
) -> tuple[dict[str, tuple[SampledToken, ...]], tuple[str, ...]]:
    """Each verified request's tokens (accepted proposals, then the bonus), and the requests whose
    rows were not finite (no tokens: the engine fails them). ``mask``: the rows' constraints, in
    the order the groups' rows are gathered here."""
    index = torch.tensor([i for g in groups for i in g.rows], dtype=torch.long, device=hidden.device)
    rows = hidden[index]
    params = [requests[g.request_id].sampling_params for g in groups]
    spans, start = [], 0
    for g in groups:
        spans.append(slice(start, start + len(g.rows)))
        start += len(g.rows)
    if mask is None and all(p.greedy and p.logprobs is None for p in params):
        # Argmaxes only, without fp32 logits: the runner's own greedy fast path.
        targets = model.greedy_tokens(padded_rows(rows))[: len(rows)].tolist()
        ok = finite_rows(rows).tolist()
        out = {
            g.request_id: tuple(SampledToken(t) for t in accept_greedy(targets[span], g.draft))
            for g, span in zip(groups, spans)
            if all(ok[span])
        }
        return out, tuple(g.request_id for g in groups if g.request_id not in out)
    logits = model.compute_logits(padded_rows(rows))[: len(rows)].float().cpu()  # [R, V]
    finite = finite_rows(logits)
    ok = finite.tolist()
    # A bad row fails only its group: zeroed, it cannot spread NaNs through the batched softmax.
    masked = torch.where(finite.view(-1, 1), logits, 0.0)
    if mask is not None:
        masked = mask.apply(masked)
    probs = _target_probs(masked, spans, params)
    out = {}
    for i, (g, span, p) in enumerate(zip(groups, spans, params)):
        if not all(ok[span]):
            continue
        if p.greedy:
            tokens = accept_greedy(masked[span].argmax(-1).tolist(), g.draft)
        else:
            q = (draft_probs or {}).get(g.request_id)
            tokens = rejection_sample(probs[i], g.draft, q, generators.get(g.request_id))
        out[g.request_id] = _with_logprobs(tokens, logits[span], p)
    return out, tuple(g.request_id for g in groups if g.request_id not in out)


def _target_probs(logits: torch.Tensor, spans: list[slice], params: list[SamplingParams]) -> dict:
    """Group index -> its rows' sampling distributions, for the sampled (non-greedy) groups."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return {}
    rows = torch.cat([logits[spans[i]] for i in sampled])
    row_params = [params[i] for i in sampled for _ in range(spans[i].stop - spans[i].start)]
    probs = sampling_probs(rows, row_params)
    out, start = {}, 0
    for i in sampled:
        n = spans[i].stop - spans[i].start
        out[i] = probs[start : start + n]
        start += n
    return out


def _with_logprobs(
    tokens: list[int], logits: torch.Tensor, params: SamplingParams
) -> tuple[SampledToken, ...]:
    if params.logprobs is None:
        return tuple(SampledToken(t) for t in tokens)
    chosen, tops = chosen_logprobs(logits[: len(tokens)], tokens, params)
    return tuple(SampledToken(t, chosen[i], None if tops is None else tops[i]) for i, t in enumerate(tokens))
