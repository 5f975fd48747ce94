"""The shell of a worker process: what a prefill and a decode worker both are around their engine.

``WorkerShell`` owns the ``AsyncEngine`` and the prefix-cache publisher, the Prometheus metrics
server, the gRPC server (with health and the ``RpcGate`` of ``services/lifecycle.py``), the
registry record and its heartbeat, and the order in which these start, drain and stop. A worker
(``DecodeWorker``, ``PrefillWorker``) subclasses it with its role, the RPCs that carry its work,
and the hooks below; the pieces themselves are ``services/worker_base.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc
from prometheus_client import CollectorRegistry

from baton.common.engine.async_engine import AsyncEngine
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.index.registry import Heartbeat, WorkerInfo, WorkerRegistry
from baton.common.metrics import EngineCollector, serve_metrics
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS
from baton.services.lifecycle import Lifecycle, RpcGate
from baton.services.worker_base import (
    advertised,
    build_engine,
    model_name,
    start_grpc,
    start_heartbeat,
    start_publisher,
    worker_settings,
)

log = logging.getLogger(__name__)

AddServicer = Callable[[grpc.aio.Server], None]
"""Adds a worker's gRPC service to a server (``baton_pb2_grpc.add_*Servicer_to_server``)."""


@dataclass(frozen=True)
class ShellConfig:
    """What every worker's config holds and its shell runs by: ``DecodeWorkerConfig`` and
    ``PrefillWorkerConfig`` add their own fields to these."""

    engine: EngineConfig
    """The engine the worker serves."""
    host: str = "127.0.0.1"
    """Address the gRPC and metrics servers bind and advertise."""
    grpc_port: int = 0
    """0 picks a free port."""
    metrics_port: int = 0
    """0 picks a free port."""
    redis_url: str | None = None
    """Registry to join; None runs unregistered (tests, a single worker)."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """Signs the registry record; only records signed with it are trusted. None: unsigned."""
    grpc_tls: GrpcTLS = PLAINTEXT
    """TLS of the worker's gRPC server and of its channels to other workers (``services/grpc_tls.py``)."""
    advertise_host: str = ""
    """The address others reach the worker at; empty: ``host``, or this machine's if a wildcard."""
    worker_id: str = ""
    """Empty: ``<role>-<host>-<pid>-<random>``."""
    heartbeat_ttl_s: float = 6.0
    """Lifetime of the registry record without a beat."""
    prefix_index_max_entries: int = 1_000_000
    """Bound on the model's prefix index in Redis (block hashes)."""


