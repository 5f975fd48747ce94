"""Disaggregated serving in real parts: a prefill worker computes the prompt and pushes its KV over
UCX into the decode worker's blocks; the decode worker computes none of the prompt and streams the
same tokens as the offline engine. Short prompts stay local; a dead prefill worker costs a
recompute, not the request."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request

import grpc
import pytest

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.index.server import EmbeddedRedis
from baton.common.llm import SamplingParams
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.prefill import worker as prefill_mod

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def pair():
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    prefill = prefill_mod.PrefillWorker(prefill_mod.PrefillWorkerConfig(engine=ENGINE, redis_url=url))
    decode = DecodeWorker(DecodeWorkerConfig(engine=ENGINE, redis_url=url))
    run = lambda coro, t=300: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=t)  # noqa: E731
    try:
        run(prefill.start())
        run(decode.start())
        yield decode, prefill
    finally:
        for w in (decode, prefill):
            try:
                run(w.stop(), 60)
            except Exception:  # noqa: BLE001 - already stopped by a test
                pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.stop()


def _metric(worker, name: str) -> float:
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).read().decode()
    )
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def _generate(decode, ids, rid, prefill_address=""):
    with grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as channel:
        req = baton_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params_to_proto(GREEDY),
            prefill_address=prefill_address,
        )
        return [t for c in baton_pb2_grpc.DecodeStub(channel).Generate(req, timeout=120) for t in c.token_ids]


def test_decode_worker_connects_to_the_prefill_worker_before_any_prompt(pair):
    """The first prompt pays no connection set-up: by the time the decode worker has started,
    the prefill worker's KV sender reaches it, and its registry record says so."""
    import redis

    from baton.common.index.registry import WorkerRegistry

    decode, prefill = pair
    assert not prefill.jobs and prefill.num_sends_total == 0  # no prompt yet
    assert len(prefill._senders) == 1
    assert decode._connected == {(prefill.worker_id, f"127.0.0.1:{prefill.grpc_port}")}
    registry = WorkerRegistry(
        redis.Redis.from_url(decode.config.redis_url), decode.engine.engine.model_name, 6
    )
    deadline = time.monotonic() + 10
    while (load := registry.list("decode")[0].load).get("prefill_connected") != 1:
        assert time.monotonic() < deadline, f"the decode worker never published its connection: {load}"
        time.sleep(0.05)


def test_prompt_kv_crosses_over_and_decode_computes_none_of_it(pair, llm_fp32):
    decode, prefill = pair
    ids = list(range(2000, 2200))  # 200 tokens: 13 blocks, chunked on the prefill worker
    before_tokens = _metric(decode, "baton:prompt_tokens_computed_total")
    before_bytes = _metric(decode, "baton:kv_transfer_bytes_total")
    tokens = _generate(decode, ids, "remote-1", prefill_address=f"127.0.0.1:{prefill.grpc_port}")
    assert tokens == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert _metric(decode, "baton:prompt_tokens_computed_total") == before_tokens
    block_bytes = decode.engine.engine.kv_cache[0].numel() * decode.engine.engine.kv_cache.element_size()
    assert _metric(decode, "baton:kv_transfer_bytes_total") - before_bytes == 13 * block_bytes
    assert decode.engine.engine.num_remote_prefills_total >= 1
    assert len(prefill._senders) == 1  # the connection made at start, reused
    decode.engine.engine.pool.check_integrity()
    # The block-location record says where the transfer landed.
    import redis

    from baton.common.index.locations import BlockLocations

    loc = BlockLocations(
        redis.Redis.from_url(decode.config.redis_url), decode.engine.engine.model_name, 60
    ).get("remote-1")
    assert loc is not None and loc.state == "landed" and loc.worker_id == decode.worker_id
    assert len(loc.block_ids) == 13


def test_top_logprobs_come_with_the_remotely_sampled_first_token(pair, llm_fp32):
    """The first token's alternatives travel in the PrefillResponse; every token's match offline."""
    decode, prefill = pair
    ids = list(range(5000, 5100))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    remote_before = decode.engine.engine.num_remote_prefills_total
    with grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as channel:
        req = baton_pb2.GenerateRequest(
            request_id="remote-top",
            prompt_token_ids=ids,
            params=params_to_proto(params),
            prefill_address=f"127.0.0.1:{prefill.grpc_port}",
        )
        chunks = list(baton_pb2_grpc.DecodeStub(channel).Generate(req, timeout=120))
    assert decode.engine.engine.num_remote_prefills_total == remote_before + 1
    ref = llm_fp32.generate([ids], params)[0].outputs[0]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert [list(t.token_ids) for t in tops] == [list(t.token_ids) for t in ref.top_logprobs]
    for got, want in zip(tops, ref.top_logprobs):
        assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-3)


def test_short_prompt_is_prefilled_locally(pair, llm_fp32):
    decode, prefill = pair
    ids = list(range(3000, 3020))  # below the 32-token threshold
    before = _metric(decode, "baton:prompt_tokens_computed_total")
    tokens = _generate(decode, ids, "local-1", prefill_address=f"127.0.0.1:{prefill.grpc_port}")
    assert tokens == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert _metric(decode, "baton:prompt_tokens_computed_total") - before == len(ids)


def test_a_prefill_address_the_registry_does_not_know_is_never_dialled(pair, llm_fp32):
    """A request names where to prefill; a decode worker dials only the prefill workers of its
    registry (a request's address could point anywhere), and prefills on one of those instead."""
    import socket

    decode, _ = pair
    ids = list(range(4000, 4100))
    before = _metric(decode, "baton:kv_transfer_bytes_total")
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(0.5)
        tokens = _generate(decode, ids, "stranger-1", prefill_address=f"127.0.0.1:{trap.getsockname()[1]}")
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody came
    assert tokens == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert _metric(decode, "baton:kv_transfer_bytes_total") > before  # the registry's prefill worker did it
    deadline = time.monotonic() + 30
    while decode.engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    decode.engine.engine.pool.check_integrity()


def test_client_leaving_mid_prefill_frees_blocks_on_both_workers(pair):
    decode, prefill = pair
    d_engine, p_engine = decode.engine.engine, prefill.engine.engine
    d_free, p_free = d_engine.pool.num_free_blocks, p_engine.pool.num_free_blocks
    ids = [(i * 37) % 30000 + 100 for i in range(1200)]  # ~19 prefill steps of 64 tokens
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as channel:
        call = baton_pb2_grpc.DecodeStub(channel).Generate(
            baton_pb2.GenerateRequest(
                request_id="leaves", prompt_token_ids=ids, params=params,
                prefill_address=f"127.0.0.1:{prefill.grpc_port}",
            ),
            timeout=120,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while "leaves" not in prefill.jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "leaves" in prefill.jobs, "the prefill never started"
        call.cancel()  # the client goes away while the prompt is being prefilled
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        prefill.jobs or p_engine.pool.num_free_blocks != p_free or d_engine.pool.num_free_blocks != d_free
    ):
        time.sleep(0.05)
    assert not prefill.jobs
    assert d_engine.pool.num_free_blocks == d_free
    assert p_engine.pool.num_free_blocks == p_free
    d_engine.pool.check_integrity()
    p_engine.pool.check_integrity()
