"""Data parallelism (replicas as processes, gloo for the experts): dense replicas of a tiny Llama
give each request what one engine gives it (greedy and seeded sampling), with requests spread by
load; a tiny Mixtral's attention data-parallel beside expert-parallel MoE blocks matches
transformers token for token, with one replica idle (its dummy steps keep the collectives in
step); then a killed replica fails the engine with an error naming it; no replica outlives its test."""

from __future__ import annotations

import pytest
import torch

from baton.common.engine.llm_engine import EngineStepError
from baton.common.engine.sampling_params import SamplingParams
from baton.common.llm import LLM
from baton.common.parallel.data_parallel import ReplicaFailedError
from tests.e2e.tiny_llama import write_tiny_llama
from tests.model.test_mixtral import PROMPTS, wait_gone
from tests.model.tiny_mixtral import assert_matches_hf, hf_greedy, write_tiny_mixtral

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
SMALL = dict(dtype="float32", kv_cache_gib=0.02, max_model_len=256)


def _pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.workers]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny_dp"), hidden=128, layers=2, max_len=512))


@pytest.fixture(scope="module")
def dp2(llama_path):
    llm = LLM(llama_path, data_parallel_size=2, **SMALL)
    pids = _pids(llm)
    yield llm
    llm.engine.close()
    assert wait_gone(pids, 10) == []


@pytest.mark.slow
def test_dense_replicas_match_one_engine_per_request(dp2, llama_path):
    one = LLM(llama_path, **SMALL)
    for params in (GREEDY, SEEDED):
        before = list(dp2.engine.num_requests_per_replica)
        got, want = dp2.generate(PROMPTS, params), one.generate(PROMPTS, params)
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
        # Least work first: replica 0, replica 1, then replica 0 again (the shorter prompts).
        spread = [a - b for a, b in zip(dp2.engine.num_requests_per_replica, before)]
        assert spread == [2, 1]
    for g, w in zip(dp2.generate(PROMPTS, GREEDY), one.generate(PROMPTS, GREEDY), strict=True):
        for gs, ws in zip(g.outputs[0].top_logprobs, w.outputs[0].top_logprobs, strict=True):
            assert gs.token_ids == ws.token_ids
            assert torch.allclose(torch.tensor(gs.logprobs), torch.tensor(ws.logprobs), atol=1e-4, rtol=0)
    assert not dp2.engine.has_unfinished_requests()


@pytest.mark.slow
def test_attention_data_parallel_beside_expert_parallel_matches_transformers_and_fails_on_a_dead_replica(
    tmp_path,
):
    path = str(write_tiny_mixtral(tmp_path / "mixtral"))
    reference = hf_greedy(path, PROMPTS, 8)
    llm = LLM(path, data_parallel_size=2, enable_expert_parallel=True, **SMALL)
    pids = _pids(llm)
    try:
        assert llm.engine.lockstep
        moe = llm.engine.model.layers[0].mlp.moe  # replica 0 holds experts 0 and 1 of 4
        assert (moe.first_expert, len(moe.experts)) == (0, 2)
        # Replica 1 gets the second prompt only, done after 2 tokens: it then idles through six
        # steps of replica 0's, taking part in every MoE collective with an empty batch.
        short = SamplingParams(temperature=0, max_tokens=2, logprobs=5, ignore_eos=True)
        outs = llm.generate(PROMPTS, [GREEDY, short, GREEDY])
        assert llm.engine.num_requests_per_replica == [2, 1]
        assert_matches_hf(outs, reference, lengths=[8, 2, 8])
        # A killed replica fails the engine, naming it, at its next call (not at a collective's timeout).
        worker = llm.engine.workers[0]
        worker.kill()
        worker.wait(10)
        with pytest.raises(EngineStepError, match=r"replica 1 \(pid \d+, exit code -9\) exited"):
            llm.generate(PROMPTS[:1], GREEDY)
        with pytest.raises(ReplicaFailedError, match="replica 1"):
            llm.engine.step()
    finally:
        llm.engine.close()
    assert wait_gone(pids, 10) == []


def test_flags_reach_the_engine_and_workers_refuse_replicas(capsys):
    from baton.cli import main as cli
    from baton.common.engine import config_flags

    a = cli.build_parser().parse_args(["generate", "--prompt", "x", "-dp", "2", "--enable-expert-parallel"])
    kwargs = config_flags.engine_kwargs(a)
    assert (kwargs["data_parallel_size"], kwargs["enable_expert_parallel"]) == (2, True)
    assert "--enable-expert-parallel" in config_flags.engine_flags(a)
    assert cli.main(["decode", "--data-parallel-size", "2"]) == 2
    assert "offline only" in capsys.readouterr().err
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        LLM(data_parallel_size=0)
    with pytest.raises(ValueError, match="not supported yet"):  # refused before anything starts
        LLM(data_parallel_size=2, tensor_parallel_size=2)
