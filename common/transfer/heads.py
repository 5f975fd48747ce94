"""UCX transfers of some of a block's KV heads: what a re-sharded transfer (``reshard.py``) moves
between workers at different tensor-parallel degrees.

A block ``[L, 2, KV, bs, row]`` holds its heads strided: heads ``[h0, h1)`` are ``2 * L`` separate
runs of ``(h1 - h0) * bs * row`` elements. A message carries them *packed*, ``[count, L, 2, h1 -
h0, bs, row]`` per run of blocks: one payload per run, as for whole blocks, instead of ``2 * L``
small ones per block (for SmolLM2 at bs 16 that would be 60 messages of 4-8 KB per block, each
one a few hundred microseconds of UCX and event-loop hand-offs here). A side that moves all of its
own heads needs no staging: the sender sends its blocks as they are, the receiver receives
straight into its blocks. Otherwise the sender packs a copy and the receiver receives into scratch
and copies the heads into place.

The receiver counts (block, head) units, so that a block whose heads come from several prefill
ranks, in separate messages, lands when the last of them has.
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


def _as_bytes(t: torch.Tensor) -> Any:
    """A contiguous tensor ``[count, ...]`` as a ``[count, bytes]`` buffer UCX can read or write."""
    flat = t.view(torch.uint8).view(t.shape[0], -1)
    return flat.numpy() if flat.device.type == "cpu" else flat


class HeadSliceSender(UcxSender):
    """Sends heads ``src_heads`` of this cache's blocks into heads ``dst_heads`` of the receiver's
    (a ``HeadSliceReceiver``)."""

    def __init__(
        self,
        config: TransferConfig,
        cache: torch.Tensor,
        src_heads: tuple[int, int],
        dst_heads: tuple[int, int],
    ) -> None:
        super().__init__(config, cache)
        if src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]:
            raise ValueError(f"source heads {src_heads} and destination heads {dst_heads} differ in count")
        if not 0 <= src_heads[0] < src_heads[1] <= cache.shape[3]:
            raise ValueError(f"source heads {src_heads} outside this cache's {cache.shape[3]}")
        self.src_heads = src_heads
        self.dst_heads = dst_heads
        self._whole = src_heads == (0, cache.shape[3])

    def _plan(self, transfer_id: str, src: Sequence[int], dst: Sequence[int]) -> tuple[list[Run], bytes]:
        return plan_message(transfer_id, src, dst, len(self._cache), heads=self.dst_heads)

    def _payloads(self, runs: list[Run]) -> list[Any]:
        if self._whole:
            return super()._payloads(runs)
        h0, h1 = self.src_heads
        # [count, L, 2, h1 - h0, bs, row]: a packed copy, alive until the message is sent. Inference
        # mode: a tensor-parallel rank's cache was made in it, and this runs on the UCX thread.
        with torch.inference_mode():
            return [_as_bytes(self._cache[r.src : r.src + r.count, :, :, h0:h1].contiguous()) for r in runs]


class HeadSliceReceiver(UcxReceiver):
    """A ``UcxReceiver`` that also takes messages carrying some of its heads (``Header.heads``);
    messages without are whole blocks, as before. A block has landed once all its heads have."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        super().__init__(config, cache)
        self._heads = cache.shape[3]  # [num_blocks, L, 2, KV, bs, row]

    # -- the table counts unit ``block * heads + head`` --------------------------------------------
    def _units(self, block_ids: Sequence[int], heads: tuple[int, int]) -> list[int]:
        return [b * self._heads + h for b in block_ids for h in range(*heads)]

    def _blocks(self, units: frozenset[int]) -> frozenset[int]:
        """Blocks all of whose heads are among ``units``."""
        seen: dict[int, int] = {}
        for u in units:
            seen[u // self._heads] = seen.get(u // self._heads, 0) + 1
        return frozenset(b for b, n in seen.items() if n == self._heads)

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle:
        ids = check_block_ids(dst_block_ids, len(self._cache), "destination")
        inner = self._table.expect(transfer_id, self._units(ids, (0, self._heads)), timeout_s)
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
        return TransferProgress(
            p.blocks_landed // self._heads, p.blocks_expected // self._heads, p.last_landed
        )

    def _message_heads(self, header: Header) -> tuple[int, int]:
        heads = header.heads or (0, self._heads)
        if not 0 <= heads[0] < heads[1] <= self._heads:
            raise ValueError(f"heads {heads} outside this cache's {self._heads}")
        return heads

    def _partial(self, header: Header) -> bool:
        return header.heads is not None and tuple(header.heads) != (0, self._heads)

    def _claim(self, header: Header, peer: int) -> bool:
        try:
            units = self._units(header.dst_block_ids(), self._message_heads(header))
        except ValueError:
            return False  # received into scratch and dropped; the transfer's deadline fails it
        return self._table.claim(header.transfer_id, units, peer=peer)

    def _targets(self, header: Header, landing: bool) -> list[Any]:
        if not self._partial(header):
            return super()._targets(header, landing)
        h0, h1 = header.heads  # type: ignore[misc]
        per_block = self._block_bytes * max(0, h1 - h0) // self._heads
        if not landing:
            return [bytearray(count * per_block) for _, count in header.runs]
        shape = tuple(self._cache.shape[1:3]) + (h1 - h0,) + tuple(self._cache.shape[4:])
        return [
            _as_bytes(torch.empty((count, *shape), dtype=self._cache.dtype, device=self._cache.device))
            for _, count in header.runs
        ]

    def _settle(
        self, header: Header, landing: bool, targets: list[Any], seconds: float, error: TransferError | None
    ) -> None:
        heads = header.heads or (0, self._heads)
        try:
            units = self._units(header.dst_block_ids(), self._message_heads(header))
        except ValueError:
            units = []
        nbytes = len(units) * self._block_bytes // self._heads
        if not landing:
            self._table.drop(nbytes)
            return
        if error is None and self._partial(header):
            self._scatter(header, heads, targets)
        self._table.landed(header.transfer_id, units, nbytes, seconds, error)

    def _scatter(self, header: Header, heads: tuple[int, int], staged: list[Any]) -> None:
        """Copy each run's packed heads into place in its blocks."""
        h0, h1 = heads
        shape = tuple(self._cache.shape[1:3]) + (h1 - h0,) + tuple(self._cache.shape[4:])
        with torch.inference_mode():  # as the sender's packing
            for (start, count), buf in zip(header.runs, staged):
                src = torch.as_tensor(buf).view(self._cache.dtype).view(count, *shape)
                self._cache[start : start + count, :, :, h0:h1].copy_(src)
