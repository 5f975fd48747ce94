"""The engine's multi-token steps (speculative decoding) against the single-token engine: the same
tokens, the same KV at every kept position, prefix caching and preemption intact; a draft model
that is the target itself accepts everything; the spec_decode metrics; and greedy identity on the
real SmolLM2 in fp32."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from baton.common.engine.llm_engine import EngineConfig, LLMEngine
from baton.common.engine.sampling_params import SamplingParams
from baton.common.metrics import EngineCollector
from baton.common.model.config import LlamaConfig
from baton.common.model.llama import LlamaForCausalLM, Rotary
from baton.common.model.source import ModelSource, load_tokenizer

VOCAB = 64
NGRAM = dict(
    speculative="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3, adaptive_speculation=False
)


def _tiny(seed: int, layers: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    model = model.float().eval().requires_grad_(False)
    model.prepack()
    return model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSource.resolve(None))


@pytest.fixture(scope="module")
def target():
    return _tiny(0)


def _engine(model, tok, draft=None, eos=frozenset({1}), **kw) -> LLMEngine:
    kw.setdefault("kv_cache_gib", 0.002)
    config = EngineConfig(dtype="float32", block_size=4, max_num_batched_tokens=64, **kw)
    return LLMEngine(config, model, tok, eos, draft_model=draft)


def _workload(seed: int, n: int = 8) -> list[list[int]]:
    """Prompts that repeat themselves (as an edit of a given text does), so n-grams propose."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 8))]
        prompts.append((motif * 6)[: rng.randrange(8, 40)])
    return prompts


def _kv_of(engine, req) -> torch.Tensor:
    """[positions, layers, 2, KV, D]: the cache at the request's computed positions, in order."""
    blocks = torch.tensor(engine.kv.block_ids(req.request_id), dtype=torch.long)
    kv = engine.kv_cache[blocks]  # [B, L, 2, KV, bs, D]
    kv = kv.permute(0, 4, 1, 2, 3, 5).reshape(-1, *kv.shape[1:4], kv.shape[-1])
    return kv[: req.num_computed_tokens].clone()


