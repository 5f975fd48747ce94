"""Transport-independent state of both sides: counters, a sender's ledger of sends per transfer, and
a receiver's table of expected transfers. Thread-safe; no torch, no I/O.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from baton.common.transfer.base import (
    KVReceiver,
    TransferConfig,
    TransferError,
    TransferHandle,
    TransferProgress,
    TransferStats,
    all_of,
)
from baton.common.transfer.wire import check_block_ids


class Counters:
    """Mutable ``TransferStats`` behind a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()

    def add(self, **deltas: float) -> None:
        with self._lock:
            current = self._stats
            self._stats = replace(current, **{k: getattr(current, k) + v for k, v in deltas.items()})

    def snapshot(self) -> TransferStats:
        with self._lock:
            return self._stats


class SendLedger:
    """A sender's handles per transfer id, so that ``finish`` can wait on all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, list[TransferHandle]] = {}
        self._open: set[TransferHandle] = set()

    def add(self, handle: TransferHandle) -> None:
        with self._lock:
            self._handles.setdefault(handle.transfer_id, []).append(handle)
            self._open.add(handle)
        handle.add_done_callback(self._closed)

    def fail_all(self, error: TransferError) -> None:
        """Fail every send not done yet (the sender is closing)."""
        with self._lock:
            handles = list(self._open)
        for handle in handles:
            handle.set_error(error)

    def _closed(self, handle: TransferHandle) -> None:
        with self._lock:
            self._open.discard(handle)

    def finish(self, transfer_id: str) -> TransferHandle:
        with self._lock:
            handles = self._handles.pop(transfer_id, [])
        return all_of(transfer_id, handles)


class FaultHold:
    """``TransferConfig.fault_hold_payload_after_blocks`` (test only): which messages a sender
    sends whole, which it stops in the middle of, and which it never starts."""

    WHOLE, HEAD_ONLY, NOTHING = "whole", "head only", "nothing"

    def __init__(self, after_blocks: int) -> None:
        self._after = after_blocks
        self._lock = threading.Lock()
        self._sent: dict[str, int] = {}
        self._held: set[str] = set()

    def next_message(self, transfer_id: str, num_blocks: int) -> str:
        """How to send the next message of ``transfer_id``, ``num_blocks`` blocks long."""
        if not self._after:
            return self.WHOLE
        with self._lock:
            if transfer_id in self._held:
                return self.NOTHING
            sent = self._sent.get(transfer_id, 0)
            if sent < self._after:
                self._sent[transfer_id] = sent + num_blocks
                return self.WHOLE
            self._held.add(transfer_id)
            return self.HEAD_ONLY


LOST_KEPT = 4096
"""Transfers given up with ``sender_lost`` that a receiver remembers (the oldest are forgotten)."""


@dataclass
class _Expected:
    handle: TransferHandle
    blocks: frozenset[int]
    remaining: set[int]
    deadline: float
    writing: set[int] = field(default_factory=set)
    inflight: int = 0
    """Messages being written into this transfer's blocks right now."""
    landed: set[int] = field(default_factory=set)
    """Blocks whose payload landed whole while the transfer was live."""
    last_landed: float | None = None
    nbytes: int = 0
    peers: set[Hashable] = field(default_factory=set)
    error: TransferError | None = None
    """Set once failed or cancelled; the handle fails when ``inflight`` drops to 0 (or at
    ``hard_deadline``, for a message that never completes)."""
    hard_deadline: float = 0.0


