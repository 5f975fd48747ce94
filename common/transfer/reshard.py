"""Which KV heads each prefill rank sends to each decode rank, when the two workers run at different
tensor-parallel degrees. No torch.

Each rank of either worker holds a contiguous run of the model's KV heads (``head_split`` in
``common/model/tensor_parallel.py``; a head is replicated on several ranks where the degree exceeds
the KV heads). A decode rank must receive exactly its heads, each once: from the one source rank
that holds it, or, for a head replicated on the prefill side, from one of its holders. Nothing is
gathered on one rank: every slice goes straight from the rank that computed it to the rank that
needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HeadRange = tuple[int, int]
"""KV heads ``[start, end)``."""


@dataclass(frozen=True)
class Slice:
    """One stream of the re-sharded transfer: heads ``heads`` of every block, from ``src_rank``'s
    cache to ``dst_rank``'s."""

    src_rank: int
    dst_rank: int
    heads: HeadRange
    """The model's KV heads this slice carries."""
    src_heads: HeadRange
    """The same heads as indices into the source rank's cache (its own heads start at 0)."""
    dst_heads: HeadRange
    """The same heads as indices into the destination rank's cache."""

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def check_ranges(ranges: Sequence[HeadRange], num_kv_heads: int, what: str) -> list[HeadRange]:
    """``ranges`` as a list of ``(start, end)`` that lie in ``[0, num_kv_heads)`` and together hold
    every head; ValueError naming ``what`` otherwise."""
    out = [(int(a), int(b)) for a, b in ranges]
    if not out:
        raise ValueError(f"{what}: no ranks")
    bad = [r for r in out if not 0 <= r[0] < r[1] <= num_kv_heads]
    if bad:
        raise ValueError(f"{what}: KV head ranges {bad} outside [0, {num_kv_heads})")
    held = {h for a, b in out for h in range(a, b)}
    if len(held) != num_kv_heads:
        missing = sorted(set(range(num_kv_heads)) - held)
        raise ValueError(f"{what}: no rank holds KV heads {missing}")
    return out


def _holders(src: list[HeadRange], head: int) -> list[int]:
    return [rank for rank, (a, b) in enumerate(src) if a <= head < b]


def plan(src: Sequence[HeadRange], dst: Sequence[HeadRange], num_kv_heads: int) -> list[Slice]:
    """The slices that give every destination rank its heads, each head once.

    A head held by several source ranks comes from the one already feeding the destination's
    previous head where it can (fewer, longer slices), else from holder ``dst_rank % holders``, so
    that destination replicas of it draw on different source replicas. Consecutive heads from the
    same source merge into one slice. Ordered by destination rank, then head.
    """
    src_ranges = check_ranges(src, num_kv_heads, "prefill ranks")
    dst_ranges = check_ranges(dst, num_kv_heads, "decode ranks")
    out: list[Slice] = []
    for d, (c0, c1) in enumerate(dst_ranges):
        runs: list[tuple[int, int, int]] = []  # (source rank, first head, end head)
        for h in range(c0, c1):
            holders = _holders(src_ranges, h)
            prev = runs[-1][0] if runs else None
            rank = prev if prev in holders else holders[d % len(holders)]
            if runs and runs[-1][0] == rank:
                runs[-1] = (rank, runs[-1][1], h + 1)
            else:
                runs.append((rank, h, h + 1))
        for rank, h0, h1 in runs:
            a = src_ranges[rank][0]
            out.append(Slice(rank, d, (h0, h1), (h0 - a, h1 - a), (h0 - c0, h1 - c0)))
    return out


def from_rank(slices: Sequence[Slice], src_rank: int) -> list[Slice]:
    """The slices one source rank sends."""
    return [s for s in slices if s.src_rank == src_rank]


def received_heads(slices: Sequence[Slice], dst_rank: int) -> int:
    """How many KV heads of each block ``dst_rank`` receives (its share of the transfer)."""
    return sum(s.num_heads for s in slices if s.dst_rank == dst_rank)
