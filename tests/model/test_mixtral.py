"""Baton's Mixtral against transformers' ``MixtralForCausalLM`` on the same random weights (fp32,
greedy tokens identical, top-5 log-probabilities within 1e-4): in one process, at TP=2 with every
expert sliced (vLLM's default), and at TP=2 with expert parallelism (two whole experts a rank).
The MoE block's pieces alone: routing as transformers routes, expert shares that add up to the
whole block, and the all-to-all dispatch of expert parallelism over a real gloo pair."""

from __future__ import annotations

import copy
import glob
import os
import threading

import pytest
import torch

from baton.common.engine.sampling_params import SamplingParams
from baton.common.llm import LLM
from baton.common.model.config import LlamaConfig
from baton.common.model.expert_parallel import ExpertDispatch, expert_split, keep_experts
from baton.common.model.loader import read_config
from baton.common.model.mixtral import MixtralConfig, MixtralForCausalLM, assemble_experts
from baton.common.model.moe import SparseMoE
from baton.common.model.rank_group import GroupConfig, RankGroup
from baton.common.model.source import ModelSource
from baton.common.net import free_port
from tests.model.tiny_mixtral import HIDDEN as TINY_HIDDEN
from tests.model.tiny_mixtral import NUM_EXPERTS, assert_matches_hf, hf_greedy, write_tiny_mixtral

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],
    [28, 1078, 3121, 30, 3028, 7, 80, 4064, 216],
    [3360, 2115, 253, 655],
]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
SMALL = dict(dtype="float32", kv_cache_gib=0.02, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(write_tiny_mixtral(tmp_path_factory.mktemp("tiny_mixtral")))


@pytest.fixture(scope="module")
def reference(tiny_path):
    return hf_greedy(tiny_path, PROMPTS, MAX_TOKENS)


# -- the model, one process ---------------------------------------------------------------------
def test_config_json_chooses_mixtral(tiny_path):
    cfg = read_config(ModelSource.resolve(tiny_path))
    assert isinstance(cfg, MixtralConfig)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (NUM_EXPERTS, 2, 96)


def test_sliding_window_caps_the_context():
    hf = {
        "model_type": "mixtral",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
    }
    assert MixtralConfig.from_hf(hf).max_position_embeddings == 4096
    assert MixtralConfig.from_hf({**hf, "sliding_window": 1024}).max_position_embeddings == 1024


def test_one_process_matches_transformers(tiny_path, reference):
    llm = LLM(tiny_path, **SMALL)
    assert isinstance(llm.engine.model, MixtralForCausalLM)
    assert_matches_hf(llm.generate(PROMPTS, GREEDY), reference)


def test_both_checkpoint_layouts_assemble_alike(tiny_path):
    """save_pretrained's original names (w1/w2/w3 per expert) and transformers 5's fused tensors."""
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM as HFMixtral

    (file,) = glob.glob(os.path.join(tiny_path, "*.safetensors"))
    disk = {k.removeprefix("model."): v for k, v in load_file(file).items()}
    assert any(".block_sparse_moe.experts.0.w1." in k for k in disk)
    hf = HFMixtral.from_pretrained(tiny_path, dtype=torch.float32)
    fused = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in fused)
    a, b = assemble_experts(disk), assemble_experts(fused)
    moe_keys = {k for k in a if ".mlp." in k}
    assert len(moe_keys) == 2 * (1 + 2 * NUM_EXPERTS)  # per layer: the router, each expert's two
    assert moe_keys == {k for k in b if ".mlp." in k}
    for k in moe_keys:
        assert torch.equal(a[k], b[k]), k


# -- the MoE block's pieces -----------------------------------------------------------------------
HIDDEN = 32


def _moe(seed: int = 0) -> SparseMoE:
    cfg = LlamaConfig(100, HIDDEN, 48, 1, 2, 1, 16)
    moe = SparseMoE(cfg, num_experts=4, top_k=2)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[-1] ** 0.5))
    return moe.eval()


def test_router_matches_transformers():
    from transformers import MixtralConfig as HFConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    moe = _moe()
    theirs = MixtralTopKRouter(HFConfig(hidden_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2))
    theirs.weight.data.copy_(moe.gate.weight.data)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    _, want_w, want_ids = theirs(x)
    got_w, got_ids = moe.gate(x)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(got_w, want_w, atol=1e-7, rtol=0)
    assert torch.allclose(got_w.sum(-1), torch.ones(9))


def test_expert_split_and_shares_add_up():
    assert expert_split(8, 2) == [(0, 4), (4, 8)]
    assert expert_split(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="at least 3 experts"):
        expert_split(2, 3)
    moe = _moe()
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = moe.gate(x)
    shares = [keep_experts(copy.deepcopy(moe), run).partial(x, weights, ids) for run in expert_split(4, 2)]
    assert all(share.abs().sum() > 0 for share in shares)
    assert torch.allclose(shares[0] + shares[1], moe(x), atol=1e-6, rtol=0)


def _dispatch_on_two_ranks(moe: SparseMoE, batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Run ``ExpertDispatch`` on a gloo pair (two threads of this process, a real TCP rendezvous):
    rank r feeds ``batches[r]`` one by one; each rank's outputs."""
    port = free_port()
    outs: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = RankGroup(GroupConfig(r, 2, "127.0.0.1", port, "cpu", 30.0, name="ep-test")).start()
            block = ExpertDispatch(copy.deepcopy(moe), group)
            with torch.inference_mode():
                outs[r] = [block(x) for x in batches[r]]
            assert block.calls == len(batches[r])
            group.close()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank is still inside a collective after 60 s"
    if errors:
        raise errors[0]
    return outs


def test_all_to_all_dispatch_gives_the_whole_block_on_each_rank():
    """Uneven batches, one of them empty (a data-parallel rank's dummy step), then the reverse."""
    moe = _moe()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, HIDDEN, generator=gen), torch.randn(3, HIDDEN, generator=gen)
    empty = torch.empty(0, HIDDEN)
    outs = _dispatch_on_two_ranks(moe, [[a, empty], [empty, b]])
    with torch.inference_mode():
        assert torch.allclose(outs[0][0], moe(a), atol=1e-6, rtol=0)
        assert torch.allclose(outs[1][1], moe(b), atol=1e-6, rtol=0)
    assert outs[0][1].shape == outs[1][0].shape == (0, HIDDEN)


# -- tensor parallelism, with and without expert parallelism -------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after waiting up to ``timeout_s`` for them to exit."""
    import time

    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


@pytest.fixture(scope="module", params=[False, True], ids=["tp2-sliced", "tp2-ep"])
def tp2(request, tiny_path):
    llm = LLM(tiny_path, tensor_parallel_size=2, enable_expert_parallel=request.param, **SMALL)
    pids = [p.pid for p in llm.engine.model.workers]
    yield llm, request.param
    llm.engine.model.close()
    assert wait_gone(pids, 10) == []


@pytest.mark.slow
def test_tensor_parallel_matches_transformers(tp2, reference):
    llm, ep = tp2
    moe = llm.engine.model.model.layers[0].mlp.moe
    if ep:  # rank 0 holds experts 0 and 1 whole
        assert (moe.first_expert, len(moe.experts)) == (0, 2)
        assert moe.experts[0].down_proj.weight.shape == (TINY_HIDDEN, 96)
    else:  # every expert, half its columns
        assert (moe.first_expert, len(moe.experts)) == (0, NUM_EXPERTS)
        assert moe.experts[0].down_proj.weight.shape == (TINY_HIDDEN, 48)
    assert_matches_hf(llm.generate(PROMPTS, GREEDY), reference)