def _run(engine, prompts, params, kv: dict | None = None) -> dict[str, list[int]]:
    """Serve the prompts to the end, checking the pool every step; ``kv`` collects each request's
    KV at its longest computed prefix."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params if isinstance(params, SamplingParams) else params[i])
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
        engine.pool.check_integrity()
        if kv is not None:
            for req in engine.scheduler.running:
                if req.request_id not in kv or kv[req.request_id].shape[0] < req.num_computed_tokens:
                    kv[req.request_id] = _kv_of(engine, req)
    return outs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_token_steps_give_the_tokens_and_kv_of_single_token_steps(target, tok, seed):
    prompts = _workload(seed)
    rng = random.Random(seed)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(4, 40)) for _ in prompts]
    kv_plain, kv_spec = {}, {}
    plain = _run(_engine(target, tok), prompts, params, kv_plain)
    spec_engine = _engine(target, tok, **NGRAM)
    spec = _run(spec_engine, prompts, params, kv_spec)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    stats = spec_engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert spec_engine.num_steps_total < _steps(target, tok, prompts, params)
    for rid, kv in kv_spec.items():
        n = min(kv.shape[0], kv_plain[rid].shape[0])
        assert n > 0
        torch.testing.assert_close(kv[:n], kv_plain[rid][:n], atol=1e-5, rtol=1e-5)


def _steps(model, tok, prompts, params) -> int:
    engine = _engine(model, tok)
    _run(engine, prompts, params)
    return engine.num_steps_total


def test_preemption_and_prefix_hits_under_speculation(target, tok):
    # 23 blocks of 4 tokens (2 KiB each, and a scratch block) for 8 requests of up to 40 + 40
    # tokens: preemptions.
    prompts = _workload(7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(kv_cache_gib=24 * 2048 / 2**30, max_model_len=88)
    plain_engine = _engine(target, tok, **small)
    spec_engine = _engine(target, tok, **small, **NGRAM)
    assert spec_engine.pool.num_blocks == 23
    plain = _run(plain_engine, prompts, params)
    spec = _run(spec_engine, prompts, params)
    assert spec_engine.num_preemptions_total > 0
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    # The next turn repeats prompt and reply: it hits the blocks computed under speculation, and
    # the contents are right (the same reply as a fresh engine's).
    follow = [prompts[0] + spec["0"].token_ids[:20]]
    fresh = _run(_engine(target, tok), follow, SamplingParams(temperature=0, max_tokens=16))
    again = _run(spec_engine, follow, SamplingParams(temperature=0, max_tokens=16))
    assert again["0"].token_ids == fresh["0"].token_ids
    spec_engine.pool.check_integrity()


def test_stop_strings_logprobs_and_max_tokens_are_those_without_speculation(target, tok):
    prompts = _workload(3)
    plain_engine, spec_engine = _engine(target, tok), _engine(target, tok, **NGRAM)
    text = _run(plain_engine, prompts[:1], SamplingParams(temperature=0, max_tokens=30))["0"].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    for params in (
        SamplingParams(temperature=0, max_tokens=30, stop=(stop,)),
        SamplingParams(temperature=0, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ):
        want = _run(plain_engine, prompts, params)
        got = _run(spec_engine, prompts, params)
        for rid, w in want.items():
            g = got[rid]
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
            if params.logprobs is not None:
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
                assert [t.token_ids for t in g.top_logprobs] == [t.token_ids for t in w.top_logprobs]
            if params.max_tokens == 7:
                assert len(g.token_ids) == 7
    assert spec_engine.speculator.stats.num_accepted_tokens > 0


def test_the_target_as_its_own_draft_accepts_every_proposal(target, tok):
    prompts = _workload(4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _run(_engine(target, tok), prompts, params)
    cfg = dict(speculative="draft", draft_model="self", num_speculative_tokens=3, adaptive_speculation=False)
    engine = _engine(target, tok, draft=target, **cfg)
    spec = _run(engine, prompts, params)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    pool = engine.speculator.drafter.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # the draft's blocks went with the requests


def test_a_different_draft_model_keeps_greedy_output_and_seeded_sampling_repeats(target, tok):
    prompts = _workload(5)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    cfg = dict(speculative="draft", draft_model="tiny", num_speculative_tokens=3, adaptive_speculation=False)
    draft = _tiny(0, layers=1)  # the target's first layer and head: a related, weaker model
    draft.load_state_dict(
        {k: v for k, v in target.state_dict().items() if not k.startswith("layers.1.")}, strict=False
    )
    engine = _engine(target, tok, draft=draft, **cfg)
    plain = _run(_engine(target, tok), prompts, greedy)
    spec = _run(engine, prompts, greedy)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    seeded = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=i) for i in range(len(prompts))]
    first = _run(engine, prompts, seeded)
    second = _run(engine, prompts, seeded)
    assert {k: v.token_ids for k, v in first.items()} == {k: v.token_ids for k, v in second.items()}
    assert engine.speculator.drafter.kv.pool.num_free_blocks == engine.speculator.drafter.kv.pool.num_blocks


def test_spec_decode_metrics_match_the_counters(target, tok):
    engine = _engine(target, tok, **NGRAM)
    outs = _run(engine, _workload(6), SamplingParams(temperature=0, max_tokens=30))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, {"worker": "w"}))
    text = generate_latest(registry).decode()
    stats = engine.speculator.stats
    assert f'baton:spec_decode_num_drafts_total{{worker="w"}} {float(stats.num_drafts)}' in text
    assert f'baton:spec_decode_num_draft_tokens_total{{worker="w"}} {float(stats.num_draft_tokens)}' in text
    assert (
        f'baton:spec_decode_num_accepted_tokens_total{{worker="w"}} {float(stats.num_accepted_tokens)}'
        in text
    )
    per_pos = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton:spec_decode_num_accepted_tokens_per_pos_total{")
    ]
    assert len(per_pos) == 3 and sum(per_pos) == stats.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a later position is accepted only after the earlier
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert engine.num_generated_tokens_total == sum(len(o.token_ids) for o in outs.values())


def test_structured_requests_are_not_speculated(target, tok):
    from baton.common.engine.sampling_params import StructuredOutputsParams

    engine = _engine(target, tok, **NGRAM)
    # This vocabulary is SmolLM2's first 64 tokens: the digits are among them.
    digits = StructuredOutputsParams(regex="[0-9]{16}")
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=digits)
    prompts = [[32 + (i % 10) for i in range(24)], [33, 34, 35] * 8]  # digit runs: n-grams would propose
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
        assert all(not r.spec_token_ids for r in engine.scheduler.running)
    assert engine.speculator.stats.num_drafts == 0
    assert len(texts) == 2 and all(len(t) == 16 and t.isdigit() for t in texts), texts


def test_smollm2_greedy_output_is_identical_with_ngram_speculation(llm_fp32):
    """The real model in fp32, on a prompt-grounded task (repeat a given text with one change)."""
    base = llm_fp32.engine
    config = EngineConfig(
        dtype="float32", kv_cache_gib=0.1, max_model_len=2048, speculative="ngram", adaptive_speculation=False
    )
    spec = LLMEngine(config, base.model, base.tokenizer, base.eos_token_ids)
    text = (
        "Baton serves large language models with disaggregated prefill and decode: a prompt is "
        "prefilled on one worker, its KV cache is handed over to another worker, and that worker "
        "generates the tokens."
    )
    messages = [
        {"role": "user", "content": f"Repeat this text exactly, with 'Baton' replaced by 'Relay':\n\n{text}"}
    ]
    prompt = base.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = base.tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=32)
    steps = base.num_steps_total
    want = _run(base, [ids], params)["0"]
    steps = base.num_steps_total - steps
    got = _run(spec, [ids], params)["0"]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert spec.speculator.stats.num_accepted_tokens >= 8, spec.speculator.stats
    assert spec.num_steps_total < steps  # copying the text, several tokens a step
