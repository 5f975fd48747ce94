"""Disaggregation across pipeline-parallel degrees, in real parts: SmolLM2 (fp32) prefill and decode
workers at PP 1 and 2 (in this process, their second stages real processes on gloo), KV over real
UCX, one Redis. Prefill PP=2 -> decode PP=1, 1 -> 2 and 2 -> 2 each give the single process's
greedy tokens with none of the prompt computed on the decode worker, and each decode rank receives
exactly its layers of the prompt's blocks, a figure taken from the GGUF's metadata. The handshake
refuses a decode worker whose ranks miss layers, and another model's cache; a rank that dies, on
either side, takes its worker out of service with an error naming it. (Layers and heads re-sharded
at once, TP x PP: ``test_up_pp.py``, and ``tests/transfer/test_reshard_transport.py`` rank by rank.)"""

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
from baton.services.lifecycle import EX_SOFTWARE
from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig

# Serial: four workers of the real model, two of them with a second stage's process.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def _engine(pp: int) -> EngineConfig:
    return EngineConfig(
        dtype="float32",
        kv_cache_gib=0.1,
        max_model_len=1024,
        max_num_batched_tokens=64,  # a 100-token prompt is two chunks: KV leaves while the next computes
        pipeline_parallel_size=pp,
    )


class _Exits:
    """The exit codes each worker asked for (``Lifecycle``'s ``on_exit``)."""

    def __init__(self) -> None:
        self.codes: dict[str, list[int]] = {}

    def of(self, name: str):
        self.codes[name] = []
        return self.codes[name].append


@pytest.fixture(scope="module")
def cluster():
    """Prefill and decode workers at PP 1 and 2, one registry."""
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro, t=300: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=t)  # noqa: E731
    exits = _Exits()
    # Patient with a machine shared with other tests: a registry entry lost to a late heartbeat, or a
    # step slow enough to look like a stalled transfer, would send the prompt elsewhere.
    patient = dict(redis_url=url, heartbeat_ttl_s=30.0)
    prefill = {
        f"pp{pp}": PrefillWorker(PrefillWorkerConfig(engine=_engine(pp), **patient), exits.of(f"p{pp}"))
        for pp in (1, 2)
    }
    decode = {
        f"pp{pp}": DecodeWorker(
            DecodeWorkerConfig(engine=_engine(pp), prefill_stall_timeout_s=30.0, **patient),
            exits.of(f"pp{pp}"),
        )
        for pp in (1, 2)
    }
    workers = [*prefill.values(), *decode.values()]
    try:
        run(_start_all(prefill.values()))
        run(_start_all(decode.values()))
        _wait_connected(decode.values(), len(prefill))
        yield prefill, decode, exits
    finally:
        for w in reversed(workers):
            try:
                run(w.stop(), 60)
            except Exception:  # noqa: BLE001 - one that failed to start
                pass
            _close_ranks(w)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.stop()


def _close_ranks(worker) -> None:
    """Stop a worker's other rank processes now, not at this process's exit."""
    try:
        model = worker.engine.engine.model
    except (AttributeError, RuntimeError):  # never started
        return
    if hasattr(model, "workers"):
        model.close()


async def _start_all(workers) -> None:
    await asyncio.gather(*(w.start() for w in workers))


def _wait_connected(decoders, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for d in decoders:
        while len(d._connected) < n:
            assert time.monotonic() < deadline, f"decode worker connected to {d._connected}, not {n}"
            time.sleep(0.05)


def _metrics(worker) -> str:
    return (
        urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).read().decode()
    )


def _metric(worker, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", _metrics(worker), re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def _rank_bytes(worker) -> dict[int, float]:
    found = re.findall(
        r'^baton:kv_received_bytes_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', _metrics(worker), re.M
    )
    assert found, "baton:kv_received_bytes_total not in metrics"
    return {int(r): float(v) for r, v in found}


def _generate(decode, ids, rid, prefill) -> list[int]:
    """One request, never retried."""
    with grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as channel:
        req = baton_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params_to_proto(GREEDY),
            prefill_address=f"127.0.0.1:{prefill.grpc_port}",
        )
        return [t for c in baton_pb2_grpc.DecodeStub(channel).Generate(req, timeout=120) for t in c.token_ids]


