"""The re-sharding planner (``common/transfer/reshard.py``): which layers and heads each prefill
rank sends to each decode rank, for SmolLM2's 30 layers and 3 KV heads at tensor- and
pipeline-parallel degrees, and for replicated heads. Pure: no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.transfer.reshard import Shard, Slice, from_rank, plan, received_cells

L, KV = 30, 3  # SmolLM2
ALL = (0, L)
ONE = [(0, 3)]
TWO = [(0, 2), (2, 3)]  # head_split(9, 3, 2): SmolLM2 at TP=2
THREE = [(0, 1), (1, 2), (2, 3)]
PP1 = [ALL]
PP2 = [(0, 15), (15, 30)]  # stage_layers(30, 2)
PP3 = [(0, 10), (10, 20), (20, 30)]


def grid(stages: list[tuple[int, int]], heads: list[tuple[int, int]]) -> list[Shard]:
    """A worker's shards in rank order: stage after stage, the tensor-parallel index innermost."""
    return [Shard(layers, h) for layers in stages for h in heads]


def tp(heads: list[tuple[int, int]]) -> list[Shard]:
    return grid(PP1, heads)


def whole_layers(src: int, dst: int, heads, src_heads, dst_heads) -> Slice:
    """A slice of every layer (tensor parallelism alone)."""
    return Slice(src, dst, ALL, heads, ALL, src_heads, ALL, dst_heads)


# -- heads alone (every rank holds every layer) -------------------------------------------------
def test_tp1_to_tp2_cuts_the_one_rank_into_both_ranges():
    assert plan(tp(ONE), tp(TWO), L, KV) == [
        whole_layers(0, 0, (0, 2), (0, 2), (0, 2)),
        whole_layers(0, 1, (2, 3), (2, 3), (0, 1)),
    ]


def test_tp2_to_tp1_fills_the_one_rank_from_both():
    assert plan(tp(TWO), tp(ONE), L, KV) == [
        whole_layers(0, 0, (0, 2), (0, 2), (0, 2)),
        whole_layers(1, 0, (2, 3), (0, 1), (2, 3)),
    ]


def test_equal_degrees_send_whole_caches_rank_to_rank():
    assert plan(tp(TWO), tp(TWO), L, KV) == [
        whole_layers(0, 0, (0, 2), (0, 2), (0, 2)),
        whole_layers(1, 1, (2, 3), (0, 1), (0, 1)),
    ]


def test_tp3_to_tp2_a_decode_rank_draws_on_two_prefill_ranks():
    assert plan(tp(THREE), tp(TWO), L, KV) == [
        whole_layers(0, 0, (0, 1), (0, 1), (0, 1)),
        whole_layers(1, 0, (1, 2), (0, 1), (1, 2)),
        whole_layers(2, 1, (2, 3), (0, 1), (0, 1)),
    ]
    assert [received_cells(plan(tp(THREE), tp(TWO), L, KV), d) for d in (0, 1)] == [2 * L, L]


def test_a_replicated_head_is_sent_once_and_replicas_draw_on_different_sources():
    # 2 KV heads at TP=4: each replicated on two ranks (head_split(8, 2, 4)).
    four = tp([(0, 1), (0, 1), (1, 2), (1, 2)])
    slices = plan(four, tp([(0, 2)]), L, 2)
    assert slices == [whole_layers(0, 0, (0, 1), (0, 1), (0, 1)), whole_layers(2, 0, (1, 2), (0, 1), (1, 2))]
    # Decode at TP=4 too: rank d gets its head from holder d % 2 of it.
    assert [(s.src_rank, s.dst_rank) for s in plan(four, four, L, 2)] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # Decode replicas of a head from a prefill worker holding it once: each gets its own copy.
    assert [(s.src_rank, s.dst_rank, s.heads) for s in plan(tp([(0, 2)]), four, L, 2)] == [
        (0, 0, (0, 1)),
        (0, 1, (0, 1)),
        (0, 2, (1, 2)),
        (0, 3, (1, 2)),
    ]


