"""The engine's multi-token steps (speculative decoding) against the single-token engine: the same
tokens, the same KV at every kept position, prefix caching and preemption intact; a draft model
that is the target itself accepts everything; the spec_decode metrics; and greedy identity on the
real SmolLM2 in fp32."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
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


# This vocabulary is SmolLM2's first 64 tokens: the digits are among them (ids 32-41).
ALTERNATING = "([0-4][5-9]){8}"
"""A low digit, then a high one: an n-gram copying a run 0123456789 breaks it every other token."""


def _digit_prompts() -> list[list[int]]:
    return [[32 + (i % 10) for i in range(24)], [33, 34, 35] * 8, [32, 37, 33, 38] * 6]


def _structured(regex: str, **kw) -> SamplingParams:
    from baton.common.engine.sampling_params import StructuredOutputsParams

    kw.setdefault("temperature", 0)
    return SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex), **kw)


def test_structured_requests_are_speculated_under_their_grammar(target, tok):
    """Proposals are verified against the grammar: greedy output is the one without speculation,
    and every output (greedy or sampled) matches; n-gram proposals are cut where the grammar
    refuses them, and the target as its own draft, cut the same way, has all of them accepted."""
    import re

    prompts = _digit_prompts()
    greedy = _structured(ALTERNATING, max_tokens=20)
    plain = _run(_engine(target, tok), prompts, greedy)
    ngram_engine = _engine(target, tok, **NGRAM)
    ngram = _run(ngram_engine, prompts, greedy)
    self_cfg = dict(
        speculative="draft", draft_model="self", num_speculative_tokens=3, adaptive_speculation=False
    )
    assert {k: v.token_ids for k, v in ngram.items()} == {k: v.token_ids for k, v in plain.items()}
    assert all(re.fullmatch(ALTERNATING, o.text) for o in plain.values()), [o.text for o in plain.values()]
    assert ngram_engine.speculator.stats.num_drafts > 0
    # A loose grammar (most of this vocabulary), where the draft's unmasked choices mostly fit it.
    loose = _structured("[^0-4]{12}", max_tokens=16)
    self_engine = _engine(target, tok, draft=target, **self_cfg)
    self_draft = _run(self_engine, prompts, loose)
    want = _run(_engine(target, tok), prompts, loose)
    assert {k: v.token_ids for k, v in self_draft.items()} == {k: v.token_ids for k, v in want.items()}
    # Matched on the tokens' own strings: xgrammar reads this vocabulary's special tokens (e.g.
    # "<repo_name>", all of it outside 0-4) as text, as vLLM's xgrammar backend does, and the
    # output text leaves them out.
    texts = [
        tok.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids) for o in want.values()
    ]
    assert all(re.fullmatch("[^0-4]{12}", t) for t in texts), texts
    stats = self_engine.speculator.stats
    assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens == stats.num_draft_tokens
    sampled = [_structured(ALTERNATING, temperature=1.0, seed=i, max_tokens=20) for i in range(len(prompts))]
    for outs in (_run(ngram_engine, prompts, sampled), _run(self_engine, prompts, sampled)):
        assert all(re.fullmatch(ALTERNATING, o.text) for o in outs.values()), [o.text for o in outs.values()]


def test_verified_rows_are_masked_by_the_grammar_after_each_proposal(target, tok):
    """Row j's mask is the grammar's after the first j proposals; a refused proposal ends the
    masked rows, and the matcher is left where it was."""
    from baton.common.engine.rejection import VerifyGroup
    from baton.common.engine.request import Request

    engine = _engine(target, tok)
    req = Request("r", [5, 6, 7], _structured(ALTERNATING, max_tokens=20), frozenset({1}))
    engine.structured.add(req)
    low, high = 32, 38  # "0", "6"
    mask = engine.structured.verify_mask([VerifyGroup("r", 0, (low, high, low, low))], {"r": req})
    assert mask.rows == (0, 1, 2, 3)  # row 3 refuses the second low digit: the rows after are free
    logits = mask.apply(torch.zeros(5, VOCAB))
    ok = [set(torch.nonzero(torch.isfinite(row)).view(-1).tolist()) for row in logits]
    assert ok[0] == ok[2] == set(range(32, 37)) and ok[1] == ok[3] == set(range(37, 42))
    assert ok[4] == set(range(VOCAB))
    assert engine.structured.trim_proposal(req, [low, high, low, low, high]) == [low, high, low]
    # Nothing was fed for good: the request's own next row is still a low digit's.
    again = engine.structured.mask(["r"], {"r": req}).apply(torch.zeros(1, VOCAB))
    assert set(torch.nonzero(torch.isfinite(again[0])).view(-1).tolist()) == set(range(32, 37))


def _common_early_token(model, tok, prompts) -> int:
    """The token the model most often puts among its first five outputs (to be made EOS)."""
    from collections import Counter

    outs = _run(_engine(model, tok), prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    return Counter(t for o in outs.values() for t in o.token_ids).most_common(1)[0][0]


def test_min_tokens_masks_eos_and_stop_token_ids_with_and_without_speculation(target, tok):
    prompts = _workload(8)
    eos = _common_early_token(target, tok, prompts)
    stop_id = next(t for t in range(2, VOCAB) if t != eos)
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=6, stop_token_ids=(stop_id,))
    free = _run(
        _engine(target, tok, eos=frozenset({eos})), prompts, SamplingParams(temperature=0, max_tokens=6)
    )
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 6 for o in free.values())  # EOS came early
    plain = _run(_engine(target, tok, eos=frozenset({eos})), prompts, params)
    spec_engine = _engine(target, tok, eos=frozenset({eos}), **NGRAM)
    spec = _run(spec_engine, prompts, params)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    assert spec_engine.speculator.stats.num_drafts > 0
    for o in plain.values():
        assert eos not in o.token_ids[:6] and stop_id not in o.token_ids[:6], o.token_ids
        assert len(o.token_ids) > 6 and o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert o.token_ids[-1] in (eos, stop_id)


def test_a_grammar_that_can_only_end_stops_short_of_min_tokens(target, tok):
    """vLLM's rule (its PR #54218): where the grammar allows only EOS, min_tokens gives way and the
    request stops, its output matching the grammar, instead of sampling from an empty mask."""
    prompts = _digit_prompts()
    for params in (
        _structured("[0-9]{3}", max_tokens=20, min_tokens=8),
        _structured("[0-9]{3}", max_tokens=20, min_tokens=8, temperature=1.0, seed=1),
    ):
        outs = [_run(_engine(target, tok, **kw), prompts, params) for kw in ({}, NGRAM)]
        if params.greedy:  # sampled: the same distribution, not the same draws
            assert {k: v.token_ids for k, v in outs[0].items()} == {
                k: v.token_ids for k, v in outs[1].items()
            }
        for o in (*outs[0].values(), *outs[1].values()):
            assert o.finish_reason == "stop" and o.text.isdigit() and len(o.text) == 3, o
            assert o.token_ids[-1] == 1 and len(o.token_ids) == 4  # three digits and EOS, under 8


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


def test_the_lm_head_runs_at_the_step_shapes_row_counts_only(target, tok, monkeypatch):
    """A verification's rows (1 + k per request, a new count almost every step) reach the LM head
    padded to the step shapes' buckets, whose primitives warm-up builds: none is built mid-run."""
    from baton.common.engine.step_shapes import token_buckets

    config = EngineConfig(
        dtype="float32", block_size=4, kv_cache_gib=0.01, max_num_batched_tokens=512, **NGRAM
    )
    engine = LLMEngine(config, target, tok, frozenset({1}))
    seen = set()
    for name in ("greedy_tokens", "compute_logits"):
        real = getattr(target, name)
        monkeypatch.setattr(target, name, lambda h, real=real: seen.add(h.shape[0]) or real(h))
    prompts = [p * 2 for p in _workload(9, n=64)]
    _run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert engine.speculator.stats.num_drafts > 0
    assert seen <= set(token_buckets(512)) and max(seen) > 64, sorted(seen)


