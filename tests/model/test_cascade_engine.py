"""Cascade attention in the engine, on the real SmolLM2 weights: requests that hit one cached
prompt prefix decode with the cascade kernel, and give the same greedy tokens as with it off."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from baton.common.engine.cascade_plan import CascadeConfig, CascadeCostModel
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.llm import LLM, SamplingParams

from .helpers import PLAIN_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Every group pays: the engine's path is under test here, not the cost model's choice.
ALWAYS = CascadeConfig(
    min_shared_blocks=4,
    cost=CascadeCostModel(shared_per_query=0.0, shared_per_token=0.0, per_group=0.0, per_merged_row=0.0),
)


def _llm_like(src: LLM, **changes) -> LLM:
    """Another engine over ``src``'s loaded weights (no second load)."""
    cfg = replace(src.config, **changes)
    llm = LLM.__new__(LLM)
    llm.config = cfg
    llm.engine = LLMEngine(cfg, src.engine.model, src.engine.tokenizer, src.engine.eos_token_ids)
    llm._ids = itertools.count()
    return llm


@pytest.fixture(scope="module")
def prompts(llm_fp32) -> list[list[int]]:
    """Six prompts of one 96-token prefix (6 blocks) and their own 5 to 30 tokens."""
    tok = llm_fp32.get_tokenizer()
    prefix = tok.encode(" ".join(PLAIN_PROMPTS) * 4, add_special_tokens=False)[:96]
    tails = [tok.encode(f" Question {i}: " + PLAIN_PROMPTS[i % len(PLAIN_PROMPTS)]) for i in range(6)]
    return [prefix + t[: 5 + 5 * i] for i, t in enumerate(tails)]


def _decode_shared(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Cache the prefix with a first request, then run the rest at once: they hit its blocks."""
    llm.engine.pool.reset_prefix_cache()
    first = llm.generate([prompts[0]], GREEDY)[0].outputs[0].token_ids
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], GREEDY)]
    return [first, *rest]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_on_and_off_give_the_same_greedy_tokens(llm_fp32, prompts, dtype):
    if dtype == "float32":
        src = llm_fp32
    else:
        src = LLM(dtype="bfloat16", kv_cache_gib=0.25)
    on = _llm_like(src, cascade="auto")
    if dtype == "float32":
        # Two rows sharing 96 tokens are too few to pay for a shared pass: the calibrated model
        # keeps the plain kernel.
        _decode_shared(on, prompts[:3])
        assert on.engine.runner.num_cascade_steps == 0
    on.engine.runner.cascade = ALWAYS
    off = _llm_like(src, cascade="off")
    assert off.engine.runner.cascade is None
    with_cascade = _decode_shared(on, prompts)
    runner = on.engine.runner
    # Five requests hit the prefix at once: each of their decode steps is one group of five.
    assert runner.num_cascade_steps >= GREEDY.max_tokens - 1
    assert runner.num_cascade_queries == 5 * runner.num_cascade_steps
    assert runner.num_cascade_groups == runner.num_cascade_steps
    without = _decode_shared(off, prompts)
    assert off.engine.runner.num_cascade_steps == 0
    if dtype == "float32":
        assert with_cascade == without
    else:  # bf16 rounds the shared pass's probabilities differently: close, not identical
        same = sum(a == b for x, y in zip(with_cascade, without) for a, b in zip(x, y))
        assert same >= 0.9 * sum(map(len, without)), (with_cascade, without)
    on.engine.pool.check_integrity()


def test_config_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="cascade must be one of"):
        EngineConfig(cascade="on")
    with pytest.raises(ValueError):
        EngineConfig(cascade_min_shared_blocks=0)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_is_never_planned(llm_fp32, kv_cache_dtype):
    # The cascade kernels read floating-point K/V: a quantized cache keeps the plain kernel,
    # which dequantizes (the cost model is not even asked).
    from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache

    model = llm_fp32.engine.model
    tables, lens = [tuple(range(8)) + (8 + i,) for i in range(4)], [130] * 4
    for dtype, planned in ((kv_cache_dtype, False), ("auto", True)):
        cache = allocate_kv_cache(model, 16, 16, llm_fp32.engine.dtype, "cpu", kv_cache_dtype=dtype)
        runner = ModelRunner(model, cache, 16, scratch_block=15, cascade=ALWAYS)
        assert (runner._cascade_groups(tables, lens) is not None) == planned, dtype
