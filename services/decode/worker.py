"""A decode worker process: an ``AsyncEngine``, a gRPC ``Decode`` service, Prometheus metrics and a
registry heartbeat.

The gRPC front runs on asyncio and the engine on its own thread, so neither waits for the other.
A prompt whose uncached part reaches ``remote_prefill_threshold`` tokens is prefilled by a prefill
worker (the request's ``prefill_address``, or the least queued one in the registry): blocks are
reserved here, the prefill worker pushes the KV straight into them over ``common/transfer``, and
decoding starts from the first token it sampled. Short prompts, or any failure on that path, are
prefilled here instead.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry

from baton.common.api.convert import params_from_proto, top_logprobs_to_proto
from baton.common.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineFullError,
    RequestFailedError,
)
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.index.outage import OutageLog
from baton.common.index.registry import WorkerInfo, WorkerRegistry
from baton.common.metrics import (
    EngineCollector,
    RegistryRejectsCollector,
    RequestMetrics,
    TransferCollector,
    serve_metrics,
    stream_handoff,
)
from baton.common.net import free_port
from baton.common.transfer import TransferConfig
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services import tp_transfer
from baton.services.decode.remote_prefill import RemotePrefill, RemotePrefillCollector, RemotePrefillConfig
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS
from baton.services.lifecycle import Lifecycle, RpcGate
from baton.services.pod_cost import PodRef
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
class DecodeWorkerConfig:
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
    grpc_tls: GrpcTLS = PLAINTEXT
    """TLS of this worker's gRPC server and of its channels to prefill workers."""
    advertise_host: str = ""
    """The address other services reach this worker at (its registry record); empty: ``host``,
    or this machine's address when ``host`` is a wildcard (``0.0.0.0`` in a container)."""
    worker_id: str = ""
    """Defaults to ``decode-<host>-<pid>-<random>``."""
    heartbeat_ttl_s: float = 6.0
    prefix_index_max_entries: int = 1_000_000
    """Bound on the model's prefix index in Redis (block hashes)."""
    transfer: TransferConfig = TransferConfig()
    """The KV transport this worker receives on."""
    remote_prefill_threshold: int = 32
    """Prompts with fewer uncached tokens than this are prefilled here."""
    colocated: bool = False
    """Prefill every prompt here: no KV receiver, never a prefill worker."""
    pod: PodRef | None = None
    """The Kubernetes pod this worker runs in, whose deletion cost it keeps at its running requests
    (``services/pod_cost.py``); None outside one."""
    prefill_timeout_s: float = 60.0
    """Bound on one remote prefill (RPC and transfer); past it the prompt is recomputed here."""
    prefill_stall_timeout_s: float = 5.0
    """A remote prefill whose transfer has started and then lands no block for this long is given
    up (the landed blocks are kept). Above a prefill step's time under load; a dead or hung prefill
    worker is noticed sooner, by its connection (keepalive: ~2 s)."""
    failed_prefill_hold_s: float = 10.0
    """A prefill worker that failed is left out of the choice this long (its registry key outlives
    it by up to the heartbeat TTL)."""
    prefill_refresh_s: float = 0.5
    """How often the prefill workers are read from the registry (new ones are connected at once)."""

    def remote_prefill(self) -> RemotePrefillConfig:
        """The slice of this config that the remote prefills run by."""
        return RemotePrefillConfig(
            self.remote_prefill_threshold,
            self.engine.block_size,
            self.prefill_timeout_s,
            self.prefill_stall_timeout_s,
            self.failed_prefill_hold_s,
            self.grpc_tls,
        )


