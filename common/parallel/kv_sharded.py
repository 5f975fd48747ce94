"""Rank 0's side of a tensor- or pipeline-parallel worker's KV transport (``kv_ranks`` has the
commands and the other ranks' side): ``RankLink`` tells the ranks and reads their replies,
``ShardedReceiver`` and ``ShardedSender`` are the decode and prefill workers' ``KVReceiver`` and
``KVSender``, each a part here over rank 0's cache and a part in every other rank over its own."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import IO, Any

import torch

from baton.common.parallel.kv_ranks import (
    Cancel,
    Command,
    Connect,
    Disconnect,
    Expect,
    OpenReceiver,
    Reply,
    Route,
    Send,
    make_local_receiver,
    quietly,
    read_frame,
    route_sender,
)
from baton.common.parallel.ranks import RankFailedError
from baton.common.transfer.base import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferDescriptor,
    TransferError,
    TransferHandle,
    TransferProgress,
    TransferStats,
    all_of,
)
from baton.common.transfer.bookkeeping import SendLedger
from baton.common.transfer.reshard import Shard

log = logging.getLogger(__name__)


class ReplyHandle(TransferHandle):
    """Completes with a rank's ``Reply`` (kept in ``reply``)."""

    reply: Reply | None = None


class RankLink:
    """Rank 0's line to the other ranks' KV transport: commands down the model's pipes, replies
    read back on a thread per rank. A rank that exits fails everything waiting on it."""

    def __init__(self, model: Any):
        """``model``: a started ``TensorParallelModel`` (``driver.launch``) or
        ``PipelineParallelModel`` (``pipeline_driver.launch_pipeline``)."""
        self.model = model
        self.kind = model.kind
        self.size = len(model.workers) + 1
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, int, str], ReplyHandle] = {}
        self._gone: dict[int, str] = {}

    def start(self) -> RankLink:
        """Read each rank's replies. From a descriptor of our own: the model closes its pipe ends
        while a read may be blocked (a buffered file closed under a reader waits for it), and the
        ranks' ready lines were read whole before any command, so nothing is left buffered there."""
        for rank, p in enumerate(self.model.workers, 1):
            f = os.fdopen(os.dup(p.stdout.fileno()), "rb")
            name = f"baton-kv-rank{rank}"
            threading.Thread(target=self._read, args=(rank, f), name=name, daemon=True).start()
        return self

    def waiter(self, kind: str, rank: int, key: str) -> ReplyHandle:
        """A handle for rank ``rank``'s next ``kind`` reply about ``key`` (register before telling)."""
        handle = ReplyHandle(key)
        with self._lock:
            gone = self._gone.get(rank)
            if gone is None:
                self._waiting[(kind, rank, key)] = handle
        if gone is not None:
            handle.set_error(TransferError(gone))
        return handle

    def tell(self, command: Command, waiters: Sequence[ReplyHandle] = ()) -> None:
        """Send ``command`` to every other rank; a rank that is gone fails ``waiters``."""
        try:
            self.model.tell(command)
        except RankFailedError as e:
            for h in waiters:
                h.set_error(TransferError(str(e)))

    def _read(self, rank: int, f: IO[bytes]) -> None:
        with f:
            try:
                while (reply := read_frame(f)) is not None:
                    self._deliver(reply)
            except (OSError, ValueError, pickle.UnpicklingError) as e:
                log.error("%s rank %d: bad KV reply: %r", self.kind, rank, e)
        self._lost(rank, f"{self.kind} rank {rank} exited")

    def _deliver(self, reply: Reply) -> None:
        with self._lock:
            handle = self._waiting.pop((reply.kind, reply.rank, reply.key), None)
        if handle is None:
            return
        handle.reply = reply
        handle.landed_block_ids = frozenset(reply.landed)
        if reply.error is None:
            handle.set_result(reply.nbytes)
        else:
            handle.set_error(TransferError(reply.error))

    def _lost(self, rank: int, why: str) -> None:
        with self._lock:
            self._gone[rank] = why
            lost = [k for k in self._waiting if k[1] == rank]
            handles = [self._waiting.pop(k) for k in lost]
        for h in handles:
            h.set_error(TransferError(why))


def all_landed(transfer_id: str, handles: Sequence[TransferHandle]) -> TransferHandle:
    """``all_of`` that also keeps, in ``landed_block_ids``, the blocks landed on every part."""
    combined = TransferHandle(transfer_id)
    inner = all_of(transfer_id, handles)

    def done(h: TransferHandle) -> None:
        sets = [p.landed_block_ids for p in handles]
        combined.landed_block_ids = frozenset.intersection(*sets) if sets else frozenset()
        error = h.exception()
        if error is None:
            combined.set_result(h.nbytes)
        else:
            combined.set_error(error)

    inner.add_done_callback(done)
    return combined


