"""The bookkeeping of make gpu-check's CUDA-graph check, on the CPU: a batch decoded step by step
through the static buffers a graph would be captured over (``DecodeGraph(capture=False)``) gives
the tokens of the eager steps (``eager_decode``, the engine's runner) and of the engine itself, in
fp32 and bf16. On a GPU the same code captures and replays (tests/gpu/test_engine_single_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from baton.bench import gpu_check_model as checks
from baton.bench.gpu_check_graph import DecodeGraph, eager_decode, prefill_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("seeded")
    assert checks.write_seeded_model(path, num_layers=3)["context_sensitivity"] >= 0.5
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_buffer_decode_gives_the_eager_and_engine_tokens(model_dir, dtype):
    from baton.common.engine.llm_engine import parse_dtype
    from baton.common.model.loader import load_model
    from baton.common.model.source import ModelSource

    torch_dtype, steps = parse_dtype(dtype), 12
    model = load_model(ModelSource.resolve(model_dir), torch_dtype, "cpu")
    prompts = checks.make_prompts([9, 16, 31, 3, 40], seed=1)
    with torch.inference_mode():
        state = prefill_batch(model, prompts, torch_dtype, max_len=40 + steps + 1)
        cache0 = state.cache.clone()
        eager_hidden: list[torch.Tensor] = []
        eager = eager_decode(model, state, steps, eager_hidden)
        state.cache.copy_(cache0)
        static_hidden: list[torch.Tensor] = []
        static = DecodeGraph(model, state, capture=False).decode(steps, static_hidden)
    assert static == eager
    assert all(torch.equal(a, b) for a, b in zip(eager_hidden, static_hidden, strict=True))
    engine = checks.engine_tokens(model_dir, prompts, steps + 1, dtype, "cpu")
    assert [[first] + rest for first, rest in zip(state.tokens, eager)] == engine
    assert len({tuple(t) for t in engine}) == len(prompts)  # the rows really differ