class DecodeServicer(baton_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: RequestMetrics,
        remote: RemotePrefill | None = None,
        handoff=None,
    ):
        """``handoff`` (a ``common.metrics.stream_handoff`` summary) observes each chunk's lag
        behind the engine."""
        self.engine = engine
        self.metrics = metrics
        self.remote = remote
        self.handoff = handoff

    async def Generate(self, request, context):
        try:
            params = params_from_proto(request.params)
            self.engine.engine.validate_request(request.prompt_token_ids, params, request.resume_token_ids)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        start = last = time.perf_counter()
        first = True
        rid = request.request_id
        # A cancelled call (the client left) aborts the request at once. The deltas' own generator
        # aborts it too when closed, but one left suspended at a yield (the call cancelled while
        # its chunk was being written) is closed only when it is garbage collected.
        context.add_done_callback(lambda ctx: self.engine.abort(rid) if ctx.cancelled() else None)
        try:
            async for d in self._deltas(request, params):
                now = time.perf_counter()
                if d.token_ids:
                    if first:
                        self.metrics.ttft.observe(now - start)
                        first = False
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if d.finished:
                    self.metrics.e2e.observe(now - start)
                chunk = _chunk(d)
                if self.handoff is not None:
                    self.handoff.observe(time.time() - d.published_unix_s)
                done = self.remote.results.get(rid) if self.remote is not None else None
                if done is not None:  # prefilled remotely: what the prefill worker did not compute
                    chunk.num_cached_tokens = done.num_cached_tokens
                    chunk.kv_transfer_bytes = done.bytes_sent
                    chunk.kv_bytes_per_token = self.remote.bytes_per_token
                yield chunk
        except EngineFullError as e:  # the waiting queue is full: the gateway answers 429
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:  # refused at admission, e.g. a request id already in use
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailedError as e:  # the engine failed this request only: not the client's fault
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except EngineDeadError as e:  # this worker is leaving service: the gateway resumes it elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            if self.remote is not None:
                self.remote.results.pop(rid, None)

    def _deltas(self, request, params):
        ids = list(request.prompt_token_ids)
        if request.resume_token_ids:  # migrated here mid-stream: recomputed here, as a preemption is
            return self.engine.generate(
                request.request_id, ids, params, request.resume_token_ids, request.resume_text_chars
            )
        if self.remote is not None and len(ids) >= self.remote.threshold:
            prefill = functools.partial(self.remote.prefill, request, params)
            return self.engine.generate_remote(request.request_id, ids, params, prefill)
        return self.engine.generate(request.request_id, ids, params)

    async def Abort(self, request, context):
        for rid in request.request_ids:
            self.engine.abort(rid)
        return baton_pb2.AbortResponse(num_aborted=len(request.request_ids))


def _chunk(d) -> baton_pb2.GenerateChunk:
    return baton_pb2.GenerateChunk(
        request_id=d.request_id,
        token_ids=d.token_ids,
        logprobs=d.logprobs or [],
        text=d.text,
        finish_reason=(d.finish_reason or "") if d.finished else "",
        stop_reason="" if d.stop_reason is None else str(d.stop_reason),
        num_prompt_tokens=d.num_prompt_tokens,
        num_cached_tokens=d.num_cached_tokens,
        published_unix_s=d.published_unix_s,
        top_logprobs=[top_logprobs_to_proto(t) for t in d.top_logprobs or ()],
    )


