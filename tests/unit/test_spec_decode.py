"""Speculative decoding's pure half: n-gram proposals, the step cost model that picks k, and the
scheduler's multi-token steps with their rollback, driven by hand with exact block ids. No model.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import SampledToken, Scheduler, SchedulerConfig
from baton.common.engine.spec_decode import (
    LinearCost,
    SpecController,
    SpecStats,
    SpeculativeConfig,
    drop_past_stop,
    expected_tokens,
    ngram_propose,
    proposal_room,
)

EOS = 2


def test_spec_decode_imports_without_torch():
    code = "import sys\nsys.modules['torch'] = None\nimport baton.common.engine.spec_decode\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- n-gram proposals ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 6, 7]
    # Suffix [6, 7] occurs at 1 and 6; the most recent earlier one (6) was followed by 3, 6, 7.
    assert ngram_propose(tokens, 1, 3, k=3) == [3, 6, 7]
    # The longest suffix wins: [3, 6, 7] never occurred before, [6, 7] did.
    assert ngram_propose(tokens, 2, 3, k=2) == [3, 6]


def test_ngram_proposes_fewer_at_the_end_and_none_without_a_match():
    assert ngram_propose([1, 2, 3, 1, 2], 2, 2, k=5) == [3, 1, 2]
    assert ngram_propose([1, 2, 3, 4], 1, 3, k=3) == []
    assert ngram_propose([1, 2, 1], 1, 3, k=0) == []
    assert ngram_propose([1], 1, 3, k=3) == []


def test_proposal_room_leaves_a_token_for_the_bonus():
    assert proposal_room(num_output=0, max_tokens=4, num_tokens=10, max_model_len=100) == 3
    assert proposal_room(num_output=3, max_tokens=4, num_tokens=10, max_model_len=100) == 0
    assert proposal_room(num_output=0, max_tokens=None, num_tokens=97, max_model_len=100) == 2


def test_config_rejects_bad_options():
    with pytest.raises(ValueError, match="speculative"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)


# -- choosing k ---------------------------------------------------------------------------------
def _fitted(a: float, b: float) -> SpecController:
    c = SpecController(k_max=4)
    for n in (1, 8, 64, 256):
        c.target.observe(n, a + b * n)
    return c


def test_linear_cost_fits_the_fixed_and_per_token_cost():
    cost = LinearCost()
    assert not cost.fitted
    cost.observe(10, 0.02)
    assert not cost.fitted  # one token count: no slope yet
    cost.observe(110, 0.12)
    assert cost.fitted and cost.predict(60) == pytest.approx(0.07)


def test_memory_bound_steps_speculate_fully():
    # Batch 1 on a small model: 20 ms per step, 0.05 ms per extra token.
    c = _fitted(0.020, 0.00005)
    assert c.choose_k(num_tokens=1, num_decodes=1, num_speculating=1) == 4


def test_compute_bound_steps_do_not_speculate():
    # Every token costs as much as the whole fixed part: more tokens never pay at 60% acceptance.
    c = _fitted(0.001, 0.001)
    assert c.choose_k(num_tokens=64, num_decodes=64, num_speculating=64) == 0
    assert c.choose_k(num_tokens=1, num_decodes=1, num_speculating=0) == 0


def test_low_acceptance_turns_speculation_off_and_it_is_retried_later():
    c = _fitted(0.020, 0.0005)
    assert c.choose_k(num_tokens=8, num_decodes=8, num_speculating=8) > 0
    for _ in range(100):
        c.observe_acceptance(num_draft=4, num_accepted=0)
    assert c.alpha < 0.05
    assert c.choose_k(num_tokens=8, num_decodes=8, num_speculating=8) == 0
    for _ in range(500):
        c.idle()
    assert c.choose_k(num_tokens=8, num_decodes=8, num_speculating=8) > 0


def test_unadaptive_controller_always_proposes_k_max():
    c = SpecController(k_max=3, adaptive=False)
    c.target.observe(1, 0.001)
    c.target.observe(100, 1.0)
    assert c.choose_k(num_tokens=100, num_decodes=100, num_speculating=100) == 3


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_stats_count_per_position():
    s = SpecStats()
    s.record(num_draft=3, num_accepted=2)
    s.record(num_draft=4, num_accepted=0)
    s.record(num_draft=0, num_accepted=0)  # no proposals: not a draft
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 7, 2)
    assert s.accepted_per_pos == [1, 1, 0, 0]
    assert s.acceptance_rate == pytest.approx(2 / 7)


# -- the scheduler's multi-token steps ------------------------------------------------------------
class Harness:
    def __init__(self, num_blocks: int = 8, block_size: int = 4, **config):
        config.setdefault("cache_final_block", False)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(self.pool, BlockHasher(block_size))
        self.sched = Scheduler(SchedulerConfig(**config), self.kv)

    def add(self, rid: str, prompt, **params) -> Request:
        req = Request(
            rid,
            list(prompt),
            SamplingParams(**params),
            eos_token_ids=frozenset({EOS}),
            arrival_time=len(self.sched.requests),
        )
        self.sched.add_request(req)
        return req


def test_a_proposal_chunk_keeps_the_accepted_prefix_and_rolls_back_the_rest():
    h = Harness()
    req = h.add("a", [10, 11, 12, 13, 14, 15], temperature=0, max_tokens=20)
    out = h.sched.schedule()  # the prompt: blocks 0, 1
    h.sched.update_from_output(out, {"a": SampledToken(16)})
    assert h.kv.block_ids("a") == [0, 1] and req.num_computed_tokens == 6

    req.spec_token_ids = [17, 18, 19, 20]
    out = h.sched.schedule()
    (s,) = out.requests
    # The last token (16, no KV yet) and the four proposals: positions 6..10, one more block.
    assert (s.token_ids, s.start_pos, s.num_spec, s.sample) == ((16, 17, 18, 19, 20), 6, 4, True)
    assert s.block_ids == (0, 1, 2) and out.num_batched_tokens == 5
    assert req.spec_token_ids == []
    # Block 1 (tokens 14..17) is not cached yet: 17 is only proposed.
    assert h.pool.blocks[1].block_hash is None

    # 17 accepted, 18 rejected (the bonus is 30): output 17, 30.
    h.sched.update_from_output(out, {"a": (SampledToken(17), SampledToken(30))})
    assert req.output_token_ids == [16, 17, 30]
    assert req.num_computed_tokens == 8  # positions 0..7 (through 17); 30 has no KV yet
    assert h.kv.block_ids("a") == [0, 1, 2]  # 30 goes at position 8, in block 2
    assert h.pool.blocks[1].block_hash == req.block_hashes[1]  # now full of accepted tokens
    assert h.pool.blocks[2].block_hash is None
    h.pool.check_integrity()


def test_rejected_proposals_free_blocks_they_alone_held():
    h = Harness()
    req = h.add("a", [10, 11, 12, 13, 14, 15], temperature=0, max_tokens=20)
    h.sched.update_from_output(h.sched.schedule(), {"a": SampledToken(16)})
    req.spec_token_ids = [17, 18, 19, 20, 21, 22]
    out = h.sched.schedule()
    assert out.requests[0].block_ids == (0, 1, 2, 3)  # positions 6..12
    free_before = h.pool.num_free_blocks
    h.sched.update_from_output(out, {"a": (SampledToken(40),)})  # the first proposal rejected
    assert req.num_computed_tokens == 7 and req.num_tokens == 8
    assert h.kv.block_ids("a") == [0, 1]  # blocks 2 and 3 held only rejected tokens
    assert h.pool.num_free_blocks == free_before + 2
    assert h.pool.blocks[2].block_hash is None and h.pool.blocks[3].block_hash is None
    h.pool.check_integrity()


def test_proposals_past_the_budget_are_cut_and_never_exceed_max_tokens():
    h = Harness(max_num_batched_tokens=3)
    req = h.add("a", [10, 11], temperature=0, max_tokens=3)
    h.sched.update_from_output(h.sched.schedule(), {"a": SampledToken(12)})
    req.spec_token_ids = [13, 14, 15, 16]
    out = h.sched.schedule()
    assert out.requests[0].num_spec == 2 and out.requests[0].num_tokens == 3
    # Three tokens come back, but max_tokens leaves room for two more.
    h.sched.update_from_output(out, {"a": (SampledToken(13), SampledToken(14), SampledToken(15))})
    assert req.output_token_ids == [12, 13, 14]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert h.pool.num_free_blocks == h.pool.num_blocks
    h.pool.check_integrity()


def test_eos_among_accepted_tokens_ends_the_request_there():
    h = Harness()
    req = h.add("a", [10, 11, 12], temperature=0, max_tokens=20)
    h.sched.update_from_output(h.sched.schedule(), {"a": SampledToken(13)})
    req.spec_token_ids = [14, EOS, 16]
    out = h.sched.schedule()
    h.sched.update_from_output(
        out, {"a": (SampledToken(14), SampledToken(EOS), SampledToken(16), SampledToken(1))}
    )
    assert req.output_token_ids == [13, 14, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    h.pool.check_integrity()


def test_proposals_never_preempt_and_a_preempted_request_forgets_them():
    h = Harness(num_blocks=4)
    a = h.add("a", [10, 11, 12, 13, 14, 15, 16], temperature=0, max_tokens=20)
    b = h.add("b", [20, 21, 22], temperature=0, max_tokens=20)
    h.sched.update_from_output(h.sched.schedule(), {"a": SampledToken(17), "b": SampledToken(23)})
    assert (h.kv.block_ids("a"), h.kv.block_ids("b")) == ([0, 1], [2])
    a.spec_token_ids = [18, 19, 20, 21, 22]  # positions 7..12: two more blocks, one is free
    b.spec_token_ids = [24, 25]  # positions 3..5: the free block
    out = h.sched.schedule()
    assert [(s.request_id, s.num_spec) for s in out.requests] == [("a", 0), ("b", 2)]
    assert out.preempted == ()
    h.sched.update_from_output(
        out, {"a": SampledToken(18), "b": (SampledToken(24), SampledToken(25), SampledToken(26))}
    )
    assert b.num_computed_tokens == 6 and h.kv.block_ids("b") == [2, 3]
    # a's next token opens a block and none is free: b, the newest, is preempted, proposals and all.
    b.spec_token_ids = [27]
    out = h.sched.schedule()
    assert out.preempted == ("b",) and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert [(s.request_id, s.num_spec) for s in out.requests] == [("a", 0)]
    h.pool.check_integrity()


def test_drop_past_stop_keeps_the_token_that_completed_the_stop_string():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    req = Request("a", [0], SamplingParams(stop=("cd",)))
    for t in (1, 2, 3, 4, 5):  # b c d e f
        req.append_output(t)
    drop_past_stop(req, "cd", Tok(), max_drop=4)
    assert req.output_token_ids == [1, 2, 3] and req.all_token_ids == [0, 1, 2, 3]


def test_measured_slower_speculation_stops_at_that_batch_size_and_is_retried_now_and_then():
    # The cost model says speculate (memory-bound), but decode steps of 64 measured fewer tokens
    # per second with proposals than without: the measurement wins, at that batch size only.
    c = _fitted(0.020, 0.00005)
    k = c.choose_k(num_tokens=64, num_decodes=64, num_speculating=64)
    assert k > 0
    c.guard.observe(64, True, tokens=90, seconds=1.0)
    assert c.choose_k(num_tokens=64, num_decodes=64, num_speculating=64) == 0  # plain measured first
    c.guard.observe(64, False, tokens=64, seconds=0.5)
    ks = []
    for _ in range(2 * c.guard.explore_every):
        ks.append(c.choose_k(num_tokens=64, num_decodes=64, num_speculating=64))
        c.guard.observe(64, ks[-1] > 0, tokens=90 if ks[-1] else 64, seconds=1.0 if ks[-1] else 0.5)
    assert ks.count(k) == 2 and ks.count(0) == len(ks) - 2  # one exploring step in each round
    assert c.choose_k(num_tokens=1, num_decodes=1, num_speculating=1) == 4  # batch 1 is unaffected


def test_measured_faster_speculation_goes_on_with_a_plain_step_now_and_then():
    c = _fitted(0.020, 0.00005)
    c.guard.observe(1, False, tokens=1, seconds=0.02)
    c.guard.observe(1, True, tokens=3, seconds=0.025)
    ks = []
    for _ in range(c.guard.explore_every):
        ks.append(c.choose_k(num_tokens=1, num_decodes=1, num_speculating=1))
        c.guard.observe(1, ks[-1] > 0, tokens=3 if ks[-1] else 1, seconds=0.025 if ks[-1] else 0.02)
    assert ks.count(0) == 1 and ks.count(4) == len(ks) - 1
