"""What the prefill and decode workers share: the gRPC server with health, the registry
heartbeat, the prefix-cache publisher, and the serve loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.engine.async_engine import AsyncEngine
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.index.registry import Heartbeat, WorkerInfo, WorkerRegistry
from baton.common.parallel.engine_factory import create_engine
from baton.services.grpc_tls import PLAINTEXT, GrpcTLS, add_port
from baton.services.lifecycle import RpcGate

WILDCARD_HOSTS = frozenset(["0.0.0.0", "::", ""])


def advertised(host: str, advertise_host: str = "") -> str:
    """The address a worker bound to ``host`` tells others to reach it at: ``advertise_host`` when
    given, ``host`` unless it is a wildcard, else this machine's own address (a container's)."""
    if advertise_host:
        return advertise_host
    if host not in WILDCARD_HOSTS:
        return host
    import socket

    return socket.gethostbyname(socket.gethostname())


def build_engine(config: EngineConfig) -> LLMEngine:
    """A worker's engine, loaded and warmed up (``LLMEngine.warm_up``): what ``AsyncEngine`` calls
    on its own thread, so that the first request after ready runs at full speed."""
    if config.emulate is not None:
        from baton.services.emulated import create_emulated_engine

        engine = create_emulated_engine(config)
    else:
        engine = create_engine(config, progress=False)
    engine.warm_up()
    return engine


def worker_settings(engine: LLMEngine, **extra) -> dict:
    """What a worker publishes about how it runs (``WorkerInfo.settings``, shown by ``/workers``):
    the engine's dtype (``auto`` resolved), the cores it may use and torch's threads."""
    import os

    import torch

    from baton.services.procs import format_cpu_list

    return {
        "dtype": engine.config.dtype,
        "quantization": engine.config.quantization,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "cpus": format_cpu_list(sorted(os.sched_getaffinity(0))),
        "threads": torch.get_num_threads(),
        **({"emulated": engine.config.emulate} if engine.config.emulate is not None else {}),
        **extra,
    }


def model_name(config: EngineConfig) -> str:
    """The model's name (the registry's key space) without loading it."""
    from baton.common.model.source import ModelSource

    return ModelSource.resolve(config.model).name


GRPC_SERVER_OPTIONS = (
    # Clients (the gateway, decode workers) ping every 2 s on open calls to notice a hung worker;
    # gRPC's defaults would answer pings more often than every 5 minutes with GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


async def start_grpc(
    host: str,
    port: int,
    add_servicer: Callable[[grpc.aio.Server], None],
    gate: RpcGate | None = None,
    tls: GrpcTLS = PLAINTEXT,
) -> tuple[grpc.aio.Server, int]:
    """A started ``grpc.aio`` server with the worker's service and gRPC health (SERVING); returns
    it and the port it bound (``port`` 0 picks one). A ``gate`` guards the work RPCs and gets the
    health servicer, to report NOT_SERVING when the worker leaves service. ``tls``: the server's
    TLS identity (``services/grpc_tls.py``), plaintext by default."""
    interceptors = [gate] if gate is not None else None
    server = grpc.aio.server(interceptors=interceptors, options=list(GRPC_SERVER_OPTIONS))
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if gate is not None:
        gate.health = health_servicer
    bound = add_port(server, f"{host}:{port}", tls)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def start_publisher(redis_url: str, model_name: str, worker_id: str, max_entries: int):
    """A started ``CachePublisher`` writing this worker's cache events to the prefix index."""
    from baton.common.index.client import connect
    from baton.common.index.prefix_index import PrefixIndex
    from baton.common.index.publisher import CachePublisher

    index = PrefixIndex(connect(redis_url), model_name, max_entries=max_entries)
    publisher = CachePublisher(index, worker_id)
    publisher.start()
    return publisher


def start_heartbeat(
    redis_url: str,
    model_name: str,
    ttl_s: float,
    info: WorkerInfo,
    load: Callable[[], dict[str, float]],
    publisher=None,
    engine: AsyncEngine | None = None,
    secret: bytes | None = None,
) -> tuple[Heartbeat, WorkerRegistry]:
    """Register ``info`` and keep it alive with fresh ``load()`` figures on every beat. With the
    worker's ``publisher`` and ``engine``, a Redis that lost this worker (restarted empty) gets the
    whole prefix cache published again (``CachePublisher.resync``), so that prefix-aware routing
    recovers without a restart. With the cluster's ``secret`` the record is signed, and the
    returned registry lists only signed records (``WorkerRegistry``)."""
    from baton.common.index.client import connect

    if publisher is not None and engine is not None:
        publisher.snapshot_source = functools.partial(_snapshot_cache, publisher, engine)
    registry = WorkerRegistry(connect(redis_url), model_name, ttl_s, secret)
    on_forgotten = publisher.resync if publisher is not None else None
    heartbeat = Heartbeat(registry, lambda: info.with_load(**load()), on_forgotten=on_forgotten)
    heartbeat.start()
    return heartbeat, registry


def _snapshot_cache(publisher, engine: AsyncEngine) -> None:
    """Have the engine thread queue every hash its prefix cache holds on ``publisher`` (between two
    steps, so the snapshot sits in order with the step events around it; nothing waits)."""
    engine.call_soon(lambda llm: publisher.submit_snapshot(llm.pool.cached_hashes()))


async def serve_worker(
    make_worker: Callable[[Callable[[int], None]], Any],
    stop: asyncio.Event,
    drain_timeout_s: float = 30.0,
    ready_file: str | None = None,
) -> int:
    """Build a worker with ``make_worker(on_exit)``, start it, note its ports in ``ready_file``,
    and serve until ``stop`` is set (then drain it, within ``drain_timeout_s``) or its engine dies;
    returns the process's exit code (0 drained, ``EX_SOFTWARE`` dead)."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()

    def on_exit(code: int) -> None:
        if not exited.done():
            exited.set_result(code)

    worker = make_worker(on_exit)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await worker.start()
        if ready_file:
            with open(ready_file, "w") as f:
                f.write(f"{worker.grpc_port} {worker.metrics_port}\n")
        await asyncio.wait({stopping, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            await worker.drain(drain_timeout_s)
        return exited.result() if exited.done() else 0
    finally:
        stopping.cancel()
        await worker.stop()