def test_spec_bench_batch_mode_runs_each_seed_off_and_on_with_the_same_tokens(tmp_path):
    """W1's case of ``baton.bench.spec`` (``--batch``): one off/on pair per seed on the real model,
    the greedy tokens compared inside the bench (it raises where they differ)."""
    import json

    from baton.bench import spec

    out = tmp_path / "spec.json"
    argv = ["--dtype", "float32", "--batch", "3", "--input-len", "24", "--output-len", "12"]
    argv += ["--num-random", "0", "--num-grounded", "0", "--batch-seeds", "1,2", "--output-json", str(out)]
    assert spec.main(argv) == 0
    batch = json.loads(out.read_text())["workloads"]["batch"]
    assert batch["requests"] == 3 and len(batch["off_s"]) == len(batch["on_s"]) == 2
    assert batch["on_over_off"] == [on / off for off, on in zip(batch["off_s"], batch["on_s"])]
    assert set(json.loads(out.read_text())["workloads"]) == {"batch"}


def test_the_throughput_guard_charges_a_verifying_step_its_proposing(target, tok, monkeypatch):
    """The guard compares tokens per second of whole steps: a verifying step's rate includes the
    n-gram search that prepared it (measured in ``propose``), not the forward pass alone, so an
    expensive proposer counts against speculation."""
    import time

    eng = _engine(target, tok, **{**NGRAM, "adaptive_speculation": True})
    spec = eng.speculator
    seen: list[tuple[bool, float]] = []
    monkeypatch.setattr(
        spec.controller.guard,
        "observe",
        lambda n, verified, tokens, seconds: seen.append((verified, seconds)),
    )
    slow = 0.05
    inner = spec._propose

    def slow_propose(*args):
        time.sleep(slow)  # a proposer that costs 50 ms a step
        return inner(*args)

    monkeypatch.setattr(spec, "_propose", slow_propose)
    _run(eng, _workload(3, n=4), SamplingParams(temperature=0, max_tokens=24))
    verified = [s for v, s in seen if v]
    plain = [s for v, s in seen if not v]
    assert verified, f"no verifying decode step was observed: {seen}"
    # Every verifying step carries the 50 ms its proposals took; a plain one does not.
    assert min(verified) >= slow, verified
    assert plain and min(plain) < slow, plain


