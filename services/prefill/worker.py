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
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.common.api.convert import params_from_proto, top_logprobs_to_proto
from baton.common.engine.async_engine import AsyncEngine, EngineDeadError, EngineFullError
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.engine.scheduler import SchedulerOutput
from baton.common.index.registry import WorkerInfo
from baton.common.metrics import LATENCY_BUCKETS, EngineCollector, serve_metrics
from baton.common.net import free_port
from baton.common.transfer import (
    KVSender,
    TransferConfig,
    TransferDescriptor,
    TransferError,
    TransferHandle,
)
from baton.common.transfer.base import BACKENDS
from baton.common.transfer.reshard import Shard
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services import tp_transfer
from baton.services.emulated import hold_transfer, transfer_model
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS
from baton.services.lifecycle import Lifecycle, RpcGate
from baton.services.worker_base import (
    advertised,
    build_engine,
    model_name,
    serve_worker,
    start_grpc,
    start_heartbeat,
    start_publisher,
    worker_settings,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillWorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    """Address the gRPC and metrics servers bind and advertise."""
    grpc_port: int = 0
    """0 picks a free port."""
    metrics_port: int = 0
    redis_url: str | None = None
    """Registry to join; None runs unregistered (tests, a single worker)."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """Signs this worker's registry record, and only records signed with it are trusted
    (``common/index/record_mac.py``); None: records are neither signed nor checked."""
    advertise_host: str = ""
    """The address other services reach this worker at (its registry record); empty: ``host``,
    or this machine's address when ``host`` is a wildcard (``0.0.0.0`` in a container)."""
    worker_id: str = ""
    """Defaults to ``prefill-<host>-<pid>-<random>``."""
    heartbeat_ttl_s: float = 6.0
    prefix_index_max_entries: int = 1_000_000
    """Bound on the model's prefix index in Redis (block hashes)."""
    grpc_tls: GrpcTLS = PLAINTEXT
    """TLS of this worker's gRPC server (``services/grpc_tls.py``)."""
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


@dataclass
class _Job:
    """One Prefill RPC in flight. Created on the event loop; advanced on the engine thread."""

    request_id: str
    prompt_len: int
    skip_blocks: int
    dst_block_ids: list[int]
    sender: KVSender
    sender_key: str
    computed: int = 0
    next_block: int = 0
    """Index of the first prompt block not yet sent (starts at ``skip_blocks``)."""
    started: float = 0.0
    bytes_sent: int = 0
    done: bool = False
    error: str | None = None
    finished: TransferHandle | None = None
    """Every send of the prompt (``KVSender.finish``), once its last block was queued."""
    sends: list[TransferHandle] = field(default_factory=list)


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


class PrefillServicer(baton_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    async def _check_layout(self, requested: str, context) -> None:
        """Refuse a destination whose cache blocks are not laid out like this worker's."""
        own = self.worker.kv_layout
        if requested and requested != own:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch: the decode worker's cache is {requested}, this prefill worker's is "
                f"{own} (start both with the same --dtype, --kv-cache-dtype, --block-size and model)",
            )

    async def Prefill(self, request, context):
        w = self.worker
        assert w.engine is not None
        llm = w.engine.engine
        rid = request.request_id
        ids = list(request.prompt_token_ids)
        try:
            if not rid:
                raise ValueError("request_id must not be empty")
            params = params_from_proto(request.params)  # one token here; min_tokens masks its stops too
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
            llm.validate_prompt(ids)
            bs = llm.config.block_size
            skip = request.num_skip_tokens
            if skip < 0 or skip % bs or skip > len(ids):
                raise ValueError(
                    f"num_skip_tokens must be a multiple of the block size {bs} in [0, {len(ids)}], got {skip}"
                )
            n_blocks = -(-len(ids) // bs)
            want = n_blocks - skip // bs
            if len(request.dst_block_ids) != want:
                raise ValueError(
                    f"expected {want} dst_block_ids for a {len(ids)}-token prompt skipping {skip} tokens, "
                    f"got {len(request.dst_block_ids)}"
                )
            _descriptor(request.destination)
            if rid in w.jobs:
                raise ValueError(f"request_id {rid!r} is already in use")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._check_layout(request.kv_layout, context)
        dest, routes = await self._destination(request, context)

        try:
            key, sender = await w.sender_for(dest, routes)
        except Exception as e:  # unreachable or bogus destination
            w.transfer_failures_total += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV receiver: {e}")

        job = _Job(rid, len(ids), skip // bs, list(request.dst_block_ids), sender, key, next_block=skip // bs)
        w.jobs[rid] = job
        first = None
        try:
            async for d in w.engine.generate(rid, ids, params):
                if d.token_ids and first is None:
                    first = d
                if d.finished:
                    if first is None:
                        first = d
                    break
        except ValueError as e:  # refused at admission
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineFullError as e:  # the waiting queue is full: the decode worker prefills itself
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineDeadError as e:  # leaving service: the decode worker prefills it itself
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            w.jobs.pop(rid, None)
            if not job.done:  # aborted: its sends are not waited for (their blocks are still held)
                job.sender.finish(rid)
        if job.error is not None:
            await context.abort(grpc.StatusCode.DATA_LOSS, job.error)
        if first is None or not first.token_ids:
            reason = first.finish_reason if first is not None else "no output"
            code = grpc.StatusCode.CANCELLED if reason == "abort" else grpc.StatusCode.INTERNAL
            await context.abort(code, f"prefill of {rid!r} ended without a token ({reason})")
        assert first is not None
        if not job.done:  # cannot happen unless the engine skipped the hook
            await context.abort(grpc.StatusCode.INTERNAL, f"KV of {rid!r} was not sent")
        error = await w.sent(job)
        if error is not None:
            # DATA_LOSS, not UNAVAILABLE: this worker is alive and says the KV did not all arrive
            # (and may have let go of blocks the receiver was still reading): recompute it all.
            await context.abort(grpc.StatusCode.DATA_LOSS, error)
        cached = first.num_cached_tokens
        return baton_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=first.token_ids[0],
            first_logprob=first.logprobs[0] if first.logprobs else 0.0,
            first_top_logprobs=top_logprobs_to_proto(first.top_logprobs[0]) if first.top_logprobs else None,
            num_computed_tokens=len(ids) - cached,
            num_cached_tokens=cached,
            bytes_sent=job.bytes_sent,
        )

    async def _destination(self, request, context) -> tuple[tp_transfer.Destination, list]:
        """The decode worker's ranks and which of this worker's ranks feeds which (re-sharded
        when the two run at different tensor- or pipeline-parallel degrees)."""
        w = self.worker
        try:
            dest = tp_transfer.destination(request, _descriptor, w.whole_kv)
            return dest, tp_transfer.routes(w.rank_shards, dest, w.whole_kv)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # abort raises; for the type checker

    async def Connect(self, request, context):
        """Connect the KV transport to a decode worker ahead of its first prompt."""
        try:
            _descriptor(request.destination)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._check_layout(request.kv_layout, context)
        dest, routes = await self._destination(request, context)
        try:
            await self.worker.sender_for(dest, routes)
        except Exception as e:  # noqa: BLE001 - unreachable or bogus destination
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV receiver: {e}")
        return baton_pb2.ConnectResponse()

    async def Abort(self, request, context):
        w = self.worker
        assert w.engine is not None
        for rid in request.request_ids:
            w.engine.abort(rid)
            w.jobs.pop(rid, None)
        return baton_pb2.AbortResponse(num_aborted=len(request.request_ids))


def _descriptor(msg: baton_pb2.TransferDescriptor) -> TransferDescriptor:
    try:
        if msg.extra_json:
            d = TransferDescriptor.from_dict(json.loads(msg.extra_json))
        else:
            d = TransferDescriptor(msg.backend, host=msg.host, port=msg.port)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"bad destination descriptor: {e}") from e
    if d.backend not in BACKENDS:
        raise ValueError(f"destination backend must be one of {BACKENDS}, got {d.backend!r}")
    return d


class PrefillWorker:
    """Owns the engine, servers, senders and heartbeat of one prefill worker. ``start()``, then
    ``drain()`` (SIGTERM) or ``stop()``; a dead engine makes it leave service and call
    ``on_exit(EX_SOFTWARE)`` (``services/lifecycle.py``)."""

    def __init__(self, config: PrefillWorkerConfig, on_exit: Callable[[int], None] | None = None):
        self.config = config
        self._gate = RpcGate(["/baton.v1.Prefill/Prefill"])
        self._lifecycle = Lifecycle(self._gate, self._leave_registry, self.stop, on_exit)
        self._stopped = False
        self.worker_id = config.worker_id or f"prefill-{config.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.grpc_port = config.grpc_port
        self.metrics_port = config.metrics_port
        self.engine: AsyncEngine | None = None
        self.kv_layout = ""
        """``model_runner.kv_cache_layout`` of this worker's cache (all ranks' layers and heads),
        once started."""
        self.rank_shards: list[Shard] = []
        """Each rank's layers and KV heads (one shard, the whole model's, for one process)."""
        self.whole_kv = Shard((0, 0), (0, 0))
        """The model's layers and KV heads, once started."""
        self._link: Any = None  # kv_sharded.RankLink to the other ranks' senders (TP or PP)
        self.jobs: dict[str, _Job] = {}
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
        self._server: grpc.aio.Server | None = None
        self._heartbeat: Any = None
        self._publisher: Any = None
        self._metrics_server: Any = None

    async def start(self) -> None:
        cfg = self.config
        on_events = None
        if cfg.redis_url:
            self._publisher = start_publisher(
                cfg.redis_url, model_name(cfg.engine), self.worker_id, cfg.prefix_index_max_entries
            )
            on_events = self._publisher.submit

        def build() -> LLMEngine:
            engine = build_engine(cfg.engine)
            engine.on_step_computed = self._on_step_computed  # after the warm-up: no job to push
            return engine

        on_fatal = self._lifecycle.on_fatal(asyncio.get_running_loop())
        self.engine = AsyncEngine(build, on_cache_events=on_events, on_fatal=on_fatal)
        llm_engine = await asyncio.to_thread(self.engine.start)
        self.kv_layout = tp_transfer.full_layout(llm_engine)
        self.rank_shards = tp_transfer.rank_shards(llm_engine)
        self.whole_kv = tp_transfer.all_of_model(llm_engine)
        self._transfer_model = transfer_model(llm_engine, cfg.transfer.backend)
        self._link = tp_transfer.rank_link(llm_engine)
        registry = CollectorRegistry()
        labels = {"model_name": llm_engine.model_name, "worker": self.worker_id}
        registry.register(EngineCollector(llm_engine, labels))
        registry.register(_TransferCollector(self, labels))
        self._transfer_seconds = Histogram(
            "baton:kv_transfer_seconds",
            "Time from a prompt's first KV send to its last block landing.",
            list(labels),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self.metrics_port = self.metrics_port or free_port(cfg.host)
        self._metrics_server, _ = serve_metrics(self.metrics_port, cfg.host, registry)

        self._server, self.grpc_port = await start_grpc(
            cfg.host,
            self.grpc_port,
            lambda srv: baton_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), srv),
            self._gate,
            cfg.grpc_tls,
        )
        if cfg.redis_url:
            info = WorkerInfo(
                id=self.worker_id,
                role="prefill",
                grpc_address=f"{advertised(cfg.host, cfg.advertise_host)}:{self.grpc_port}",
                kv_address="",
                metrics_url=f"http://{advertised(cfg.host, cfg.advertise_host)}:{self.metrics_port}/metrics",
                settings=worker_settings(llm_engine, **tp_transfer.tp_settings(llm_engine)),
            )

            def load() -> dict[str, float]:
                st = llm_engine.stats()
                return {
                    "queued_prefill_tokens": self.queued_prefill_tokens(),
                    "num_running": st["num_requests_running"],
                    "num_waiting": st["num_requests_waiting"],
                }

            self._heartbeat, _ = start_heartbeat(
                cfg.redis_url, llm_engine.model_name, cfg.heartbeat_ttl_s, info, load,
                publisher=self._publisher, engine=self.engine, secret=cfg.cluster_secret,
            )  # fmt: skip
        log.info("prefill worker %s serving gRPC on %s:%d", self.worker_id, cfg.host, self.grpc_port)

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

    def _advance(self, job: _Job, computed: int, block_ids: tuple[int, ...], bs: int) -> None:
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

    def _maybe_pause_for_fault(self, job: _Job) -> None:
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

    async def sent(self, job: _Job) -> str | None:
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

    def _fail(self, job: _Job, message: str) -> None:
        log.warning("%s", message)
        job.done = True
        job.error = message
        self.transfer_failures_total += 1
        self._drop_sender(job.sender_key, job.sender)

    # -- registry --------------------------------------------------------------------------------
    def queued_prefill_tokens(self) -> int:
        return sum(max(0, j.prompt_len - j.computed) for j in list(self.jobs.values()))

    async def drain(self, timeout_s: float) -> bool:
        """Leave service and let the prefills in flight, their KV transfers included, finish within
        ``timeout_s``; the rest end with UNAVAILABLE (the decode worker prefills them itself).
        Then stop. Whether all finished."""
        return await self._lifecycle.drain(timeout_s)

    def _leave_registry(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()  # deletes the key: decode workers stop picking it at their next read

    async def stop(self) -> None:
        self._fault_resume.set()
        if self._stopped:
            return
        self._stopped = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._server is not None:
            # Drained or dead: every work call has ended, what is left (health watches) needs no grace.
            await self._server.stop(grace=0.2 if self._gate.refusal is not None else 2.0)
        if self.engine is not None:
            self.engine.stop()
        with self._senders_lock:
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            try:
                await asyncio.to_thread(s.close)
            except Exception:
                log.exception("closing a KV sender")
        if self._publisher is not None:
            self._publisher.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()


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
