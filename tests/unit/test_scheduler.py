"""Scheduler driven by hand: schedule(), then update_from_output() with made-up tokens. No model.

Block size 4 and tiny pools throughout, so every block id below is exact.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import (
    SampledToken,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2
FILLER = 7  # the token "sampled" when a test does not care which


class Harness:
    def __init__(self, num_blocks: int, block_size: int = 4, **config):
        # Exact block ids below assume a finished request frees its blocks at once.
        config.setdefault("cache_final_block", False)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, BlockHasher(block_size))
        self.sched = Scheduler(SchedulerConfig(**config), self.kv)
        self._arrival = itertools.count()

    def add(self, rid: str, prompt, **params) -> Request:
        req = Request(
            rid,
            list(prompt),
            SamplingParams(**params),
            eos_token_ids=frozenset({EOS}),
            arrival_time=next(self._arrival),
        )
        self.sched.add_request(req)
        return req

    def step(self, feed: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """One engine step: schedule, 'sample' for rows that reached their last token, update."""
        feed = feed if feed is not None else {}
        out = self.sched.schedule()
        sampled = {
            s.request_id: SampledToken(feed[s.request_id].pop(0) if feed.get(s.request_id) else FILLER)
            for s in out.requests
            if s.sample
        }
        self.sched.update_from_output(out, sampled)
        self.pool.check_integrity()
        check_layout(out)
        return out

    def run_to_end(self, max_steps: int = 200, feed=None) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "scheduler made no progress"
            outs.append(self.step(feed))
        return outs


def check_layout(out: SchedulerOutput) -> None:
    """One-token rows come first: the model runner treats the leading one-token rows as decodes."""
    sizes = [s.num_tokens for s in out.requests]
    assert sizes == sorted(sizes, key=lambda n: n > 1), sizes
    assert all(n >= 1 for n in sizes), sizes


def view(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start_pos, number of tokens, sample) of each scheduled row, in order."""
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.requests]


def blocks_of(out: SchedulerOutput) -> dict[str, tuple[int, ...]]:
    return {s.request_id: s.block_ids for s in out.requests}


