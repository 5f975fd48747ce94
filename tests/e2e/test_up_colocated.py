"""``baton up --colocated``: one worker that prefills and decodes, no KV transfer, same answers."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from baton.bench.serve import BenchConfig, run_benchmark
from baton.common.llm import SamplingParams
from tests.e2e.up_process import allowed_cpus, start_up, stop_up, worker_pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("colocated-logs")
    port, proc = start_up(
        ["--colocated", "--cpus", "auto", "--dtype", "float32", "--kv-cache-gib", "1"], logs
    )
    yield f"http://127.0.0.1:{port}", proc
    stop_up(proc)


def test_one_decode_worker_on_every_core(cluster):
    _, proc = cluster
    workers = {n: p for n, p in worker_pids(proc.pid).items() if not n.startswith("gateway")}
    assert [name.split("-")[0] for name in workers] == ["decode"]
    assert allowed_cpus(next(iter(workers.values()))) == set(os.sched_getaffinity(proc.pid))


def test_same_tokens_and_no_kv_transfer(cluster, llm_fp32):
    base, _ = cluster
    prompt = list(range(1000, 1300))  # long enough that a disaggregated cluster would prefill remotely
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    ref = llm_fp32.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert choice["token_ids"] == ref.token_ids and choice["prompt_token_ids"] == prompt
    assert "kv_transfer_bytes" not in usage


def test_bench_serve_against_it(cluster):
    base, _ = cluster
    s = asyncio.run(
        run_benchmark(BenchConfig(base_url=base, workload="w2", num_prompts=4, input_len=64, output_len=8,
                                  request_rate=10, progress=False, timeout_s=120))
    )  # fmt: skip
    assert (s["completed"], s["failed"]) == (4, 0)
