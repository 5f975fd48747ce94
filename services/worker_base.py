"""What the prefill and decode workers share: the gRPC server with health, the registry
heartbeat, the prefix-cache publisher, and the serve loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.engine.llm_engine import EngineConfig, LLMEngine
from baton.common.index.registry import Heartbeat, WorkerInfo, WorkerRegistry


def build_engine(config: EngineConfig) -> LLMEngine:
    """A worker's engine, loaded and warmed up (``LLMEngine.warm_up``): what ``AsyncEngine`` calls
    on its own thread, so that the first request after ready runs at full speed."""
    engine = LLMEngine.from_config(config, progress=False)
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
        "cpus": format_cpu_list(sorted(os.sched_getaffinity(0))),
        "threads": torch.get_num_threads(),
        **extra,
    }


def model_name(config: EngineConfig) -> str:
    """The model's name (the registry's key space) without loading it."""
    from baton.common.model.source import ModelSource

    return ModelSource.resolve(config.model).name


async def start_grpc(
    host: str, port: int, add_servicer: Callable[[grpc.aio.Server], None]
) -> tuple[grpc.aio.Server, int]:
    """A started ``grpc.aio`` server with the worker's service and gRPC health (SERVING); returns
    it and the port it bound (``port`` 0 picks one)."""
    server = grpc.aio.server()
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def start_publisher(redis_url: str, model_name: str, worker_id: str, max_entries: int):
    """A started ``CachePublisher`` writing this worker's cache events to the prefix index."""
    import redis

    from baton.common.index.prefix_index import PrefixIndex
    from baton.common.index.publisher import CachePublisher

    index = PrefixIndex(redis.Redis.from_url(redis_url), model_name, max_entries=max_entries)
    publisher = CachePublisher(index, worker_id)
    publisher.start()
    return publisher


def start_heartbeat(
    redis_url: str, model_name: str, ttl_s: float, info: WorkerInfo, load: Callable[[], dict[str, float]]
) -> tuple[Heartbeat, WorkerRegistry]:
    """Register ``info`` and keep it alive with fresh ``load()`` figures on every beat."""
    import redis

    registry = WorkerRegistry(redis.Redis.from_url(redis_url), model_name, ttl_s)
    heartbeat = Heartbeat(registry, lambda: info.with_load(**load()))
    heartbeat.start()
    return heartbeat, registry


async def serve_worker(worker, ready_file: str | None = None) -> None:
    """Start a worker, note its ports in ``ready_file``, and run until cancelled."""
    await worker.start()
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{worker.grpc_port} {worker.metrics_port}\n")
    try:
        await asyncio.Event().wait()
    finally:
        await worker.stop()
