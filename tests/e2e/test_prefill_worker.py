"""A real prefill worker over real gRPC and a real KV transport (ucx, and the "nccl" transport as it runs on CPU caches: gloo): the first token
matches the offline engine; the blocks that land in a destination cache hold the offline engine's KV
(all of them, or only those after ``num_skip_tokens``); the worker's prefix cache is reused; a
destination that cannot be reached fails the RPC, bounded, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import grpc
import pytest
import torch

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.common.llm import SamplingParams
from baton.common.net import free_port
from baton.common.transfer import TransferConfig, TransferDescriptor, TransferError, make_receiver
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig, _TransferCollector
from tests.transfer.backends import CPU_BACKENDS

BS = 16
PROMPT = [(i * 7919) % 5000 + 100 for i in range(200)]  # 13 blocks, the last one partial
GREEDY = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def worker():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    w = PrefillWorker(
        PrefillWorkerConfig(
            engine=EngineConfig(
                dtype="float32",
                kv_cache_gib=0.3,
                max_model_len=2048,
                max_num_batched_tokens=64,
                block_size=BS,
            ),
            transfer=TransferConfig(timeout_s=5.0),
        )
    )
    asyncio.run_coroutine_threadsafe(w.start(), loop).result(timeout=300)
    yield w
    asyncio.run_coroutine_threadsafe(w.stop(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.fixture(scope="module", params=CPU_BACKENDS)
def dest(request, worker):
    """A decode-side receiver over a zeroed cache shaped like the worker's (64 blocks)."""
    shape = worker.engine.engine.kv_cache.shape[1:]
    cache = torch.zeros((64, *shape), dtype=worker.engine.engine.kv_cache.dtype)
    receiver = make_receiver(TransferConfig(backend=request.param, timeout_s=30.0), cache)
    descriptor = receiver.start()
    yield receiver, descriptor, cache
    receiver.close()


@torch.inference_mode()
def reference_kv(engine, token_ids: list[int]) -> torch.Tensor:
    """The offline engine's KV for a whole prompt, one block per row, in a scratch cache."""
    n_blocks = -(-len(token_ids) // BS)
    cache = allocate_kv_cache(engine.model, n_blocks + 1, BS, engine.dtype, "cpu")  # + a scratch block
    runner = ModelRunner(engine.model, cache, BS, scratch_block=n_blocks)
    sched = SchedulerOutput((ScheduledRequest("x", tuple(token_ids), 0, tuple(range(n_blocks)), True),))
    inputs = runner.prepare(sched)
    engine.model(inputs.input_ids, inputs.positions, cache, inputs.meta)
    return cache[:n_blocks]


def _proto(d: TransferDescriptor) -> baton_pb2.TransferDescriptor:
    return baton_pb2.TransferDescriptor(
        backend=d.backend, host=d.host, port=d.port, extra_json=json.dumps(d.to_dict())
    )


def _prefill(worker, rid, ids, descriptor, skip, dst_ids, timeout=60, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=20)
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        return baton_pb2_grpc.PrefillStub(channel).Prefill(
            baton_pb2.PrefillRequest(
                request_id=rid,
                prompt_token_ids=ids,
                params=params_to_proto(params),
                destination=descriptor,
                num_skip_tokens=skip,
                dst_block_ids=dst_ids,
            ),
            timeout=timeout,
        )


def _run(worker, dest, rid, ids, skip=0, params=None):
    """Expect, prefill, wait: returns the response and the destination ids used."""
    receiver, descriptor, cache = dest
    cache.zero_()
    n = -(-len(ids) // BS) - skip // BS
    dst = random.Random(rid).sample(range(64), n)
    handle = receiver.expect(rid, dst)
    resp = _prefill(worker, rid, ids, _proto(descriptor), skip, dst, params=params)
    handle.wait(30)
    return resp, dst


def _prompt(descriptor, k: int) -> list[int]:
    """A prompt of its own per test and backend (the worker's prefix cache outlives tests)."""
    return [t + k + (0 if descriptor.backend == "ucx" else 50) for t in PROMPT]


def _check_kv(cache, dst, ref, prompt_len, skip_blocks):
    tail = prompt_len % BS or BS
    for j, d in enumerate(dst):
        i = j + skip_blocks
        got, want = cache[d], ref[i]
        if i == len(ref) - 1:  # the partial last block: only its prompt slots are defined
            got, want = got[..., :tail, :], want[..., :tail, :]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"block {i} -> dst {d}")


def test_prefill_pushes_the_offline_kv(worker, dest, llm_fp32):
    receiver, descriptor, cache = dest
    rid = f"full-{descriptor.backend}"
    ids = _prompt(descriptor, 0)
    sends = worker.num_sends_total
    resp, dst = _run(worker, dest, rid, ids)
    assert worker.num_sends_total - sends >= 4  # 200 tokens in 64-token steps: a send per chunk
    assert resp.request_id == rid
    assert resp.first_token_id == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids[0]
    assert resp.num_computed_tokens == len(ids) and resp.num_cached_tokens == 0
    ref = reference_kv(llm_fp32.engine, ids)
    assert resp.bytes_sent == len(dst) * ref[0].numel() * ref.element_size()
    _check_kv(cache, dst, ref, len(ids), 0)
    untouched = sorted(set(range(64)) - set(dst))
    assert not cache[untouched].any()


def test_min_tokens_keeps_a_stop_token_from_being_the_first_token(worker, dest, llm_fp32):
    """The first token, sampled on the prefill worker, obeys ``min_tokens``: a stop token there
    would end the request before its minimum."""
    _, descriptor, _ = dest
    ids = _prompt(descriptor, 900)
    greedy_first = llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=2, stop_token_ids=[greedy_first])
    resp, _ = _run(worker, dest, f"min-tokens-{descriptor.backend}", ids, params=params)
    offline = llm_fp32.generate([ids], params)[0].outputs[0].token_ids
    assert resp.first_token_id != greedy_first
    assert resp.first_token_id == offline[0] and len(offline) >= 2


