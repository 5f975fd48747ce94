"""The engine on one CUDA device (every other CUDA engine test here needs two): token for token
against transformers on a seeded random model of SmolLM2-135M's shape (fp32; bf16 up to near-ties
of the fp32 reference), a batch against each prompt alone, chunked prefill against one shot, and
the decode step replayed from a CUDA graph against the eager step. Skipped without CUDA; the same
checks run in ``make gpu-check`` (bench/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from baton.bench import gpu_check_model as checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("seeded-smollm2")
    checks.write_seeded_model(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_one_gpu_matches_transformers(model_dir, dtype):
    figures = checks.check_engine_vs_transformers(model_dir, "cuda", dtype)
    assert "error" not in figures, figures
    if dtype == "float32":
        assert figures["tokens_matched"] == figures["tokens"], figures


def test_batch_and_chunked_prefill_give_each_prompt_its_tokens_alone(model_dir):
    from baton.common.llm import LLM, SamplingParams

    prompts = checks.make_prompts([5, 17, 33, 64, 200], seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", device="cuda", kv_cache_gib=0.25, max_model_len=512)
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    llm.engine.pool.reset_prefix_cache()
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert together == alone
    chunked = LLM(model_dir, dtype="float32", device="cuda", kv_cache_gib=0.25, max_model_len=512,
                  max_num_batched_tokens=48)  # fmt: skip
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy)] == alone
    assert all(len(t) == 16 for t in alone)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_replayed_from_a_cuda_graph_matches_eager(model_dir, dtype):
    figures = checks.check_cuda_graph_decode(model_dir, dtype)
    assert figures["identical"] and "error" not in figures, figures
