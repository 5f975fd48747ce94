"""Tensor parallelism over NCCL: TP=2 on two CUDA devices gives one process's greedy tokens and
logprobs (the same identity test as tests/model/test_tensor_parallel.py, which runs gloo on CPU).
NCCL cannot put two ranks on one device, so this needs two GPUs; it is skipped otherwise."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import LLM
from tests.model.test_tensor_parallel import GREEDY, _assert_same_top, _tokens, _top, _wait_gone, _write_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one NCCL rank per device)"
    ),
]

ON_GPU = dict(dtype="float32", kv_cache_gib=0.05, max_model_len=256, device="cuda")


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_tp2_nccl_matches_one_process(tmp_path, model):
    path = str(_write_tiny(tmp_path / "tiny")) if model == "tiny" else None
    ref = LLM(path, **ON_GPU)
    want_tokens, want_top = _tokens(ref, GREEDY), _top(ref)
    del ref
    llm = LLM(path, tensor_parallel_size=2, **ON_GPU)
    pids = [p.pid for p in llm.engine.model.workers]
    try:
        assert llm.engine.model.group.pg.name() == "nccl"
        assert _tokens(llm, GREEDY) == want_tokens
        _assert_same_top(_top(llm), want_top)
    finally:
        llm.engine.model.close()
    assert _wait_gone(pids, 10) == []
