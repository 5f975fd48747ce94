"""The KV transport of a tensor- or pipeline-parallel worker: every rank moves its own layers and
KV heads, straight from or into its own cache (the re-sharded transfer of
``common/transfer/reshard.py``; nothing is gathered on one rank).

Rank 0 (the worker's process) runs its own part and tells the other ranks theirs down the pipes
that carry its forward steps (``TensorParallelModel.tell``; ``PipelineParallelModel`` inherits it):
a command sent after a step reaches a rank after that step's forward pass (a pipeline stage's
included), so a rank sends blocks only once it has computed them.
Each rank answers on its stdout pipe (length-prefixed pickles of ``Reply``; the channel never
leaves the worker's own processes). This module is what the ranks run (``RankKV``) and what
travels; rank 0's side is ``kv_sharded``.

* Decode: ``kv_sharded.ShardedReceiver``, a receiver per rank over that rank's cache. ``expect``
  arms every rank (``ready`` waits until they all are: only then may the prefill worker be told)
  and its handle completes once every rank's cells of every block have landed. The descriptors,
  one per rank with the layers and heads it holds, travel in the Prefill RPC.
* Prefill: ``kv_sharded.ShardedSender``, one per decode worker. Each rank holds a sender to each
  decode rank it feeds (a ``Route``) and sends its slices of every finished block; the handle of a
  ``send`` completes once every rank's has.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import IO, Any

import torch

from baton.common.transfer import make_sender
from baton.common.transfer.base import (
    KVReceiver,
    KVSender,
    TransferConfig,
    TransferDescriptor,
    TransferHandle,
    all_of,
)

log = logging.getLogger(__name__)

_LEN = struct.Struct("<Q")


# -- what rank 0 tells the other ranks ------------------------------------------------------------
class Command:
    """A KV-transport command for ranks 1..N-1 (``worker.serve`` hands it to ``RankKV.handle``)."""


@dataclass(frozen=True)
class OpenReceiver(Command):
    cache_shape: tuple[int, ...]
    """Rank 0's KV cache shape (a rank's own has its layers and KV heads in place of rank 0's)."""
    cache_dtype: torch.dtype
    transfer: TransferConfig


@dataclass(frozen=True)
class Expect(Command):
    transfer_id: str
    block_ids: tuple[int, ...]
    timeout_s: float


@dataclass(frozen=True)
class Cancel(Command):
    transfer_id: str
    sender_lost: bool = False


@dataclass(frozen=True)
class Route:
    """One prefill rank's stream to one decode rank."""

    rank: int
    """The prefill rank that sends."""
    descriptor: str
    """The decode rank's receiver (``TransferDescriptor`` as JSON)."""
    src_heads: tuple[int, int]
    """Heads of the sending rank's cache."""
    dst_heads: tuple[int, int]
    """Where they go in the decode rank's cache."""
    whole: bool
    """Both sides move all their layers and heads: a plain sender, blocks as they are."""
    src_layers: tuple[int, int] | None = None
    """Layers of the sending rank's cache; None: all of them, into all of the decode rank's."""
    dst_layers: tuple[int, int] | None = None
    """Where they go in the decode rank's cache (None with ``src_layers``)."""


@dataclass(frozen=True)
class Connect(Command):
    key: str
    routes: tuple[Route, ...]
    """Every rank's routes; each rank connects its own."""
    cache_shape: tuple[int, ...]
    cache_dtype: torch.dtype
    transfer: TransferConfig


@dataclass(frozen=True)
class Send(Command):
    key: str
    transfer_id: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    seq: int


@dataclass(frozen=True)
class Disconnect(Command):
    key: str


@dataclass(frozen=True)
class Reply:
    """A rank's answer: ``kind`` is ``opened``, ``armed``, ``settled``, ``connected`` or ``sent``."""

    kind: str
    rank: int
    key: str
    """The transfer id, the sender's key, or ``key#seq`` for a send."""
    error: str | None = None
    nbytes: int = 0
    landed: tuple[int, ...] = ()
    """``settled``: the blocks whose heads all landed."""
    data: str = ""
    """``opened``: the rank's receiver descriptor (JSON)."""
    total_bytes: int = 0
    """``settled`` and ``sent``: the rank's bytes received or sent so far."""


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def read_frame(f: IO[bytes]) -> Any | None:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = f.read(n)
    return pickle.loads(body) if len(body) == n else None


def route_sender(config: TransferConfig, cache: torch.Tensor, route: Route) -> KVSender:
    """A connected sender for ``route`` from ``cache``."""
    from baton.common.transfer.heads import HeadSliceSender

    descriptor = TransferDescriptor.from_dict(json.loads(route.descriptor))
    config = replace(config, backend=descriptor.backend)
    if route.whole:
        sender = make_sender(config, cache)
    elif descriptor.backend != "ucx":
        raise ValueError(
            "a re-sharded KV transfer (different tensor- or pipeline-parallel degrees) needs"
            " --kv-transport ucx"
        )
    else:
        sender = HeadSliceSender(
            config, cache, route.src_heads, route.dst_heads, route.src_layers, route.dst_layers
        )
    try:
        sender.connect(descriptor)
    except BaseException:
        sender.close()
        raise
    return sender


