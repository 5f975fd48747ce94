"""Pipeline parallelism over NCCL: PP=2 on two CUDA devices, and TP=2 x PP=2 on four, give one
process's greedy tokens and logprobs (the identity tests of tests/model/test_pipeline_parallel.py,
which run gloo on CPU). NCCL cannot put two ranks on one device, so each case needs a GPU per rank
and is skipped otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton.common.llm import LLM
from tests.e2e.tiny_llama import write_tiny_llama
from tests.model.test_tensor_parallel import GREEDY, _assert_same_top, _tokens, _top, _wait_gone

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ON_GPU = dict(dtype="float32", kv_cache_gib=0.05, max_model_len=256, device="cuda")


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_pipeline_nccl_matches_one_process(tmp_path, model, tp, pp):
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} CUDA GPUs (one NCCL rank per device)")
    path = str(write_tiny_llama(Path(tmp_path / "tiny"), layers=4)) if model == "tiny" else None
    ref = LLM(path, **ON_GPU)
    want_tokens, want_top = _tokens(ref, GREEDY), _top(ref)
    del ref
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ON_GPU)
    pids = [p.pid for p in llm.engine.model.workers]
    try:
        assert llm.engine.model.stage.pp_group.pg.name() == "nccl"
        assert _tokens(llm, GREEDY) == want_tokens
        _assert_same_top(_top(llm), want_top)
    finally:
        llm.engine.model.close()
    assert _wait_gone(pids, 10) == []
