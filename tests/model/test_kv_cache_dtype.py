"""``kv_cache_dtype`` on the real SmolLM2 weights: a quantized cache holds ~2x the tokens of a bf16
one in the same budget, its blocks are reused by prefix caching, and greedy decoding mostly agrees
with the bf16 cache (bounds measured on these prompts; the perplexity bar is ``baton bench accuracy``'s)."""

from __future__ import annotations

import pytest
import torch

from baton.common.engine.config import EngineConfig
from baton.common.engine.model_runner import kv_cache_block_bytes, kv_cache_layout
from baton.common.llm import LLM, SamplingParams
from baton.kernels import kv_quant
from tests.model.helpers import PLAIN_PROMPTS

GIB = 0.25
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(kv_cache_dtype: str) -> LLM:
    # fp32 compute, as the session's llm_fp32 baseline: only the KV cache differs
    return LLM(dtype="float32", kv_cache_gib=GIB, max_model_len=2048, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def base_tokens(llm_fp32):
    return [o.outputs[0].token_ids for o in llm_fp32.generate(PLAIN_PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def int8_llm():
    return _llm("int8")


def _agreement(base: list[list[int]], other: list[list[int]]) -> float:
    """Share of positions where the tokens agree (after a divergence they mostly do not)."""
    pairs = [(a, b) for x, y in zip(base, other) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / len(pairs)


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, fp8 \(fp8_e4m3\), got 'int4'",
    ):
        EngineConfig(kv_cache_dtype="int4")


def test_vllms_fp8_name_is_e4m3():
    """``--kv-cache-dtype fp8`` (vLLM's name for its e4m3 cache) is fp8_e4m3 everywhere after the
    config: the workers' published settings and the hand-shake's layout compare one name."""
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert kv_quant.kv_format("fp8") is kv_quant.FORMATS["fp8_e4m3"]
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def test_a_quantized_cache_holds_about_twice_the_tokens(int8_llm):
    engine = int8_llm.engine
    assert engine.kv_cache.dtype == torch.int8
    cfg = engine.model.config
    # D codes + a 2-byte scale per (token, head) row, every layer, K and V
    int8_bytes = kv_cache_block_bytes(engine.model, 16, torch.bfloat16, "int8")
    bf16_bytes = kv_cache_block_bytes(engine.model, 16, torch.bfloat16)
    assert int8_bytes == cfg.num_layers * 2 * 3 * 16 * 66 and bf16_bytes == cfg.num_layers * 2 * 3 * 16 * 128
    assert engine.kv_cache[0].nbytes == int8_bytes
    assert engine.kv_cache.nbytes <= GIB * 2**30
    # the pool is sized from the real bytes per block: the budget's blocks, less the scratch block
    assert engine.pool.num_blocks == int(GIB * 2**30) // int8_bytes - 1
    bf16_blocks = int(GIB * 2**30) // bf16_bytes - 1
    assert 1.9 <= engine.pool.num_blocks / bf16_blocks <= 2.0  # 128 / 66 bytes per row at head_dim 64
    assert kv_cache_layout(engine.kv_cache) == "int8 30x2x3x16x66"


def test_int8_greedy_tokens_mostly_agree_with_the_unquantized_cache(base_tokens, int8_llm):
    tokens = [o.outputs[0].token_ids for o in int8_llm.generate(PLAIN_PROMPTS, GREEDY)]
    agreement = _agreement(base_tokens, tokens)
    print(f"int8 KV greedy agreement with fp32 KV: {agreement:.3f} over {len(PLAIN_PROMPTS)} prompts x 16")
    assert agreement >= 0.75


def test_an_fp8_cache_serves_and_mostly_agrees(base_tokens):
    llm = _llm("fp8")  # vLLM's name for e4m3
    assert llm.engine.config.kv_cache_dtype == "fp8_e4m3"
    assert kv_quant.format_of(llm.engine.kv_cache) is kv_quant.FORMATS["fp8_e4m3"]
    assert kv_cache_layout(llm.engine.kv_cache) == "float8_e4m3fn 30x2x3x16x66"
    tokens = [o.outputs[0].token_ids for o in llm.generate(PLAIN_PROMPTS[:4], GREEDY)]
    agreement = _agreement(base_tokens[:4], tokens)
    print(f"fp8_e4m3 KV greedy agreement with fp32 KV: {agreement:.3f} over 4 prompts x 16")
    assert agreement >= 0.5


def test_prefix_cache_hits_read_the_quantized_blocks(int8_llm):
    """A repeated prompt reuses the quantized blocks the first one wrote and decodes the same tokens:
    the codes of a block depend only on its own tokens (a scale per row), so reuse is exact."""
    prompt = " ".join(PLAIN_PROMPTS) * 3  # several full blocks
    first = int8_llm.generate([prompt], GREEDY)[0]
    second = int8_llm.generate([prompt], GREEDY)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens >= 16 * (len(first.prompt_token_ids) // 16 - 1), second.num_cached_tokens


def test_the_kv_step_bench_times_each_cache_against_the_first(int8_llm):
    from baton.bench import kv_step_measure
    from baton.bench.kv_step_config import KVStepConfig

    cfg = KVStepConfig(batch=2, context=40, repeats=1)
    runs = [kv_step_measure.measure(int8_llm.engine.model, cfg, d) for d in ("auto", "int8")]
    assert [r["kv_bytes_per_token"] for r in runs] == [30 * 2 * 3 * 64 * 4, 30 * 2 * 3 * 66]  # fp32, int8
    for r in runs:
        assert r["attention"]["best_ms"] > 0 and r["step"]["best_ms"] > r["attention"]["best_ms"]


def test_the_kv_cache_dtype_flag_reaches_every_command_and_baton_up_workers():
    from baton.cli.main import build_parser
    from baton.common.engine.config_flags import engine_flags, engine_kwargs

    parser = build_parser()
    for cmd in (
        ["generate", "--prompt", "hi"],
        ["bench", "offline"],
        ["bench", "latency"],
        ["prefill"],
        ["decode"],
    ):
        assert (
            engine_kwargs(parser.parse_args([*cmd, "--kv-cache-dtype", "fp8_e4m3"]))["kv_cache_dtype"]
            == "fp8_e4m3"
        )
        assert engine_kwargs(parser.parse_args(cmd))["kv_cache_dtype"] == "auto"
    flags = engine_flags(parser.parse_args(["up", "--kv-cache-dtype", "int8"]))
    assert flags[flags.index("--kv-cache-dtype") + 1] == "int8"
    assert engine_kwargs(parser.parse_args(["prefill", *flags]))["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--kv-cache-dtype", "int4"])
    for cmd in (["up"], ["decode"], ["bench", "accuracy"], ["bench", "transfer"]):  # vLLM's fp8
        assert parser.parse_args([*cmd, "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["bench", "kv-step", "--kv-cache-dtype", "auto", "fp8"]).kv_cache_dtype == [
        "auto",
        "fp8",
    ]