def test_a_source_that_already_feeds_the_previous_head_keeps_feeding():
    # Source ranks (0,2) and (1,3): head 1 is on both; after head 0 from rank 0, rank 0 goes on.
    assert plan(tp([(0, 2), (1, 3)]), tp([(0, 3)]), L, KV) == [
        whole_layers(0, 0, (0, 2), (0, 2), (0, 2)),
        whole_layers(1, 0, (2, 3), (1, 2), (2, 3)),
    ]


# -- layers (pipeline stages) -----------------------------------------------------------------
def test_pp2_to_pp1_each_stage_fills_its_layers_of_the_one_rank():
    assert plan(grid(PP2, ONE), grid(PP1, ONE), L, KV) == [
        Slice(0, 0, (0, 15), (0, 3), (0, 15), (0, 3), (0, 15), (0, 3)),
        Slice(1, 0, (15, 30), (0, 3), (0, 15), (0, 3), (15, 30), (0, 3)),
    ]


def test_pp1_to_pp2_cuts_the_one_rank_into_both_stages():
    assert plan(grid(PP1, ONE), grid(PP2, ONE), L, KV) == [
        Slice(0, 0, (0, 15), (0, 3), (0, 15), (0, 3), (0, 15), (0, 3)),
        Slice(0, 1, (15, 30), (0, 3), (15, 30), (0, 3), (0, 15), (0, 3)),
    ]


def test_equal_stages_send_whole_caches_stage_to_stage():
    assert plan(grid(PP2, ONE), grid(PP2, ONE), L, KV) == [
        Slice(0, 0, (0, 15), (0, 3), (0, 15), (0, 3), (0, 15), (0, 3)),
        Slice(1, 1, (15, 30), (0, 3), (0, 15), (0, 3), (0, 15), (0, 3)),
    ]


def test_pp2_to_pp3_the_middle_stage_draws_on_both():
    assert plan(grid(PP2, ONE), grid(PP3, ONE), L, KV) == [
        Slice(0, 0, (0, 10), (0, 3), (0, 10), (0, 3), (0, 10), (0, 3)),
        Slice(0, 1, (10, 15), (0, 3), (10, 15), (0, 3), (0, 5), (0, 3)),
        Slice(1, 1, (15, 20), (0, 3), (0, 5), (0, 3), (5, 10), (0, 3)),
        Slice(1, 2, (20, 30), (0, 3), (5, 15), (0, 3), (0, 10), (0, 3)),
    ]


def test_tp2_pp2_to_one_rank_four_slices_each_rank_its_own():
    # Ranks 0, 1: stage 0 with heads 0-1 and 2; ranks 2, 3: stage 1.
    assert plan(grid(PP2, TWO), grid(PP1, ONE), L, KV) == [
        Slice(0, 0, (0, 15), (0, 2), (0, 15), (0, 2), (0, 15), (0, 2)),
        Slice(1, 0, (0, 15), (2, 3), (0, 15), (0, 1), (0, 15), (2, 3)),
        Slice(2, 0, (15, 30), (0, 2), (0, 15), (0, 2), (15, 30), (0, 2)),
        Slice(3, 0, (15, 30), (2, 3), (0, 15), (0, 1), (15, 30), (2, 3)),
    ]


def test_pp2_to_tp2_each_stage_feeds_both_head_ranges():
    assert plan(grid(PP2, ONE), grid(PP1, TWO), L, KV) == [
        Slice(0, 0, (0, 15), (0, 2), (0, 15), (0, 2), (0, 15), (0, 2)),
        Slice(1, 0, (15, 30), (0, 2), (0, 15), (0, 2), (15, 30), (0, 2)),
        Slice(0, 1, (0, 15), (2, 3), (0, 15), (2, 3), (0, 15), (0, 1)),
        Slice(1, 1, (15, 30), (2, 3), (0, 15), (2, 3), (15, 30), (0, 1)),
    ]