class ExpectedTransfers:
    """The receiver's table: which destination blocks each pending transfer still waits for.

    Transports call ``claim`` when a message's header arrives (True: receive its payload into the
    cache; False: into scratch, then ``drop``), then ``landed`` once the payload is in. A periodic
    ``sweep`` enforces deadlines.
    """

    def __init__(self, timeout_s: float, counters: Counters) -> None:
        self._timeout_s = timeout_s
        self._counters = counters
        self._lock = threading.Lock()
        self._pending: dict[str, _Expected] = {}
        self._owner: dict[int, str] = {}  # destination block -> pending transfer id
        self._lost: OrderedDict[str, None] = OrderedDict()  # the last LOST_KEPT sender_lost ids

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle:
        ids = set(dst_block_ids)
        handle = TransferHandle(transfer_id)
        with self._lock:
            if transfer_id in self._pending:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            taken = sorted(i for i in ids if i in self._owner)
            if taken:
                raise ValueError(f"blocks {taken[:8]} already belong to a pending transfer")
            if not ids:
                handle.set_result(0)
                return handle
            deadline = time.monotonic() + (timeout_s or self._timeout_s)
            self._pending[transfer_id] = _Expected(handle, frozenset(ids), set(ids), deadline)
            self._owner.update((i, transfer_id) for i in ids)
        return handle

    def claim(self, transfer_id: str, dst_block_ids: Sequence[int], peer: Hashable) -> bool:
        """Reserve ``dst_block_ids`` of a live transfer for one incoming message."""
        ids = set(dst_block_ids)
        with self._lock:
            entry = self._pending.get(transfer_id)
            if entry is None or entry.error is not None:
                return False
            now = time.monotonic()
            if now >= entry.deadline:  # expired, the sweep has not run yet: nothing more lands
                self._fail_locked(entry, TransferError(f"transfer {transfer_id!r} timed out"), now)
                done = self._settle_locked(entry, now)
                claimed = False
            else:
                claimed = self._claim_locked(entry, ids, len(dst_block_ids), peer, now)
                done = None if claimed else self._settle_locked(entry, now)
        self._complete(done)
        return claimed

    def _claim_locked(self, entry: _Expected, ids: set[int], count: int, peer: Hashable, now: float) -> bool:
        entry.peers.add(peer)
        if ids <= entry.remaining and len(ids) == count:
            entry.remaining -= ids
            entry.writing |= ids
            entry.inflight += 1
            return True
        tid = entry.handle.transfer_id
        self._fail_locked(entry, TransferError(f"transfer {tid!r}: unexpected blocks"), now)
        return False

    def landed(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        nbytes: int,
        seconds: float,
        error: TransferError | None = None,
    ) -> None:
        """A claimed message finished: its payload is in the cache, or ``error``."""
        done: tuple[TransferHandle, TransferError | None, int] | None = None
        with self._lock:
            entry = self._pending.get(transfer_id)
            if entry is None:
                return
            entry.inflight -= 1
            entry.writing -= set(dst_block_ids)
            now = time.monotonic()
            if error is None and entry.error is None and now >= entry.deadline:
                error = TransferError(f"transfer {transfer_id!r} timed out")
            if error is None:
                entry.nbytes += nbytes
                self._counters.add(bytes=nbytes, seconds=seconds)
                if entry.error is None:
                    entry.landed |= set(dst_block_ids)
                    entry.last_landed = now
            else:
                self._fail_locked(entry, error, now)
            done = self._settle_locked(entry, now)
        self._complete(done)

    def drop(self, nbytes: int) -> None:
        self._counters.add(dropped_bytes=nbytes)

    def cancel(self, transfer_id: str, sender_lost: bool = False) -> None:
        if sender_lost:
            with self._lock:
                self._lost[transfer_id] = None
                while len(self._lost) > LOST_KEPT:
                    self._lost.popitem(last=False)
        self._fail(lambda tid, e: tid == transfer_id, TransferError(f"transfer {transfer_id!r} cancelled"))

    def sender_lost(self, transfer_id: str) -> bool:
        """Whether the transfer was given up because its sender is unreachable (``cancel``)."""
        with self._lock:
            return transfer_id in self._lost

    def fail_peer(self, peer: Hashable, error: TransferError) -> None:
        """The transport lost ``peer``: fail every transfer it had started writing."""
        self._fail(lambda tid, e: peer in e.peers, error)

    def close(self, error: TransferError) -> None:
        self._fail(lambda tid, e: True, error)
        self.sweep(float("inf"))

    def sweep(self, now: float | None = None) -> None:
        """Fail transfers past their deadline; complete failed ones that nothing writes any more."""
        now = time.monotonic() if now is None else now
        done = []
        with self._lock:
            for entry in list(self._pending.values()):
                if entry.error is None and now >= entry.deadline:
                    tid = entry.handle.transfer_id
                    self._fail_locked(entry, TransferError(f"transfer {tid!r} timed out"), now)
                done.append(self._settle_locked(entry, now))
        for item in done:
            self._complete(item)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def progress(self, transfer_id: str) -> TransferProgress | None:
        with self._lock:
            entry = self._pending.get(transfer_id)
            if entry is None:
                return None
            return TransferProgress(
                len(entry.landed),
                len(entry.blocks),
                entry.last_landed,
                frozenset(entry.landed),
                frozenset(entry.writing),
            )

    # -- internals (``_locked``: caller holds the lock) -----------------------------------------
    def _fail(self, match, error: TransferError) -> None:
        done = []
        now = time.monotonic()
        with self._lock:
            for tid, entry in list(self._pending.items()):
                if match(tid, entry):
                    self._fail_locked(entry, error, now)
                    done.append(self._settle_locked(entry, now))
        for item in done:
            self._complete(item)

    def _fail_locked(self, entry: _Expected, error: TransferError, now: float) -> None:
        if entry.error is None:
            entry.error = error
            entry.hard_deadline = now + self._timeout_s

    def _settle_locked(
        self, entry: _Expected, now: float
    ) -> tuple[TransferHandle, TransferError | None, int] | None:
        """Remove a finished entry and say how to complete its handle, or None if still open."""
        succeeded = entry.error is None and not entry.remaining and entry.inflight == 0
        failed = entry.error is not None and (entry.inflight == 0 or now >= entry.hard_deadline)
        if not (succeeded or failed):
            return None
        tid = entry.handle.transfer_id
        del self._pending[tid]
        for i in entry.blocks:
            self._owner.pop(i, None)
        self._counters.add(**{"transfers_ok" if succeeded else "transfers_failed": 1})
        entry.handle.landed_block_ids = frozenset(entry.landed)
        return entry.handle, entry.error, entry.nbytes

    @staticmethod
    def _complete(item: tuple[TransferHandle, TransferError | None, int] | None) -> None:
        if item is None:
            return
        handle, error, nbytes = item
        if error is None:
            handle.set_result(nbytes)
        else:
            handle.set_error(error)


class TableReceiver(KVReceiver):
    """The receiver side both backends share: the expected-transfer table and its counters.
    Subclasses move the bytes (``start``, ``close``) and report landings to ``self._table``."""

    def __init__(self, config: TransferConfig, cache) -> None:
        self.config = config
        self._cache = cache
        self._counters = Counters()
        self._table = ExpectedTransfers(config.timeout_s, self._counters)

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle:
        ids = check_block_ids(dst_block_ids, len(self._cache), "destination")
        return self._table.expect(transfer_id, ids, timeout_s)

    def cancel(self, transfer_id: str, sender_lost: bool = False) -> None:
        self._table.cancel(transfer_id, sender_lost)

    def progress(self, transfer_id: str) -> TransferProgress | None:
        return self._table.progress(transfer_id)

    def stats(self) -> TransferStats:
        return self._counters.snapshot()
