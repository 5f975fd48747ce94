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
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from baton.common.api.convert import params_from_proto, top_logprobs_to_proto
from baton.common.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineFullError,
    RequestFailedError,
)
from baton.common.engine.llm_engine import LLMEngine
from baton.common.index.outage import OutageLog
from baton.common.index.registry import WorkerInfo
from baton.common.metrics import RegistryRejectsCollector, RequestMetrics, TransferCollector, stream_handoff
from baton.common.transfer import TransferConfig
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services import tp_transfer
from baton.services.decode.remote_prefill import RemotePrefill, RemotePrefillCollector, RemotePrefillConfig
from baton.services.pod_cost import PodRef
from baton.services.worker_base import serve_worker
from baton.services.worker_shell import AddServicer, ShellConfig, WorkerShell

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeWorkerConfig(ShellConfig):
    """A decode worker: its shell's settings (``ShellConfig``: engine, addresses, registry, TLS)
    and its own."""

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


class DecodeWorker(WorkerShell):
    """One decode worker: the shell (engine, servers, heartbeat: ``services/worker_shell.py``), the
    ``Decode`` service, and with a registry and not ``colocated`` the KV receiver and the prefill
    workers it connects to. ``start()``, then ``drain()`` (SIGTERM: the streams in flight finish,
    the rest end with UNAVAILABLE for the gateway to resume elsewhere) or ``stop()``."""

    role = "decode"
    work_rpcs = ("/baton.v1.Decode/Generate",)

    def __init__(self, config: DecodeWorkerConfig, on_exit: Callable[[int], None] | None = None):
        self.config = config
        super().__init__(config, on_exit)
        self._receiver = None
        self._remote: RemotePrefill | None = None
        self._prefill_workers: list[WorkerInfo] = []
        """Prefill workers from the registry, refreshed every ``prefill_refresh_s``."""
        self._connected: set[tuple[str, str]] = set()
        """(id, address) of the prefill workers whose transport reaches this worker."""
        self._watcher: asyncio.Task | None = None
        self._registry_outage = OutageLog(log, "worker registry (prefill workers)")
        self._pod_cost = None

    def _engine_ready(
        self, llm: LLMEngine, metrics: CollectorRegistry, labels: dict[str, str]
    ) -> AddServicer:
        assert self.engine is not None
        metrics.register(RegistryRejectsCollector(self._num_rejected, labels))
        request_metrics = RequestMetrics(metrics, labels)
        if self.config.redis_url and not self.config.colocated:
            self._start_receiver(llm, metrics, labels)
        servicer = DecodeServicer(self.engine, request_metrics, self._remote, stream_handoff(metrics, labels))
        return functools.partial(baton_pb2_grpc.add_DecodeServicer_to_server, servicer)

    def _start_receiver(self, llm: LLMEngine, metrics: CollectorRegistry, labels: dict[str, str]) -> None:
        """The KV receiver (one per tensor- or pipeline-parallel rank, each into its own cache:
        ``tp_transfer``) and the remote prefills that land in it."""
        cfg = self.config
        assert cfg.redis_url
        self._receiver = tp_transfer.make_receiver(cfg.transfer, llm, tp_transfer.rank_link(llm))
        descriptor = self._receiver.start()
        self.kv_address = json.dumps(descriptor.to_dict())
        metrics.register(TransferCollector(self._receiver.stats, labels))
        metrics.register(tp_transfer.RankBytesCollector(self._receiver, labels))
        from baton.common.index.client import connect
        from baton.common.index.locations import BlockLocations, LocationRecorder

        locations = LocationRecorder(
            BlockLocations(connect(cfg.redis_url), llm.model_name, ttl_s=cfg.prefill_timeout_s * 2)
        )
        locations.start()
        self._remote = RemotePrefill(
            self._receiver,
            descriptor,
            self._pick_prefill,
            cfg.remote_prefill(),
            locations=locations,
            worker_id=self.worker_id,
            bytes_per_token=tp_transfer.bytes_per_token(llm),
            kv_layout=tp_transfer.full_layout(llm),
            known_prefill=lambda: {w.grpc_address for w in self._prefill_workers},
            rank_destinations=tp_transfer.rank_destinations(self._receiver),
        )
        metrics.register(RemotePrefillCollector(self._remote, labels))

    def _settings(self, llm: LLMEngine) -> dict:
        return {"colocated": self.config.colocated, **tp_transfer.tp_settings(llm)}

    def _load(self, llm: LLMEngine) -> dict[str, float]:
        st = llm.stats()
        return {
            "num_running": st["num_requests_running"],
            "num_waiting": st["num_requests_waiting"],
            "free_blocks": st["num_free_blocks"],
            "prefill_connected": len(self._connected),
        }

    async def _serving(self, llm: LLMEngine) -> None:
        if self.config.pod is not None:
            from baton.services.pod_cost import start_reporter

            self._pod_cost = start_reporter(self.config.pod, lambda: llm.stats()["num_requests_running"])
        if self._remote is not None:
            await self._refresh_prefill_workers()
            self._watcher = asyncio.create_task(self._watch_prefill_workers())

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

    async def _stop_background(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        if self._pod_cost is not None:
            self._pod_cost.stop()

    async def _close(self) -> None:
        if self._remote is not None:
            await self._remote.close()
        if self._receiver is not None:
            self._receiver.close()


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