def test_a_source_spanning_another_sources_stage_boundary_sends_one_slice():
    # Rank 0 holds heads 0-1 of every layer; heads 2 are split at layer 15 over ranks 1 and 2.
    src = [Shard(ALL, (0, 2)), Shard((0, 15), (2, 3)), Shard((15, 30), (2, 3))]
    assert plan(src, grid(PP1, ONE), L, KV) == [
        Slice(0, 0, (0, 30), (0, 2), (0, 30), (0, 2), (0, 30), (0, 2)),
        Slice(1, 0, (0, 15), (2, 3), (0, 15), (0, 1), (0, 15), (2, 3)),
        Slice(2, 0, (15, 30), (2, 3), (0, 15), (0, 1), (15, 30), (2, 3)),
    ]


@pytest.mark.parametrize("src_stages", [PP1, PP2, PP3])
@pytest.mark.parametrize("src_heads", [ONE, TWO, THREE])
@pytest.mark.parametrize("dst_stages", [PP1, PP2, PP3])
@pytest.mark.parametrize("dst_heads", [ONE, TWO, THREE])
def test_every_cell_exactly_once_from_a_rank_that_holds_it(src_stages, src_heads, dst_stages, dst_heads):
    src, dst = grid(src_stages, src_heads), grid(dst_stages, dst_heads)
    slices = plan(src, dst, L, KV)
    assert {s for r in range(len(src)) for s in from_rank(slices, r)} == set(slices)
    for d, shard in enumerate(dst):
        got = sorted(
            (layer, h)
            for s in slices
            if s.dst_rank == d
            for layer in range(*s.layers)
            for h in range(*s.heads)
        )
        assert got == [(layer, h) for layer in range(*shard.layers) for h in range(*shard.heads)]
        assert received_cells(slices, d) == len(got)
    for s in slices:
        held, into = src[s.src_rank], dst[s.dst_rank]
        # The local ranges are the model's, shifted by each rank's first layer and head.
        assert s.src_layers == (s.layers[0] - held.layers[0], s.layers[1] - held.layers[0])
        assert s.src_heads == (s.heads[0] - held.heads[0], s.heads[1] - held.heads[0])
        assert s.dst_layers == (s.layers[0] - into.layers[0], s.layers[1] - into.layers[0])
        assert s.dst_heads == (s.heads[0] - into.heads[0], s.heads[1] - into.heads[0])
        assert held.layers[0] <= s.layers[0] < s.layers[1] <= held.layers[1]
        assert held.heads[0] <= s.heads[0] < s.heads[1] <= held.heads[1]


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "src, dst, message",
    [
        (tp([(0, 2)]), tp(ONE), "prefill ranks: no rank holds KV heads \\[2\\]$"),
        (tp(ONE), tp([(0, 4)]), "decode ranks: KV head ranges \\[\\(0, 4\\)\\] outside"),
        ([], tp(ONE), "prefill ranks: no ranks"),
        (tp(ONE), tp([(1, 1), (0, 3)]), "outside"),
        # A decode worker whose ranks leave out a stage's layers.
        (tp(ONE), grid([(0, 15)], ONE), "decode ranks: no rank holds layers 15-29$"),
        (grid(PP2, ONE), grid([(0, 15), (16, 30)], ONE), "decode ranks: no rank holds layer 15$"),
        # Heads missing from some layers only.
        (
            [Shard(ALL, (0, 2)), Shard((0, 15), (2, 3))],
            tp(ONE),
            "prefill ranks: no rank holds KV heads \\[2\\] of layers 15-29$",
        ),
        (tp(ONE), grid([(0, 31)], ONE), "decode ranks: layer ranges \\[\\(0, 31\\)\\] outside \\[0, 30\\)"),
    ],
)
def test_shards_that_do_not_hold_the_model_are_refused(src, dst, message):
    with pytest.raises(ValueError, match=message):
        plan(src, dst, L, KV)


def test_the_planner_imports_with_torch_blocked():
    code = "import sys; sys.modules['torch'] = None; import baton.common.transfer.reshard"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
