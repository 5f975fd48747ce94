"""Disaggregation across tensor-parallel degrees through ``baton up`` as a user runs it: a prefill
worker at TP=1 and a decode worker at TP=2 (and the reverse), every rank a real process, KV over
real UCX. The completion's greedy tokens (fp32) are the single process's, the prompt went through
the prefill worker (the decode worker computed none of it), and each decode rank received exactly
its KV heads' share of the prompt's blocks (``baton:kv_received_bytes_total{rank}``), a figure
taken from the model's config, not from the cache that received it."""

from __future__ import annotations

import re

import httpx
import pytest

from baton.common.llm import SamplingParams
from tests.e2e.up_process import start_up, stop_up

# Serial: its four worker processes (a TP pair and one rank on each side) each hold the model; beside
# another module's cluster the parallel phase peaks at the most memory of the suite.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

BLOCK = 16  # baton up's default block size


@pytest.fixture(
    scope="module", params=[(1, 2), (2, 1)], ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1"]
)
def cluster(request, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    logs = tmp_path_factory.mktemp(f"up-tp{prefill_tp}{decode_tp}")
    args = ["--dtype", "float32", "--kv-cache-gib", "0.25", "--max-model-len", "1024", "--prefill", "1"]
    port, proc = start_up([*args, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp)], logs)
    yield port, prefill_tp, decode_tp
    stop_up(proc)


def _decode_metrics(port: int) -> str:
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    (decode,) = [w for w in workers if w["role"] == "decode"]
    return httpx.get(decode["metrics_url"], timeout=10).text


def _sum(body: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body, re.M))


def _rank_bytes(body: str) -> dict[int, float]:
    found = re.findall(r'^baton:kv_received_bytes_total\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', body, re.M)
    return {int(r): float(v) for r, v in found}


def test_kv_crosses_degrees_and_the_tokens_are_one_process(cluster, llm_fp32, model_path):
    port, prefill_tp, decode_tp = cluster
    ids = [(i * 7919 + 13 * decode_tp) % 40000 + 100 for i in range(100)]  # 7 blocks, 6 full
    before = _decode_metrics(port)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    after = _decode_metrics(port)

    ref = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert r.json()["choices"][0]["token_ids"] == ref.token_ids
    # The prompt was computed by the prefill worker, none of it by the decode worker.
    computed = "baton:prompt_tokens_computed_total"
    assert _sum(after, computed) == _sum(before, computed), "the decode worker computed the prompt"
    # Each decode rank received its KV heads of the prompt's blocks: SmolLM2's 3 KV heads split
    # 2 + 1 at TP=2; a head of a block is layers x (K, V) x block x head_dim fp32 values.
    import gguf

    meta = gguf.GGUFReader(model_path).fields
    layers, hidden, heads = (
        meta[f"llama.{k}"].contents() for k in ("block_count", "embedding_length", "attention.head_count")
    )
    head_block = layers * 2 * BLOCK * (hidden // heads) * 4
    held = [2, 1] if decode_tp == 2 else [3]
    blocks = -(-len(ids) // BLOCK)
    got = {rank: v - _rank_bytes(before).get(rank, 0.0) for rank, v in _rank_bytes(after).items()}
    assert got == {rank: float(blocks * n * head_block) for rank, n in enumerate(held)}, (
        prefill_tp,
        decode_tp,
    )
