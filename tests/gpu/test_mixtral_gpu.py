"""Mixtral over NCCL: TP=2 with every expert sliced, and TP=2 with expert parallelism (whole experts
a rank), on two CUDA devices, give transformers' greedy tokens and top-5 log-probabilities on the
same random weights (the identity tests of tests/model/test_mixtral.py, which run gloo on CPU).
NCCL cannot put two ranks on one device, so this needs two GPUs; it is skipped otherwise."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import LLM
from tests.model.test_mixtral import GREEDY, MAX_TOKENS, PROMPTS, wait_gone
from tests.model.tiny_mixtral import assert_matches_hf, hf_greedy, write_tiny_mixtral

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one NCCL rank per device)"
    ),
]

ON_GPU = dict(dtype="float32", kv_cache_gib=0.02, max_model_len=256, device="cuda")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(write_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral")))


@pytest.fixture(scope="module")
def reference(tiny_path):
    return hf_greedy(tiny_path, PROMPTS, MAX_TOKENS)  # transformers, on the CPU


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2-sliced", "tp2-ep"])
def test_mixtral_tp2_nccl_matches_transformers(tiny_path, reference, expert_parallel):
    llm = LLM(tiny_path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ON_GPU)
    pids = [p.pid for p in llm.engine.model.workers]
    try:
        assert_matches_hf(llm.generate(PROMPTS, GREEDY), reference)
    finally:
        llm.engine.model.close()
    assert wait_gone(pids, 10) == []
