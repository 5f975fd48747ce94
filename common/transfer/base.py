"""The KV transport contract: a receiver on the decode worker, a sender on the prefill worker.

A worker's KV cache is one contiguous tensor ``[num_blocks, num_layers, 2, KV, block_size, D]``, so
block ``i`` is the slice ``cache[i]``. A transfer moves whole blocks: the decode worker reserves
destination blocks and calls ``KVReceiver.expect(transfer_id, dst_block_ids)`` *before* it tells the
prefill worker where to write (the descriptor and the ids travel in the ``Prefill`` RPC); the prefill
worker calls ``KVSender.send(transfer_id, src_block_ids, dst_block_ids)`` once per finished chunk.
Data lands directly in the destination blocks; the receiver's handle completes when every expected
block has landed. Nothing here blocks the caller for the duration of a transfer: both sides move
bytes on a background thread and report through ``TransferHandle``.

This module imports no torch (the package ``__init__`` stays light).
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

BACKENDS = ("ucx", "nccl")


class TransferError(RuntimeError):
    """A transfer failed, timed out, was cancelled, or its peer went away."""


@dataclass(frozen=True)
class TransferConfig:
    """What a worker needs to run one side of the KV transport."""

    backend: str = "ucx"
    """``"ucx"`` (ucxx: shared memory / TCP on a host, CUDA IPC or RDMA between GPUs) or ``"nccl"``
    (torch.distributed point-to-point: NCCL for CUDA caches, gloo for CPU caches)."""
    host: str = "127.0.0.1"
    """Address that peers use to reach this worker (the nccl backend's store and gloo device)."""
    port: int = 0
    """Receiver's listening port for the nccl backend's store; 0 picks a free one (published)."""
    timeout_s: float = 30.0
    """Bound on connecting, on each send, and on each expected transfer from ``expect`` on."""
    fault_hold_payload_after_blocks: int = 0
    """Test only (0: off; ``baton prefill --fault-hold-payload-after-blocks``): a sender stops in
    the middle of a message once a transfer has had this many blocks sent. That message's head goes
    out, so the receiver claims its blocks and posts their receives, and its payload never does, nor
    anything after it (ucx: of that transfer; nccl: on that pair, whose messages are ordered): what a
    sender killed mid-message leaves behind."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.fault_hold_payload_after_blocks < 0:
            raise ValueError("fault_hold_payload_after_blocks must not be negative")


@dataclass(frozen=True)
class TransferDescriptor:
    """How a sender reaches a receiver; small and JSON-able (it travels inside the Prefill RPC)."""

    backend: str
    host: str = ""
    port: int = 0
    address: str = ""
    """Backend-specific connection blob (ucx: the receiver's UCX worker address and stream, base64)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferDescriptor:
        return cls(**{k: data[k] for k in ("backend", "host", "port", "address") if k in data})


@dataclass(frozen=True)
class TransferProgress:
    """How far one expected transfer has got (``KVReceiver.progress``)."""

    blocks_landed: int
    """Destination blocks whose payload has fully landed."""
    blocks_expected: int
    last_landed: float | None
    """``time.monotonic()`` of the latest landing; None before the first."""
    landed_block_ids: frozenset[int] | None = None
    """The blocks that landed whole while the transfer was live (None: this receiver cannot say,
    e.g. one spread over ranks). Final once the transfer failed or was cancelled."""
    writing_block_ids: frozenset[int] | None = None
    """The blocks a message is being written into now (None: cannot say; assume all not landed).
    After ``cancel`` nothing new is claimed, so these are the only blocks still written."""


@dataclass(frozen=True)
class TransferStats:
    """Counters of one sender or receiver since start (exported to Prometheus by the services)."""

    bytes: int = 0
    """Payload bytes sent, or received into cache blocks."""
    seconds: float = 0.0
    """Wall time spent moving payload (per message, summed)."""
    transfers_ok: int = 0
    """Receiver: transfers completed. Sender: ``send`` calls completed."""
    transfers_failed: int = 0
    dropped_bytes: int = 0
    """Receiver: payload that arrived for an unknown, cancelled or expired transfer, discarded."""


class TransferHandle:
    """Completion of a transfer (receiver) or of a send (sender), set from a transport thread.

    ``done()`` never blocks; ``wait(timeout)`` returns when the transfer succeeded and raises
    ``TransferError`` when it failed or did not finish within ``timeout`` (a ``wait`` that runs out
    does not fail the transfer itself: its own deadline does).
    """

    def __init__(self, transfer_id: str) -> None:
        self.transfer_id = transfer_id
        self.nbytes = 0
        """Payload bytes moved for this handle (set on completion)."""
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        """Seconds from creation to completion (0 until done)."""
        self.landed_block_ids: frozenset[int] = frozenset()
        """Receiver: the destination blocks whose payload fully landed while the transfer was live
        (set on completion; every block on success). After a failure these hold whole, valid KV
        and nothing writes them any more; the others must be recomputed."""
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: TransferError | None = None
        self._callbacks: list[Callable[[TransferHandle], None]] = []

    def done(self) -> bool:
        return self._event.is_set()

    def ok(self) -> bool:
        """True once the transfer completed successfully."""
        return self._event.is_set() and self._error is None

    def exception(self) -> TransferError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TransferError(f"transfer {self.transfer_id!r} not done after {timeout} s of waiting")
        if self._error is not None:
            raise self._error

    async def wait_async(self, timeout: float | None = None) -> None:
        """``wait`` for an asyncio caller: the event loop goes on meanwhile and no thread is held."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def wake(_: TransferHandle) -> None:
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

        self.add_done_callback(wake)
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            raise TransferError(
                f"transfer {self.transfer_id!r} not done after {timeout} s of waiting"
            ) from None
        if self._error is not None:
            raise self._error

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call ``fn(handle)`` once done — at once if already done, else on a transport thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # -- for transports ------------------------------------------------------------------------
    def set_result(self, nbytes: int = 0) -> bool:
        return self._finish(None, nbytes)

    def set_error(self, error: TransferError) -> bool:
        return self._finish(error, 0)

    def _finish(self, error: TransferError | None, nbytes: int) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._error, self.nbytes = error, nbytes
            self.elapsed_s = time.monotonic() - self.started
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True


def all_of(transfer_id: str, handles: Sequence[TransferHandle]) -> TransferHandle:
    """A handle that completes when all ``handles`` have: ok if all are ok, else the first error."""
    combined = TransferHandle(transfer_id)
    remaining = [len(handles)]
    lock = threading.Lock()

    def one_done(_: TransferHandle) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [h.exception() for h in handles if h.exception() is not None]
            if errors:
                combined.set_error(errors[0])  # type: ignore[arg-type]
            else:
                combined.set_result(sum(h.nbytes for h in handles))

    if not handles:
        combined.set_result(0)
    for h in handles:
        h.add_done_callback(one_done)
    return combined


class KVReceiver(ABC):
    """The decode worker's side: receives blocks straight into its cache.

    Contract:
      * ``start()`` opens the transport (threads, sockets) and returns the descriptor to publish.
      * ``expect(tid, dst_block_ids)`` must be called before the sender is told about ``tid``;
        payload for a transfer id that is not expected (unknown, cancelled, expired) is received
        into scratch memory and dropped, never into the cache.
      * The handle completes once every block of ``dst_block_ids`` has landed, in any order and in
        any number of messages. It fails after ``timeout_s`` (config default), on ``cancel``, on
        ``close``, or when the transport sees the peer that was writing it die (nccl/gloo: at once;
        ucx does not report dead peers, so there the deadline does it).
      * A failed or cancelled transfer's handle completes only once no message is still being
        written into its blocks (bounded by ``timeout_s`` more): release the blocks after that.
        Its ``landed_block_ids`` are the blocks that landed whole before it failed (a message that
        completes after the failure, or after the deadline, is not counted: its sender may have
        given up on it and reused the source blocks), so a caller may keep those and recompute
        only the rest.
      * Only blocks named in ``expect`` are ever written.
      * ``progress(tid)`` says how many blocks have landed so far and when the latest did (None
        once the transfer is settled or if it was never expected): a stalled sender shows there.
        After a ``cancel`` whose handle is not done yet, its ``writing_block_ids`` are the blocks
        that may still be written (a receive the transport cannot cancel: ucx): a caller may
        quarantine those and let the others go at once, instead of waiting for the handle.
    """

    @abstractmethod
    def start(self) -> TransferDescriptor: ...

    @abstractmethod
    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> TransferHandle: ...

    async def ready(self, transfer_id: str, timeout_s: float) -> None:
        """Return once ``expect(transfer_id)`` holds everywhere it must, before the sender is told
        (TransferError if it cannot): a receiver spread over a tensor-parallel worker's ranks arms
        theirs by message (``kv_sharded.ShardedReceiver``); one that armed it in ``expect`` at once."""
        return None

    @abstractmethod
    def cancel(self, transfer_id: str, sender_lost: bool = False) -> None:
        """Stop expecting the transfer. ``sender_lost``: its sender is unreachable (hung, dead or
        cut off), so a message of it that arrives later is not received at all, where a
        cancelled transfer's late payload is otherwise received and dropped (see
        ``ucx.UcxReceiver._receive``)."""

    @abstractmethod
    def progress(self, transfer_id: str) -> TransferProgress | None: ...

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(ABC):
    """The prefill worker's side: pushes blocks of its cache to one receiver.

    Contract:
      * ``connect(descriptor)`` opens the connection (bounded by ``timeout_s``).
      * ``send(tid, src, dst)`` queues one message per run of consecutive ids and returns at once;
        its handle completes when the source blocks may be overwritten. Call it as each chunk of a
        prompt finishes; several calls per transfer id are expected.
      * ``finish(tid)`` returns a handle over every ``send`` of ``tid`` so far (the receiver needs
        no end marker: it knows its block ids from ``expect``).
      * A transport failure fails the send's handle and every later one: make a new sender.
    """

    @abstractmethod
    def connect(self, descriptor: TransferDescriptor) -> None: ...

    @abstractmethod
    def send(
        self, transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle: ...

    @abstractmethod
    def finish(self, transfer_id: str) -> TransferHandle: ...

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