def test_a_migrated_speculating_request_resumes_token_for_token(target, tok):
    """A speculating request resumed from the tokens another worker already streamed (request
    migration, ``AsyncEngine.generate(resume=...)``) recomputes prompt + output, goes on speculating
    from there, and streams exactly the tokens the uninterrupted run would have."""
    import asyncio

    from baton.common.engine.async_engine import AsyncEngine

    from .helpers import wait_engine_idle

    engine = _engine(target, tok, **NGRAM)
    plain = _engine(target, tok)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = _workload(7, 1)[0]
    want = _run(plain, [prompt], params)["0"].token_ids
    runner = AsyncEngine(engine)
    runner.start()

    async def tokens(rid: str, resume: list[int] = ()) -> list[int]:
        return [t async for d in runner.generate(rid, prompt, params, resume) for t in d.token_ids]

    try:
        seen = asyncio.run(tokens("first"))[:9]  # what the client had when its worker died
        before = engine.speculator.stats.num_accepted_tokens
        rest = asyncio.run(tokens("resumed", seen))
        accepted = engine.speculator.stats.num_accepted_tokens - before
        wait_engine_idle(engine)
    finally:
        runner.stop()
    assert seen == want[:9] and seen + rest == want
    assert accepted > 0, "the resumed request was not speculated"
    engine.pool.check_integrity()