def make_local_receiver(config: TransferConfig, cache: torch.Tensor) -> KVReceiver:
    """A receiver over ``cache`` that takes whole blocks and layer or head slices (ucx), or whole
    blocks."""
    if config.backend == "ucx":
        from baton.common.transfer.heads import HeadSliceReceiver

        return HeadSliceReceiver(config, cache)
    from baton.common.transfer import make_receiver

    return make_receiver(config, cache)


# -- ranks 1..N-1 -------------------------------------------------------------------------------------
class RankKV:
    """A rank's own receiver and senders, driven by rank 0's commands, answering on ``reply_fd``."""

    def __init__(self, rank: int, reply_fd: int):
        self.rank = rank
        self._reply_fd = reply_fd
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._receiver: KVReceiver | None = None
        self._senders: dict[str, list[KVSender]] = {}

    def handle(self, msg: Command, cache: torch.Tensor | None, cache_for: Callable) -> torch.Tensor | None:
        """Run ``msg``; returns the rank's cache (``cache_for(cache, msg)`` allocates it where the
        transport starts before the first forward step)."""
        if self._fd is None:
            # The replies get a descriptor of their own; anything else printing to stdout from now
            # on (a library's warning) goes to stderr instead of into the replies.
            self._fd = os.dup(self._reply_fd)
            os.dup2(2, self._reply_fd)
        if isinstance(msg, (OpenReceiver, Connect)):
            cache = cache_for(cache, msg)
        if isinstance(msg, OpenReceiver):
            self._open(msg, cache)
        elif isinstance(msg, Expect):
            self._expect(msg)
        elif isinstance(msg, Cancel):
            if self._receiver is not None:
                self._receiver.cancel(msg.transfer_id, msg.sender_lost)
        elif isinstance(msg, Connect):
            self._connect(msg, cache)
        elif isinstance(msg, Send):
            self._send(msg)
        elif isinstance(msg, Disconnect):
            for sender in self._senders.pop(msg.key, []):
                sender.close()
        return cache

    def _reply(self, reply: Reply) -> None:
        data = memoryview(_frame(reply))
        with self._lock:
            assert self._fd is not None
            while data:
                data = data[os.write(self._fd, data) :]

    def _open(self, msg: OpenReceiver, cache) -> None:
        try:
            if self._receiver is None:
                self._receiver = make_local_receiver(msg.transfer, cache)
                self._descriptor = self._receiver.start()
            self._reply(Reply("opened", self.rank, "", data=json.dumps(self._descriptor.to_dict())))
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the worker's start
            self._reply(Reply("opened", self.rank, "", error=f"rank {self.rank}: {e!r}"))

    def _expect(self, msg: Expect) -> None:
        if self._receiver is None:
            self._reply(Reply("armed", self.rank, msg.transfer_id, error="no receiver"))
            return
        receiver = self._receiver
        try:
            handle = receiver.expect(msg.transfer_id, msg.block_ids, msg.timeout_s)
        except ValueError as e:
            self._reply(Reply("armed", self.rank, msg.transfer_id, error=str(e)))
            self._reply(Reply("settled", self.rank, msg.transfer_id, error=str(e)))
            return
        self._reply(Reply("armed", self.rank, msg.transfer_id))

        def settled(h: TransferHandle) -> None:
            error = h.exception()
            self._reply(
                Reply(
                    "settled",
                    self.rank,
                    h.transfer_id,
                    error=None if error is None else str(error),
                    nbytes=h.nbytes,
                    landed=tuple(sorted(h.landed_block_ids)),
                    total_bytes=receiver.stats().bytes,
                )
            )

        handle.add_done_callback(settled)

    def _connect(self, msg: Connect, cache) -> None:
        try:
            if msg.key not in self._senders:
                mine = [r for r in msg.routes if r.rank == self.rank]
                self._senders[msg.key] = [route_sender(msg.transfer, cache, r) for r in mine]
            self._reply(Reply("connected", self.rank, msg.key))
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which fails the connect
            self._reply(Reply("connected", self.rank, msg.key, error=f"rank {self.rank}: {e!r}"))

    def _send(self, msg: Send) -> None:
        key = f"{msg.key}#{msg.seq}"
        senders = self._senders.get(msg.key)
        if senders is None:
            self._reply(Reply("sent", self.rank, key, error=f"rank {self.rank} is not connected"))
            return
        try:
            handles = [s.send(msg.transfer_id, msg.src, msg.dst) for s in senders]
        except Exception as e:  # noqa: BLE001 - bad block ids: rank 0's send fails
            self._reply(Reply("sent", self.rank, key, error=str(e)))
            return

        def sent(h: TransferHandle) -> None:
            error = h.exception()
            total = sum(s.stats().bytes for s in senders)
            self._reply(
                Reply(
                    "sent", self.rank, key, None if error is None else str(error), h.nbytes, total_bytes=total
                )
            )

        all_of(msg.transfer_id, handles).add_done_callback(sent)

    def close(self) -> None:
        for senders in self._senders.values():
            for s in senders:
                quietly(s.close)
        self._senders = {}
        if self._receiver is not None:
            quietly(self._receiver.close)
            self._receiver = None


def quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - shutting down: nothing to do about it
        log.debug("closing a KV transport part", exc_info=True)
