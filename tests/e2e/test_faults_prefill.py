"""A dead prefill worker costs latency, never the request, and never stalls others (issue 10, part 3).

Real parts: a real Redis, real gRPC, UCX between real processes, a tiny random Llama. Prefill
worker A is a ``baton prefill`` process with the test-only fault flag: it stops its engine once its
first prompt's first 40 blocks have landed, so a transfer is deterministically in progress when the
test kills it. Prefill worker B and decode worker D1 live in this process, so that their books can
be read; decode worker D2 is a process, to be frozen (SIGSTOP) as a receiver that stops reading. A
hung prefill worker (alive to the kernel, answering nothing) is noticed by the decode worker's
channel keepalive: that is checked against a frozen gRPC server on its own, without a model.

Killed in the middle of one message (issue 28, part 3): a prefill worker process started with
``--fault-hold-payload-after-blocks`` sends each prompt's message after its first 40 blocks as a head
without a payload, so the decode worker has receives posted into that message's blocks when the
test kills it, over UCX (which cannot cancel them) and gloo.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.index.registry import WorkerRegistry
from baton.common.index.server import EmbeddedRedis
from baton.common.llm import LLM, SamplingParams
from baton.common.transfer import TransferConfig
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig

from ..transfer.backends import CPU_BACKENDS
from .fault_cluster import ENGINE_FLAGS, LoopThread, WorkerProcess, metric, tiny_model, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.serial]

PAUSE_BLOCKS = 40
BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = 1500  # tokens: 94 blocks, ~24 prefill steps of 64 tokens


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_model()
    logs = tmp_path_factory.mktemp("logs")
    redis = EmbeddedRedis()
    url = redis.start()
    procs: list[WorkerProcess] = []
    loop = LoopThread()
    engine = EngineConfig(model=str(model), **ENGINE_FLAGS)
    # B answers a Prefill whose receiver stops reading within its 3 s transfer deadline.
    b = PrefillWorker(
        PrefillWorkerConfig(engine=engine, redis_url=url, transfer=TransferConfig(timeout_s=3.0))
    )
    # D1 leaves the decision to the connection: no stall deadline within the test.
    d1 = DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=url, prefill_stall_timeout_s=30.0))
    try:
        procs.append(
            WorkerProcess("prefill", model, url, logs, "--fault-pause-after-blocks", str(PAUSE_BLOCKS))
        )
        procs.append(WorkerProcess("decode", model, url, logs))
        loop.run(b.start())  # while the processes start
        for p in procs:
            p.wait_ready()
        loop.run(d1.start())  # after the prefill workers: it connects to all of them at start
        yield {"model": model, "url": url, "a": procs[0], "d2": procs[1], "b": b, "d1": d1}
    finally:
        for p in procs:
            p.stop()
        for w in (d1, b):
            try:
                loop.run(w.stop(), 60)
            except Exception:  # noqa: BLE001 - it never started
                pass
        loop.close()
        redis.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    """Greedy tokens of the same tiny model computed here, whole, in one engine."""
    llm = LLM(model=str(cluster["model"]), **ENGINE_FLAGS)
    return lambda ids: llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def _generate(address: str, rid: str, ids: list[int], prefill_address: str) -> tuple[list[int], float]:
    """A Generate call's tokens and its time to first token (s)."""
    started = time.monotonic()
    first = None
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        request = baton_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params_to_proto(GREEDY),
            prefill_address=prefill_address,
        )
        for chunk in baton_pb2_grpc.DecodeStub(channel).Generate(request, timeout=120):
            if chunk.token_ids and first is None:
                first = time.monotonic() - started
            tokens += chunk.token_ids
    assert first is not None, f"{rid}: no token"
    return tokens, first


def _landed(decode: DecodeWorker, rid: str) -> int:
    progress = decode._receiver.progress(rid)
    return progress.blocks_landed if progress is not None else 0


