"""Rejection sampling keeps the target's distribution: directly on made-up distributions, and
through the engine on a tiny random model against the exact distribution of its next tokens."""

from __future__ import annotations

import torch

from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.engine.rejection import accept_greedy, rejection_sample
from baton.common.engine.sampling_params import SamplingParams
from baton.common.model.config import LlamaConfig
from baton.common.model.llama import LlamaForCausalLM, Rotary
from baton.common.model.source import ModelSource, load_tokenizer
from tests.model.helpers import prompt_logits

V = 8


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_greedy_acceptance_is_the_prefix_of_argmax_matches():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, bonus 8
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # 6 rejected, 9 in its place
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_one_hot_proposals_keep_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 1.5, -1)
    draft = [int(p[0].argsort()[V // 2]), 3]  # a middling first proposal: often rejected, resampled
    first = torch.zeros(V)
    second = torch.zeros(V)
    n = 20_000
    for _ in range(n):
        out = rejection_sample(p, draft, None, gen)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert _tv(first, p[0]) < 0.02
    assert second.sum() > 1000 and _tv(second, p[1]) < 0.05  # given an accepted first, the next is p[1]'s


def test_draft_distributions_keep_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, V, generator=gen), -1)
    q = torch.softmax(torch.randn(1, V, generator=gen), -1)
    counts = torch.zeros(V)
    accepted = 0
    n = 20_000
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        out = rejection_sample(p, [d], q, gen)
        counts[out[0]] += 1
        accepted += len(out) == 2
    assert _tv(counts, p[0]) < 0.02
    # The acceptance rate is sum(min(p, q)): 1 - TV(p, q).
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.02


def _tiny_model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    model = model.float().eval().requires_grad_(False)
    model.prepack()
    return model


def _exact_marginals(engine, prompt: list[int]) -> list[torch.Tensor]:
    """The exact distributions of the first three output tokens (each summed over the ones before)."""
    p1 = prompt_logits(engine, prompt)[-1].softmax(-1)
    p2 = torch.zeros(V)
    p3 = torch.zeros(V)
    for a in range(V):
        pa = prompt_logits(engine, prompt + [a])[-1].softmax(-1)
        p2 += p1[a] * pa
        for b in range(V):
            p3 += p1[a] * pa[b] * prompt_logits(engine, prompt + [a, b])[-1].softmax(-1)
    return [p1, p2, p3]


def test_speculative_sampling_through_the_engine_matches_the_exact_distribution():
    tok = load_tokenizer(ModelSource.resolve(None))
    config = EngineConfig(
        dtype="float32",
        kv_cache_gib=0.01,
        block_size=4,
        speculative="ngram",
        num_speculative_tokens=2,
        ngram_min=1,
        ngram_max=2,
        adaptive_speculation=False,
        max_waiting_requests=4096,
    )
    engine = LLMEngine(config, _tiny_model(), tok, frozenset())
    prompt = [3, 1, 4, 1, 5, 0, 2, 6, 7, 5, 3]  # every token occurs: a proposal always exists
    n = 2000
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=i))
    counts = [torch.zeros(V) for _ in range(4)]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for pos, t in enumerate(out.outputs[0].token_ids):
                counts[pos][t] += 1
    stats = engine.speculator.stats
    # Tokens 2 and 3 came from a verified step, with proposals both accepted and rejected.
    assert stats.num_drafts >= n and stats.accepted_per_pos[1] > 0 and 0.02 < stats.acceptance_rate < 0.98
    for pos, p in enumerate(_exact_marginals(engine, prompt)):
        assert counts[pos].sum() == n
        assert _tv(counts[pos], p) < 0.07, (pos, counts[pos] / n, p)