def test_skip_tokens_sends_only_the_rest(worker, dest, llm_fp32):
    receiver, descriptor, cache = dest
    ids = _prompt(descriptor, 1)
    resp, dst = _run(worker, dest, f"skip-{descriptor.backend}", ids, skip=32)
    assert len(dst) == 13 - 2
    _check_kv(cache, dst, reference_kv(llm_fp32.engine, ids), len(ids), 2)
    assert not cache[sorted(set(range(64)) - set(dst))].any()
    assert resp.first_token_id == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids[0]


def test_prefix_cache_is_reused(worker, dest, llm_fp32):
    receiver, descriptor, cache = dest
    base = _prompt(descriptor, 2)
    first, _ = _run(worker, dest, f"pfx-a-{descriptor.backend}", base)
    assert first.num_cached_tokens == 0 and first.num_computed_tokens == len(base)
    ids = base[:128] + _prompt(descriptor, 3)[128:]
    resp, dst = _run(worker, dest, f"pfx-b-{descriptor.backend}", ids)
    assert resp.num_cached_tokens >= 128
    assert resp.num_computed_tokens == len(ids) - resp.num_cached_tokens
    _check_kv(cache, dst, reference_kv(llm_fp32.engine, ids), len(ids), 0)  # cached blocks too