def prompt(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


# -- token budget and chunked prefill -------------------------------------------------------------


def test_token_budget_is_respected_and_filled_every_step():
    h = Harness(64, max_num_batched_tokens=8)
    specs = {"a": (3, 5), "b": (17, 3), "c": (5, 8), "d": (9, 2), "e": (1, 6), "f": (12, 4)}
    reqs = {
        rid: h.add(rid, prompt(1000 * (i + 1), n), max_tokens=m)
        for i, (rid, (n, m)) in enumerate(specs.items())
    }
    late = {"g": (6, 3), "h": (20, 2)}
    next_pos = {rid: 0 for rid in list(specs) + list(late)}
    steps = 0
    while h.sched.has_unfinished() or late:
        if steps == 3:
            for i, (rid, (n, m)) in enumerate(late.items()):
                reqs[rid] = h.add(rid, prompt(50_000 + 1000 * i, n), max_tokens=m)
            late = {}
        outstanding = sum(r.num_tokens - r.num_computed_tokens for r in h.sched.requests.values())
        out = h.sched.schedule()
        assert 0 < out.num_batched_tokens <= 8
        check_layout(out)
        # Greedy filling: the budget is used up whenever there is enough work (no preemption here).
        assert out.num_batched_tokens == min(8, outstanding)
        assert out.preempted == ()
        for s in out.requests:
            req = reqs[s.request_id]
            assert s.start_pos == next_pos[s.request_id]  # contiguous positions, no gaps
            assert s.token_ids == tuple(req.all_token_ids[s.start_pos : s.start_pos + s.num_tokens])
            next_pos[s.request_id] += s.num_tokens
            assert s.sample == (next_pos[s.request_id] == req.num_tokens)
        h.sched.update_from_output(
            out, {s.request_id: SampledToken(FILLER) for s in out.requests if s.sample}
        )
        h.pool.check_integrity()
        steps += 1
        assert steps < 200
    all_specs = {**specs, "g": (6, 3), "h": (20, 2)}
    for rid, (n, m) in all_specs.items():
        assert reqs[rid].status == RequestStatus.FINISHED_LENGTH
        assert reqs[rid].num_output_tokens == m
        # Every token but the last sampled one was computed.
        assert next_pos[rid] == n + m - 1
    assert h.pool.num_free_blocks == 64


def test_chunked_prefill_computes_4_4_2_and_samples_only_on_the_last_chunk():
    h = Harness(8, max_num_batched_tokens=4)
    a = h.add("a", prompt(10, 10), max_tokens=5)
    out1, out2, out3 = h.step(), h.step(), h.step()
    assert view(out1) == [("a", 0, 4, False)]
    assert view(out2) == [("a", 4, 4, False)]
    assert view(out3) == [("a", 8, 2, True)]
    assert out1.requests[0].token_ids == (10, 11, 12, 13)
    assert out2.requests[0].token_ids == (14, 15, 16, 17)
    assert out3.requests[0].token_ids == (18, 19)
    assert [blocks_of(o)["a"] for o in (out1, out2, out3)] == [(0,), (0, 1), (0, 1, 2)]
    assert a.output_token_ids == [FILLER]  # one token, from the last chunk only
    out4 = h.step()
    assert view(out4) == [("a", 10, 1, True)]
    assert out4.requests[0].token_ids == (FILLER,)
    assert a.num_computed_tokens == 11


def test_decode_is_scheduled_before_a_new_prompts_chunk_and_costs_one_token():
    h = Harness(16, max_num_batched_tokens=4)
    h.add("a", prompt(10, 4), max_tokens=10)
    assert view(h.step()) == [("a", 0, 4, True)]
    h.add("b", prompt(100, 10), max_tokens=2)
    expected = [
        [("a", 4, 1, True), ("b", 0, 3, False)],
        [("a", 5, 1, True), ("b", 3, 3, False)],
        [("a", 6, 1, True), ("b", 6, 3, False)],
        [("a", 7, 1, True), ("b", 9, 1, True)],
        [("a", 8, 1, True), ("b", 10, 1, True)],
    ]
    for want in expected:
        out = h.step()
        assert view(out) == want
        assert out.num_batched_tokens == sum(n for _, _, n, _ in want)


def test_decodes_listed_before_prefill_chunks_in_the_output():
    h = Harness(16, max_num_batched_tokens=8)
    h.add("a", prompt(10, 3), max_tokens=10)
    h.add("b", prompt(20, 3), max_tokens=10)
    h.step()
    h.add("c", prompt(30, 12), max_tokens=2)
    out = h.step()
    assert view(out) == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 0, 6, False)]


def test_one_token_prefill_chunks_are_listed_with_the_decodes():
    h = Harness(16, max_num_batched_tokens=8)
    h.add("a", prompt(10, 5), max_tokens=4)
    h.add("b", prompt(20, 1), max_tokens=4)
    h.add("c", prompt(30, 10), max_tokens=4)
    out = h.step()
    assert view(out) == [("b", 0, 1, True), ("a", 0, 5, True), ("c", 0, 2, False)]
    out = h.step()
    assert view(out) == [("a", 5, 1, True), ("b", 1, 1, True), ("c", 2, 6, False)]
    h2 = Harness(16, max_num_batched_tokens=8)
    h2.add("a", prompt(10, 7), max_tokens=4)
    h2.add("b", prompt(20, 3), max_tokens=4)
    assert view(h2.step()) == [("b", 0, 1, False), ("a", 0, 7, True)]


def test_max_num_seqs_is_respected():
    h = Harness(16, max_num_seqs=2, max_num_batched_tokens=64)
    a = h.add("a", prompt(10, 3), max_tokens=1)
    h.add("b", prompt(20, 3), max_tokens=3)
    h.add("c", prompt(30, 3), max_tokens=3)
    out = h.step()
    assert view(out) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert (h.sched.num_running, h.sched.num_waiting) == (1, 1)
    out = h.step()
    assert view(out) == [("b", 3, 1, True), ("c", 0, 3, True)]
    for out in h.run_to_end():
        assert len(out.requests) <= 2
        assert h.sched.num_running <= 2


