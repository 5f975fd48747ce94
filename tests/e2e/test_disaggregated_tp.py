"""Disaggregation across tensor-parallel degrees, in real parts: prefill workers at TP 1, 2, 3 and
decode workers at TP 1, 2 (in this process, their other ranks real processes on gloo), KV over
real UCX, one Redis. Prefill TP=1 -> decode TP=2, 2 -> 1, 2 -> 2, 3 -> 1 and 3 -> 2 each give the
colocated single process's greedy tokens (fp32) with none of the prompt computed on the decode
worker, and each
decode rank receives exactly its heads' share of the prompt's blocks (its own metric). A model of
3 KV heads, so that TP=2 splits them 2 + 1 as SmolLM2's are: a decode rank's heads may come from
two prefill ranks, and a prefill rank's go to two decode ranks."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from baton.common.api.convert import params_to_proto
from baton.common.engine.config import EngineConfig
from baton.common.index.server import EmbeddedRedis
from baton.common.llm import LLM, SamplingParams
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.prefill.worker import PrefillWorker, PrefillWorkerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HEADS, KV_HEADS = 6, 3
BLOCK = 16


def _write_tiny(path: Path) -> Path:
    """6 query heads, 3 KV heads of 16, 2 layers, SmolLM2's tokenizer; weights scaled up from a
    normal draw so that greedy decoding has clear winners."""
    import torch
    from safetensors.torch import save_file

    from baton.common.model.config import LlamaConfig
    from baton.common.model.source import ModelSource, load_tokenizer

    vocab, hidden, inter, d = 49152, 96, 192, 16
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (2.0 / shape[-1] ** 0.5)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(HEADS * d, hidden),
            p + "self_attn.k_proj.weight": w(KV_HEADS * d, hidden),
            p + "self_attn.v_proj.weight": w(KV_HEADS * d, hidden),
            p + "self_attn.o_proj.weight": w(hidden, HEADS * d),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    cfg = LlamaConfig(vocab, hidden, inter, 2, HEADS, KV_HEADS, d, max_position_embeddings=1024)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    load_tokenizer(ModelSource.resolve(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(_write_tiny(tmp_path_factory.mktemp("tiny-kv3")))


@pytest.fixture(scope="module")
def reference(tiny):
    """The colocated single process."""
    return LLM(model=tiny, dtype="float32", kv_cache_gib=0.02, max_model_len=1024)


def _engine(model: str, tp: int) -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype="float32",
        kv_cache_gib=0.02,
        max_model_len=1024,
        max_num_batched_tokens=64,  # a 100-token prompt is two chunks: KV leaves while the next computes
        tensor_parallel_size=tp,
    )


@pytest.fixture(scope="module")
def cluster(tiny):
    """Prefill workers at TP 1, 2 and 3, decode workers at TP 1 and 2, all in one registry."""
    server = EmbeddedRedis()
    url = server.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro, t=300: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=t)  # noqa: E731
    prefill = {
        tp: PrefillWorker(PrefillWorkerConfig(engine=_engine(tiny, tp), redis_url=url)) for tp in (1, 2, 3)
    }
    decode = {tp: DecodeWorker(DecodeWorkerConfig(engine=_engine(tiny, tp), redis_url=url)) for tp in (1, 2)}
    workers = [*prefill.values(), *decode.values()]
    try:
        # Each kind at once: their engines load and their other ranks start side by side.
        run(_start_all(prefill.values()))
        run(_start_all(decode.values()))
        _wait_connected(decode.values(), 3)
        yield prefill, decode
    finally:
        for w in reversed(workers):
            try:
                run(w.stop(), 60)
            except Exception:  # noqa: BLE001 - one that failed to start
                pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.stop()


async def _start_all(workers) -> None:
    await asyncio.gather(*(w.start() for w in workers))


def _wait_connected(decoders, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for d in decoders:
        while len(d._connected) < n:
            assert time.monotonic() < deadline, (
                f"decode worker connected to {d._connected}, not {n} prefill workers"
            )
            time.sleep(0.05)


def _metrics(worker) -> str:
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _metric(worker, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", _metrics(worker), re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


def _rank_bytes(worker) -> dict[int, float]:
    body = _metrics(worker)
    found = re.findall(r'^baton:kv_received_bytes_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', body, re.M)
    assert found, "baton:kv_received_bytes_total not in metrics"
    return {int(r): float(v) for r, v in found}


def _generate(decode, ids, rid, prefill) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{decode.grpc_port}") as channel:
        req = baton_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            params=params_to_proto(GREEDY),
            prefill_address=f"127.0.0.1:{prefill.grpc_port}",
        )
        return [t for c in baton_pb2_grpc.DecodeStub(channel).Generate(req, timeout=120) for t in c.token_ids]


def _head_block_bytes(decode) -> int:
    """Bytes of one KV head of one block (rank 0's cache holds its heads of every block)."""
    cache = decode.engine.engine.kv_cache  # [num_blocks, L, 2, KV_0, bs, D]
    return cache[0].nbytes // cache.shape[3]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_kv_crosses_degrees_resharded_and_decode_gives_one_process_tokens(
    cluster, reference, prefill_tp, decode_tp
):
    prefill, decode = cluster
    p, d = prefill[prefill_tp], decode[decode_tp]
    ids = [(i * 7919 + 11 * prefill_tp + decode_tp) % 40000 + 100 for i in range(100)]  # 7 blocks
    computed = _metric(d, "baton:prompt_tokens_computed_total")
    remote = d.engine.engine.num_remote_prefills_total
    before = _rank_bytes(d)

    tokens = _generate(d, ids, f"tp{prefill_tp}-to-tp{decode_tp}", p)

    assert tokens == reference.generate([ids], GREEDY)[0].outputs[0].token_ids
    assert d.engine.engine.num_remote_prefills_total == remote + 1  # it went through the prefill worker
    assert _metric(d, "baton:prompt_tokens_computed_total") == computed  # decode computed none of it
    # Each decode rank received its heads of the prompt's 7 blocks, and nothing else.
    blocks = -(-len(ids) // BLOCK)
    held = [2, 1] if decode_tp == 2 else [3]  # head_split(6, 3, 2): KV heads 0-1 and 2
    after = _rank_bytes(d)
    got = {r: after[r] - before.get(r, 0.0) for r in after}
    assert got == {r: blocks * n * _head_block_bytes(d) for r, n in enumerate(held)}
    d.engine.engine.pool.check_integrity()


def test_workers_publish_their_degree_and_head_ranges(cluster):
    import redis

    from baton.common.index.registry import WorkerRegistry

    prefill, decode = cluster
    registry = WorkerRegistry(
        redis.Redis.from_url(decode[2].config.redis_url), decode[2].engine.engine.model_name, 6
    )
    settings = {w.id: w.settings for w in registry.list("decode") + registry.list("prefill")}
    for tp, heads in ((1, [[0, 3]]), (2, [[0, 2], [2, 3]]), (3, [[0, 1], [1, 2], [2, 3]])):
        for w in (prefill[tp], decode.get(tp)):
            if w is None:
                continue
            assert settings[w.worker_id]["tensor_parallel_size"] == tp
            assert settings[w.worker_id]["kv_heads"] == heads


def _connect(prefill, request: baton_pb2.ConnectRequest):
    with grpc.insecure_channel(f"127.0.0.1:{prefill.grpc_port}") as channel:
        return baton_pb2_grpc.PrefillStub(channel).Connect(request, timeout=30)


def test_the_handshake_refuses_another_model_and_ranks_that_miss_heads(cluster):
    prefill, decode = cluster
    p, d = prefill[2], decode[2]
    good = d._remote.rank_destinations
    dest = baton_pb2.TransferDescriptor(backend="ucx", extra_json=d._remote.descriptor_json)
    # A cache of another head count (or dtype, layers, block size): refused before anything connects.
    with pytest.raises(grpc.RpcError) as e:
        _connect(
            p,
            baton_pb2.ConnectRequest(
                destination=dest, kv_layout="float32 2x2x2x16x16", rank_destinations=good
            ),
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV layout mismatch" in e.value.details() and "float32 2x2x3x16x16" in e.value.details()
    # Ranks that together do not hold the model's heads.
    missing = [good[0]]  # heads 0-1 only
    with pytest.raises(grpc.RpcError) as e:
        _connect(
            p, baton_pb2.ConnectRequest(destination=dest, kv_layout=p.kv_layout, rank_destinations=missing)
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no rank holds KV heads [2]" in e.value.details()
    assert _connect(
        p, baton_pb2.ConnectRequest(destination=dest, kv_layout=p.kv_layout, rank_destinations=good)
    )


def test_baton_up_passes_each_role_its_degree(monkeypatch):
    """``--prefill-tp`` and ``--decode-tp`` reach the config ``baton up`` runs (both default to
    ``--tensor-parallel-size``)."""
    from baton.cli import main as cli
    from baton.services import up

    seen = []
    monkeypatch.setattr(up, "run_cluster", lambda cfg: seen.append(cfg) or 0)
    assert cli.main(["up", "--prefill-tp", "2", "--decode-tp", "1", "--prefill", "1"]) == 0
    assert cli.main(["up", "-tp", "2", "--prefill", "1"]) == 0
    assert [(c.prefill_tp, c.decode_tp) for c in seen] == [(2, 1), (2, 2)]
