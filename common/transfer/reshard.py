"""Which part of the KV cache each prefill rank sends to each decode rank, when the two workers run
at different tensor- or pipeline-parallel degrees. No torch.

Each rank of either worker holds a *shard* of the model's KV: a contiguous run of layers (its
pipeline stage's, ``stage_layers`` in ``common/model/pipeline_parallel.py``) times a contiguous run
of KV heads (its tensor-parallel index's, ``head_split`` in ``common/model/tensor_parallel.py``; a
head is replicated on several ranks where the degree exceeds the KV heads). A decode rank must
receive exactly its (layer, head) cells, each once: from the one source rank that holds it, or,
for a cell replicated on the prefill side, from one of its holders. Nothing is gathered on one
rank: every slice goes straight from the rank that computed it to the rank that needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

HeadRange = tuple[int, int]
"""KV heads ``[start, end)``."""
LayerRange = tuple[int, int]
"""Layers ``[start, end)``."""


@dataclass(frozen=True)
class Shard:
    """What one rank's cache holds of the model's KV: layers ``layers`` x KV heads ``heads`` (its
    cache's layer 0 and head 0 are the first of each)."""

    layers: LayerRange
    heads: HeadRange


@dataclass(frozen=True)
class Slice:
    """One stream of the re-sharded transfer: layers ``layers`` x heads ``heads`` of every block,
    from ``src_rank``'s cache to ``dst_rank``'s."""

    src_rank: int
    dst_rank: int
    layers: LayerRange
    """The model's layers this slice carries."""
    heads: HeadRange
    """The model's KV heads this slice carries."""
    src_layers: LayerRange
    """The same layers as indices into the source rank's cache (its own layers start at 0)."""
    src_heads: HeadRange
    """The same heads as indices into the source rank's cache."""
    dst_layers: LayerRange
    """The same layers as indices into the destination rank's cache."""
    dst_heads: HeadRange
    """The same heads as indices into the destination rank's cache."""

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


def _bad(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    return [r for r in ranges if not 0 <= r[0] < r[1] <= n]


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted ``values`` as runs ``[start, end)`` of consecutive ones."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1] = (out[-1][0], v + 1)
        else:
            out.append((v, v + 1))
    return out


def _describe_missing(missing: dict[int, list[int]], num_layers: int, num_kv_heads: int) -> str:
    """The (layer -> heads) no rank holds, in words: ``KV heads [2]`` where every layer misses the
    same heads, else per run of layers, e.g. ``layers 15-29`` or ``KV heads [2] of layers 0-14``."""
    kinds = {tuple(h) for h in missing.values()}
    if len(missing) == num_layers and len(kinds) == 1:
        return f"KV heads {missing[0]}"
    parts = []
    for heads in sorted(kinds):
        for a, b in _runs(sorted(layer for layer, h in missing.items() if tuple(h) == heads)):
            span = f"layer {a}" if b == a + 1 else f"layers {a}-{b - 1}"
            parts.append(span if len(heads) == num_kv_heads else f"KV heads {list(heads)} of {span}")
    return "; ".join(parts)


def check_shards(shards: Sequence[Shard], num_layers: int, num_kv_heads: int, what: str) -> list[Shard]:
    """``shards`` whose ranges lie in ``[0, num_layers)`` x ``[0, num_kv_heads)`` and together hold
    every (layer, head) cell; ValueError naming ``what`` and what is missing otherwise."""
    out = [Shard((int(s.layers[0]), int(s.layers[1])), (int(s.heads[0]), int(s.heads[1]))) for s in shards]
    if not out:
        raise ValueError(f"{what}: no ranks")
    if bad := _bad([s.heads for s in out], num_kv_heads):
        raise ValueError(f"{what}: KV head ranges {bad} outside [0, {num_kv_heads})")
    if bad := _bad([s.layers for s in out], num_layers):
        raise ValueError(f"{what}: layer ranges {bad} outside [0, {num_layers})")
    missing = {}
    for layer in range(num_layers):
        heads = [h for h in range(num_kv_heads) if not _holders(out, (layer, layer + 1), h)]
        if heads:
            missing[layer] = heads
    if missing:
        raise ValueError(f"{what}: no rank holds {_describe_missing(missing, num_layers, num_kv_heads)}")
    return out


def _holders(src: list[Shard], layers: LayerRange, head: int) -> list[int]:
    """The ranks holding ``head`` of every layer in ``layers``."""
    return [
        rank
        for rank, s in enumerate(src)
        if s.heads[0] <= head < s.heads[1] and s.layers[0] <= layers[0] and layers[1] <= s.layers[1]
    ]


def _segments(src: list[Shard], layers: LayerRange) -> list[LayerRange]:
    """``layers`` cut at every source shard's layer boundaries: each source holds all or none of a
    segment's layers."""
    a, b = layers
    cuts = sorted({a, b} | {x for s in src for x in s.layers if a < x < b})
    return list(zip(cuts, cuts[1:]))


def _head_runs(
    src: list[Shard], layers: LayerRange, heads: HeadRange, dst_rank: int
) -> list[tuple[int, HeadRange]]:
    """(source rank, heads) feeding ``heads`` of the segment ``layers`` to ``dst_rank``: a head held
    by several source ranks comes from the one already feeding the previous head where it can
    (fewer, longer slices), else from holder ``dst_rank % holders``, so that destination replicas
    draw on different source replicas."""
    runs: list[tuple[int, HeadRange]] = []
    for h in range(*heads):
        holders = _holders(src, layers, h)
        prev = runs[-1][0] if runs else None
        rank = prev if prev in holders else holders[dst_rank % len(holders)]
        if runs and runs[-1][0] == rank:
            runs[-1] = (rank, (runs[-1][1][0], h + 1))
        else:
            runs.append((rank, (h, h + 1)))
    return runs


def _slice(
    src: Shard, dst: Shard, src_rank: int, dst_rank: int, layers: LayerRange, heads: HeadRange
) -> Slice:
    def local(r: tuple[int, int], base: int) -> tuple[int, int]:
        return (r[0] - base, r[1] - base)

    return Slice(
        src_rank, dst_rank, layers, heads,
        local(layers, src.layers[0]), local(heads, src.heads[0]),
        local(layers, dst.layers[0]), local(heads, dst.heads[0]),
    )  # fmt: skip


def _merge_layers(slices: list[Slice]) -> list[Slice]:
    """Slices of one destination that continue each other's layers from the same source with the
    same heads, as one (a source spanning segments that another source's boundaries cut)."""
    out: list[Slice] = []
    for s in slices:
        for i, o in enumerate(out):
            key = (o.src_rank, o.dst_rank, o.heads)
            if key == (s.src_rank, s.dst_rank, s.heads) and o.layers[1] == s.layers[0]:
                out[i] = replace(
                    o,
                    layers=(o.layers[0], s.layers[1]),
                    src_layers=(o.src_layers[0], s.src_layers[1]),
                    dst_layers=(o.dst_layers[0], s.dst_layers[1]),
                )
                break
        else:
            out.append(s)
    return out


def plan(src: Sequence[Shard], dst: Sequence[Shard], num_layers: int, num_kv_heads: int) -> list[Slice]:
    """The slices that give every destination rank its (layer, head) cells, each cell once.

    Each destination's layers are cut where a source shard starts or ends; within a cut, heads are
    assigned as ``_head_runs`` says; consecutive heads, and then consecutive layers, from the same
    source merge into one slice. Ordered by destination rank, then layer, then head. ValueError if
    either side's shards do not hold every cell of the model.
    """
    src_shards = check_shards(src, num_layers, num_kv_heads, "prefill ranks")
    dst_shards = check_shards(dst, num_layers, num_kv_heads, "decode ranks")
    out: list[Slice] = []
    for d, shard in enumerate(dst_shards):
        mine = []
        for seg in _segments(src_shards, shard.layers):
            for rank, heads in _head_runs(src_shards, seg, shard.heads, d):
                mine.append(_slice(src_shards[rank], shard, rank, d, seg, heads))
        out += sorted(_merge_layers(mine), key=lambda s: (s.layers[0], s.heads[0]))
    return out


def from_rank(slices: Sequence[Slice], src_rank: int) -> list[Slice]:
    """The slices one source rank sends."""
    return [s for s in slices if s.src_rank == src_rank]


def received_cells(slices: Sequence[Slice], dst_rank: int) -> int:
    """How many (layer, KV head) cells of each block ``dst_rank`` receives (its share of the
    transfer: a cell is ``2 x block_size x head_dim`` values)."""
    return sum(s.num_layers * s.num_heads for s in slices if s.dst_rank == dst_rank)
