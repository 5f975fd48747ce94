"""CPU steps run every decoder layer in one C++ call (the extension's ``llama_layers``,
``LlamaForCausalLM._layers_in_one_call``): on the real SmolLM2 weights in bf16, the tokens and
logprobs are bit for bit the Python layers' (``BATON_ONE_CALL_LAYERS=0``) over decode steps, padded
steps, prompts prefilled in several chunks and steps that mix the two, with a bf16 and an int8 KV
cache; the steps it does not cover, and models it cannot run, keep the Python layers."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import LLM, SamplingParams
from baton.common.model.llama import LlamaForCausalLM
from baton.kernels import cpu_ops

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 5, 8, 13,",
    "A long time ago, in a small village by the mountains, there lived an old clockmaker who " * 12,
]
"""Lengths 6 to ~230 tokens: with a 128-token chunk the long one is prefilled in two steps, beside
the others' decodes; 4 decode rows run unpadded, and a batch of 70 rows is padded to 80."""

needs_bf16_gemm = pytest.mark.skipif(
    not cpu_ops.bf16_gemm_available(),
    reason="bf16 projections use Baton's packed GEMM only with AVX512-BF16 or AVX2",
)


def _runs(monkeypatch, llm: LLM, one_call: str, prompts: list[str]) -> tuple[list, list[tuple]]:
    """Greedy outputs (token ids and top-5 logprobs) with ``BATON_ONE_CALL_LAYERS=one_call``, and
    each step's (answer of ``_layers_in_one_call``, decode rows, padding rows, prefill chunks)."""
    steps: list[tuple] = []
    real = LlamaForCausalLM._layers_in_one_call

    def recorded(self, n, kv_cache, meta):
        answer = real(self, n, kv_cache, meta)
        steps.append(
            (answer, meta.num_decode_tokens, meta.num_padding_tokens, meta.prefill_context_lens.numel())
        )
        return answer

    monkeypatch.setenv("BATON_ONE_CALL_LAYERS", one_call)
    monkeypatch.setattr(LlamaForCausalLM, "_layers_in_one_call", recorded)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=5))
    monkeypatch.undo()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], steps


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@needs_bf16_gemm
def test_one_call_computes_bit_for_bit_what_the_python_layers_do(monkeypatch, kv_cache_dtype):
    # No prefix cache: the second run's prompts are computed again, as in the first.
    llm = LLM(
        dtype="bfloat16", kv_cache_gib=0.25, max_model_len=1024, kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False, max_num_batched_tokens=128,
    )  # fmt: skip
    assert llm.engine.runner.model.one_call_weights is not None
    prompts = PROMPTS + [f"Count to {i}:" for i in range(66)]
    for batch in (PROMPTS, prompts):
        python, off = _runs(monkeypatch, llm, "0", batch)
        fused, on = _runs(monkeypatch, llm, "1", batch)
        assert fused == python
        assert not any(answer for answer, *_ in off), "BATON_ONE_CALL_LAYERS=0 keeps the Python layers"
        ran = {(bool(nd), bool(pad), bool(chunks)) for answer, nd, pad, chunks in on if answer}
        skipped = [step for step in on if not step[0]]
        if kv_cache_dtype == "auto":
            assert not skipped, f"every step ran in one call: {skipped}"
        else:  # a quantized cache's prefill dequantizes blocks in Python
            assert all(chunks for _, _, _, chunks in skipped), skipped
        assert (True, False, False) in ran, f"decode-only steps: {on}"
        if batch is prompts:
            assert (True, True, False) in ran, f"a padded decode step: {on}"
        if kv_cache_dtype == "auto":
            assert (True, False, True) in ran, f"a step mixing decodes and a prefill chunk: {on}"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@needs_bf16_gemm
def test_on_two_threads_a_small_decode_step_reads_ahead_and_computes_the_same(monkeypatch, kv_cache_dtype):
    # On two threads a decode step whose attention runs on one (fewer than 2,048 key rows a step:
    # one prompt, then three) has the other thread read the next projections' weights meanwhile
    # (llama_layers.cpp's `overlap`); under make test's xdist workers torch runs one thread, which
    # never takes that path, so the test sets two.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(
            dtype="bfloat16", kv_cache_gib=0.25, max_model_len=1024, kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=False, max_num_batched_tokens=128,
        )  # fmt: skip
        for batch in (PROMPTS[:1], PROMPTS[:3]):
            python, _ = _runs(monkeypatch, llm, "0", batch)
            fused, on = _runs(monkeypatch, llm, "1", batch)
            assert fused == python
            decodes = [nd for answer, nd, pad, chunks in on if answer and nd and not chunks]
            assert decodes and max(decodes) == len(batch), f"decode-only steps in one call: {on}"
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_models_it_cannot_run_keep_the_python_layers(llm_fp32):
    """fp32 projections are not packed for bf16_gemm: no one-call weights, the Python layers."""
    assert llm_fp32.engine.runner.model.one_call_weights is None
    out = llm_fp32.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
