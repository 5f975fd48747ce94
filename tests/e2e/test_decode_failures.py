"""The decode worker's gRPC answers to the engine's refusals and failures, over real gRPC: a full
waiting queue is RESOURCE_EXHAUSTED (the gateway's 429), a request the engine failed is INTERNAL
(the gateway's 500) and the worker serves the next request normally."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from baton.common.api.convert import params_to_proto
from baton.common.engine.async_engine import AsyncEngine
from baton.common.engine.llm_engine import LLMEngine
from baton.common.llm import SamplingParams
from baton.common.metrics import EngineCollector, RequestMetrics
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeServicer
from baton.services.gateway.dispatch import rpc_error

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPT = list(range(600, 640))
LABELS = {"worker": "test"}


def _wait(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def served(llm_fp32):
    """A DecodeServicer on a real gRPC server over its own engine (one running request at a time,
    one more may wait), sharing the session's fp32 weights."""
    src = llm_fp32.engine
    block_bytes = src.kv_cache[0].numel() * src.kv_cache.element_size()
    cfg = replace(
        src.config,
        kv_cache_gib=64 * block_bytes / 2**30,
        max_model_len=512,
        max_num_seqs=1,
        max_waiting_requests=1,
    )
    engine = LLMEngine(cfg, src.model, src.tokenizer, src.eos_token_ids)
    ae = AsyncEngine(engine)
    ae.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, LABELS))

    async def serve():
        server = grpc.aio.server()
        metrics = RequestMetrics(registry, LABELS)
        baton_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(ae, metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield engine, baton_pb2_grpc.DecodeStub(channel), registry
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=1), loop).result(timeout=30)
        ae.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _req(rid: str, params: SamplingParams = GREEDY) -> baton_pb2.GenerateRequest:
    return baton_pb2.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, params=params_to_proto(params))


def _tokens(call) -> list[int]:
    return [t for chunk in call for t in chunk.token_ids]


def test_a_full_waiting_queue_is_resource_exhausted(served, llm_fp32):
    engine, stub, registry = served
    ref = llm_fp32.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    running = stub.Generate(_req("running", LONG), timeout=120)
    assert next(running).token_ids  # streaming: the only request that may run
    waiting = stub.Generate(_req("waiting"), timeout=120)
    _wait(lambda: engine.scheduler.num_waiting == 1, "the second request to wait")
    sent = time.perf_counter()
    with pytest.raises(grpc.RpcError) as refused:
        _tokens(stub.Generate(_req("refused"), timeout=60))
    print(
        f"[reliability] full queue: RESOURCE_EXHAUSTED {1e3 * (time.perf_counter() - sent):.0f} ms after the call"
    )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests=1" in refused.value.details()
    err = rpc_error(refused.value, "prompt")
    assert (err.status, err.type) == (429, "rate_limit_error")  # what the gateway answers
    assert registry.get_sample_value("baton:requests_refused_total", LABELS) == 1
    running.cancel()  # room again: the waiting request runs and completes normally
    assert _tokens(waiting) == ref
    _wait(lambda: not engine.has_unfinished_requests(), "the engine to go idle")
    engine.pool.check_integrity()


def test_a_request_the_engine_failed_is_internal_and_the_next_one_is_served(served, llm_fp32, monkeypatch):
    engine, stub, registry = served
    ref = llm_fp32.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    _wait(lambda: not engine.has_unfinished_requests(), "the engine to go idle")
    real = engine.runner.execute
    faults = iter([RuntimeError("injected step fault")])

    def once(*args):
        fault = next(faults, None)
        if fault is not None:
            raise fault
        return real(*args)

    monkeypatch.setattr(engine.runner, "execute", once)
    sent = time.perf_counter()
    with pytest.raises(grpc.RpcError) as failed:
        _tokens(stub.Generate(_req("fails"), timeout=60))
    print(
        f"[reliability] failed request: INTERNAL {1e3 * (time.perf_counter() - sent):.0f} ms after the call"
    )
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "injected step fault" in failed.value.details()
    assert rpc_error(failed.value, "prompt").status == 500  # not the client's fault
    assert _tokens(stub.Generate(_req("next"), timeout=60)) == ref
    assert registry.get_sample_value("baton:requests_failed_total", LABELS) == 1
    assert registry.get_sample_value("baton:engine_failed_steps_total", LABELS) == 1
