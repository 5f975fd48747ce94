"""Engine behaviour on the real model: chunking, prefix cache, batching, sampling, bad input."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import LLM, SamplingParams

from .helpers import PLAIN_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ids(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    text = " ".join(PLAIN_PROMPTS) * 3
    return tok.encode(text, add_special_tokens=False)[:150]


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def chunked_llm(llm_fp32):
    """The same weights under a 32-token step budget, no prefix cache: every prompt is chunked."""
    import itertools
    from dataclasses import replace

    from baton.common.engine.llm_engine import LLMEngine

    src = llm_fp32.engine
    cfg = replace(
        src.config,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
        kv_cache_gib=0.1,
        max_model_len=1024,
    )
    llm = LLM.__new__(LLM)
    llm.config = cfg
    llm.engine = LLMEngine(cfg, src.model, src.tokenizer, src.eos_token_ids)
    llm._ids = itertools.count()
    return llm


def test_chunked_prefill_matches_one_shot(llm_fp32, chunked_llm, ids):
    llm_fp32.engine.pool.reset_prefix_cache()
    one_shot = _tokens(llm_fp32, [ids])
    computed_before = chunked_llm.engine.num_computed_tokens_total
    chunked = _tokens(chunked_llm, [ids])
    assert chunked == one_shot
    # 150 prompt tokens in 32-token steps: 5 chunks, then 23 decode steps.
    assert chunked_llm.engine.num_steps_with_prefill >= 5
    assert chunked_llm.engine.num_computed_tokens_total - computed_before == len(ids) + 23


def test_prefix_hit_computes_only_the_suffix(llm_fp32, ids):
    engine = llm_fp32.engine
    engine.pool.reset_prefix_cache()
    first = llm_fp32.generate([ids[:140]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    tail = ids[140:] + [42, 43, 44]
    before = engine.num_computed_tokens_total
    hit = llm_fp32.generate([ids[:140] + tail], GREEDY)[0]
    computed = engine.num_computed_tokens_total - before
    block = engine.config.block_size
    assert hit.num_cached_tokens == (140 // block) * block
    # The suffix, plus one token per decode step after the first sampled token.
    assert computed == (140 + len(tail) - hit.num_cached_tokens) + (GREEDY.max_tokens - 1)
    engine.pool.reset_prefix_cache()
    cold = llm_fp32.generate([ids[:140] + tail], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    engine.pool.check_integrity()


def test_next_turn_hits_the_whole_reply_when_it_ends_a_block(llm_fp32, ids):
    """A reply whose last token completes a block gets that token's KV computed after it
    finishes, so the next turn (history + reply + new text) recomputes none of the history."""
    engine = llm_fp32.engine
    engine.pool.reset_prefix_cache()
    block = engine.config.block_size
    prompt = ids[: 10 * block - GREEDY.max_tokens]  # prompt + reply = exactly 10 blocks
    reply = llm_fp32.generate([prompt], GREEDY)[0].outputs[0].token_ids
    turn2 = prompt + reply + [42, 43, 44]
    before = engine.num_computed_tokens_total
    hit = llm_fp32.generate([turn2], GREEDY)[0]
    assert hit.num_cached_tokens == 10 * block
    assert engine.num_computed_tokens_total - before == 3 + (GREEDY.max_tokens - 1)
    engine.pool.reset_prefix_cache()
    cold = llm_fp32.generate([turn2], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids  # the final token's KV is right
    engine.pool.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing held after the last step


def test_mixed_batch_gives_each_request_its_tokens_alone(llm_fp32, ids):
    llm_fp32.engine.pool.reset_prefix_cache()
    prompts = [ids[:7], ids[20:150], ids[3:40], ids[60:61], ids[10:100]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 5, 17, 24, 9)]
    alone = []
    for p, sp in zip(prompts, params):
        llm_fp32.engine.pool.reset_prefix_cache()
        alone.append(_tokens(llm_fp32, [p], sp)[0])
    llm_fp32.engine.pool.reset_prefix_cache()
    together = llm_fp32.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert [len(t) for t in alone] == [30, 5, 17, 24, 9]


def test_preemption_recomputes_and_finishes(llm_fp32, ids):
    """A pool too small for every request at once: requests are preempted and still match."""
    from dataclasses import replace

    from baton.common.engine.llm_engine import LLMEngine

    src = llm_fp32.engine
    block_bytes = src.kv_cache[0].numel() * src.kv_cache.element_size()
    tiny = replace(src.config, kv_cache_gib=23 * block_bytes / 2**30, max_model_len=300)
    engine = LLMEngine(tiny, src.model, src.tokenizer, src.eos_token_ids)
    assert engine.pool.num_blocks == 22  # one block of the 23 is the padding rows' scratch block
    assert engine.kv_cache.shape[0] == 23
    prompts = [ids[i : i + 100] for i in (0, 10, 20, 30)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    engine.pool.check_integrity()
    assert engine.pool.num_free_blocks == 22
    assert engine.num_preemptions_total > 0
    llm_fp32.engine.pool.reset_prefix_cache()
    assert [outs[str(i)] for i in range(4)] == _tokens(llm_fp32, prompts)


def test_stop_strings_and_stop_tokens(llm_fp32):
    prompt = "1, 2, 3, 4, 5,"
    free = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert " 8" in free.text
    stopped = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[" 8"]))[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 8"
    assert stopped.text == free.text[: free.text.index(" 8")]
    first = free.token_ids[2]
    by_id = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first]))
    assert by_id[0].outputs[0].token_ids == free.token_ids[:3]
    assert by_id[0].outputs[0].stop_reason == first


def test_seeded_sampling_is_reproducible_and_varies(llm_fp32):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    a = _tokens(llm_fp32, ["Tell me a story"], p)
    b = _tokens(llm_fp32, ["Tell me a story"], p)
    assert a == b
    others = {
        tuple(
            _tokens(
                llm_fp32,
                ["Tell me a story"],
                SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True),
            )[0]
        )
        for s in range(4)
    }
    assert len(others) > 1
    n2 = llm_fp32.generate(["Tell me a story"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8))[0]
    assert [c.index for c in n2.outputs] == [0, 1]


def test_top_k_one_is_greedy_and_logprobs(llm_fp32):
    greedy = llm_fp32.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    )
    k1 = llm_fp32.generate(
        ["The quick brown fox"], SamplingParams(temperature=0.8, top_k=1, max_tokens=8, seed=1)
    )
    assert greedy[0].outputs[0].token_ids == k1[0].outputs[0].token_ids
    lps = greedy[0].outputs[0].logprobs
    assert len(lps) == 8 and all(lp <= 0.0 for lp in lps)
    assert greedy[0].outputs[0].cumulative_logprob == pytest.approx(sum(lps))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_leave_the_engine_clean(llm_fp32):
    engine = llm_fp32.engine
    free = engine.pool.num_free_blocks
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm_fp32.generate([""], GREEDY)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm_fp32.generate([[]], GREEDY)
    too_long = [100] * engine.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm_fp32.generate([too_long], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm_fp32.generate([[5, 10**6]], GREEDY)
    # A bad prompt in a batch rejects the batch before any work is queued.
    with pytest.raises(ValueError):
        llm_fp32.generate(["fine", ""], GREEDY)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == free
    engine.pool.check_integrity()


def test_kv_cache_stays_within_its_budget(llm_fp32):
    engine = llm_fp32.engine
    budget = engine.config.kv_cache_gib * 2**30
    used = engine.kv_cache.numel() * engine.kv_cache.element_size()
    assert used <= budget
    # And the budget is used, not ignored: less than one block is left over.
    assert budget - used < engine.kv_cache[0].numel() * engine.kv_cache.element_size()


def test_cache_budget_too_small_for_one_context_is_refused(llm_fp32):
    from dataclasses import replace

    from baton.common.engine.llm_engine import LLMEngine

    src = llm_fp32.engine
    with pytest.raises(ValueError, match="kv_cache_gib"):
        LLMEngine(replace(src.config, kv_cache_gib=0.001), src.model, src.tokenizer, src.eos_token_ids)


def test_warm_up_leaves_no_trace(llm_fp32, ids):
    engine = llm_fp32.engine
    before = _tokens(llm_fp32, [ids])
    engine.pool.reset_prefix_cache()
    engine.pool.take_events()
    counters = {name: getattr(engine, name) for name in engine._COUNTERS}
    queries, hits = engine.kv.prefix_cache_queries, engine.kv.prefix_cache_hits
    default_rng = engine._default_generator.get_state()
    engine.warm_up()
    assert not engine.has_unfinished_requests()
    # Its sampled request (top-p, top-k, logprobs) drew from its own seed, not the engine's: the
    # unseeded requests after it sample what they would have without it.
    assert torch.equal(engine._default_generator.get_state(), default_rng)
    assert not engine._generators
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.pool._cached  # nothing of the warm-up can be hit by a request
    events = engine.pool.take_events()
    assert not events.stored and not events.removed  # nothing to publish to the prefix index
    assert {name: getattr(engine, name) for name in engine._COUNTERS} == counters
    assert (engine.kv.prefix_cache_queries, engine.kv.prefix_cache_hits) == (queries, hits)
    engine.pool.check_integrity()
    assert _tokens(llm_fp32, [ids]) == before


def test_padding_rows_touch_only_the_scratch_block(llm_fp32, ids):
    """A 70-token step runs as 80 rows: the 10 padding rows store their K/V in the scratch block
    (the one block the pool never hands out), no request's block changes, and the tokens are
    those of an unpadded run (a 64-token prompt needs no padding)."""
    import torch

    from baton.common.engine.step_shapes import padded_num_tokens

    assert padded_num_tokens(70) == 80 and padded_num_tokens(64) == 64
    engine = llm_fp32.engine
    engine.pool.reset_prefix_cache()
    scratch = engine.runner.scratch_block
    assert scratch == engine.pool.num_blocks == engine.kv_cache.shape[0] - 1
    engine.kv_cache.zero_()
    out = llm_fp32.generate([ids[:70]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    written = [b for b in range(engine.kv_cache.shape[0]) if engine.kv_cache[b].abs().sum() > 0]
    assert scratch in written
    assert len(written) == 1 + -(-70 // engine.config.block_size)  # the prompt's 5 blocks, and scratch
    # Each padding row is position 0 of token 0 stored at offset 0: nothing past it in the block.
    assert torch.count_nonzero(engine.kv_cache[scratch][:, :, :, 1:]) == 0
    assert out.outputs[0].token_ids == _tokens(llm_fp32, [ids[:70]], GREEDY)[0][:1]


def test_incremental_text_is_always_a_prefix_of_the_whole_decode(llm_fp32):
    """Output text grows token by token (never re-decoding the whole output); at every step it is
    a prefix of what decoding the whole output gives, also when a character's UTF-8 bytes are
    split over several tokens, and the finished output is exactly the whole decode."""
    from baton.common.engine.output_processor import IncrementalText

    tok = llm_fp32.get_tokenizer()
    text = "Grüße aus Köln 🚀🎉 — 東京タワー, naïve café! <|im_end|> done"
    ids = tok.encode(text, add_special_tokens=False)
    backend = tok.backend_tokenizer
    for skip in (True, False):
        inc = IncrementalText(skip)
        whole = tok.decode(ids, skip_special_tokens=skip)
        seen = ""
        for n in range(1, len(ids) + 1):
            got = inc.extend(backend, ids[:n])
            assert whole.startswith(got) and got.startswith(seen), (n, got)
            assert "\ufffd" not in got  # a split character waits until it is complete
            seen = got
        assert seen == whole


def test_streamed_outputs_end_with_the_whole_decode(llm_fp32, ids):
    engine = llm_fp32.engine
    engine.add_request("inc", ids[:40], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step(include_unfinished=True):
            texts.append(out.outputs[0].text)
            final = out
    assert final.finished and final.outputs[0].text == engine.tokenizer.decode(
        final.outputs[0].token_ids, skip_special_tokens=True
    )
    assert all(final.outputs[0].text.startswith(t) for t in texts)
    assert "inc" not in engine.output_processor._texts  # forgotten with the request