def _d1(cluster) -> tuple[DecodeWorker, str]:
    d1 = cluster["d1"]
    return d1, f"127.0.0.1:{d1.grpc_port}"


def test_prefill_worker_killed_mid_transfer_costs_its_request_latency_only(cluster, reference):
    d1, d1_address = _d1(cluster)
    a1, b = cluster["a"], cluster["b"]
    b_address = f"127.0.0.1:{b.grpc_port}"
    ids, other = _prompt(1, LONG), _prompt(2, 300)
    metrics = f"http://127.0.0.1:{d1.metrics_port}/metrics"
    computed_before = metric(metrics, "baton:prompt_tokens_computed_total")
    kept_before = metric(metrics, "baton:remote_prefill_kept_tokens_total")
    with ThreadPoolExecutor(2) as pool:
        victim = pool.submit(_generate, d1_address, "kill-1", ids, a1.address)
        landed = wait_for(lambda: _landed(d1, "kill-1") >= PAUSE_BLOCKS, 60, "A1 to land its first blocks")
        landed = _landed(d1, "kill-1")
        assert landed < -(-LONG // BS), "the transfer was not in progress"
        bystander = pool.submit(_generate, d1_address, "bystander-1", other, b_address)
        a1.signal(signal.SIGKILL)
        killed = time.monotonic()
        tokens, _ = victim.result(timeout=120)
        other_tokens, other_ttft = bystander.result(timeout=120)
    # The request completed, token for token what one engine computes.
    assert tokens == reference(ids)
    failure = d1._remote.last_failure
    assert failure is not None and failure.request_id == "kill-1" and failure.address == a1.address
    assert 0 <= failure.noticed - killed < 2.0, f"noticed {failure.noticed - killed:.2f} s after the kill"
    # The blocks that landed were kept: only the rest of the prompt was computed here.
    assert landed >= PAUSE_BLOCKS and failure.kept_tokens == landed * BS
    assert metric(metrics, "baton:remote_prefill_kept_tokens_total") - kept_before == landed * BS
    assert metric(metrics, "baton:prompt_tokens_computed_total") - computed_before == LONG - landed * BS
    # The other prompt, on the other prefill worker meanwhile, was not held up.
    assert other_tokens == reference(other) and other_ttft < 5.0
    # The gateway may go on suggesting A1 until its registry key expires: D1 knows better.
    again = _prompt(3, 300)
    computed = metric(metrics, "baton:prompt_tokens_computed_total")
    after_kill = _generate(d1_address, "after-kill", again, a1.address)
    assert after_kill[0] == reference(again)
    assert metric(metrics, "baton:prompt_tokens_computed_total") == computed  # prefilled remotely
    assert d1._remote.last_failure is failure
    wait_for(lambda: not d1.engine.engine.has_unfinished_requests(), 30, "D1 to go idle")
    d1.engine.engine.pool.check_integrity()
    print(
        f"\nprefill worker killed mid-transfer: noticed after {failure.noticed - killed:.3f} s, "
        f"{failure.kept_tokens} of {LONG} prompt tokens kept; the other prefill worker's prompt: "
        f"TTFT {other_ttft:.2f} s; a prompt sent to the dead one afterwards: TTFT {after_kill[1]:.2f} s"
    )


def test_stopped_receiver_costs_the_prefill_worker_only_the_blocks_it_holds_until_the_deadline(
    cluster, reference
):
    """D2 stops reading (SIGSTOP) with a transfer to it on the way: B's engine goes on serving D1's
    prompts at full speed, and B lets go of the blocks it held for D2 at the transfer deadline."""
    d1, d1_address = _d1(cluster)
    b, d2 = cluster["b"], cluster["d2"]
    b_address = f"127.0.0.1:{b.grpc_port}"
    b_metrics = f"http://127.0.0.1:{b.metrics_port}/metrics"
    baseline = _generate(d1_address, "baseline", _prompt(5, 300), b_address)[1]
    registry = WorkerRegistry(
        __import__("redis").Redis.from_url(cluster["url"]), d1.engine.engine.model_name, 6
    )
    d2_info = next(w for w in registry.list("decode") if w.grpc_address == d2.address)
    ids = _prompt(6, LONG)
    n_blocks = -(-LONG // BS)
    prefill = baton_pb2.PrefillRequest(  # D2's own request, as D2 would send it: its blocks 10..103
        request_id="to-stopped",
        prompt_token_ids=ids,
        params=params_to_proto(GREEDY),
        destination=baton_pb2.TransferDescriptor(
            backend=json.loads(d2_info.kv_address)["backend"], extra_json=d2_info.kv_address
        ),
        dst_block_ids=list(range(10, 10 + n_blocks)),
    )
    d2.signal(signal.SIGSTOP)
    try:
        with grpc.insecure_channel(b_address) as channel, ThreadPoolExecutor(1) as pool:
            sent = time.monotonic()
            answer = pool.submit(baton_pb2_grpc.PrefillStub(channel).Prefill, prefill, timeout=60)
            wait_for(
                lambda: b.blocks_held > 0 and not b.jobs, 30, "B to finish the prompt and hold its blocks"
            )
            assert metric(b_metrics, "baton:kv_blocks_held_for_transfer") > 0
            # B's engine is free meanwhile: D1's prompts through B run as fast as before.
            other = _prompt(7, 300)
            tokens, ttft = _generate(d1_address, "beside-stopped", other, b_address)
            assert tokens == reference(other) and ttft < max(5.0, 3 * baseline), (ttft, baseline)
            with pytest.raises(grpc.RpcError) as failed:
                answer.result(timeout=60)
            answered = time.monotonic() - sent
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS  # alive, and says the KV did not all go
        assert answered < 3.0 + 6.0, f"B answered {answered:.1f} s after the request"
        # Past the transfer deadline, nothing is held and B's pool is whole again.
        wait_for(lambda: b.blocks_held == 0, 10, "B to let go of the blocks held for D2")
        freed = time.monotonic() - sent
        assert metric(b_metrics, "baton:kv_blocks_held_for_transfer") == 0
        wait_for(lambda: metric(b_metrics, "baton:kv_cache_usage_perc") == 0.0, 10, "B's pool to be all free")
        b.engine.engine.pool.check_integrity()
    finally:
        d2.signal(signal.SIGCONT)
    # D2, woken, finds its stale blocks from B unexpected (dropped, never landed) and serves on.
    again = _prompt(8, 300)
    assert _generate(d2.address, "d2-after", again, b_address)[0] == reference(again)
    print(
        f"\nreceiver stopped: a prompt beside it TTFT {ttft:.2f} s (before: {baseline:.2f} s); "
        f"the stopped one's Prefill answered DATA_LOSS after {answered:.2f} s, blocks freed after {freed:.2f} s"
    )


HOLD_BLOCKS = 40
MID_MESSAGE_PROMPTS = (1500, 1200, 1000, 900)  # tokens: every one past HOLD_BLOCKS blocks


def _labelled(url: str, name: str, **labels: str) -> float:
    """The sample of ``name`` whose labels include ``labels`` (0 when there is none yet)."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", body, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def _generate_timed(address: str, rid: str, ids: list[int], prefill_address: str) -> tuple[list[int], float]:
    """A Generate call's tokens and when (``time.monotonic()``) its first token came."""
    first = None
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        request = baton_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params_to_proto(GREEDY),
            prefill_address=prefill_address,
        )
        for chunk in baton_pb2_grpc.DecodeStub(channel).Generate(request, timeout=120):
            if chunk.token_ids and first is None:
                first = time.monotonic()
            tokens += chunk.token_ids
    assert first is not None, f"{rid}: no token"
    return tokens, first


@pytest.fixture(params=CPU_BACKENDS)
def mid_message(request, cluster, tmp_path):
    """A prefill worker process whose every prompt's KV stops in the middle of a message after
    ``HOLD_BLOCKS`` blocks (``--fault-hold-payload-after-blocks``), and the decode worker that
    receives it over ``request.param``: D1 for ucx, a new one in this process for gloo."""
    backend = request.param
    loop = LoopThread()
    decode = cluster["d1"]
    if backend != "ucx":
        engine = EngineConfig(model=str(cluster["model"]), **ENGINE_FLAGS)
        decode = DecodeWorker(
            DecodeWorkerConfig(
                engine=engine,
                redis_url=cluster["url"],
                transfer=TransferConfig(backend=backend),
                prefill_stall_timeout_s=30.0,
            )
        )
        loop.run(decode.start())
    held = WorkerProcess(
        "prefill",
        cluster["model"],
        cluster["url"],
        tmp_path,
        "--fault-hold-payload-after-blocks",
        str(HOLD_BLOCKS),
    )
    try:
        held.wait_ready()
        wait_for(lambda: held.address in decode._remote.known_prefill(), 30, "the decode worker to see it")
        yield backend, held, decode
    finally:
        held.stop()
        if decode is not cluster["d1"]:
            loop.run(decode.stop(), 60)
        loop.close()


def test_prefill_worker_killed_mid_message_costs_detection_and_recompute_only(mid_message, reference):
    """A prefill worker killed with a message half-sent (its head arrived, so the decode worker
    posted receives into the message's blocks, and its payload never will): the decode worker
    notices at the first sign (the Prefill call fails), quarantines the blocks those receives may
    still write, and recomputes the rest of each prompt on fresh blocks at once, instead of
    holding the requests until the receives time out (~30 s: issue 28). Tokens as one engine's."""
    backend, held, d = mid_message
    address = f"127.0.0.1:{d.grpc_port}"
    metrics = f"http://127.0.0.1:{d.metrics_port}/metrics"
    failed_before = _labelled(metrics, "baton:remote_prefill_failures_total", reason="unavailable")
    prompts = {f"mid-{backend}-{i}": _prompt(20 + i, n) for i, n in enumerate(MID_MESSAGE_PROMPTS)}

    def writing(rid: str) -> bool:
        p = d._receiver.progress(rid)
        return p is not None and p.blocks_landed >= HOLD_BLOCKS and bool(p.writing_block_ids)

    with ThreadPoolExecutor(len(prompts)) as pool:
        calls = {
            rid: pool.submit(_generate_timed, address, rid, ids, held.address) for rid, ids in prompts.items()
        }
        # ucx: every prompt's transfer stops mid-message; gloo: the first stops its pair's stream.
        enough = all if backend == "ucx" else any
        wait_for(lambda: enough(writing(rid) for rid in prompts), 90, "transfers to stop mid-message")
        mid = [rid for rid in prompts if writing(rid)]
        held.signal(signal.SIGKILL)
        killed = time.monotonic()
        results = {rid: call.result(timeout=120) for rid, call in calls.items()}
    served = {rid: first - killed for rid, (_, first) in results.items()}
    failures = {f.request_id: f for f in d._remote.failures if f.request_id in prompts}
    for rid, ids in prompts.items():
        assert results[rid][0] == reference(ids), f"{rid}: tokens differ from one engine's"
        assert rid in failures and failures[rid].address == held.address
        assert failures[rid].noticed - killed < 2.0, (
            f"{rid} noticed {failures[rid].noticed - killed:.2f} s after"
        )
        # Detection plus the recompute of a prompt of at most 1,500 tokens, not the ~30 s receive timeout.
        assert served[rid] < 8.0, f"{rid}: first token {served[rid]:.1f} s after the kill"
    # Each noticed by its Prefill call failing (the connection reset), and counted so.
    assert all(failures[rid].reason == "UNAVAILABLE" for rid in prompts)
    failed = _labelled(metrics, "baton:remote_prefill_failures_total", reason="unavailable")
    assert failed - failed_before == len(prompts)
    quarantined = sum(failures[rid].quarantined_blocks for rid in mid)
    if backend == "ucx":  # receives it cannot cancel: their blocks are out of the pool, not reused
        assert all(failures[rid].quarantined_blocks > 0 for rid in mid)
        assert metric(metrics, "baton:kv_blocks_quarantined") == quarantined
    # The quarantined blocks go back once their receives give up (ucx: the transfer deadline; gloo: at
    # once, the pair died), and the pool balances with nothing leaked.
    wait_for(lambda: metric(metrics, "baton:kv_blocks_quarantined") == 0, 45, "the quarantine to end")
    released = time.monotonic() - killed
    wait_for(lambda: not d.engine.engine.has_unfinished_requests(), 30, "the decode worker to go idle")
    wait_for(lambda: metric(metrics, "baton:kv_cache_usage_perc") == 0.0, 10, "its pool to be all free")
    d.engine.engine.pool.check_integrity()
    print(
        f"\nprefill worker killed mid-message ({'gloo' if backend == 'nccl' else backend}, {len(mid)} of "
        f"{len(prompts)} transfers mid-message, "
        f"{quarantined} blocks quarantined): noticed "
        f"{min(f.noticed for f in failures.values()) - killed:.3f}-{max(f.noticed for f in failures.values()) - killed:.3f} s "
        f"after the kill; first tokens {min(served.values()):.2f}-{max(served.values()):.2f} s after it "
        f"(kept {sum(failures[r].kept_tokens for r in prompts)} of {sum(MID_MESSAGE_PROMPTS)} prompt tokens); "
        f"the quarantine over {released:.1f} s after it"
    )


_FROZEN_SERVER = """
import asyncio, json, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
GRPC_SERVER_OPTIONS = [tuple(o) for o in json.loads(sys.argv[1])]

class Slow(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):  # a prefill that takes long
        await asyncio.sleep(60)
        return health_pb2.HealthCheckResponse()

async def main():
    server = grpc.aio.server(options=list(GRPC_SERVER_OPTIONS))
    health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.mark.parametrize("caller", ["decode worker -> prefill", "gateway -> decode"])
def test_a_hung_worker_is_noticed_by_the_channel_keepalive(caller):
    """A worker frozen mid-call (SIGSTOP: the kernel keeps its connection open, nothing answers)
    fails the call within seconds on the callers' channels (``RemotePrefill``'s, ~2 s; the
    gateway's ``Router``'s, ~4 s: also before a stream's first token, when the gateway's progress
    deadline does not apply yet), not at the call's deadline. The server takes the workers' own
    options, so pings this often are accepted, not refused."""
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from baton.services.decode.remote_prefill import RemotePrefill
    from baton.services.gateway.router import Router
    from baton.services.worker_base import GRPC_SERVER_OPTIONS

    channel_options, bound = {
        "decode worker -> prefill": (RemotePrefill.CHANNEL_OPTIONS, 2.5),
        "gateway -> decode": (Router.CHANNEL_OPTIONS, 5.0),
    }[caller]

    options = json.dumps(GRPC_SERVER_OPTIONS)  # passed in: the server needs grpc only, not torch
    server = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_SERVER, options], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(wait_for(server.stdout.readline, 60, "the gRPC server to start"))

        async def call() -> tuple[grpc.StatusCode, float]:
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address, options=list(channel_options)) as ch:
                pending = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                await asyncio.sleep(2.5)  # the call is open, pings are answered
                server.send_signal(signal.SIGSTOP)
                frozen = time.monotonic()
                try:
                    await pending
                except grpc.aio.AioRpcError as e:
                    return e.code(), time.monotonic() - frozen
                raise AssertionError("the call to a frozen server succeeded")

        code, noticed = asyncio.run(call())
        assert code == grpc.StatusCode.UNAVAILABLE and noticed < bound, (code, noticed)
        print(f"\nfrozen worker ({caller}): its call failed {noticed:.2f} s after SIGSTOP")
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(10)
