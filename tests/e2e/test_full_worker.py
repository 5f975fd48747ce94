"""A decode worker whose waiting queue is full (it answers RESOURCE_EXHAUSTED, injected here as a
gRPC server that does only that) costs the client nothing while another decode worker has room:
the gateway tries that one before the first token. Only when every worker it tries is full does
the client get the 429."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.common.index.client import connect
from baton.common.index.registry import WorkerInfo, WorkerRegistry
from baton.common.index.server import EmbeddedRedis
from baton.common.model.source import ModelSource
from baton.common.net import free_port
from baton.protos import baton_pb2_grpc
from baton.services.gateway.app import GatewayConfig
from tests.e2e.tiny_gateway import build_tiny_llama, decode_worker, gateway


class FullDecode(baton_pb2_grpc.DecodeServicer):
    """A decode worker whose queue is always full."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "1 requests are waiting (max_waiting_requests=1)"
        )
        yield  # pragma: no cover - a generator, as the real servicer is


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two registries: one with the full worker and a real tiny decode worker, one with the full
    worker alone; a gateway on each."""
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    name = ModelSource.resolve(str(model)).name
    redis, alone = EmbeddedRedis(), EmbeddedRedis()
    url, alone_url = redis.start(), alone.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    full = FullDecode()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        baton_pb2_grpc.add_DecodeServicer_to_server(full, server)
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    info = WorkerInfo("a-full", "decode", f"127.0.0.1:{port}", "", "")  # first by id on a tie
    for u in (url, alone_url):
        WorkerRegistry(connect(u), name, ttl_s=300).register(info)
    try:
        with decode_worker(model, url, max_model_len=256):
            with gateway(GatewayConfig(model=str(model), port=free_port(), redis_url=url)) as base:
                with gateway(GatewayConfig(model=str(model), port=free_port(), redis_url=alone_url)) as only:
                    yield base, only, full
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        redis.stop()
        alone.stop()


def test_a_full_worker_is_passed_over_before_the_first_token(cluster):
    base, _, full = cluster
    for stream in (False, True):
        # A refused worker sits out until the router's next registry read (0.5 s): send until a
        # request is offered to it first, then check that one still succeeded.
        deadline = time.monotonic() + 20
        while True:
            before = full.calls
            body = {"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True, "stream": stream}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                text = r.read().decode()
            assert r.status_code == 200 and "error" not in text, text
            if full.calls == before + 1:
                break  # tried first, refused, and served elsewhere
            assert time.monotonic() < deadline, "no request was offered to the full worker first"
            time.sleep(0.1)


def test_when_every_worker_is_full_the_client_gets_a_429(cluster):
    _, only, full = cluster
    before = full.calls
    r = httpx.post(f"{only}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "worker_queue_full" and r.headers["Retry-After"] == "1"
    assert full.calls == before + 1
