"""UCX transfers of part of each block, some of its KV heads or layers or both: what a re-sharded
transfer (``reshard.py``) moves between workers at different tensor- or pipeline-parallel degrees.

A block ``[L, 2, KV, bs, row]`` holds its heads strided: heads ``[h0, h1)`` are ``2 * L`` separate
runs of ``(h1 - h0) * bs * row`` elements. A message of head slices carries them *packed*,
``[count, L, 2, h1 - h0, bs, row]`` per run of blocks: one payload per run, as for whole blocks,
instead of ``2 * L`` small ones per block (for SmolLM2 at bs 16 that would be 60 messages of 4-8 KB
per block, each one a few hundred microseconds of UCX and event-loop hand-offs here).

Layers are the outer dimension: layers ``[l0, l1)`` of one block with all its heads are one
contiguous region of the cache. A message of layer slices (``Header.layers``, a pipeline stage's
part) therefore has one payload per block, ``[1, l1 - l0, 2, heads, bs, row]``.

Either side moves a payload in place where its region of its cache is contiguous (whole blocks; a
layer range of one block with all its heads): the sender sends from its blocks, the receiver
receives into them. Otherwise the sender packs a copy, and the receiver receives into scratch and
copies the cells into place.

The receiver counts (block, layer, head) units, so that a block whose cells come from several
prefill ranks, in separate messages, lands when the last of them has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from baton.common.transfer.base import (
    TransferConfig,
    TransferError,
    TransferHandle,
    TransferProgress,
)
from baton.common.transfer.ucx import UcxReceiver, UcxSender
from baton.common.transfer.wire import Header, Run, check_block_ids, plan_message

Range = tuple[int, int]


def _as_bytes(t: torch.Tensor) -> Any:
    """A contiguous tensor ``[count, ...]`` as a ``[count, bytes]`` buffer UCX can read or write."""
    flat = t.view(torch.uint8).view(t.shape[0], -1)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _check_pair(src: Range, dst: Range, n: int, what: str) -> None:
    if src[1] - src[0] != dst[1] - dst[0]:
        raise ValueError(f"source {what} {src} and destination {what} {dst} differ in count")
    if not 0 <= src[0] < src[1] <= n:
        raise ValueError(f"source {what} {src} outside this cache's {n}")


class HeadSliceSender(UcxSender):
    """Sends layers ``src_layers`` x heads ``src_heads`` of this cache's blocks into layers
    ``dst_layers`` x heads ``dst_heads`` of the receiver's (a ``HeadSliceReceiver``). Layer ranges
    None: every layer of both caches (payloads per run of blocks, not per block)."""

    def __init__(
        self,
        config: TransferConfig,
        cache: torch.Tensor,
        src_heads: Range,
        dst_heads: Range,
        src_layers: Range | None = None,
        dst_layers: Range | None = None,
    ) -> None:
        super().__init__(config, cache)
        _check_pair(src_heads, dst_heads, cache.shape[3], "heads")  # [num_blocks, L, 2, KV, bs, row]
        if (src_layers is None) != (dst_layers is None):
            raise ValueError("give both source and destination layers, or neither")
        if src_layers is not None and dst_layers is not None:
            _check_pair(src_layers, dst_layers, cache.shape[1], "layers")
        self.src_heads = src_heads
        self.dst_heads = dst_heads
        self.src_layers = src_layers
        self.dst_layers = dst_layers
        self._whole = src_heads == (0, cache.shape[3]) and src_layers is None

    def _plan(self, transfer_id: str, src: Sequence[int], dst: Sequence[int]) -> tuple[list[Run], bytes]:
        return plan_message(
            transfer_id, src, dst, len(self._cache), heads=self.dst_heads, layers=self.dst_layers
        )

    def _payloads(self, runs: list[Run]) -> list[Any]:
        if self._whole:
            return super()._payloads(runs)
        l0, l1 = self.src_layers or (0, self._cache.shape[1])
        h0, h1 = self.src_heads
        if self.src_layers is None:
            pieces = [(r.src, r.count) for r in runs]
        else:
            pieces = [(r.src + i, 1) for r in runs for i in range(r.count)]
        # A contiguous region goes as it is (``contiguous`` returns it); any other as a packed copy,
        # alive until the message is sent. Inference mode: a parallel rank's cache was made in it,
        # and this runs on the UCX thread.
        with torch.inference_mode():
            return [_as_bytes(self._cache[s : s + n, l0:l1, :, h0:h1].contiguous()) for s, n in pieces]


class HeadSliceReceiver(UcxReceiver):
    """A ``UcxReceiver`` that also takes messages carrying some of its layers or heads
    (``Header.layers``, ``Header.heads``); messages without are whole blocks, as before. A block
    has landed once all its (layer, head) cells have."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        super().__init__(config, cache)
        self._layers, self._heads = cache.shape[1], cache.shape[3]  # [num_blocks, L, 2, KV, bs, row]
        self._cells = self._layers * self._heads
        """Units per block."""

    # -- the table counts unit ``(block * layers + layer) * heads + head`` -------------------------
    def _units(self, block_ids: Sequence[int], layers: Range, heads: Range) -> list[int]:
        return [
            (b * self._layers + layer) * self._heads + h
            for b in block_ids
            for layer in range(*layers)
            for h in range(*heads)
        ]

    def _blocks(self, units: frozenset[int]) -> frozenset[int]:
        """Blocks all of whose cells are among ``units``."""
        seen: dict[int, int] = {}
        for u in units:
            seen[u // self._cells] = seen.get(u // self._cells, 0) + 1
        return frozenset(b for b, n in seen.items() if n == self._cells)

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle:
        ids = check_block_ids(dst_block_ids, len(self._cache), "destination")
        units = self._units(ids, (0, self._layers), (0, self._heads))
        inner = self._table.expect(transfer_id, units, timeout_s)
        outer = TransferHandle(transfer_id)

        def done(h: TransferHandle) -> None:
            outer.landed_block_ids = self._blocks(h.landed_block_ids)
            error = h.exception()
            if error is None:
                outer.set_result(h.nbytes)
            else:
                outer.set_error(error)

        inner.add_done_callback(done)
        return outer

    def progress(self, transfer_id: str) -> TransferProgress | None:
        p = self._table.progress(transfer_id)
        if p is None:
            return None
        landed = None if p.landed_block_ids is None else self._blocks(p.landed_block_ids)
        writing = (
            None if p.writing_block_ids is None else frozenset(u // self._cells for u in p.writing_block_ids)
        )
        return TransferProgress(
            p.blocks_landed // self._cells, p.blocks_expected // self._cells, p.last_landed, landed, writing
        )

    # -- a message's cells and where its payloads go ---------------------------------------------
    def _message_cells(self, header: Header) -> tuple[Range, Range]:
        """The message's destination layers and heads (ValueError if outside this cache)."""
        layers = header.layers or (0, self._layers)
        heads = header.heads or (0, self._heads)
        if not 0 <= heads[0] < heads[1] <= self._heads:
            raise ValueError(f"heads {heads} outside this cache's {self._heads}")
        if not 0 <= layers[0] < layers[1] <= self._layers:
            raise ValueError(f"layers {layers} outside this cache's {self._layers}")
        return layers, heads

    def _regions(self, header: Header) -> list[torch.Tensor]:
        """The region of the cache each payload fills, in payload order."""
        (l0, l1), (h0, h1) = self._message_cells(header)
        return [self._cache[s : s + n, l0:l1, :, h0:h1] for s, n in header.pieces()]

    def _claim(self, header: Header, peer: int) -> bool:
        try:
            units = self._units(header.dst_block_ids(), *self._message_cells(header))
        except ValueError:
            return False  # received into scratch and dropped; the transfer's deadline fails it
        return self._table.claim(header.transfer_id, units, peer=peer)

    def _targets(self, header: Header, landing: bool) -> list[Any]:
        if not landing:
            return [bytearray(n * self._piece_bytes(header)) for _, n in header.pieces()]
        # In place where the region is contiguous, else into scratch that ``_scatter`` copies from.
        return [
            _as_bytes(r if r.is_contiguous() else torch.empty_like(r, memory_format=torch.contiguous_format))
            for r in self._regions(header)
        ]

    def _piece_bytes(self, header: Header) -> int:
        """Bytes of one block's cells in a message (a malformed range counts none)."""
        layers = header.layers or (0, self._layers)
        heads = header.heads or (0, self._heads)
        cells = max(0, layers[1] - layers[0]) * max(0, heads[1] - heads[0])
        return self._block_bytes * cells // self._cells

    def _settle(
        self, header: Header, landing: bool, targets: list[Any], seconds: float, error: TransferError | None
    ) -> None:
        try:
            units = self._units(header.dst_block_ids(), *self._message_cells(header))
        except ValueError:
            units = []
        nbytes = len(units) * self._block_bytes // self._cells
        if not landing:
            self._table.drop(nbytes)
            return
        if error is None:
            self._scatter(header, targets)
        self._table.landed(header.transfer_id, units, nbytes, seconds, error)

    def _scatter(self, header: Header, staged: list[Any]) -> None:
        """Copy each payload received into scratch into its place in the blocks."""
        with torch.inference_mode():  # as the sender's packing
            for region, buf in zip(self._regions(header), staged):
                if not region.is_contiguous():
                    region.copy_(torch.as_tensor(buf).view(region.dtype).view(region.shape))
