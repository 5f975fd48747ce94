"""KV transport over UCX (the ``ucxx`` package): shared memory / CMA or TCP on a host, CUDA IPC or
RDMA between GPUs, whatever ``UCX_TLS`` allows (default: all).

Connection: the receiver publishes its UCX *worker address*; the sender opens an endpoint to it.
Not a listener: endpoints accepted by a ucxx listener always carry peer error handling, which
limits them to TCP (~1 GB/s on loopback); worker-address endpoints without it may use shared memory
and cross-memory attach (~5-11 GB/s here). The price is that UCX does not report a dead peer: the
receiver's deadlines do.

Tuning (``baton bench transfer``, W5, 2-core host): UCX's own choice between two processes is
already the best one — sysv shared memory for small messages, rendezvous with a CMA zero-copy read
(one copy, straight into the destination blocks) from 8 KB on — so no ``UCX_*`` default is set
here. Measured and rejected: ``UCX_RNDV_THRESH=1M`` (eager copies, slower), ``UCX_RNDV_SCHEME=
put_zcopy``, ``UCX_CMA_SEG_SIZE=64M`` (no change), delayed submission off (+0.5 ms per transfer).
What did pay: a CPU cache on transparent huge pages (``allocate_kv_cache``; CMA pins the source
page by page): 4k tokens ~5 -> ~10 GB/s, 16k tokens ~6.6 -> ~10.5 GB/s, 2-2.6x a loopback TCP
socket; and one receive fewer per message (below). Below ~1k tokens a transfer is latency-bound
(~1 ms of thread hand-offs) and a plain socket is faster.

Messages: every message has its own tag, ``stream << 32 | seq``, so a receive posted for a message
can only ever match that message. A fixed-size head (the preamble and, when it fits, the whole
header) goes to the receiver's control tag (named in its descriptor), then the header's tail if
any and one payload per run on the message's tag. Payloads are sent from and received into slices
of the caches themselves. Each completion the receiver awaits costs a few hundred microseconds of
thread hand-offs here (UCX progress thread, ucxx notifier, event loop), so a message is two waits
(head, payloads), not three: a one-block transfer took ~1.1 ms with the header as its own message.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from baton.common.transfer.base import (
    KVSender,
    TransferConfig,
    TransferDescriptor,
    TransferError,
    TransferHandle,
    TransferStats,
)
from baton.common.transfer.blocks import as_block_bytes
from baton.common.transfer.bookkeeping import Counters, FaultHold, SendLedger, TableReceiver
from baton.common.transfer.wire import (
    HEAD_BYTES,
    KIND_DATA,
    Header,
    Preamble,
    Run,
    decode_head,
    decode_header,
    encode_head,
    plan_message,
)

logger = logging.getLogger(__name__)

# UCX and ucxx read these when the context is created; the user's environment wins.
UCX_ENV_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # "No Futures available" warnings whenever more requests are posted than the notifier thread
    # pre-allocated: harmless, and a burst of them per fragmented transfer.
    "UCXX_LOG_LEVEL": "ERROR",
}
SWEEP_PERIOD_S = 0.05
PROGRESS_EPOLL_TIMEOUT_MS = 100
_ADDRESS_HEAD = struct.Struct("<I")  # the receiver's control stream, then its worker address


class UcxRuntime:
    """The process's ucxx context and the event loop thread that drives it.

    ucxx keeps one global context per process, bound to one asyncio loop (its notifier thread
    completes requests on that loop), so every receiver and sender in a process shares this
    object; it starts with the first ``acquire`` and stops with the last ``release``. Progress is
    ucxx's "thread" mode with Python futures: the default mode busy-polls a core while idle.
    """

    _lock = threading.Lock()
    _current: UcxRuntime | None = None
    unreceived = False
    """Set once a lost sender's message was left unreceived (``UcxReceiver._receive``): the UCX
    worker holds it, and destroying the worker receives it to drain it
    (``ucxx::Worker::drainWorkerTagRecv``), which crashes UCX 1.21 as receiving it at once would.
    Such a worker is never destroyed: it ends with the process (which cannot start UCX again)."""

    def __init__(self) -> None:
        self._users = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="baton-ucx", daemon=True)

    @classmethod
    def acquire(cls) -> UcxRuntime:
        with cls._lock:
            if cls._current is None:
                runtime = cls()
                runtime._start()
                cls._current = runtime
            cls._current._users += 1
            return cls._current

    def release(self) -> None:
        with UcxRuntime._lock:
            self._users -= 1
            if self._users > 0:
                return
            UcxRuntime._current = None
        self._stop()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        """Run ``coro`` on the loop thread; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Run ``coro`` on the loop thread and wait for its result (never from the loop thread)."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except TimeoutError as e:
            future.cancel()
            raise TransferError(f"UCX operation timed out after {timeout_s} s") from e

    def _start(self) -> None:
        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self._thread.start()
        self.call(self._init(), 30.0)

    @staticmethod
    async def _init() -> None:
        import ucxx

        ucxx.init(progress_mode="thread", enable_python_future=True)
        # ucxx's progress thread waits on the worker's event fd with a 1 ms timeout: ~1,000 wake-ups
        # a second on an idle worker, each preempting a core that the engine's OpenMP team is
        # spinning on. UCX signals that fd whenever there is work, so the timeout is only a safety
        # net; restart the thread with a long one.
        worker = ucxx.core._get_ctx().worker
        worker.stop_progress_thread()
        worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_EPOLL_TIMEOUT_MS)

    @staticmethod
    async def _reset() -> None:
        import ucxx

        ucxx.stop_notifier_thread()
        if UcxRuntime.unreceived:
            # One reference more than anything will drop: no destructor runs, the exit frees it.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(ucxx.core._get_ctx().worker))
            logger.warning("UCX worker kept to the process's exit: it holds a lost sender's messages")
            return
        try:
            ucxx.reset()
        except Exception as e:  # objects still alive somewhere: the context outlives us, harmlessly
            logger.warning("ucxx.reset: %s", e)

    def _stop(self) -> None:
        try:
            self.call(self._reset(), 10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            if not self._thread.is_alive():
                self._loop.close()


def _buffers(cache: torch.Tensor) -> Any:
    """``[num_blocks, bytes_per_block]`` buffer over the cache that ucxx can read and write."""
    blocks = as_block_bytes(cache)
    return blocks.numpy() if blocks.device.type == "cpu" else blocks  # CUDA: __cuda_array_interface__


def _stream_id() -> int:
    return secrets.randbelow(2**32 - 1) + 1


def _encode_address(control_stream: int, worker_address: bytes) -> str:
    return base64.b64encode(_ADDRESS_HEAD.pack(control_stream) + worker_address).decode()


def _decode_address(address: str) -> tuple[int, bytes]:
    raw = base64.b64decode(address)
    (control_stream,) = _ADDRESS_HEAD.unpack_from(raw)
    return control_stream, raw[_ADDRESS_HEAD.size :]


class UcxReceiver(TableReceiver):
    """Receives messages on the shared UCX loop into the destination blocks of ``cache``."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        super().__init__(config, cache)
        self._runtime: UcxRuntime | None = None
        self._tasks: set[asyncio.Task] = set()
        self._control_tag = 0
        self._posted: list[Any] = []
        """Buffers of receives given up on (timed out, failed): see ``_keep_posted``."""
        self._last_unreceived = ""

    def start(self) -> TransferDescriptor:
        if self._runtime is not None:
            raise RuntimeError("receiver already started")
        self._buffers = _buffers(self._cache)
        self._block_bytes = self._buffers.shape[1]
        control_stream = _stream_id()
        self._control_tag = control_stream << 32
        self._runtime = UcxRuntime.acquire()
        worker_address = self._runtime.call(self._open(), self.config.timeout_s)
        address = _encode_address(control_stream, worker_address)
        return TransferDescriptor("ucx", host=self.config.host, port=0, address=address)

    def close(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        try:
            runtime.call(self._shut(), 10.0)
        finally:
            self._table.close(TransferError("receiver closed"))
            runtime.release()

    # -- on the loop thread --------------------------------------------------------------------
    async def _open(self) -> bytes:
        import ucxx

        self._spawn(self._control_loop())
        self._spawn(self._sweep_loop())
        return bytes(ucxx.get_worker_address())

    async def _shut(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sweep_loop(self) -> None:
        while True:
            self._table.sweep()
            await asyncio.sleep(SWEEP_PERIOD_S)

    async def _control_loop(self) -> None:
        import ucxx

        while True:
            buf = bytearray(HEAD_BYTES)
            try:
                await ucxx.recv(buf, self._control_tag)
                preamble, header_head = decode_head(buf)
            except ValueError as e:
                logger.error("dropping a malformed KV preamble: %s", e)
                continue
            except Exception as e:  # the UCX worker is gone: nothing more will arrive
                logger.error("KV receiver stopped: %r", e)
                return
            if preamble.kind == KIND_DATA:
                self._spawn(self._receive(preamble, header_head))

    async def _receive(self, preamble: Preamble, header_head: bytes) -> None:
        import ucxx

        tag = preamble.tag
        tail = bytearray(max(preamble.header_len - len(header_head), 0))
        try:
            raw = header_head
            if tail:  # the rest of a long header follows on the tag
                await asyncio.wait_for(ucxx.recv(tail, tag), self.config.timeout_s)
                raw += tail
            header = decode_header(raw)
        except Exception as e:
            logger.error("KV message %#x: no header: %r", tag, e)
            self._keep_posted([tail])
            return
        landing = self._claim(header, peer=tag >> 32)
        if not landing and self._table.sender_lost(header.transfer_id):
            # Not received: a receive posted for a rendezvous message whose sender's endpoint
            # failed after the message arrived crashes UCX 1.21 (SIGSEGV in
            # ucp_proto_rndv_send_reply, its endpoint's config NULL), and the late messages of a
            # sender that was cut off and died are exactly those (tests/hosts). A sender that
            # is alive after all sees its send time out, and connects again.
            UcxRuntime.unreceived = True
            if header.transfer_id != self._last_unreceived:  # a warning per transfer, not per message
                self._last_unreceived = header.transfer_id
                logger.warning(
                    "late KV messages of transfer %r not received: its sender was lost", header.transfer_id
                )
            return
        targets = self._targets(header, landing)
        started = time.perf_counter()
        error = None
        try:
            receives = asyncio.gather(*(ucxx.recv(t, tag) for t in targets))
            await asyncio.wait_for(receives, self.config.timeout_s)
        except Exception as e:
            error = TransferError(f"receiving transfer {header.transfer_id!r}: {e!r}")
            self._keep_posted(targets)
        except asyncio.CancelledError:
            error = TransferError("receiver closed")
            raise
        finally:
            self._settle(header, landing, targets, time.perf_counter() - started, error)

    @property
    def abandoned_receives(self) -> int:
        """Buffers held for receives this receiver gave up on (``_keep_posted``)."""
        return len(self._posted)

    def _keep_posted(self, buffers: list[Any]) -> None:
        """Keep the buffers of receives this receiver gave up on alive for as long as it lives.
        Cancelling the awaits does not withdraw the receives UCX posted (ucxx cannot cancel one), so
        a message that arrives late (a cut link that comes back) is still written where they point:
        into freed memory, had the buffers been dropped (the decode worker died of SIGSEGV in
        tests/hosts). Views of the cache cost nothing; scratch buffers only for failed messages."""
        self._posted.extend(buffers)

    # -- where a message's payloads go (``heads.HeadSliceReceiver`` receives head slices) --------
    def _claim(self, header: Header, peer: int) -> bool:
        return self._table.claim(header.transfer_id, header.dst_block_ids(), peer=peer)

    def _targets(self, header: Header, landing: bool) -> list[Any]:
        return [self._target(start, count, landing) for start, count in header.runs]

    def _settle(
        self, header: Header, landing: bool, targets: list[Any], seconds: float, error: TransferError | None
    ) -> None:
        dst = header.dst_block_ids()
        nbytes = len(dst) * self._block_bytes
        if landing:
            self._table.landed(header.transfer_id, dst, nbytes, seconds, error)
        else:
            self._table.drop(nbytes)

    def _target(self, start: int, count: int, landing: bool) -> Any:
        if landing:
            return self._buffers[start : start + count]
        return bytearray(count * self._block_bytes)  # scratch for a message nobody expects


class UcxSender(KVSender):
    """Sends messages from the source blocks of ``cache`` to one receiver."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        self.config = config
        self._cache = cache
        self._counters = Counters()
        self._ledger = SendLedger()
        self._runtime: UcxRuntime | None = None
        self._endpoint: Any = None
        self._lock = threading.Lock()
        self._seq = 0
        self._broken: TransferError | None = None
        self._fault = FaultHold(config.fault_hold_payload_after_blocks)

    def connect(self, descriptor: TransferDescriptor) -> None:
        if descriptor.backend != "ucx":
            raise ValueError(f"descriptor is for backend {descriptor.backend!r}, not 'ucx'")
        if self._runtime is not None:
            raise RuntimeError("sender already connected")
        control_stream, worker_address = _decode_address(descriptor.address)
        self._buffers = _buffers(self._cache)
        self._control_tag = control_stream << 32
        self._stream = _stream_id()
        self._runtime = UcxRuntime.acquire()
        try:
            self._endpoint = self._runtime.call(self._open(worker_address), self.config.timeout_s)
        except Exception as e:
            self.close()
            raise TransferError(f"connecting to the KV receiver: {e!r}") from e

    def send(
        self, transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle:
        runs, header = self._plan(transfer_id, src_block_ids, dst_block_ids)
        handle = TransferHandle(transfer_id)
        self._ledger.add(handle)
        with self._lock:
            broken, runtime = self._broken, self._runtime
            if broken is not None or runtime is None:
                handle.set_error(broken or TransferError("sender is not connected"))
                return handle
            self._seq = self._seq % (2**32 - 1) + 1
            tag = self._stream << 32 | self._seq
        how = self._fault.next_message(transfer_id, len(dst_block_ids))
        runtime.submit(self._send(tag, header, runs, handle, how))
        return handle

    def finish(self, transfer_id: str) -> TransferHandle:
        return self._ledger.finish(transfer_id)

    def stats(self) -> TransferStats:
        return self._counters.snapshot()

    def close(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        try:
            if self._endpoint is not None:
                runtime.call(self._endpoint.close(), 10.0)
        finally:
            self._endpoint = None
            self._ledger.fail_all(TransferError("sender closed"))
            runtime.release()

    # -- what a message carries (``heads.HeadSliceSender`` sends head slices) --------------------
    def _plan(self, transfer_id: str, src: Sequence[int], dst: Sequence[int]) -> tuple[list[Run], bytes]:
        return plan_message(transfer_id, src, dst, len(self._cache))

    def _payloads(self, runs: list[Run]) -> list[Any]:
        """One buffer per run, read by UCX until the message is sent."""
        return [self._buffers[r.src : r.src + r.count] for r in runs]

    # -- on the loop thread --------------------------------------------------------------------
    @staticmethod
    async def _open(worker_address: bytes) -> Any:
        import ucxx

        address = ucxx.get_ucx_address_from_buffer(worker_address)
        return await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)

    async def _send(
        self, tag: int, header: bytes, runs: list[Run], handle: TransferHandle, how: str = FaultHold.WHOLE
    ) -> None:
        head, header_tail = encode_head(KIND_DATA, tag, header)
        started = time.perf_counter()
        ep = self._endpoint
        if how != FaultHold.WHOLE:
            await self._send_held(ep, tag, head, header_tail, how)
            return
        try:
            payloads = self._payloads(runs)
            nbytes = sum(p.nbytes for p in payloads)
            sends = [ep.send(head, tag=self._control_tag, force_tag=True)]
            sends += [ep.send(header_tail, tag=tag, force_tag=True)] if header_tail else []
            sends += [ep.send(p, tag=tag, force_tag=True) for p in payloads]
            await asyncio.wait_for(asyncio.gather(*sends), self.config.timeout_s)
        except Exception as e:
            error = TransferError(f"sending transfer {handle.transfer_id!r}: {e!r}")
            with self._lock:
                self._broken = self._broken or error
            self._counters.add(transfers_failed=1)
            handle.set_error(error)
            return
        self._counters.add(bytes=nbytes, seconds=time.perf_counter() - started, transfers_ok=1)
        handle.set_result(nbytes)

    async def _send_held(self, ep: Any, tag: int, head: bytes, header_tail: bytes, how: str) -> None:
        """Test only (``FaultHold``): the head of a message and never its payload, or nothing."""
        if how == FaultHold.HEAD_ONLY:
            await ep.send(head, tag=self._control_tag, force_tag=True)
            if header_tail:
                await ep.send(header_tail, tag=tag, force_tag=True)
            logger.warning("FAULT INJECTION (test only): KV message %#x stops after its head", tag)
        await asyncio.get_running_loop().create_future()  # never done: the handle stays open