class ShardedReceiver(KVReceiver):
    """A tensor- or pipeline-parallel decode worker's receivers: rank 0's here, the others' in
    their ranks."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor, link: RankLink, shards: Sequence[Shard]):
        """``cache``: rank 0's; ``shards``: each rank's layers and KV heads of the model's."""
        self.config = config
        self.shards = list(shards)
        self._cache = cache
        self._link = link
        self._local = make_local_receiver(config, cache)
        self._armed: dict[str, list[ReplyHandle]] = {}
        self._rank_bytes = [0] * link.size
        self.descriptors: list[TransferDescriptor] = []
        """Each rank's receiver, in rank order (after ``start``)."""

    def start(self) -> TransferDescriptor:
        own = self._local.start()
        waiters = [self._link.waiter("opened", r, "") for r in range(1, self._link.size)]
        self._link.tell(OpenReceiver(tuple(self._cache.shape), self._cache.dtype, self.config), waiters)
        others = []
        for h in waiters:
            h.wait(self.config.timeout_s)
            assert h.reply is not None
            others.append(TransferDescriptor.from_dict(json.loads(h.reply.data)))
        self.descriptors = [own, *others]
        return own

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle:
        local = self._local.expect(transfer_id, dst_block_ids, timeout_s)
        ranks = range(1, self._link.size)
        armed = [self._link.waiter("armed", r, transfer_id) for r in ranks]
        settled = [self._link.waiter("settled", r, transfer_id) for r in ranks]
        for rank, h in zip(ranks, settled):
            h.add_done_callback(lambda h, rank=rank: self._count(rank, h))
        self._armed[transfer_id] = armed
        command = Expect(
            transfer_id, tuple(int(b) for b in dst_block_ids), timeout_s or self.config.timeout_s
        )
        self._link.tell(command, [*armed, *settled])
        return all_landed(transfer_id, [local, *settled])

    def _count(self, rank: int, h: ReplyHandle) -> None:
        if h.reply is not None:
            self._rank_bytes[rank] = max(self._rank_bytes[rank], h.reply.total_bytes)

    async def ready(self, transfer_id: str, timeout_s: float) -> None:
        for h in self._armed.pop(transfer_id, []):
            await h.wait_async(timeout_s)

    def cancel(self, transfer_id: str, sender_lost: bool = False) -> None:
        self._armed.pop(transfer_id, None)
        self._local.cancel(transfer_id, sender_lost)
        self._link.tell(Cancel(transfer_id, sender_lost))

    def progress(self, transfer_id: str) -> TransferProgress | None:
        # Rank 0's: it is fed by prefill rank 0 under every plan (the first holder of layer 0's
        # head 0), whose stream moves in step with its worker's other ranks (one engine drives
        # them); a stream that stalls alone into another decode rank is caught by the transfer's
        # deadline instead. Which blocks landed or are being written it cannot say for the others.
        p = self._local.progress(transfer_id)
        return None if p is None else replace(p, landed_block_ids=None, writing_block_ids=None)

    def rank_bytes(self) -> list[int]:
        """Bytes each rank has received, in rank order."""
        return [self._local.stats().bytes, *self._rank_bytes[1:]]

    def stats(self) -> TransferStats:
        return replace(self._local.stats(), bytes=sum(self.rank_bytes()))

    def close(self) -> None:
        self._local.close()


class ShardedSender(KVSender):
    """A tensor- or pipeline-parallel prefill worker's sends to one decode worker: each rank its
    routes."""

    def __init__(
        self,
        config: TransferConfig,
        cache: torch.Tensor,
        routes: Sequence[Route],
        link: RankLink | None,
        key: str,
    ):
        self.config = config
        self.routes = tuple(routes)
        self._cache = cache
        self._link = link
        # Unique per sender: a destination reconnected after a failure must not meet the ranks'
        # senders of the failed one (their Disconnect may arrive later).
        self._key = f"{key}@{uuid.uuid4().hex[:12]}"
        self._local: list[KVSender] = []
        self._remote = sorted({r.rank for r in self.routes if r.rank != 0})
        if self._remote and link is None:
            raise ValueError("routes from other ranks need the ranks' link")
        self._ledger = SendLedger()
        self._lock = threading.Lock()
        self._seq = 0
        self._remote_bytes: dict[int, int] = {}

    def connect(self, descriptor: TransferDescriptor | None = None) -> None:
        """Connect every rank's routes (``descriptor`` is not needed: the routes name theirs)."""
        try:
            for route in self.routes:
                if route.rank == 0:
                    self._local.append(route_sender(self.config, self._cache, route))
            if self._remote:
                assert self._link is not None
                waiters = [self._link.waiter("connected", r, self._key) for r in self._remote]
                command = Connect(
                    self._key, self.routes, tuple(self._cache.shape), self._cache.dtype, self.config
                )
                self._link.tell(command, waiters)
                for h in waiters:
                    h.wait(self.config.timeout_s)
        except BaseException:
            self.close()
            raise

    def send(
        self, transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle:
        handles = [s.send(transfer_id, src_block_ids, dst_block_ids) for s in self._local]
        if self._remote:
            assert self._link is not None
            with self._lock:
                self._seq += 1
                seq = self._seq
            key = f"{self._key}#{seq}"
            remote = [self._link.waiter("sent", r, key) for r in self._remote]
            for h in remote:
                h.add_done_callback(self._count)
            src, dst = tuple(int(i) for i in src_block_ids), tuple(int(i) for i in dst_block_ids)
            self._link.tell(Send(self._key, transfer_id, src, dst, seq), remote)
            handles += remote
        handle = all_of(transfer_id, handles)
        self._ledger.add(handle)
        return handle

    def _count(self, h: TransferHandle) -> None:
        reply = getattr(h, "reply", None)
        if reply is not None:
            self._remote_bytes[reply.rank] = max(self._remote_bytes.get(reply.rank, 0), reply.total_bytes)

    def finish(self, transfer_id: str) -> TransferHandle:
        return self._ledger.finish(transfer_id)

    def stats(self) -> TransferStats:
        parts = [s.stats() for s in self._local]
        return TransferStats(
            bytes=sum(p.bytes for p in parts) + sum(self._remote_bytes.values()),
            seconds=sum(p.seconds for p in parts),
            transfers_ok=sum(p.transfers_ok for p in parts),
            transfers_failed=sum(p.transfers_failed for p in parts),
        )

    def close(self) -> None:
        local, self._local = self._local, []
        for s in local:
            quietly(s.close)
        if self._remote and self._link is not None:
            self._link.tell(Disconnect(self._key))
        self._ledger.fail_all(TransferError("sender closed"))
