"""A decode worker joined to a real Redis: it registers itself and publishes the block hashes it
caches to the prefix index, where a router can find the longest cached prefix."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import redis

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.engine.hashing import BlockHasher
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.registry import WorkerRegistry
from baton.common.index.server import EmbeddedRedis
from baton.common.llm import SamplingParams
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig


@pytest.fixture(scope="module")
def joined_worker():
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = DecodeWorkerConfig(
        engine=EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048), redis_url=url
    )
    worker = DecodeWorker(cfg)
    asyncio.run_coroutine_threadsafe(worker.start(), loop).result(timeout=300)
    yield worker, redis.Redis.from_url(url)
    asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    server.stop()


def _poll(fn, expected, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    value = fn()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        value = fn()
    return value


def test_worker_registers_and_publishes_its_cached_prefix(joined_worker):
    worker, client = joined_worker
    model = worker.engine.engine.model_name
    registry = WorkerRegistry(client, model, ttl_s=6.0)
    assert [w.id for w in registry.list(role="decode")] == [worker.worker_id]

    prompt = list(range(300, 370))  # 70 tokens: 4 full blocks of 16
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        chunks = list(baton_pb2_grpc.DecodeStub(channel).Generate(
            baton_pb2.GenerateRequest(request_id="p1", prompt_token_ids=prompt, params=params), timeout=120
        ))  # fmt: skip
    assert chunks[-1].finish_reason == "length"

    index = PrefixIndex(client, model, max_entries=1000)
    hashes = BlockHasher(worker.engine.engine.config.block_size).hash_blocks(prompt)
    assert len(hashes) == 4
    assert _poll(lambda: index.longest_prefix(hashes), {worker.worker_id: 4}) == {worker.worker_id: 4}
    # A different prompt shares nothing with it.
    other = BlockHasher(16).hash_blocks(list(range(1000, 1070)))
    assert index.longest_prefix(other) == {}
