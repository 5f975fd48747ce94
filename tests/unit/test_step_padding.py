"""The row counts a step is padded to (``step_shapes.padded_num_tokens``): few shapes, little waste."""

from __future__ import annotations

from baton.common.engine.step_shapes import padded_num_tokens, token_buckets


def test_small_steps_run_exactly_and_large_ones_in_buckets():
    assert [padded_num_tokens(n) for n in (1, 2, 17, 64)] == [1, 2, 17, 64]
    assert [padded_num_tokens(n) for n in (65, 80, 81, 512, 513, 2048, 2049)] == [
        80,
        80,
        96,
        512,
        576,
        2048,
        2304,
    ]


def test_padding_wastes_at_most_an_eighth_and_never_shrinks():
    prev = 0
    for n in range(1, 8193):
        p = padded_num_tokens(n)
        assert n <= p <= n * 1.125 + 15, n  # within 12.5% (and a bucket of 16 at 65-80)
        assert p >= prev
        prev = p


def test_a_default_step_budget_has_few_shapes():
    buckets = token_buckets(2048)
    assert buckets[:64] == list(range(1, 65))
    assert len(buckets) == 64 + 28 + 24  # exact to 64, 16s to 512, 64s to 2048
    assert buckets[-1] == 2048
