"""A real decode worker over real gRPC: streamed tokens match the offline engine; errors are
INVALID_ARGUMENT; a cancelled stream frees its blocks; metrics and health answer."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.llm import SamplingParams
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def worker_loop():
    """One worker for the module, on its own event loop thread."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker = DecodeWorker(
        DecodeWorkerConfig(engine=EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048))
    )
    asyncio.run_coroutine_threadsafe(worker.start(), loop).result(timeout=300)
    yield worker
    asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _stub(worker):
    channel = grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}")
    return channel, baton_pb2_grpc.DecodeStub(channel)


def test_generate_streams_the_offline_tokens(worker_loop, llm_fp32):
    ids = llm_fp32.get_tokenizer().encode("The three laws of robotics are", add_special_tokens=False)
    channel, stub = _stub(worker_loop)
    with channel:
        chunks = list(
            stub.Generate(
                baton_pb2.GenerateRequest(
                    request_id="a", prompt_token_ids=ids, params=params_to_proto(GREEDY)
                ),
                timeout=120,
            )
        )
    tokens = [t for c in chunks for t in c.token_ids]
    ref = llm_fp32.generate([ids], GREEDY)[0].outputs[0]
    assert tokens == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_prompt_tokens == len(ids)
    assert all(c.finish_reason == "" for c in chunks[:-1])


def test_bad_request_is_invalid_argument(worker_loop):
    channel, stub = _stub(worker_loop)
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    baton_pb2.GenerateRequest(
                        request_id="b", prompt_token_ids=[], params=params_to_proto(GREEDY)
                    ),
                    timeout=30,
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt must not be empty" in e.value.details()
        bad = params_to_proto(GREEDY)
        bad.top_p = 1.5
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    baton_pb2.GenerateRequest(request_id="c", prompt_token_ids=[5], params=bad), timeout=30
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()


def test_cancelled_stream_frees_its_blocks(worker_loop):
    engine = worker_loop.engine.engine
    free = engine.pool.num_free_blocks
    channel, stub = _stub(worker_loop)
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    with channel:
        call = stub.Generate(
            baton_pb2.GenerateRequest(
                request_id="d", prompt_token_ids=list(range(100, 200)), params=params_to_proto(long)
            ),
            timeout=120,
        )
        next(call)
        call.cancel()
    for _ in range(400):  # bounded: the worker sees the cancel and aborts
        if not engine.has_unfinished_requests():
            break
        import time

        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == free


def test_health_and_metrics(worker_loop):
    channel = grpc.insecure_channel(f"127.0.0.1:{worker_loop.grpc_port}")
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{worker_loop.metrics_port}/metrics", timeout=10)
        .read()
        .decode()
    )
    assert "baton:num_requests_running" in body
    assert "baton:time_to_first_token_seconds_bucket" in body
    assert "baton:prompt_tokens_computed_total" in body
