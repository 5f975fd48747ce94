"""Disaggregation across pipeline- and tensor-parallel degrees at once, through ``baton up`` as a user
runs it: ``-pp 2`` gives the prefill worker two stages, ``--decode-pp 1 --decode-tp 2`` gives the
decode worker one stage of two tensor-parallel ranks, every rank a real process, KV over real UCX.
Each decode rank's heads of every layer come from both prefill stages, re-sharded by layers and
heads on the way. The completion's greedy tokens (fp32) are the single process's, the prompt went
through the prefill worker (the decode worker computed none of it), and each decode rank received
exactly its share of the prompt's blocks (``baton:kv_received_bytes_total{rank}``), a figure taken
from the GGUF's metadata, not from the cache that received it."""

from __future__ import annotations

import re

import httpx
import pytest

from baton.common.llm import SamplingParams
from tests.e2e.up_process import start_up, stop_up

# Serial: four worker processes of the real model (two stages, two tensor-parallel ranks).
pytestmark = [pytest.mark.slow, pytest.mark.serial]

BLOCK = 16  # baton up's default block size


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-pp")
    args = ["--dtype", "float32", "--kv-cache-gib", "0.25", "--max-model-len", "1024", "--prefill", "1"]
    port, proc = start_up([*args, "-pp", "2", "--decode-pp", "1", "--decode-tp", "2"], logs)
    yield port
    stop_up(proc)


def _workers(port: int) -> dict[str, dict]:
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    return {w["role"]: w for w in workers}


def _decode_metrics(port: int) -> str:
    return httpx.get(_workers(port)["decode"]["metrics_url"], timeout=10).text


def _sum(body: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body, re.M))


def _rank_bytes(body: str) -> dict[int, float]:
    found = re.findall(r'^baton:kv_received_bytes_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', body, re.M)
    return {int(r): float(v) for r, v in found}


def test_each_role_runs_its_degrees(cluster):
    workers = _workers(cluster)
    prefill, decode = workers["prefill"]["settings"], workers["decode"]["settings"]
    assert (prefill["pipeline_parallel_size"], prefill["tensor_parallel_size"]) == (2, 1)
    assert (decode["pipeline_parallel_size"], decode["tensor_parallel_size"]) == (1, 2)


def test_kv_crosses_layers_and_heads_and_the_tokens_are_one_process(cluster, llm_fp32, model_path):
    port = cluster
    ids = [(i * 7919 + 29) % 40000 + 100 for i in range(100)]  # 7 blocks, 6 full
    before = _decode_metrics(port)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    after = _decode_metrics(port)

    ref = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert r.json()["choices"][0]["token_ids"] == ref.token_ids
    computed = "baton:prompt_tokens_computed_total"
    assert _sum(after, computed) == _sum(before, computed), "the decode worker computed the prompt"
    # Each decode rank holds every layer of its KV heads: SmolLM2's split 2 + 1 at TP=2 (the
    # earlier rank one longer); a (layer, head) of a block is K and V x block x head_dim fp32 values.
    import gguf

    meta = gguf.GGUFReader(model_path).fields
    layers, hidden, heads, kv = (
        meta[f"llama.{k}"].contents()
        for k in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv")
    )
    cell = 2 * BLOCK * (hidden // heads) * 4
    held = [kv // 2 + kv % 2, kv // 2]
    blocks = -(-len(ids) // BLOCK)
    got = {rank: v - _rank_bytes(before).get(rank, 0.0) for rank, v in _rank_bytes(after).items()}
    assert got == {rank: float(blocks * layers * n * cell) for rank, n in enumerate(held)}
