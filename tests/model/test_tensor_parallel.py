"""Tensor parallelism (gloo, ranks as processes): TP=2 and TP=3 give one process's greedy tokens
and logits, for SmolLM2 (9 query / 3 KV heads: split 6+3 at TP=2) and for a tiny random Llama whose
heads divide evenly; a killed rank fails the engine with an error naming it; no rank outlives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from baton.common.engine.llm_engine import EngineStepError
from baton.common.engine.sampling_params import SamplingParams
from baton.common.llm import LLM
from baton.common.model.config import LlamaConfig
from baton.common.model.tensor_parallel import head_split, plan_shard
from baton.common.parallel.ranks import RankFailedError

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],
    [28, 1078, 3121, 30, 3028, 7, 80, 4064, 216],
    [3360, 2115, 253, 655],
]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
WITH_LOGPROBS = SamplingParams(temperature=0, max_tokens=4, logprobs=5)
SMALL = dict(dtype="float32", kv_cache_gib=0.05, max_model_len=256)


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to exit."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _top(llm: LLM) -> list:
    outs = llm.generate(PROMPTS, WITH_LOGPROBS)
    return [[(t.token_ids, t.logprobs) for t in o.outputs[0].top_logprobs] for o in outs]


def _assert_same_top(got, want, atol: float = 1e-4) -> None:
    for g_req, w_req in zip(got, want, strict=True):
        for (g_ids, g_lp), (w_ids, w_lp) in zip(g_req, w_req, strict=True):
            assert g_ids == w_ids
            assert torch.allclose(torch.tensor(g_lp), torch.tensor(w_lp), atol=atol, rtol=0)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"tp{n}")
def smollm2_tp(request):
    llm = LLM(tensor_parallel_size=request.param, **SMALL)
    pids = [p.pid for p in llm.engine.model.workers]
    yield llm
    llm.engine.model.close()
    assert _wait_gone(pids, 10) == []


def test_head_split_smollm2_shapes():
    assert head_split(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert head_split(9, 3, 3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    # More ranks than KV heads: each KV head replicated, its query heads shared (vLLM's case).
    assert head_split(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    with pytest.raises(ValueError, match="cannot split"):
        head_split(9, 3, 4)
    cfg = LlamaConfig(49152, 576, 1536, 30, 9, 3, 64)
    assert [plan_shard(cfg, r, 3).vocab for r in range(3)] == [(0, 16384), (16384, 32768), (32768, 49152)]


def test_smollm2_greedy_tokens_match_one_process(smollm2_tp, llm_fp32):
    assert _tokens(smollm2_tp, GREEDY) == _tokens(llm_fp32, GREEDY)


def test_smollm2_logprobs_match_one_process(smollm2_tp, llm_fp32):
    _assert_same_top(_top(smollm2_tp), _top(llm_fp32))


def test_smollm2_lm_head_logits_match(smollm2_tp, llm_fp32):
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    want = llm_fp32.engine.model.compute_logits(hidden)
    got = smollm2_tp.engine.model.compute_logits(hidden)
    assert got.shape == want.shape == (3, 49152)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert smollm2_tp.engine.model.greedy_tokens(hidden).tolist() == want.argmax(-1).tolist()


def test_smollm2_kv_cache_holds_only_this_ranks_heads(smollm2_tp):
    want = head_split(9, 3, len(smollm2_tp.engine.model.workers) + 1)[0][1]
    assert smollm2_tp.engine.kv_cache.shape[3] == want[1] - want[0]


# -- a tiny random Llama whose heads divide evenly by 2 and by 3 ----------------------------------
def _write_tiny(path: Path) -> Path:
    """12 query heads, 6 KV heads of 16, 2 layers, untied LM head, SmolLM2's tokenizer."""
    from safetensors.torch import save_file

    from baton.common.model.source import ModelSource, load_tokenizer

    vocab, hidden, heads, kv, inter, d = 49152, 192, 12, 6, 384, 16
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (2.0 / shape[-1] ** 0.5)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    state["lm_head.weight"] = w(vocab, hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden) + 0.1 * torch.randn(hidden, generator=gen),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(heads * d, hidden),
            p + "self_attn.k_proj.weight": w(kv * d, hidden),
            p + "self_attn.v_proj.weight": w(kv * d, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * d),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    cfg = LlamaConfig(
        vocab, hidden, inter, 2, heads, kv, d, max_position_embeddings=512, tie_word_embeddings=False
    )
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    load_tokenizer(ModelSource.resolve(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(_write_tiny(tmp_path_factory.mktemp("tiny_tp")))


@pytest.fixture(scope="module")
def tiny_reference(tiny_path):
    llm = LLM(tiny_path, **SMALL)
    return _tokens(llm, GREEDY), _top(llm)


@pytest.mark.parametrize("size", [2, 3])
def test_tiny_llama_matches_one_process(tiny_path, tiny_reference, size):
    llm = LLM(tiny_path, tensor_parallel_size=size, **SMALL)
    pids = [p.pid for p in llm.engine.model.workers]
    try:
        assert llm.engine.kv_cache.shape[3] == 6 // size
        assert _tokens(llm, GREEDY) == tiny_reference[0]
        _assert_same_top(_top(llm), tiny_reference[1])
    finally:
        llm.engine.model.close()
    assert _wait_gone(pids, 10) == []


def test_killed_rank_fails_the_engine_naming_it(tiny_path):
    llm = LLM(tiny_path, tensor_parallel_size=2, **SMALL)
    worker = llm.engine.model.workers[0]
    try:
        worker.kill()
        worker.wait(10)
        start = time.monotonic()
        with pytest.raises(EngineStepError, match=r"rank 1 \(pid \d+, exit code -9\) exited"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 30
        with pytest.raises(RankFailedError, match="rank 1"):
            llm.engine.model.greedy_tokens(torch.zeros(1, 192))
    finally:
        llm.engine.model.close()


_ORPHAN_SCRIPT = """
import os, sys
from baton.common.llm import LLM
llm = LLM(sys.argv[1], dtype="float32", kv_cache_gib=0.05, max_model_len=256, tensor_parallel_size=2)
print(" ".join(str(p.pid) for p in llm.engine.model.workers), flush=True)
os.kill(os.getpid(), 9)  # rank 0 dies without closing anything
"""


def test_ranks_exit_when_rank_0_dies(tiny_path):
    proc = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, tiny_path], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    left = _wait_gone(pids, 20)
    for pid in left:  # do not leave them behind even when the test fails
        os.kill(pid, 9)
    assert left == [], "ranks outlived rank 0"


def test_cli_flag_reaches_the_engine_and_kv_moving_workers_refuse_nccl(capsys):
    from baton.cli import main as cli
    from baton.common.engine import config_flags

    a = cli.build_parser().parse_args(["generate", "--prompt", "x", "-tp", "2"])
    assert config_flags.engine_kwargs(a)["tensor_parallel_size"] == 2
    flags = config_flags.engine_flags(a)  # what baton up passes on to its workers
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    # Re-sharded transfers run over ucx (tests/e2e/test_disaggregated_tp.py); nccl is refused.
    assert cli.main(["prefill", "--tensor-parallel-size", "2", "--kv-transport", "nccl"]) == 2
    assert "ucx only" in capsys.readouterr().err
    assert cli.main(["up", "--decode-tp", "2", "--kv-transport", "nccl"]) == 2
    assert "ucx only" in capsys.readouterr().err