class DecodeWorker:
    """Owns the engine, servers and heartbeat of one decode worker. ``start()``, then ``drain()``
    (SIGTERM) or ``stop()``. When the engine dies the worker leaves service by itself and calls
    ``on_exit(EX_SOFTWARE)`` (``services/lifecycle.py``)."""

    def __init__(self, config: DecodeWorkerConfig, on_exit: Callable[[int], None] | None = None):
        self.config = config
        self._gate = RpcGate(["/baton.v1.Decode/Generate"])
        self._lifecycle = Lifecycle(self._gate, self._leave_registry, self.stop, on_exit)
        self._stopped = False
        self.worker_id = config.worker_id or f"decode-{config.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.grpc_port = config.grpc_port
        self.metrics_port = config.metrics_port
        self.engine: AsyncEngine | None = None
        self.kv_address = ""
        self._server: grpc.aio.Server | None = None
        self._heartbeat = None
        self._registry: WorkerRegistry | None = None
        """Set with the heartbeat; where the prefill workers are read."""
        self._publisher = None
        self._receiver = None
        self._remote: RemotePrefill | None = None
        self._prefill_workers: list[WorkerInfo] = []
        """Prefill workers from the registry, refreshed every ``prefill_refresh_s``."""
        self._connected: set[tuple[str, str]] = set()
        """(id, address) of the prefill workers whose transport reaches this worker."""
        self._watcher: asyncio.Task | None = None
        self._registry_outage = OutageLog(log, "worker registry (prefill workers)")
        self._metrics_server = None
        self._pod_cost = None

    async def start(self) -> None:
        cfg = self.config
        on_events = None
        if cfg.redis_url:
            self._publisher = start_publisher(
                cfg.redis_url, model_name(cfg.engine), self.worker_id, cfg.prefix_index_max_entries
            )
            on_events = self._publisher.submit
        self.engine = AsyncEngine(
            functools.partial(build_engine, cfg.engine),
            on_cache_events=on_events,
            on_fatal=self._lifecycle.on_fatal(asyncio.get_running_loop()),
        )
        llm_engine = await asyncio.to_thread(self.engine.start)
        registry = CollectorRegistry()
        labels = {"model_name": llm_engine.model_name, "worker": self.worker_id}
        registry.register(EngineCollector(llm_engine, labels))
        registry.register(RegistryRejectsCollector(self._num_rejected, labels))
        metrics = RequestMetrics(registry, labels)
        if cfg.redis_url and not cfg.colocated:
            # One receiver per tensor- or pipeline-parallel rank, each into its own cache (tp_transfer).
            link = tp_transfer.rank_link(llm_engine)
            self._receiver = tp_transfer.make_receiver(cfg.transfer, llm_engine, link)
            descriptor = self._receiver.start()
            self.kv_address = json.dumps(descriptor.to_dict())
            registry.register(TransferCollector(self._receiver.stats, labels))
            registry.register(tp_transfer.RankBytesCollector(self._receiver, labels))
            from baton.common.index.client import connect
            from baton.common.index.locations import BlockLocations, LocationRecorder

            locations = LocationRecorder(
                BlockLocations(connect(cfg.redis_url), llm_engine.model_name, ttl_s=cfg.prefill_timeout_s * 2)
            )
            locations.start()
            self._remote = RemotePrefill(
                self._receiver,
                descriptor,
                self._pick_prefill,
                cfg.remote_prefill(),
                locations=locations,
                worker_id=self.worker_id,
                bytes_per_token=tp_transfer.bytes_per_token(llm_engine),
                kv_layout=tp_transfer.full_layout(llm_engine),
                known_prefill=lambda: {w.grpc_address for w in self._prefill_workers},
                rank_destinations=tp_transfer.rank_destinations(self._receiver),
            )
            registry.register(RemotePrefillCollector(self._remote, labels))
        self.metrics_port = self.metrics_port or free_port(cfg.host)
        self._metrics_server, _ = serve_metrics(self.metrics_port, cfg.host, registry)

        remote = self._remote
        self._server, self.grpc_port = await start_grpc(
            cfg.host,
            self.grpc_port,
            lambda srv: baton_pb2_grpc.add_DecodeServicer_to_server(
                DecodeServicer(self.engine, metrics, remote, stream_handoff(registry, labels)), srv
            ),
            self._gate,
            cfg.grpc_tls,
        )
        if cfg.redis_url:
            self._start_heartbeat(llm_engine)
        if cfg.pod is not None:
            from baton.services.pod_cost import start_reporter

            self._pod_cost = start_reporter(cfg.pod, lambda: llm_engine.stats()["num_requests_running"])
        if self._remote is not None:
            await self._refresh_prefill_workers()
            self._watcher = asyncio.create_task(self._watch_prefill_workers())
        log.info("decode worker %s serving gRPC on %s:%d", self.worker_id, cfg.host, self.grpc_port)

    def _start_heartbeat(self, llm_engine: LLMEngine) -> None:
        cfg = self.config
        assert cfg.redis_url
        info = WorkerInfo(
            id=self.worker_id,
            role="decode",
            grpc_address=f"{advertised(cfg.host, cfg.advertise_host)}:{self.grpc_port}",
            kv_address=self.kv_address,
            metrics_url=f"http://{advertised(cfg.host, cfg.advertise_host)}:{self.metrics_port}/metrics",
            settings=worker_settings(
                llm_engine, colocated=cfg.colocated, **tp_transfer.tp_settings(llm_engine)
            ),
        )

        def load() -> dict[str, float]:
            st = llm_engine.stats()
            return {
                "num_running": st["num_requests_running"],
                "num_waiting": st["num_requests_waiting"],
                "free_blocks": st["num_free_blocks"],
                "prefill_connected": len(self._connected),
            }

        self._heartbeat, self._registry = start_heartbeat(
            cfg.redis_url, llm_engine.model_name, cfg.heartbeat_ttl_s, info, load,
            publisher=self._publisher, engine=self.engine, secret=cfg.cluster_secret,
        )  # fmt: skip

    def _num_rejected(self) -> int:
        """Prefill worker records this worker left out for their MAC (0 before it registers)."""
        return 0 if self._registry is None else self._registry.num_rejected

    async def _watch_prefill_workers(self) -> None:
        while True:
            await asyncio.sleep(self.config.prefill_refresh_s)
            await self._refresh_prefill_workers()

    async def _refresh_prefill_workers(self) -> None:
        """Read the prefill workers from the registry and connect to the new ones (a Redis blip
        keeps the last list; a worker that cannot be reached is tried again next time)."""
        assert self._remote is not None and self._registry is not None
        try:
            workers = await asyncio.to_thread(self._registry.list, "prefill")
        except Exception as e:  # noqa: BLE001 - Redis away: keep the workers last seen
            self._registry_outage.failed(e)
            return
        self._registry_outage.ok()
        self._prefill_workers = workers
        live = {(w.id, w.grpc_address) for w in workers}
        before = set(self._connected)
        self._connected &= live
        for key in sorted(live - self._connected):
            try:
                await self._remote.connect(key[1])
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.error(
                        "prefill worker %s at %s cannot serve this worker: %s", key[0], key[1], e.details()
                    )
                else:
                    log.warning("prefill worker %s at %s not reachable yet: %s", key[0], key[1], e.details())
                continue
            self._connected.add(key)
        if self._connected != before and self._heartbeat is not None:
            self._heartbeat.beat_now()

    async def _pick_prefill(self, exclude: Collection[str] = ()) -> str | None:
        """The least queued prefill worker of the last registry read (address not in ``exclude``)."""
        workers = [w for w in self._prefill_workers if w.grpc_address not in exclude]
        if not workers:
            return None
        best = min(workers, key=lambda w: (w.load.get("queued_prefill_tokens", 0.0), w.id))
        return best.grpc_address

    async def drain(self, timeout_s: float) -> bool:
        """Leave service and let the streams in flight finish within ``timeout_s``; the rest end
        with UNAVAILABLE (the gateway resumes them elsewhere). Then stop. Whether all finished."""
        return await self._lifecycle.drain(timeout_s)

    def _leave_registry(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()  # deletes the key: gateways stop routing here at their next read

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._pod_cost is not None:
            self._pod_cost.stop()
        if self._server is not None:
            # Drained or dead: every work call has ended, what is left (health watches) needs no grace.
            await self._server.stop(grace=0.2 if self._gate.refusal is not None else 2.0)
        if self.engine is not None:
            self.engine.stop()
        if self._remote is not None:
            await self._remote.close()
        if self._receiver is not None:
            self._receiver.close()
        if self._publisher is not None:
            self._publisher.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()


async def serve(
    config: DecodeWorkerConfig,
    stop: asyncio.Event,
    drain_timeout_s: float = 30.0,
    ready_file: str | None = None,
) -> int:
    """Run a decode worker until ``stop`` is set (SIGINT/SIGTERM in ``baton decode``), then drain
    it; or until its engine dies. Returns the exit code (``worker_base.serve_worker``)."""
    return await serve_worker(
        lambda on_exit: DecodeWorker(config, on_exit), stop, drain_timeout_s, ready_file
    )
