"""A prefill worker process: an ``AsyncEngine``, a gRPC ``Prefill`` service that pushes each prompt's
KV blocks to the decode worker that asked for them, Prometheus metrics and a registry heartbeat.

The KV of a prompt leaves from ``LLMEngine.on_step_computed`` (the engine thread, right after each
forward step, while the step's requests still own their blocks): every block that the step
completed is queued on the transport at once (``KVSender.send`` returns immediately), so earlier
blocks travel while later chunks compute.

The engine never waits on a receiver. Each block being sent is held (one more reference, so the
pool cannot hand it out, and out of any schedule) until its send completes or fails at the
transport's deadline (``TransferConfig.timeout_s``); then the engine thread lets it go. A request
that finishes meanwhile frees its blocks as usual, the held ones stay in use until then. The
Prefill RPC answers once every send has completed (awaited on the event loop, not the engine
thread): a decode worker that stops reading costs this worker only the blocks held for it, while
its engine goes on with other prompts.

The gRPC service (a call's checks and the status each failure ends with) is ``service.py``; the
servers, registry record, drain and stop are the shell's (``services/worker_shell.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.common.engine.llm_engine import LLMEngine
from baton.common.engine.scheduler import SchedulerOutput
from baton.common.metrics import LATENCY_BUCKETS
from baton.common.transfer import KVSender, TransferConfig, TransferError, TransferHandle
from baton.common.transfer.reshard import Shard
from baton.protos import baton_pb2_grpc
from baton.services import tp_transfer
from baton.services.emulated import hold_transfer, transfer_model
from baton.services.prefill.service import PrefillJob, PrefillServicer
from baton.services.worker_base import serve_worker
from baton.services.worker_shell import AddServicer, ShellConfig, WorkerShell

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig(ShellConfig):
    """A prefill worker: its shell's settings (``ShellConfig``: engine, addresses, registry, TLS)
    and its own."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    """KV transport settings; the backend of each sender is the one its destination names."""
    fault_pause_after_blocks: int = 0
    """Test-only fault injection (``baton prefill --fault-pause-after-blocks``; 0: off): once the
    first prompt has had this many blocks sent and landed, the engine thread stops for good, as a
    worker that dies mid-transfer would (the fault tests then kill or stop the process)."""
    fault_hold_payload_after_blocks: int = 0
    """Test-only fault injection (``baton prefill --fault-hold-payload-after-blocks``; 0: off): each
    prompt's KV stops in the middle of a message once this many of its blocks were sent
    (``TransferConfig.fault_hold_payload_after_blocks``), so that a kill lands mid-message."""


class _TransferCollector:
    """``baton:kv_transfer_bytes`` and ``baton:kv_transfer_failures`` (counters),
    ``baton:kv_blocks_held_for_transfer`` and ``baton:prefill_queued_prompt_tokens`` (gauges), read
    at scrape."""

    def __init__(self, worker: PrefillWorker, labels: dict[str, str]):
        self.worker = worker
        self.labels = labels

    def collect(self):
        for name, doc, value in (
            (
                "baton:kv_transfer_bytes",
                "KV cache bytes sent to decode workers.",
                self.worker.bytes_sent_total,
            ),
            ("baton:kv_transfer_failures", "KV transfers that failed.", self.worker.transfer_failures_total),
        ):
            c = CounterMetricFamily(name, doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            yield c
        g = GaugeMetricFamily(
            "baton:kv_blocks_held_for_transfer",
            "KV blocks held until their send to a decode worker completes or times out.",
            labels=list(self.labels),
        )
        g.add_metric(list(self.labels.values()), self.worker.blocks_held)
        yield g
        # What the prefill pool's autoscaler follows: TTFT grows with the prompt tokens queued ahead.
        q = GaugeMetricFamily(
            "baton:prefill_queued_prompt_tokens",
            "Prompt tokens of the prefills on this worker not yet computed.",
            labels=list(self.labels),
        )
        q.add_metric(list(self.labels.values()), self.worker.queued_prefill_tokens())
        yield q


class PrefillWorker(WorkerShell):
    """One prefill worker: the shell (engine, servers, heartbeat: ``services/worker_shell.py``), the
    ``Prefill`` service (``service.py``), and the senders that push each prompt's KV from the engine
    thread. ``start()``, then ``drain()`` (SIGTERM: the prefills in flight, their KV transfers
    included, finish; the rest end with UNAVAILABLE and the decode worker prefills them itself) or
    ``stop()``."""

    role = "prefill"
    work_rpcs = ("/baton.v1.Prefill/Prefill",)

    def __init__(self, config: PrefillWorkerConfig, on_exit: Callable[[int], None] | None = None):
        self.config = config
        super().__init__(config, on_exit)
        self.kv_layout = ""
        """``model_runner.kv_cache_layout`` of this worker's cache (all ranks' layers and heads),
        once started."""
        self.rank_shards: list[Shard] = []
        """Each rank's layers and KV heads (one shard, the whole model's, for one process)."""
        self.whole_kv = Shard((0, 0), (0, 0))
        """The model's layers and KV heads, once started."""
        self._link: Any = None  # kv_sharded.RankLink to the other ranks' senders (TP or PP)
        self.jobs: dict[str, PrefillJob] = {}
        self.bytes_sent_total = 0
        self.transfer_failures_total = 0
        self.num_sends_total = 0
        """``KVSender.send`` calls (one per step per prompt that completed blocks): for tests."""
        self.blocks_held = 0
        """Blocks held for sends not completed yet (``baton:kv_blocks_held_for_transfer``)."""
        self._fault_tripped = False
        self._fault_resume = threading.Event()
        self._senders: dict[str, KVSender] = {}
        self._senders_lock = threading.Lock()
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._transfer_seconds: Histogram | None = None
        self._transfer_model: Any = None  # an emulated worker's modelled transfer time (emulated.py)

    # -- the shell's hooks -----------------------------------------------------------------------
    def _make_engine(self) -> LLMEngine:
        engine = super()._make_engine()
        engine.on_step_computed = self._on_step_computed  # after the warm-up: no job to push
        return engine

    def _engine_ready(
        self, llm: LLMEngine, metrics: CollectorRegistry, labels: dict[str, str]
    ) -> AddServicer:
        self.kv_layout = tp_transfer.full_layout(llm)
        self.rank_shards = tp_transfer.rank_shards(llm)
        self.whole_kv = tp_transfer.all_of_model(llm)
        self._transfer_model = transfer_model(llm, self.config.transfer.backend)
        self._link = tp_transfer.rank_link(llm)
        metrics.register(_TransferCollector(self, labels))
        self._transfer_seconds = Histogram(
            "baton:kv_transfer_seconds",
            "Time from a prompt's first KV send to its last block landing.",
            list(labels),
            buckets=LATENCY_BUCKETS,
            registry=metrics,
        ).labels(**labels)
        return functools.partial(baton_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(self))

    def _settings(self, llm: LLMEngine) -> dict:
        return tp_transfer.tp_settings(llm)

    def _load(self, llm: LLMEngine) -> dict[str, float]:
        st = llm.stats()
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "num_running": st["num_requests_running"],
            "num_waiting": st["num_requests_waiting"],
        }

    # -- senders ---------------------------------------------------------------------------------
    async def sender_for(self, dest: tp_transfer.Destination, routes: list) -> tuple[str, KVSender]:
        """The connected sender for ``dest`` (one per destination), connecting it if new; ``routes``
        (``tp_transfer.routes``) say which rank sends which layers and heads where."""
        assert self.engine is not None
        key = dest.key
        with self._senders_lock:
            sender = self._senders.get(key)
        if sender is not None:
            return key, sender
        lock = self._connect_locks.setdefault(key, asyncio.Lock())
        async with lock:
            with self._senders_lock:
                sender = self._senders.get(key)
            if sender is not None:
                return key, sender
            t = self.config.transfer
            config = TransferConfig(
                backend=dest.descriptor.backend,
                host=t.host,
                timeout_s=t.timeout_s,
                fault_hold_payload_after_blocks=self.config.fault_hold_payload_after_blocks,
            )
            connect = functools.partial(tp_transfer.connect_sender, config, self.engine.engine, self._link)
            sender = await asyncio.to_thread(connect, dest, routes)
            with self._senders_lock:
                self._senders[key] = sender
            return key, sender

    def _drop_sender(self, key: str, sender: KVSender) -> None:
        with self._senders_lock:
            if self._senders.get(key) is sender:
                del self._senders[key]
            else:
                return
        _close_later(sender)

    # -- the engine thread -----------------------------------------------------------------------
    def _on_step_computed(self, sched: SchedulerOutput) -> None:
        """Push the blocks each active job's chunk completed (never waiting for them)."""
        if not self.jobs:
            return
        bs = self.config.engine.block_size
        for r in sched.requests:
            job = self.jobs.get(r.request_id)
            if job is None or job.done:
                continue
            try:
                self._advance(job, r.start_pos + r.num_tokens, r.block_ids, bs)
            except Exception as e:  # never let the engine loop die
                self._fail(job, f"KV transfer of {job.request_id!r} failed: {e}")

    def _advance(self, job: PrefillJob, computed: int, block_ids: tuple[int, ...], bs: int) -> None:
        job.computed = computed
        complete = computed >= job.prompt_len
        available = -(-job.prompt_len // bs) if complete else computed // bs
        if available > job.next_block and job.error is None:
            src = [block_ids[i] for i in range(job.next_block, available)]
            dst = [job.dst_block_ids[i - job.skip_blocks] for i in range(job.next_block, available)]
            if not job.started:
                job.started = time.monotonic()
            handle = job.sender.send(job.request_id, src, dst)
            self._hold(src, handle)
            job.sends.append(handle)
            self.num_sends_total += 1
            job.next_block = available
            self._maybe_pause_for_fault(job)
        if complete:
            job.done = True
            job.finished = job.sender.finish(job.request_id)

    def _hold(self, block_ids: list[int], handle: TransferHandle) -> None:
        """Keep blocks that a send reads from out of the pool until the send completes or fails
        (the engine may finish or preempt their request meanwhile): one more reference each, let
        go on the engine thread."""
        assert self.engine is not None
        engine, pool = self.engine, self.engine.engine.pool
        blocks = [pool.blocks[i] for i in block_ids]
        pool.touch(blocks)
        self.blocks_held += len(blocks)

        def let_go(llm: LLMEngine) -> None:
            llm.pool.free_blocks(reversed(blocks))
            self.blocks_held -= len(blocks)

        handle.add_done_callback(lambda _: engine.call_soon(let_go))

    def _maybe_pause_for_fault(self, job: PrefillJob) -> None:
        """``fault_pause_after_blocks`` (test only): stop the engine thread once the first prompt's
        first N blocks have landed, as if the worker died mid-transfer."""
        n = self.config.fault_pause_after_blocks
        if not n or self._fault_tripped or job.next_block - job.skip_blocks < n:
            return
        self._fault_tripped = True
        for handle in job.sends:
            handle.wait(self.config.transfer.timeout_s)
        log.warning(
            "FAULT INJECTION (test only): the engine stops after %d blocks of %s",
            job.next_block - job.skip_blocks,
            job.request_id,
        )
        self._fault_resume.wait()  # until stop(): the tests kill or stop the process meanwhile

    async def sent(self, job: PrefillJob) -> str | None:
        """Wait (on the event loop) until every send of a finished job has completed; None when all
        did, else what failed. Bounded: each send fails at the transport's deadline."""
        assert job.finished is not None
        timeout = self.config.transfer.timeout_s
        try:
            await job.finished.wait_async(timeout + 5.0)
        except TransferError as e:
            self.transfer_failures_total += 1
            self._drop_sender(job.sender_key, job.sender)
            log.warning("KV transfer of %r failed: %s", job.request_id, e)
            return f"KV transfer of {job.request_id!r} failed: {e}"
        tokens = job.prompt_len - job.skip_blocks * self.config.engine.block_size
        await hold_transfer(self._transfer_model, tokens, job.started or None)
        job.bytes_sent = job.finished.nbytes
        self.bytes_sent_total += job.finished.nbytes
        if self._transfer_seconds is not None and job.started:
            self._transfer_seconds.observe(time.monotonic() - job.started)
        return None

    def _fail(self, job: PrefillJob, message: str) -> None:
        log.warning("%s", message)
        job.done = True
        job.error = message
        self.transfer_failures_total += 1
        self._drop_sender(job.sender_key, job.sender)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of the prefills in flight not computed yet (the registry record's load)."""
        return sum(max(0, j.prompt_len - j.computed) for j in list(self.jobs.values()))

    async def stop(self) -> None:
        self._fault_resume.set()  # on every call: frees an engine thread the fault injection paused
        await super().stop()

    async def _close(self) -> None:
        with self._senders_lock:
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            try:
                await asyncio.to_thread(s.close)
            except Exception:
                log.exception("closing a KV sender")


def _close_later(sender: KVSender) -> None:
    """Close a sender off the caller's thread (closing may wait on the transport)."""

    def close() -> None:
        try:
            sender.close()
        except Exception:
            log.debug("closing a failed KV sender", exc_info=True)

    threading.Thread(target=close, name="baton-sender-close", daemon=True).start()


async def serve(
    config: PrefillWorkerConfig,
    stop: asyncio.Event,
    drain_timeout_s: float = 30.0,
    ready_file: str | None = None,
) -> int:
    """Run a prefill worker until ``stop`` is set (SIGINT/SIGTERM in ``baton prefill``), then drain
    it; or until its engine dies. Returns the exit code (``worker_base.serve_worker``)."""
    return await serve_worker(
        lambda on_exit: PrefillWorker(config, on_exit), stop, drain_timeout_s, ready_file
    )
