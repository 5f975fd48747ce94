"""The re-sharding planner (``common/transfer/reshard.py``): which heads each prefill rank sends
to each decode rank, for SmolLM2's 3 KV heads and for replicated heads. Pure: no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.transfer.reshard import Slice, from_rank, plan, received_heads

ONE = [(0, 3)]
TWO = [(0, 2), (2, 3)]  # head_split(9, 3, 2): SmolLM2 at TP=2
THREE = [(0, 1), (1, 2), (2, 3)]


def test_tp1_to_tp2_cuts_the_one_rank_into_both_ranges():
    assert plan(ONE, TWO, 3) == [
        Slice(0, 0, (0, 2), (0, 2), (0, 2)),
        Slice(0, 1, (2, 3), (2, 3), (0, 1)),
    ]


def test_tp2_to_tp1_fills_the_one_rank_from_both():
    assert plan(TWO, ONE, 3) == [
        Slice(0, 0, (0, 2), (0, 2), (0, 2)),
        Slice(1, 0, (2, 3), (0, 1), (2, 3)),
    ]


def test_equal_degrees_send_whole_caches_rank_to_rank():
    assert plan(TWO, TWO, 3) == [
        Slice(0, 0, (0, 2), (0, 2), (0, 2)),
        Slice(1, 1, (2, 3), (0, 1), (0, 1)),
    ]


def test_tp3_to_tp2_a_decode_rank_draws_on_two_prefill_ranks():
    assert plan(THREE, TWO, 3) == [
        Slice(0, 0, (0, 1), (0, 1), (0, 1)),
        Slice(1, 0, (1, 2), (0, 1), (1, 2)),
        Slice(2, 1, (2, 3), (0, 1), (0, 1)),
    ]
    assert [received_heads(plan(THREE, TWO, 3), d) for d in (0, 1)] == [2, 1]


def test_a_replicated_head_is_sent_once_and_replicas_draw_on_different_sources():
    # 2 KV heads at TP=4: each replicated on two ranks (head_split(8, 2, 4)).
    four = [(0, 1), (0, 1), (1, 2), (1, 2)]
    slices = plan(four, [(0, 2)], 2)
    assert slices == [Slice(0, 0, (0, 1), (0, 1), (0, 1)), Slice(2, 0, (1, 2), (0, 1), (1, 2))]
    # Decode at TP=4 too: rank d gets its head from holder d % 2 of it.
    assert [(s.src_rank, s.dst_rank) for s in plan(four, four, 2)] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # Decode replicas of a head from a prefill worker holding it once: each gets its own copy.
    assert [(s.src_rank, s.dst_rank, s.heads) for s in plan([(0, 2)], four, 2)] == [
        (0, 0, (0, 1)),
        (0, 1, (0, 1)),
        (0, 2, (1, 2)),
        (0, 3, (1, 2)),
    ]


def test_a_source_that_already_feeds_the_previous_head_keeps_feeding():
    # Source ranks (0,2) and (1,3): head 1 is on both; after head 0 from rank 0, rank 0 goes on.
    assert plan([(0, 2), (1, 3)], [(0, 3)], 3) == [
        Slice(0, 0, (0, 2), (0, 2), (0, 2)),
        Slice(1, 0, (2, 3), (1, 2), (2, 3)),
    ]


def test_from_rank_and_every_head_exactly_once():
    for src in (ONE, TWO, THREE):
        for dst in (ONE, TWO, THREE):
            slices = plan(src, dst, 3)
            assert {s for r in range(len(src)) for s in from_rank(slices, r)} == set(slices)
            for d, (a, b) in enumerate(dst):
                got = sorted(h for s in slices if s.dst_rank == d for h in range(*s.heads))
                assert got == list(range(a, b))
                for s in slices:
                    assert s.src_heads[1] - s.src_heads[0] == s.dst_heads[1] - s.dst_heads[0] == s.num_heads


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([(0, 2)], ONE, "prefill ranks: no rank holds KV heads \\[2\\]"),
        (ONE, [(0, 4)], "decode ranks: KV head ranges \\[\\(0, 4\\)\\] outside"),
        ([], ONE, "prefill ranks: no ranks"),
        (ONE, [(1, 1), (0, 3)], "outside"),
    ],
)
def test_ranges_that_do_not_hold_the_model_are_refused(src, dst, message):
    with pytest.raises(ValueError, match=message):
        plan(src, dst, 3)


def test_the_planner_imports_with_torch_blocked():
    code = "import sys; sys.modules['torch'] = None; import baton.common.transfer.reshard"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