class WorkerShell:
    """Start, drain and stop of one worker around its engine.

    A subclass sets ``role`` (``"decode"``, ``"prefill"``: the registry's role and the default id's
    prefix) and ``work_rpcs`` (the full names of the RPCs that carry work, which a drain waits for
    and a leaving worker refuses). ``start()`` runs, in order: the publisher (with a registry); the
    engine, built on its thread by ``_make_engine``; ``_engine_ready`` (the role's collectors and
    transport; it returns how to add the gRPC service); the metrics server; the gRPC server; the
    registry record (``_settings``), kept alive with ``_load`` figures; ``_serving``. Then
    ``drain()`` (SIGTERM) or ``stop()``. When the engine dies the worker leaves service by itself
    and calls ``on_exit(EX_SOFTWARE)`` (``services/lifecycle.py``).
    """

    role: ClassVar[str]
    work_rpcs: ClassVar[tuple[str, ...]]

    def __init__(self, shell: ShellConfig, on_exit: Callable[[int], None] | None = None):
        self.shell_config = shell
        self._gate = RpcGate(self.work_rpcs)
        self._lifecycle = Lifecycle(self._gate, self._leave_registry, self.stop, on_exit)
        self._stopped = False
        self.worker_id = shell.worker_id or f"{self.role}-{shell.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.grpc_port = shell.grpc_port
        self.metrics_port = shell.metrics_port
        self.engine: AsyncEngine | None = None
        self.kv_address = ""
        """Where other workers send this one KV (its registry record); empty: it receives none."""
        self._server: grpc.aio.Server | None = None
        self._heartbeat: Heartbeat | None = None
        self._registry: WorkerRegistry | None = None
        """Set with the heartbeat: the registry the worker reads others from."""
        self._publisher: Any = None
        self._metrics_server: Any = None

    # -- the role's hooks ------------------------------------------------------------------------
    def _make_engine(self) -> LLMEngine:
        """The engine, loaded and warmed up (runs on the engine's thread)."""
        return build_engine(self.shell_config.engine)

    def _engine_ready(
        self, llm: LLMEngine, metrics: CollectorRegistry, labels: dict[str, str]
    ) -> AddServicer:
        """Once the engine runs: register the role's collectors on ``metrics`` (labelled ``labels``),
        start what the role needs beside the engine, and return how to add its gRPC service."""
        raise NotImplementedError

    def _settings(self, llm: LLMEngine) -> dict:
        """The role's entries of the registry record's ``settings`` (beside ``worker_settings``)."""
        return {}

    def _load(self, llm: LLMEngine) -> dict[str, float]:
        """The load figures the registry record carries, read at each beat."""
        raise NotImplementedError

    async def _serving(self, llm: LLMEngine) -> None:
        """Called once the worker serves and is registered."""

    async def _stop_background(self) -> None:
        """Stop the role's own tasks and threads, first thing on ``stop()``."""

    async def _close(self) -> None:
        """Close the role's transport, once the gRPC server and the engine have stopped."""

    # -- start -----------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.shell_config
        llm = await self._start_engine()
        metrics = CollectorRegistry()
        labels = {"model_name": llm.model_name, "worker": self.worker_id}
        metrics.register(EngineCollector(llm, labels))
        add_servicer = self._engine_ready(llm, metrics, labels)
        # Port 0: the kernel's pick, bound at once (a free port picked first can be taken before
        # the bind: seen with a dozen workers starting beside other tests' clusters).
        self._metrics_server, _ = serve_metrics(self.metrics_port, cfg.host, metrics)
        self.metrics_port = self._metrics_server.server_port
        self._server, self.grpc_port = await start_grpc(
            cfg.host, self.grpc_port, add_servicer, self._gate, cfg.grpc_tls
        )
        if cfg.redis_url:
            self._join_registry(llm)
        await self._serving(llm)
        log.info("%s worker %s serving gRPC on %s:%d", self.role, self.worker_id, cfg.host, self.grpc_port)

    async def _start_engine(self) -> LLMEngine:
        """Start the engine on its thread (publishing its cache events with a registry); the
        ``LLMEngine`` once it is loaded and warmed up."""
        cfg = self.shell_config
        on_events = None
        if cfg.redis_url:
            self._publisher = start_publisher(
                cfg.redis_url, model_name(cfg.engine), self.worker_id, cfg.prefix_index_max_entries
            )
            on_events = self._publisher.submit
        self.engine = AsyncEngine(
            self._make_engine,
            on_cache_events=on_events,
            on_fatal=self._lifecycle.on_fatal(asyncio.get_running_loop()),
        )
        return await asyncio.to_thread(self.engine.start)

    def _join_registry(self, llm: LLMEngine) -> None:
        """Register this worker and keep its record alive (``worker_base.start_heartbeat``)."""
        cfg = self.shell_config
        assert cfg.redis_url
        host = advertised(cfg.host, cfg.advertise_host)
        info = WorkerInfo(
            id=self.worker_id,
            role=self.role,
            grpc_address=f"{host}:{self.grpc_port}",
            kv_address=self.kv_address,
            metrics_url=f"http://{host}:{self.metrics_port}/metrics",
            settings=worker_settings(llm, **self._settings(llm)),
        )
        self._heartbeat, self._registry = start_heartbeat(
            cfg.redis_url, llm.model_name, cfg.heartbeat_ttl_s, info, lambda: self._load(llm),
            publisher=self._publisher, engine=self.engine, secret=cfg.cluster_secret,
        )  # fmt: skip

    # -- leave -----------------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> bool:
        """Leave service and let the work in flight finish within ``timeout_s``; the rest ends with
        UNAVAILABLE (the caller takes it elsewhere). Then stop. Whether all finished."""
        return await self._lifecycle.drain(timeout_s)

    def _leave_registry(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()  # deletes the key: others stop sending work here at their next read

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self._stop_background()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._server is not None:
            # Drained or dead: every work call has ended, what is left (health watches) needs no grace.
            await self._server.stop(grace=0.2 if self._gate.refusal is not None else 2.0)
        if self.engine is not None:
            self.engine.stop()
        await self._close()
        if self._publisher is not None:
            self._publisher.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