def test_unreachable_destination_fails_and_worker_keeps_serving(worker, dest, llm_fp32):
    receiver, descriptor, cache = dest
    if descriptor.backend == "ucx":
        bogus = TransferDescriptor("ucx", host="127.0.0.1", address="AAAA")  # not a UCX address
    else:
        bogus = TransferDescriptor("nccl", host="127.0.0.1", port=free_port())  # nobody listens
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        _prefill(worker, f"bogus-{descriptor.backend}", PROMPT, _proto(bogus), 0, list(range(13)), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert time.monotonic() - started < 20
    resp, dst = _run(worker, dest, f"after-{descriptor.backend}", _prompt(descriptor, 4))
    assert resp.num_computed_tokens > 0
    engine = worker.engine.engine
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    engine.pool.check_integrity()
    assert not worker.jobs


def test_invalid_requests(worker, dest):
    receiver, descriptor, cache = dest
    d = _proto(descriptor)
    for ids, skip, dst, needle in [
        ([], 0, [], "prompt must not be empty"),
        (PROMPT, 0, list(range(12)), "dst_block_ids"),
        (PROMPT, 8, list(range(13)), "num_skip_tokens"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            _prefill(worker, "bad", ids, d, skip, dst, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()


def test_abort_cancels_the_prefill_and_frees_its_blocks(worker, dest):
    receiver, descriptor, cache = dest
    engine = worker.engine.engine
    rid = "abort-me"
    ids = [(i * 31) % 4000 + 7 for i in range(1000)]  # 63 blocks: ~16 steps of 64 tokens
    dst = list(range(63))
    handle = receiver.expect(rid, dst)
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        stub = baton_pb2_grpc.PrefillStub(channel)
        call = stub.Prefill.future(
            baton_pb2.PrefillRequest(
                request_id=rid,
                prompt_token_ids=ids,
                params=params_to_proto(GREEDY),
                destination=_proto(descriptor),
                dst_block_ids=dst,
            ),
            timeout=60,
        )
        for _ in range(200):  # bounded: until the prompt is being computed
            if worker.queued_prefill_tokens() and engine.has_unfinished_requests():
                break
            time.sleep(0.01)
        assert 0 < _queued_gauge(worker) <= len(ids)  # what the prefill pool's autoscaler reads
        stub.Abort(baton_pb2.AbortRequest(request_ids=[rid]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            call.result(timeout=30)
        assert e.value.code() == grpc.StatusCode.CANCELLED, e.value.details()
    receiver.cancel(rid)
    with pytest.raises(TransferError):
        handle.wait(30)
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert not engine.has_unfinished_requests() and not worker.jobs
    assert _queued_gauge(worker) == 0
    engine.pool.check_integrity()


def _queued_gauge(worker) -> float:
    """``baton:prefill_queued_prompt_tokens`` as the worker's /metrics collector reports it."""
    families = {f.name: f for f in _TransferCollector(worker, {"worker": "w"}).collect()}
    return families["baton:prefill_queued_prompt_tokens"].samples[0].value


def _connect(worker, descriptor: baton_pb2.TransferDescriptor, timeout=30):
    with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
        return baton_pb2_grpc.PrefillStub(channel).Connect(
            baton_pb2.ConnectRequest(destination=descriptor, kv_layout=worker.kv_layout), timeout=timeout
        )


def test_connect_makes_the_sender_that_prompts_then_use(worker, dest, llm_fp32):
    receiver, descriptor, cache = dest
    key = json.dumps(descriptor.to_dict(), sort_keys=True)
    with worker._senders_lock:
        worker._senders.pop(key, None)  # as if this destination were new
    _connect(worker, _proto(descriptor))
    sender = worker._senders[key]
    _connect(worker, _proto(descriptor))  # again: nothing new
    resp, dst = _run(worker, dest, f"connected-{descriptor.backend}", _prompt(descriptor, 6))
    assert worker._senders[key] is sender
    _check_kv(cache, dst, reference_kv(llm_fp32.engine, _prompt(descriptor, 6)), len(PROMPT), 0)
    assert resp.bytes_sent > 0


def test_connect_refuses_bad_and_unreachable_destinations(worker, dest):
    _, descriptor, _ = dest
    with pytest.raises(grpc.RpcError) as e:
        _connect(worker, baton_pb2.TransferDescriptor(backend="carrier-pigeon", host="127.0.0.1"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "backend" in e.value.details()
    if descriptor.backend == "ucx":
        bogus = TransferDescriptor("ucx", host="127.0.0.1", address="AAAA")
    else:
        bogus = TransferDescriptor("nccl", host="127.0.0.1", port=free_port())
    with pytest.raises(grpc.RpcError) as e:
        _connect(worker, _proto(bogus))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()


def test_a_destination_laid_out_otherwise_is_refused(worker, dest, llm_fp32):
    """A decode worker whose cache differs (here: bf16 against this worker's fp32) is refused at
    the hand-shake and at every prompt, with both layouts named; the worker keeps serving."""
    _, descriptor, _ = dest
    own = worker.kv_layout
    assert own.startswith("float32 ") and own.endswith("x16x64")
    other = own.replace("float32", "bfloat16")
    with pytest.raises(grpc.RpcError) as e:
        with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
            baton_pb2_grpc.PrefillStub(channel).Connect(
                baton_pb2.ConnectRequest(destination=_proto(descriptor), kv_layout=other), timeout=30
            )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert other in e.value.details() and own in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        with grpc.insecure_channel(f"127.0.0.1:{worker.grpc_port}") as channel:
            baton_pb2_grpc.PrefillStub(channel).Prefill(
                baton_pb2.PrefillRequest(
                    request_id="other-layout",
                    prompt_token_ids=PROMPT,
                    params=params_to_proto(GREEDY),
                    destination=_proto(descriptor),
                    dst_block_ids=list(range(13)),
                    kv_layout=other,
                ),
                timeout=30,
            )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not worker.jobs
    _connect(worker, _proto(descriptor))  # its own layout, or none said: served
