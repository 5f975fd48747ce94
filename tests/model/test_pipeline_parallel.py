"""Pipeline parallelism (gloo, ranks as processes): PP=2 and TP=2 x PP=2 give one process's greedy
tokens and logprobs, for SmolLM2 (30 layers: 15 + 15) and for tiny random Llamas of 4 and 3 layers
(3: split 2 + 1); a step cut into micro-batches gives the whole batch's results while the stages'
busy intervals overlap; a killed stage rank fails the engine with an error naming it; no rank
outlives its engine; workers that move KV take it over ucx only."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from baton.common.engine.llm_engine import EngineStepError
from baton.common.engine.sampling_params import SamplingParams
from baton.common.llm import LLM
from baton.common.model.attention import AttentionMetadata, FreshRun, PrefillSegment
from baton.common.model.pipeline_parallel import (
    request_starts,
    split_micro_batches,
    split_points,
    stage_layers,
)
from baton.common.parallel.ranks import RankFailedError
from baton.kernels.cascade_groups import CascadeGroups
from tests.e2e.tiny_llama import write_tiny_llama
from tests.model.test_tensor_parallel import (
    GREEDY,
    PROMPTS,
    SMALL,
    _assert_same_top,
    _tokens,
    _top,
    _wait_gone,
)

pytestmark = pytest.mark.slow


def _close(llm: LLM) -> None:
    pids = [p.pid for p in llm.engine.model.workers]
    llm.engine.model.close()
    assert _wait_gone(pids, 15) == [], "ranks outlived the engine"


# -- the split, pure ----------------------------------------------------------------------------
def test_stage_layers_split_evenly_earlier_stages_longer():
    assert stage_layers(30, 2) == [(0, 15), (15, 30)]
    assert stage_layers(3, 2) == [(0, 2), (2, 3)]
    assert stage_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ValueError, match="between 1 and the model's 2 layers"):
        stage_layers(2, 3)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _step_meta() -> AttentionMetadata:
    """3 decode rows (0-2; rows 0 and 2 a cascade group), two fresh 3-token chunks (3-5, 6-8),
    a 2-token chunk with cached context (9-10) and 1 padding row (11)."""
    return AttentionMetadata(
        slot_blocks=torch.arange(12),
        slot_offsets=torch.arange(12) + 100,
        num_decode_tokens=3,
        decode_block_tables=_i32([[1, 2], [3, 0], [1, 4]]),
        decode_context_lens=_i32([20, 5, 21]),
        fresh_runs=(FreshRun(3, 2, 3),),
        context_prefills=(PrefillSegment(9, 11, 18, (7, 8)),),
        prefill_block_tables=_i32([[5, 0], [6, 0], [7, 8]]),
        prefill_context_lens=_i32([3, 3, 18]),
        prefill_query_start_loc=_i32([3, 6, 9, 11]),
        num_padding_tokens=1,
        cascade=CascadeGroups.build([([0, 2], 1)]),
    )


def test_micro_batches_keep_requests_whole_and_renumber_their_metadata():
    meta = _step_meta()
    assert request_starts(meta) == [0, 1, 2, 3, 6, 9, 11]
    assert split_points([0, 1, 2, 3, 6, 9, 11], 2) == [0, 6, 11]  # 5.5 rows each: 6 is nearest
    assert split_points([0, 11], 3) == [0, 11]  # one request cannot be cut
    a, b = split_micro_batches(torch.arange(12) + 50, torch.arange(12), meta, 2)
    assert (a.start, a.input_ids.tolist(), b.start, b.input_ids.tolist()) == (
        0, list(range(50, 56)), 6, list(range(56, 62)),
    )  # fmt: skip
    ma, mb = a.meta, b.meta
    assert ma.slot_blocks.tolist() == [0, 1, 2, 3, 4, 5] and mb.slot_blocks.tolist() == [6, 7, 8, 9, 10, 11]
    assert ma.num_decode_tokens == 3 and ma.decode_context_lens.tolist() == [20, 5, 21]
    assert ma.cascade is not None and ma.cascade.as_lists() == [([0, 2], 1)]
    assert ma.fresh_runs == (FreshRun(3, 1, 3),) and ma.context_prefills == ()
    assert ma.prefill_context_lens.tolist() == [3] and ma.prefill_query_start_loc.tolist() == [3, 6]
    assert ma.num_padding_tokens == 0
    assert mb.num_decode_tokens == 0 and mb.decode_block_tables.shape[0] == 0 and mb.cascade is None
    assert mb.fresh_runs == (FreshRun(0, 1, 3),)
    assert mb.context_prefills == (PrefillSegment(3, 5, 18, (7, 8)),)
    assert mb.prefill_block_tables.tolist() == [[6, 0], [7, 8]]
    assert mb.prefill_query_start_loc.tolist() == [0, 3, 5] and mb.num_padding_tokens == 1


def test_a_cascade_group_cut_in_two_attends_plainly():
    three = split_micro_batches(torch.arange(12), torch.arange(12), _step_meta(), 4)
    assert [m.start for m in three] == [0, 3, 6, 9]
    assert three[0].meta.num_decode_tokens == 3 and three[0].meta.cascade is not None
    decode_only = split_micro_batches(torch.arange(12), torch.arange(12), _step_meta(), 12)
    assert decode_only[0].meta.cascade is None  # row 0 alone: its group has one member left


# -- tiny random Llamas ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_pp")
    return {
        n: str(write_tiny_llama(Path(root / n), layers=layers)) for n, layers in (("even", 4), ("odd", 3))
    }


@pytest.fixture(scope="module")
def tiny_reference(tiny_paths):
    out = {}
    for name, path in tiny_paths.items():
        llm = LLM(path, **SMALL)
        out[name] = _tokens(llm, GREEDY), _top(llm)
    return out


@pytest.fixture(scope="module")
def tiny_tp2_pp2(tiny_paths):
    llm = LLM(tiny_paths["even"], tensor_parallel_size=2, pipeline_parallel_size=2, **SMALL)
    yield llm
    _close(llm)


def test_tiny_tp2_pp2_matches_one_process(tiny_tp2_pp2, tiny_reference):
    cache = tiny_tp2_pp2.engine.kv_cache  # rank 0: stage 0's 2 layers, 1 of the 2 KV heads
    assert (cache.shape[1], cache.shape[3]) == (2, 1)
    assert _tokens(tiny_tp2_pp2, GREEDY) == tiny_reference["even"][0]
    _assert_same_top(_top(tiny_tp2_pp2), tiny_reference["even"][1])


@pytest.mark.parametrize("model", ["even", "odd"])
def test_tiny_pp2_matches_one_process(tiny_paths, tiny_reference, model):
    llm = LLM(tiny_paths[model], pipeline_parallel_size=2, **SMALL)
    try:
        assert llm.engine.kv_cache.shape[1] == 2  # 4 layers: 2 + 2; 3 layers: 2 + 1
        assert _tokens(llm, GREEDY) == tiny_reference[model][0]
        _assert_same_top(_top(llm), tiny_reference[model][1])
    finally:
        _close(llm)


# -- SmolLM2 --------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def smollm2_pp(request):
    tp, pp = request.param
    llm = LLM(tensor_parallel_size=tp, pipeline_parallel_size=pp, **SMALL)
    yield llm
    _close(llm)


def test_smollm2_greedy_tokens_and_logprobs_match_one_process(smollm2_pp, llm_fp32):
    cache = smollm2_pp.engine.kv_cache
    tp = smollm2_pp.engine.model.layout.tensor_parallel_size
    assert (cache.shape[1], cache.shape[3]) == (15, 3 if tp == 1 else 2)  # stage 0; heads 2 + 1
    assert _tokens(smollm2_pp, GREEDY) == _tokens(llm_fp32, GREEDY)
    _assert_same_top(_top(smollm2_pp), _top(llm_fp32))


def test_smollm2_lm_head_on_the_last_stage_matches(smollm2_pp, llm_fp32):
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    want = llm_fp32.engine.model.compute_logits(hidden)
    got = smollm2_pp.engine.model.compute_logits(hidden)
    assert got.shape == want.shape == (3, 49152)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert smollm2_pp.engine.model.greedy_tokens(hidden).tolist() == want.argmax(-1).tolist()


def _busy_since(llm: LLM, since: float) -> dict[int, list[tuple[float, float]]]:
    return {r: [iv for iv in ivs if iv[0] >= since] for r, ivs in llm.engine.model.busy_intervals().items()}


def _overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    return any(s0 < e1 and s1 < e0 for s0, e0 in a for s1, e1 in b)


LONG = [[(7 + 31 * j + i) % 40000 + 100 for j in range(96)] for i in range(4)]
"""Four 96-token prompts: a prefill step heavy enough that a hand-off is short beside it."""


def test_micro_batched_steps_equal_the_whole_batch_and_the_stages_overlap(smollm2_pp):
    model = smollm2_pp.engine.model
    last = model.layout.world_size - model.layout.tensor_parallel_size  # the last stage's first rank
    one = SamplingParams(temperature=0, max_tokens=3, logprobs=5)
    results = {}
    try:
        for parts in (1, 2, 4):
            model.num_micro_batches = parts
            smollm2_pp.engine.pool.reset_prefix_cache()  # each run prefills the whole prompts
            since = time.monotonic()
            outs = smollm2_pp.generate(LONG, one)
            results[parts] = [[(t.token_ids, t.logprobs) for t in o.outputs[0].top_logprobs] for o in outs]
            busy = _busy_since(smollm2_pp, since)
            # 3 steps (a prefill, two decodes of 4 rows), each in `parts` micro-batches on every rank
            assert len(busy[0]) == len(busy[last]) == 3 * parts
            assert _overlaps(busy[0], busy[last]) == (parts > 1), busy
    finally:
        model.num_micro_batches = 2
    _assert_same_top(results[2], results[1], atol=1e-4)
    _assert_same_top(results[4], results[1], atol=1e-4)


def test_cli_flag_reaches_the_engine_and_kv_moving_workers_refuse_nccl(capsys):
    from baton.cli import main as cli
    from baton.common.engine import config_flags

    a = cli.build_parser().parse_args(["generate", "--prompt", "x", "-pp", "2", "-tp", "2"])
    kwargs = config_flags.engine_kwargs(a)
    assert (kwargs["pipeline_parallel_size"], kwargs["tensor_parallel_size"]) == (2, 2)
    flags = config_flags.engine_flags(a)  # what baton up passes on to its workers
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "2"
    # Stages move their own layers' KV over ucx (tests/e2e/test_disaggregated_pp.py); nccl is refused.
    assert cli.main(["prefill", "--pipeline-parallel-size", "2", "--kv-transport", "nccl"]) == 2
    assert "ucx only" in capsys.readouterr().err
    assert cli.main(["decode", "-pp", "2", "--kv-transport", "nccl"]) == 2
    assert "ucx only" in capsys.readouterr().err


# -- failures (last: it kills a rank of the module's TP x PP engine) ------------------------------
def test_killed_stage_rank_fails_the_engine_naming_it(tiny_tp2_pp2):
    llm = tiny_tp2_pp2
    victim = llm.engine.model.workers[2]  # rank 3: stage 1, tensor-parallel rank 1
    victim.kill()
    victim.wait(10)
    start = time.monotonic()
    with pytest.raises(EngineStepError, match=r"rank 3 \(stage 1, pid \d+, exit code -9\) exited"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - start < 30
    with pytest.raises(RankFailedError, match="rank 3"):
        llm.engine.model.greedy_tokens(torch.zeros(1, 128))