# -- preemption ----------------------------------------------------------------------------------


def test_newer_request_is_preempted_when_blocks_run_out_and_resumes_from_its_cached_prefix():
    h = Harness(4, max_num_batched_tokens=64)
    a = h.add("a", [10, 11, 12, 13], max_tokens=6)
    b = h.add("b", [20, 21, 22, 23], max_tokens=6)
    out = h.step()
    assert view(out) == [("a", 0, 4, True), ("b", 0, 4, True)]
    assert blocks_of(out) == {"a": (0,), "b": (1,)}
    out = h.step()
    assert blocks_of(out) == {"a": (0, 2), "b": (1, 3)}
    for pos in (5, 6, 7):
        out = h.step()
        assert view(out) == [("a", pos, 1, True), ("b", pos, 1, True)]
        assert out.preempted == ()
    assert h.pool.num_free_blocks == 0
    # Both need a third block at position 8; the pool has none. "a" is older, so "b" goes.
    out = h.step()
    assert out.preempted == ("b",)
    assert view(out) == [("a", 8, 1, True)]
    assert blocks_of(out) == {"a": (0, 2, 3)}  # b's tail block, freed first, reused first
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.num_output_tokens == 5
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 6
    assert h.sched.num_waiting == 1
    # b's first block is still cached (free); its second was evicted when handed to a.
    out = h.step()
    assert out.preempted == ()
    assert view(out) == [("b", 4, 5, True)]
    assert out.requests[0].token_ids == tuple(b.all_token_ids[4:9])
    assert blocks_of(out) == {"b": (1, 3, 2)}
    assert b.num_cached_tokens == 0  # set on first scheduling only
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 6
    assert not h.sched.has_unfinished()
    assert h.pool.num_free_blocks == 4
    assert [blk.ref_cnt for blk in h.pool.blocks] == [0, 0, 0, 0]
    h.pool.check_integrity()


