"""``sampler.sample``: sampled tokens follow the model's distribution (after temperature, top-k and
top-p), masked tokens are never drawn, seeds reproduce, and greedy rows stay argmax."""

from __future__ import annotations

import math

import torch

from baton.common.engine.sampler import NUCLEUS_CANDIDATES, _filter_top_p, sample
from baton.common.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5])


def _draw(params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = LOGITS.repeat(50, 1)  # 50 rows a call, as a batch would
    out = []
    for _ in range(n // 50):
        out += sample(logits, [params] * 50, [gen] * 50).token_ids
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


def test_the_nucleus_is_the_one_a_full_sort_finds_whether_it_is_small_or_not():
    """The nucleus is first looked for among the most likely 64, then 1024 tokens: rows whose
    nucleus is inside each of those, and beyond both (a near-flat row), keep exactly the tokens that
    sorting the whole vocabulary keeps (the smallest set, most likely first, whose mass reaches
    top_p), and nothing else."""
    gen = torch.Generator().manual_seed(0)
    vocab = 49_152
    sizes = []
    for spread in (8.0, 3.0, 1.0, 0.3, 0.01):  # peaked .. near-flat
        for top_p in (0.5, 0.9, 0.99):
            logits = torch.randn(vocab, generator=gen) * spread
            probs = logits.softmax(-1)  # fp32, as sampled: the boundary is that of fp32 sums
            top, order = torch.sort(probs, descending=True)
            nucleus = order[: int((top.cumsum(0) - top < top_p).sum())]
            got = _filter_top_p(logits, top_p)
            kept = torch.isfinite(got).nonzero().view(-1)
            assert set(kept.tolist()) == set(nucleus.tolist()), (spread, top_p)
            assert torch.equal(got[kept], logits[kept])  # kept logits unchanged
            sizes.append(len(nucleus))
    small, large = NUCLEUS_CANDIDATES
    assert min(sizes) <= small and any(small < n <= large for n in sizes) and max(sizes) > large


def test_seeds_reproduce_and_greedy_rows_stay_argmax():
    a = _draw(SamplingParams(temperature=1.0), 1000, seed=7)
    assert torch.equal(a, _draw(SamplingParams(temperature=1.0), 1000, seed=7))
    assert not torch.equal(a, _draw(SamplingParams(temperature=1.0), 1000, seed=8))
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    got = sample(logits, params, [None, torch.Generator().manual_seed(0), None])
    tokens = got.token_ids
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert got.logprobs is None and got.top_logprobs is None and got.bad_rows == ()
    params = [SamplingParams(temperature=1.0, logprobs=0)] * 3
    got = sample(logits, params, [torch.Generator().manual_seed(0)] * 3)
    want = logits.log_softmax(-1)[torch.arange(3), torch.tensor(got.token_ids)]
    assert torch.allclose(torch.tensor(got.logprobs), want)
    assert got.top_logprobs is None  # logprobs=0: no alternatives, and no top-k computed


def test_tiny_temperatures_are_greedy_and_never_nan():
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(2)) * 20
    for t in (1e-30, 1e-10, 9.9e-6):
        params = [SamplingParams(temperature=t, logprobs=0)] * 4
        got = sample(logits, params, [torch.Generator().manual_seed(0)] * 4)
        assert got.token_ids == logits.argmax(-1).tolist(), t
        assert all(math.isfinite(lp) for lp in got.logprobs) and got.bad_rows == ()
    # Just above the floor the row is sampled, in fp32, and the division stays finite: at 1e-5 the
    # scaled logits are ~1e6 apart, so the argmax is drawn every time.
    bf16 = logits.to(torch.bfloat16)
    got = sample(bf16, [SamplingParams(temperature=1e-5)] * 4, [torch.Generator().manual_seed(0)] * 4)
    assert got.token_ids == bf16.float().argmax(-1).tolist() and got.bad_rows == ()


def test_a_non_finite_row_fails_alone_and_the_others_sample_as_without_it():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0, logprobs=2),
    ]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(4)]  # noqa: E731
    clean = sample(logits, params, gens())
    bad = logits.clone()
    bad[1, 17] = float("nan")
    bad[2, 5] = float("inf")
    got = sample(bad, params, gens())
    assert got.bad_rows == (1, 2)
    assert [got.token_ids[i] for i in (0, 3)] == [clean.token_ids[i] for i in (0, 3)]
    assert [got.logprobs[i] for i in (0, 3)] == [clean.logprobs[i] for i in (0, 3)]
    assert got.top_logprobs[3] == clean.top_logprobs[3]
    assert all(math.isfinite(lp) for lp in got.logprobs)
    assert sample(torch.full((2, 8), float("-inf")), params[:2], gens()[:2]).bad_rows == (0, 1)


def test_top_logprobs_are_each_rows_k_most_likely_and_hold_the_chosen_token():
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=1.0, logprobs=None),
        SamplingParams(temperature=1.0, top_k=3, logprobs=25),  # more than the cap: 20
    ]
    got = sample(logits, params, [torch.Generator().manual_seed(0)] * 3)
    want = torch.topk(logits.double().log_softmax(-1), 20, dim=-1)
    assert got.top_logprobs[1] is None
    for row, k in ((0, 5), (2, 20)):
        top = got.top_logprobs[row]
        assert list(top.token_ids) == want.indices[row, :k].tolist()
        assert torch.allclose(
            torch.tensor(top.logprobs, dtype=torch.float64), want.values[row, :k], atol=1e-5
        )
        # The chosen token (top-3 sampling: within the top 20) is in the list, with its own logprob.
        assert got.logprobs[row] == top.logprobs[top.token_ids.index(got.token_ids[row])]
    assert got.token_ids[0] == got.top_logprobs[0].token_ids[0]
    assert list(got.top_logprobs[0].logprobs) == sorted(got.top_logprobs[0].logprobs, reverse=True)
