"""``sampler.sample``: sampled tokens follow the model's distribution (after temperature, top-k and
top-p), masked tokens are never drawn, seeds reproduce, and greedy rows stay argmax."""

from __future__ import annotations

import math

import torch

from baton.common.engine.sampler import sample
from baton.common.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5])


def _draw(params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = LOGITS.repeat(50, 1)  # 50 rows a call, as a batch would
    out = []
    for _ in range(n // 50):
        tokens, _ = sample(logits, [params] * 50, [gen] * 50)
        out += tokens
    return torch.bincount(torch.tensor(out), minlength=len(LOGITS)).double()


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square against ``probs`` below its 99.9% quantile (Wilson-Hilferty)."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    k = int(keep.sum()) - 1
    z = 3.09  # the normal's 99.9% quantile
    return chi2 < k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def test_temperature_sampling_follows_the_softmax():
    for t in (1.0, 0.5, 2.0):
        probs = (LOGITS.double() / t).softmax(-1)
        assert _chi2_ok(_draw(SamplingParams(temperature=t), 20000), probs), t


def test_top_k_and_top_p_draw_only_inside_the_mask_in_proportion():
    counts = _draw(SamplingParams(temperature=1.0, top_k=3), 20000)
    probs = torch.zeros(8, dtype=torch.float64)
    probs[[0, 7, 1]] = LOGITS[[0, 7, 1]].double().softmax(-1)
    assert counts[[2, 3, 4, 5, 6]].sum() == 0 and _chi2_ok(counts, probs)
    full = LOGITS.double().softmax(-1)
    order = full.argsort(descending=True)  # 0, 7, 1, 2, 6, 3, 4, 5
    nucleus = order[: int((full[order].cumsum(0) < 0.8).sum()) + 1]  # the smallest set reaching 0.8
    counts = _draw(SamplingParams(temperature=1.0, top_p=0.8), 20000)
    outside = [i for i in range(8) if i not in nucleus.tolist()]
    assert counts[outside].sum() == 0
    probs = torch.zeros(8, dtype=torch.float64)
    probs[nucleus] = full[nucleus] / full[nucleus].sum()
    assert _chi2_ok(counts, probs)


def test_seeds_reproduce_and_greedy_rows_stay_argmax():
    a = _draw(SamplingParams(temperature=1.0), 1000, seed=7)
    assert torch.equal(a, _draw(SamplingParams(temperature=1.0), 1000, seed=7))
    assert not torch.equal(a, _draw(SamplingParams(temperature=1.0), 1000, seed=8))
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    tokens, logprobs = sample(logits, params, [None, torch.Generator().manual_seed(0), None])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert logprobs is None
    params = [SamplingParams(temperature=1.0, logprobs=0)] * 3
    tokens, logprobs = sample(logits, params, [torch.Generator().manual_seed(0)] * 3)
    want = logits.log_softmax(-1)[torch.arange(3), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), want)