def test_request_that_cannot_grow_preempts_itself_when_no_newer_request_can_go():
    h = Harness(3, max_num_batched_tokens=64)
    a = h.add("a", prompt(10, 5), max_tokens=3)
    b = h.add("b", [20, 21, 22, 23], max_tokens=2)
    out = h.step()
    assert blocks_of(out) == {"a": (0, 1), "b": (2,)}
    # b needs a second block; a (already served this step) keeps its blocks, so b yields.
    out = h.step()
    assert out.preempted == ("b",)
    assert view(out) == [("a", 5, 1, True)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # Resuming needs block 2 revived plus one more: none until a finishes.
    out = h.step()
    assert view(out) == [("a", 6, 1, True)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = h.step()
    assert view(out) == [("b", 4, 1, True)]  # prefix hit on its own cached block 2
    assert blocks_of(out) == {"b": (2, 1)}
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [FILLER, FILLER]
    assert h.pool.num_free_blocks == 3


def test_a_step_that_preempts_admits_no_waiting_request():
    h = Harness(3, max_num_batched_tokens=4)
    a = h.add("a", [10], max_tokens=4)
    r = h.add("r", prompt(100, 9), max_tokens=2)
    assert view(h.step()) == [("a", 0, 1, True), ("r", 0, 3, False)]
    assert view(h.step()) == [("a", 1, 1, True), ("r", 3, 3, False)]
    # r needs a third block for positions 6..8; a (older, served first) keeps its block, so r
    # preempts itself. Restarting r at once from its cached first block would fit (4 + 3 tokens
    # in blocks 1 and 2) but would only redo work: the waiting queue is left alone this step.
    out = h.step()
    assert out.preempted == ("r",)
    assert view(out) == [("a", 2, 1, True)]
    assert r.status == RequestStatus.PREEMPTED
    out = h.step()
    assert view(out) == [("a", 3, 1, True), ("r", 4, 3, False)]
    assert blocks_of(out) == {"a": (0,), "r": (1, 2)}
    assert a.status == RequestStatus.FINISHED_LENGTH
    out = h.step()
    assert view(out) == [("r", 7, 2, True)]
    assert blocks_of(out) == {"r": (1, 2, 0)}
    assert view(h.step()) == [("r", 9, 1, True)]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert (r.num_output_tokens, r.num_preemptions, r.num_cached_tokens) == (2, 1, 0)
    assert h.pool.num_free_blocks == 3


def test_preemption_under_load_finishes_everything_with_exact_output_counts():
    h = Harness(6, max_num_batched_tokens=16)
    reqs = [h.add(f"r{i}", prompt(100 * (i + 1), 3 + i), max_tokens=8 + i) for i in range(5)]
    outs = h.run_to_end()
    assert any(o.preempted for o in outs)
    for o in outs:
        assert o.num_batched_tokens <= 16
        for s in o.requests:
            assert len(s.block_ids) * 4 >= s.start_pos + s.num_tokens
    for i, r in enumerate(reqs):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 8 + i
    assert h.pool.num_free_blocks == 6


# -- prefix cache --------------------------------------------------------------------------------


def test_identical_second_prompt_hits_the_first_ones_blocks():
    h = Harness(8, max_num_batched_tokens=64)
    a = h.add("a", prompt(10, 10), max_tokens=2)
    b = h.add("b", prompt(10, 10), max_tokens=2)
    out = h.sched.schedule()
    assert view(out) == [("a", 0, 10, True), ("b", 8, 2, True)]
    assert blocks_of(out) == {"a": (0, 1, 2), "b": (0, 1, 3)}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert [blk.ref_cnt for blk in h.pool.blocks[:4]] == [2, 2, 1, 1]
    assert out.requests[1].token_ids == (18, 19)


def test_prompt_after_a_finished_one_hits_its_free_cached_blocks():
    h = Harness(8, max_num_batched_tokens=64)
    h.add("a", prompt(10, 10), max_tokens=1)
    h.step()
    assert h.pool.num_free_blocks == 8
    c = h.add("c", prompt(10, 9), max_tokens=1)
    out = h.step()
    assert view(out) == [("c", 8, 1, True)]
    assert blocks_of(out)["c"][:2] == (0, 1)
    assert c.num_cached_tokens == 8


# -- stopping ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, feed, want_status, want_out, want_reason",
    [
        pytest.param(
            {"max_tokens": 10}, [5, EOS, 5], RequestStatus.FINISHED_STOPPED, [5, EOS], None, id="eos"
        ),
        pytest.param(
            {"max_tokens": 10, "stop_token_ids": (9,)},
            [5, 9, 5],
            RequestStatus.FINISHED_STOPPED,
            [5, 9],
            9,
            id="stop_token",
        ),
        pytest.param(
            {"max_tokens": 3, "ignore_eos": True},
            [EOS, EOS, EOS, EOS],
            RequestStatus.FINISHED_LENGTH,
            [EOS, EOS, EOS],
            None,
            id="ignore_eos",
        ),
        pytest.param(
            {"max_tokens": 10, "ignore_eos": True, "stop_token_ids": (9,)},
            [EOS, 9],
            RequestStatus.FINISHED_STOPPED,
            [EOS, 9],
            9,
            id="ignore_eos_keeps_stop_tokens",
        ),
        pytest.param(
            {"max_tokens": 10, "min_tokens": 3, "stop_token_ids": (9,)},
            [EOS, 9, 5, EOS],
            RequestStatus.FINISHED_STOPPED,
            [EOS, 9, 5, EOS],
            None,
            id="min_tokens",
        ),
        pytest.param(
            {"max_tokens": 10, "min_tokens": 2},
            [EOS, EOS, 5],
            RequestStatus.FINISHED_STOPPED,
            [EOS, EOS],
            None,
            id="min_tokens_reached_by_eos",
        ),
        pytest.param(
            {"max_tokens": 3}, [5, 5, 5, 5], RequestStatus.FINISHED_LENGTH, [5, 5, 5], None, id="max_tokens"
        ),
        pytest.param(
            {"max_tokens": 2},
            [5, EOS],
            RequestStatus.FINISHED_STOPPED,
            [5, EOS],
            None,
            id="eos_beats_length",
        ),
    ],
)
def test_stop_conditions(params, feed, want_status, want_out, want_reason):
    h = Harness(8, max_num_batched_tokens=64)
    r = h.add("r", prompt(10, 3), **params)
    h.run_to_end(feed={"r": list(feed)})
    assert r.status == want_status
    assert r.status.finish_reason == want_status.value
    assert r.output_token_ids == want_out
    assert r.stop_reason == want_reason
    assert h.pool.num_free_blocks == 8
    assert "r" not in h.sched.requests


def test_max_model_len_ends_the_request():
    h = Harness(8, max_num_batched_tokens=64, max_model_len=8)
    r = h.add("r", prompt(10, 5), max_tokens=None)
    outs = h.run_to_end()
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == 3
    assert r.num_tokens == 8
    assert len(outs) == 3


def test_update_returns_the_requests_that_got_a_token():
    h = Harness(8, max_num_batched_tokens=4)
    a = h.add("a", prompt(10, 2), max_tokens=1)
    b = h.add("b", prompt(20, 6), max_tokens=4)
    out = h.sched.schedule()
    assert view(out) == [("a", 0, 2, True), ("b", 0, 2, False)]
    progressed = h.sched.update_from_output(out, {"a": SampledToken(5, logprob=-0.5)})
    assert progressed == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_logprobs == [-0.5]
    assert b.output_token_ids == []


# -- aborts and misuse ---------------------------------------------------------------------------


def test_finish_requests_aborts_waiting_and_running_and_frees_blocks():
    h = Harness(8, max_num_batched_tokens=6)
    a = h.add("a", prompt(10, 6), max_tokens=4)
    b = h.add("b", prompt(20, 3), max_tokens=4)
    h.step()
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert h.pool.num_free_blocks == 6
    done = h.sched.finish_requests(["b", "nope", "a"], RequestStatus.FINISHED_ABORTED)
    assert done == [b, a]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.status.finish_reason == "abort"
    assert h.pool.num_free_blocks == 8
    assert (h.sched.num_running, h.sched.num_waiting) == (0, 0)
    assert not h.sched.has_unfinished()
    assert h.sched.requests == {}
    assert h.sched.schedule().is_empty
    h.pool.check_integrity()


def test_abort_of_a_preempted_request():
    h = Harness(3, max_num_batched_tokens=64)
    h.add("a", prompt(10, 5), max_tokens=3)
    b = h.add("b", [20, 21, 22, 23], max_tokens=2)
    h.step()
    assert h.step().preempted == ("b",)
    assert h.sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert h.sched.num_waiting == 0
    assert h.pool.num_free_blocks == 1  # a still holds 0 and 1


def test_token_for_a_request_aborted_mid_step_is_dropped():
    h = Harness(8, max_num_batched_tokens=64)
    a = h.add("a", prompt(10, 3))
    out = h.sched.schedule()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert h.sched.update_from_output(out, {"a": SampledToken(5)}) == []
    assert a.output_token_ids == []
    assert h.pool.num_free_blocks == 8


def test_scheduler_output_is_immutable():
    h = Harness(8)
    h.add("a", prompt(10, 3))
    out = h.sched.schedule()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.preempted = ("x",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.requests = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.requests[0].start_pos = 5
    assert isinstance(out.requests, tuple)
    assert isinstance(out.requests[0].block_ids, tuple)
    assert isinstance(out.requests[0].token_ids, tuple)


def test_duplicate_request_id_raises():
    h = Harness(8)
    first = h.add("a", prompt(10, 3))
    with pytest.raises(ValueError, match="'a'"):
        h.add("a", prompt(20, 3))
    assert h.sched.requests["a"] is first
    assert h.sched.num_waiting == 1


# -- sampling params -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_reject_invalid_values_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).split()[0] == name, str(info.value)


def test_sampling_params_accept_edge_values_and_normalise_stop():
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=1, stop="x", stop_token_ids=[3])
    assert p.greedy
    assert p.stop == ("x",)
    assert p.stop_token_ids == (3,)
    assert SamplingParams(top_k=0, max_tokens=None, min_tokens=100).max_tokens is None


# -- randomized workloads ------------------------------------------------------------------------


class _SimulatedKV:
    """Stands in for the KV cache: each slot remembers the token prefix whose K/V it holds.

    A step writes every scheduled token's slot first, then each row reads its whole context,
    the order in which ``paged_attention`` works. A read that finds another prefix means the
    scheduler handed out wrong blocks (a bad prefix hit, a shared block overwritten, ...).
    """

    def __init__(self, block_size: int):
        self.bs = block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def _slot(self, block_ids, pos: int) -> tuple[int, int]:
        return block_ids[pos // self.bs], pos % self.bs

    def write(self, req: Request, start: int, n: int, block_ids) -> None:
        for pos in range(start, start + n):
            self.slots[self._slot(block_ids, pos)] = tuple(req.all_token_ids[: pos + 1])

    def check(self, req: Request, upto: int, block_ids) -> None:
        for pos in range(upto):
            got = self.slots.get(self._slot(block_ids, pos))
            assert got == tuple(req.all_token_ids[: pos + 1]), (req.request_id, pos)


def _random_workload(seed: int, steps: int = 250, cache_final_block: bool = False) -> dict[str, int]:
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    num_blocks = rng.randint(3, 10)
    budget = rng.randint(2, 12)
    max_len = min(num_blocks * bs, 40)  # the engine guarantees the pool holds one full sequence
    h = Harness(
        num_blocks,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=rng.randint(1, 4),
        max_model_len=max_len,
        cache_final_block=cache_final_block,
    )
    kv = _SimulatedKV(bs)
    prefixes = [[rng.randint(3, 9) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    reqs: dict[str, Request] = {}
    stats = {"preempted": 0, "hits": 0, "final_blocks": 0}
    step = 0
    while step < steps or h.sched.has_unfinished():
        assert step < steps + 1000, "no progress"
        if step < steps and rng.random() < 0.3:
            p = rng.choice(prefixes)[: rng.randint(1, 12)] + [
                rng.randint(3, 9) for _ in range(rng.randint(0, 5))
            ]
            rid = f"r{len(reqs)}"
            reqs[rid] = h.add(
                rid, p[: max_len - 1], max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.2
            )
        if step < steps and rng.random() < 0.05 and h.sched.requests:
            h.sched.finish_requests([rng.choice(sorted(h.sched.requests))], RequestStatus.FINISHED_ABORTED)
        computed = {rid: r.num_computed_tokens for rid, r in h.sched.requests.items()}
        out = h.sched.schedule()
        check_layout(out)
        assert out.num_batched_tokens <= budget
        stats["preempted"] += len(out.preempted)
        for s in out.requests:
            req = reqs[s.request_id]
            if s.request_id not in computed:  # a finished request's final block: its last token
                assert req.is_finished and not s.sample and s.start_pos == req.num_tokens - 1
                assert req.num_tokens % bs == 0
                stats["final_blocks"] += 1
            elif s.start_pos > computed[s.request_id]:
                assert computed[s.request_id] == 0  # only a fresh start may skip ahead (prefix hit)
                stats["hits"] += 1
            assert s.token_ids == tuple(req.all_token_ids[s.start_pos : s.start_pos + s.num_tokens])
            kv.write(req, s.start_pos, s.num_tokens, s.block_ids)
        for s in out.requests:
            kv.check(reqs[s.request_id], s.start_pos + s.num_tokens, s.block_ids)
        eos_rate = 0.1 if step < steps else 0.0
        sampled = {
            s.request_id: SampledToken(EOS if rng.random() < eos_rate else rng.randint(3, 9))
            for s in out.requests
            if s.sample
        }
        h.sched.update_from_output(out, sampled)
        h.pool.check_integrity()
        for req in h.sched.running:  # nobody's computed context was overwritten
            kv.check(req, req.num_computed_tokens, h.kv.block_ids(req.request_id))
        step += 1
    assert h.pool.num_free_blocks == num_blocks
    for req in reqs.values():
        assert req.is_finished
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.sampling_params.max_tokens or req.num_tokens == max_len
    return stats


@pytest.mark.parametrize("cache_final_block", [False, True])
def test_random_workloads_never_read_wrong_kv_and_always_finish(cache_final_block):
    totals = {"preempted": 0, "hits": 0, "final_blocks": 0}
    for seed in range(120):
        for key, value in _random_workload(seed, cache_final_block=cache_final_block).items():
            totals[key] += value
    # The workloads really exercised preemption and prefix hits (and final blocks, when on).
    assert totals["preempted"] > 400 and totals["hits"] > 2000, totals
    assert (totals["final_blocks"] > 100) == cache_final_block, totals


def test_a_finished_requests_final_block_is_computed_then_cached():
    h = Harness(8, cache_final_block=True)
    a = h.add("a", [3, 4, 5, 6, 7, 8], max_tokens=2, ignore_eos=True)
    h.step()  # prompt: 6 tokens, samples the 7th
    out = h.step({"a": [9]})  # computes token 7, samples the 8th: done, and it completes block 2
    assert a.is_finished and a.num_tokens == 8 and "a" not in h.sched.requests
    assert h.sched.has_unfinished()  # the final block is still to compute
    used = h.pool.num_free_blocks
    out = h.step()
    [final] = out.requests
    assert (final.request_id, final.start_pos, final.token_ids, final.sample) == ("a", 7, (9,), False)
    assert h.pool.num_free_blocks == used + 2 and not h.sched.has_unfinished()
    # The next turn repeats the whole reply: both blocks hit, nothing of the history is recomputed.
    b = h.add("b", a.all_token_ids + [5, 5])
    out = h.step()
    assert out.requests[0].start_pos == 8 and b.num_cached_tokens == 8


def test_no_final_block_step_unless_the_last_token_completes_a_block():
    h = Harness(8, cache_final_block=True)
    a = h.add("a", [3, 4, 5, 6, 7], max_tokens=2, ignore_eos=True)  # ends at 7 tokens
    h.step()
    h.step()
    assert a.is_finished and not h.sched.has_unfinished() and h.pool.num_free_blocks == 8


def test_reusing_a_completing_requests_id_frees_its_blocks_first():
    h = Harness(8, cache_final_block=True)
    h.add("a", [3, 4, 5, 6, 7, 8], max_tokens=2, ignore_eos=True)
    h.step()
    h.step()
    assert h.sched.completing
    h.add("a", [9, 9, 9])  # same id, before the final-block step
    assert not h.sched.completing
    out = h.step()
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in out.requests] == [("a", 0, 3)]


def test_aborting_during_the_final_block_step_is_harmless():
    h = Harness(8, cache_final_block=True)
    h.add("a", [3, 4, 5, 6, 7, 8], max_tokens=2, ignore_eos=True)
    h.step()
    h.step()
    assert h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # already finished
    h.step()
    assert h.pool.num_free_blocks == 8 and not h.sched.has_unfinished()


def test_a_readmitted_request_goes_first_and_is_computed_from_its_start():
    h = Harness(8, max_num_batched_tokens=64)
    h.add("a", prompt(10, 4), max_tokens=2)
    late = Request("late", prompt(30, 6), SamplingParams(max_tokens=2), arrival_time=-1)
    late.num_computed_tokens = 4  # what it had computed elsewhere does not count any more
    h.sched.readmit(late)
    assert late.status == RequestStatus.PREEMPTED and late.num_computed_tokens == 0
    with pytest.raises(ValueError, match="already in use"):
        h.sched.readmit(late)
    out = h.step()
    assert view(out)[0] == ("late", 0, 6, True)
    h.run_to_end()
    assert late.status == RequestStatus.FINISHED_LENGTH