def _first_longer(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` runs, the earlier ones one longer where it is uneven."""
    return [n // parts + (i < n % parts) for i in range(parts)]


@pytest.fixture(scope="module")
def shares(model_path):
    """Each decode worker's ranks' (layers, KV heads), from the GGUF's metadata."""
    import gguf

    meta = gguf.GGUFReader(model_path).fields
    layers, kv = (meta[f"llama.{k}"].contents() for k in ("block_count", "attention.head_count_kv"))
    return {"pp1": [(layers, kv)], "pp2": [(n, kv) for n in _first_longer(layers, 2)]}


@pytest.fixture(scope="module")
def cell_bytes(model_path) -> int:
    """One layer x KV head of one block: K and V, a block of tokens, a head's fp32 values."""
    import gguf

    meta = gguf.GGUFReader(model_path).fields
    hidden, heads = (meta[f"llama.{k}"].contents() for k in ("embedding_length", "attention.head_count"))
    return 2 * BLOCK * (hidden // heads) * 4


CASES = [("pp2", "pp1"), ("pp1", "pp2"), ("pp2", "pp2")]


@pytest.mark.parametrize("src, dst", CASES, ids=[f"prefill-{s}-decode-{d}" for s, d in CASES])
def test_kv_crosses_degrees_resharded_and_decode_gives_one_process_tokens(
    cluster, llm_fp32, shares, cell_bytes, src, dst
):
    prefill, decode, _ = cluster
    p, d = prefill[src], decode[dst]
    salt = CASES.index((src, dst))
    ids = [(i * 7919 + 101 * salt) % 40000 + 100 for i in range(100)]  # 7 blocks, 6 full
    computed = _metric(d, "baton:prompt_tokens_computed_total")
    remote = d.engine.engine.num_remote_prefills_total
    before = _rank_bytes(d)

    tokens = _generate(d, ids, f"{src}-to-{dst}", p)

    ref = llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert tokens == ref
    assert d.engine.engine.num_remote_prefills_total == remote + 1  # it went through the prefill worker
    assert _metric(d, "baton:prompt_tokens_computed_total") == computed  # decode computed none of it
    blocks = -(-len(ids) // BLOCK)
    after = _rank_bytes(d)
    got = {r: after[r] - before.get(r, 0.0) for r in after}
    assert got == {
        r: blocks * n_layers * n_heads * cell_bytes for r, (n_layers, n_heads) in enumerate(shares[dst])
    }
    d.engine.engine.pool.check_integrity()


def test_workers_publish_their_layers_and_heads(cluster):
    import redis

    from baton.common.index.registry import WorkerRegistry

    prefill, decode, _ = cluster
    w = decode["pp2"]
    registry = WorkerRegistry(redis.Redis.from_url(w.config.redis_url), w.engine.engine.model_name, 6)
    settings = {x.id: x.settings for x in registry.list("decode") + registry.list("prefill")}
    for worker, pp, layers, heads in (
        (prefill["pp2"], 2, [[0, 15], [15, 30]], [[0, 3], [0, 3]]),
        (decode["pp2"], 2, [[0, 15], [15, 30]], [[0, 3], [0, 3]]),
        (decode["pp1"], 1, [[0, 30]], [[0, 3]]),
    ):
        s = settings[worker.worker_id]
        assert (s["pipeline_parallel_size"], s["kv_layers"], s["kv_heads"]) == (pp, layers, heads)


def _connect(prefill, request: baton_pb2.ConnectRequest):
    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as channel:
        return baton_pb2_grpc.PrefillStub(channel).Connect(request, timeout=30)


def test_the_handshake_refuses_ranks_that_miss_layers_and_another_model(cluster):
    prefill, decode, _ = cluster
    p, d = prefill["pp2"], decode["pp2"]
    good = d._remote.rank_destinations
    assert [(r.layer_start, r.layer_end, r.kv_head_start, r.kv_head_end) for r in good] == [
        (0, 15, 0, 3),
        (15, 30, 0, 3),
    ]
    dest = baton_pb2.TransferDescriptor(backend="ucx", extra_json=d._remote.descriptor_json)
    # A decode worker whose ranks leave out the second stage's layers.
    with pytest.raises(grpc.RpcError) as e:
        _connect(
            p, baton_pb2.ConnectRequest(destination=dest, kv_layout=p.kv_layout, rank_destinations=good[:1])
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode ranks: no rank holds layers 15-29" in e.value.details()
    # Another model: 29 layers where this one has 30 (all ranks together).
    assert p.kv_layout == "float32 30x2x3x16x64" == d._remote.kv_layout
    with pytest.raises(grpc.RpcError) as e:
        _connect(
            p,
            baton_pb2.ConnectRequest(
                destination=dest, kv_layout="float32 29x2x3x16x64", rank_destinations=good
            ),
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV layout mismatch" in e.value.details()
    assert _connect(
        p, baton_pb2.ConnectRequest(destination=dest, kv_layout=p.kv_layout, rank_destinations=good)
    )


# -- last: these kill ranks of the module's workers ---------------------------------------------------
def _kill_rank(worker, rank: int) -> int:
    victim = worker.engine.engine.model.workers[rank - 1]
    victim.kill()
    victim.wait(10)
    return victim.pid


def _wait_exit(codes: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_dead_prefill_stage_fails_its_worker_and_decode_recomputes(cluster, llm_fp32):
    prefill, decode, exits = cluster
    p, d = prefill["pp2"], decode["pp1"]
    pid = _kill_rank(p, 1)
    ids = [(i * 7919 + 977) % 40000 + 100 for i in range(100)]
    computed = _metric(d, "baton:prompt_tokens_computed_total")

    tokens = _generate(d, ids, "dead-prefill-stage", p)

    assert tokens == llm_fp32.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert _metric(d, "baton:prompt_tokens_computed_total") == computed + len(ids)  # recomputed here
    _wait_exit(exits.codes["p2"])
    assert exits.codes["p2"] == [EX_SOFTWARE]
    assert f"pipeline-parallel rank 1 (stage 1, pid {pid}, exit code -9) exited" in p._gate.failure


def test_a_dead_decode_stage_fails_its_worker_naming_it(cluster):
    prefill, decode, exits = cluster
    d = decode["pp2"]
    pid = _kill_rank(d, 1)
    ids = [(i * 7919 + 1999) % 40000 + 100 for i in range(100)]
    with pytest.raises(grpc.RpcError) as e:
        _generate(d, ids, "dead-decode-stage", prefill["pp1"])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"pipeline-parallel rank 1 (stage 1, pid {pid}, exit code -9) exited" in e.value.details()
    _wait_exit(exits.codes["pp2"])
    assert exits.codes["pp2"] == [EX_SOFTWARE]
