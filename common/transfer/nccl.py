"""KV transport over torch.distributed point-to-point: NCCL for CUDA caches, gloo for CPU caches.

No global ``init_process_group``: each sender/receiver pair gets its own two-rank group. The
receiver runs a ``TCPStore`` (master, port 0 = pick, published in its descriptor); a sender takes
the next slot ``k`` from the store, announces ``join/k``, and both build a group on
``PrefixStore("pair/k", store)``, the receiver as rank 0. Messages on a pair are strictly ordered
(preamble, header, one payload per run), so each pair has one receiving thread.

Gloo facts that shape this (torch 2.13): a ``recv`` is only completed inside ``wait`` (no
polling), nothing (not ``abort``, not ``shutdown``) wakes a blocked ``wait``, and a ``wait`` that
times out closes the pair for good. So an idle sender sends a keepalive every ``KEEPALIVE_S``: the
receiver's thread wakes at least that often (to notice ``close``), and a silent pair is a dead one
after ``timeout_s``. A dead peer fails a pending ``recv`` at once ("connection closed"). A gloo
``send`` completes once the receiver has posted the matching ``recv`` and the bytes are across.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
    KIND_BYE,
    KIND_DATA,
    KIND_KEEPALIVE,
    Header,
    Preamble,
    Run,
    decode_head,
    decode_header,
    encode_head,
    plan_message,
)

logger = logging.getLogger(__name__)

SWEEP_PERIOD_S = 0.05
KEEPALIVE_S = 0.5
TAG = 0


def make_pair_group(store: Any, rank: int, config: TransferConfig, device: torch.device) -> Any:
    """A two-rank process group on ``store``: NCCL for CUDA caches, gloo otherwise."""
    timeout = timedelta(seconds=config.timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=config.host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _wait(work: Any, timeout_s: float) -> None:
    work.wait(timedelta(seconds=timeout_s))


class NcclReceiver(TableReceiver):
    """Accepts sender pairs on a TCPStore; one thread per pair receives into ``cache``."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        super().__init__(config, cache)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store: Any = None

    def start(self) -> TransferDescriptor:
        if self._store is not None:
            raise RuntimeError("receiver already started")
        self._blocks = as_block_bytes(self._cache)  # [N, bytes_per_block]
        timeout = timedelta(seconds=self.config.timeout_s)
        self._store = dist.TCPStore(
            self.config.host, self.config.port, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self._spawn(self._accept_loop, "baton-kv-accept")
        return TransferDescriptor("nccl", host=self.config.host, port=self._store.port)

    def close(self) -> None:
        if self._store is None or self._stop.is_set():
            return
        self._stop.set()
        for thread in self._threads:
            thread.join(KEEPALIVE_S + 1.0)  # a pair thread wakes on its sender's next keepalive
        self._table.close(TransferError("receiver closed"))
        self._store = None

    # -- threads -------------------------------------------------------------------------------
    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        slot = 0
        while not self._stop.is_set():
            self._table.sweep()
            if self._store.check([f"join/{slot}"]):
                self._spawn(self._pair_loop, f"baton-kv-pair-{slot}", slot)
                slot += 1
                continue
            self._stop.wait(SWEEP_PERIOD_S)

    def _pair_loop(self, slot: int) -> None:
        try:
            store = dist.PrefixStore(f"pair/{slot}", self._store.clone())
            group = make_pair_group(store, 0, self.config, self._cache.device)
        except Exception as e:
            logger.error("KV pair %d: could not join: %r", slot, e)
            return
        try:
            self._receive_messages(_PairReader(group, self._cache.device, self.config.timeout_s), slot)
        except Exception as e:  # the pair is gone (peer died, or a timeout closed it)
            self._table.fail_peer(slot, TransferError(f"KV sender {slot} lost: {e!r}"))
            logger.warning("KV pair %d closed: %r", slot, e)

    def _receive_messages(self, reader: _PairReader, slot: int) -> None:
        """Until goodbye or close: read a head, post its payloads, then the next head, then wait."""
        head = reader.post_head()
        while True:
            preamble, header = reader.read_head(head)  # keepalives wake this at least every 0.5 s
            if preamble.kind == KIND_BYE or self._stop.is_set():
                return
            if header is None:  # keepalive
                head = reader.post_head()
                continue
            dst = header.dst_block_ids()
            landing = self._table.claim(header.transfer_id, dst, peer=slot)
            targets = [self._blocks[s : s + n] if landing else self._scratch(n) for s, n in header.runs]
            started = time.perf_counter()
            works = reader.post_payloads(targets)
            head = reader.post_head()  # behind the payloads: the next message needs no round trip
            self._finish_payload(reader, works, header, landing, started)

    def _finish_payload(
        self, reader: _PairReader, works: list[Any], header: Header, landing: bool, started: float
    ) -> None:
        dst = header.dst_block_ids()
        nbytes = len(dst) * self._blocks.shape[1]
        try:
            reader.wait_all(works)
        except Exception as e:
            if landing:
                self._table.landed(header.transfer_id, dst, 0, 0.0, TransferError(repr(e)))
            raise
        if landing:
            self._table.landed(header.transfer_id, dst, nbytes, time.perf_counter() - started)
        else:
            self._table.drop(nbytes)

    def _scratch(self, count: int) -> torch.Tensor:
        return torch.empty(count, self._blocks.shape[1], dtype=torch.uint8, device=self._cache.device)


class _PairReader:
    """The receiving end of one pair: fixed-size heads, header tails, payloads."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float) -> None:
        self._group, self._device, self._timeout_s = group, device, timeout_s

    def post_head(self) -> tuple[torch.Tensor, Any]:
        raw = torch.empty(HEAD_BYTES, dtype=torch.uint8, device=self._device)
        return raw, self._group.recv([raw], 1, TAG)

    def read_head(self, head: tuple[torch.Tensor, Any]) -> tuple[Preamble, Header | None]:
        raw, work = head
        _wait(work, self._timeout_s)
        preamble, header = decode_head(raw.cpu().numpy().tobytes())
        if preamble.kind != KIND_DATA:
            return preamble, None
        missing = preamble.header_len - len(header)
        if missing > 0:  # a header longer than the head: its tail follows as one message
            tail = torch.empty(missing, dtype=torch.uint8, device=self._device)
            _wait(self._group.recv([tail], 1, TAG), self._timeout_s)
            header += tail.cpu().numpy().tobytes()
        return preamble, decode_header(header)

    def post_payloads(self, targets: list[torch.Tensor]) -> list[Any]:
        return [self._group.recv([t], 1, TAG) for t in targets]

    def wait_all(self, works: list[Any]) -> None:
        for work in works:
            _wait(work, self._timeout_s)


class NcclSender(KVSender):
    """One pair group to one receiver; a thread sends queued messages in order."""

    def __init__(self, config: TransferConfig, cache: torch.Tensor) -> None:
        self.config = config
        self._cache = cache
        self._counters = Counters()
        self._ledger = SendLedger()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        self._broken: TransferError | None = None
        self._fault = FaultHold(config.fault_hold_payload_after_blocks)
        self._closing = threading.Event()

    def connect(self, descriptor: TransferDescriptor) -> None:
        if descriptor.backend != "nccl":
            raise ValueError(f"descriptor is for backend {descriptor.backend!r}, not 'nccl'")
        if self._thread is not None:
            raise RuntimeError("sender already connected")
        self._blocks = as_block_bytes(self._cache)
        try:
            self._group = self._join(descriptor)
        except Exception as e:
            raise TransferError(f"connecting to the KV receiver {descriptor}: {e!r}") from e
        self._thread = threading.Thread(target=self._send_loop, name="baton-kv-send", daemon=True)
        self._thread.start()

    def send(
        self, transfer_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle:
        runs, header = plan_message(transfer_id, src_block_ids, dst_block_ids, len(self._cache))
        handle = TransferHandle(transfer_id)
        self._ledger.add(handle)
        if self._thread is None or self._broken is not None:
            handle.set_error(self._broken or TransferError("sender is not connected"))
        else:
            self._queue.put((runs, header, handle, self._fault.next_message(transfer_id, len(dst_block_ids))))
        return handle

    def finish(self, transfer_id: str) -> TransferHandle:
        return self._ledger.finish(transfer_id)

    def stats(self) -> TransferStats:
        return self._counters.snapshot()

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)  # queued sends go first, then the goodbye
        self._closing.set()
        thread.join(self.config.timeout_s + 1.0)
        self._ledger.fail_all(TransferError("sender closed"))
        self._group = None

    # -- internals -----------------------------------------------------------------------------
    def _join(self, descriptor: TransferDescriptor) -> Any:
        timeout = timedelta(seconds=self.config.timeout_s)
        store = dist.TCPStore(descriptor.host, descriptor.port, is_master=False, timeout=timeout)
        slot = store.add("next", 1) - 1
        store.set(f"join/{slot}", "1")
        return make_pair_group(dist.PrefixStore(f"pair/{slot}", store), 1, self.config, self._cache.device)

    def _send_loop(self) -> None:
        """Post each message's sends, then complete the previous message (one in flight ahead)."""
        pending: _Posted | None = None
        while True:
            try:
                job = self._queue.get_nowait() if pending else self._queue.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                if pending:
                    self._complete(pending)
                    pending = None
                else:
                    self._send_control(KIND_KEEPALIVE)
                continue
            if job is None:
                break
            runs, header, handle, how = job
            if how != FaultHold.WHOLE:
                if pending:
                    self._complete(pending)
                self._hold(header)
                return
            posted = self._post(runs, header, handle)
            if pending:
                self._complete(pending)
            pending = posted
        if pending:
            self._complete(pending)
        self._send_control(KIND_BYE)

    def _hold(self, header: bytes) -> None:
        """Test only (``FaultHold``): a message's head and never its payload; then nothing more on
        this pair until ``close``."""
        try:
            heads = _head_tensors(KIND_DATA, header, self._cache.device)
            for work in [self._group.send([t], 0, TAG) for t in heads]:
                _wait(work, self.config.timeout_s)
        except Exception as e:  # noqa: BLE001 - the receiver went away meanwhile
            logger.warning("held KV message: %r", e)
        logger.warning("FAULT INJECTION (test only): a KV message stops after its head")
        self._closing.wait()

    def _post(self, runs: list[Run], header: bytes, handle: TransferHandle) -> _Posted | None:
        if self._broken is not None:
            handle.set_error(self._broken)
            return None
        tensors = _head_tensors(KIND_DATA, header, self._cache.device)
        tensors += [self._blocks[r.src : r.src + r.count] for r in runs]
        nbytes = sum(r.count for r in runs) * self._blocks.shape[1]
        started = time.perf_counter()
        try:
            works = [self._group.send([t], 0, TAG) for t in tensors]
        except Exception as e:
            self._fail(handle, e)
            return None
        return _Posted(works, tensors, handle, nbytes, started)

    def _complete(self, posted: _Posted) -> None:
        try:
            for work in posted.works:
                _wait(work, self.config.timeout_s)
        except Exception as e:
            self._fail(posted.handle, e)
            return
        seconds = time.perf_counter() - posted.started
        self._counters.add(bytes=posted.nbytes, seconds=seconds, transfers_ok=1)
        posted.handle.set_result(posted.nbytes)

    def _fail(self, handle: TransferHandle, error: Exception) -> None:
        self._broken = self._broken or TransferError(f"sending transfer {handle.transfer_id!r}: {error!r}")
        self._counters.add(transfers_failed=1)
        handle.set_error(self._broken)

    def _send_control(self, kind: int) -> None:
        """A keepalive or goodbye: a head with no header and no payload."""
        if self._broken is not None:
            return
        try:
            (raw,) = _head_tensors(kind, b"", self._cache.device)
            _wait(self._group.send([raw], 0, TAG), self.config.timeout_s)
        except Exception as e:
            self._broken = TransferError(f"KV receiver lost: {e!r}")


@dataclass
class _Posted:
    """One message whose sends are posted: completed (and its handle set) once they are done."""

    works: list[Any]
    tensors: list[torch.Tensor]  # kept alive until the sends complete
    handle: TransferHandle
    nbytes: int
    started: float


def _head_tensors(kind: int, header: bytes, device: torch.device) -> list[torch.Tensor]:
    """The fixed-size head (preamble, then as much header as fits) and the header's tail, if any."""
    head, tail = encode_head(kind, 0, header)
    tensors = [_bytes_tensor(head, device)]
    return tensors + ([_bytes_tensor(tail, device)] if tail else [])
