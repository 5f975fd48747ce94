"""``baton up --colocated``: one worker that prefills and decodes, no KV transfer, same answers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from baton.bench.serve import BenchConfig, run_benchmark
from baton.common.llm import SamplingParams
from tests.e2e.up_process import allowed_cpus, start_up, stop_up, worker_pids

# Serial: its cluster is pinned with --cpus auto; beside another module's cluster on the same two
# cores its starved worker missed the gateway's 2 s keepalive ack (GOAWAY ping_timeout) mid-stream.
pytestmark = pytest.mark.serial


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


def _goodput(base: str, out, slos: list[str]) -> dict:
    cmd = [sys.executable, "-m", "baton.cli", "bench", "goodput", "--base-url", base, "--rates", "20,5",
           "--num-prompts", "3", "--input-len", "32", "--output-len", "4", "--goodput", *slos,
           "--output-json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "goodput:" in run.stdout
    return json.loads(out.read_text())


def test_goodput_search_from_the_command_line(cluster, tmp_path):
    base, _ = cluster
    g = _goodput(base, tmp_path / "lax.json", ["ttft:600000", "tpot:600000"])
    assert [r["rate"] for r in g["rates"]] == [5, 20]  # from the lowest up, a seed each
    assert [r["seed"] for r in g["rates"]] == [0, 1]
    assert all((r["completed"], r["good"], r["passed"]) == (3, 3, True) for r in g["rates"])
    assert g["goodput"] == 20
    g = _goodput(base, tmp_path / "strict.json", ["ttft:0.01"])  # no request can meet it
    assert len(g["rates"]) == 1 and g["rates"][0]["good"] == 0 and g["goodput"] == 0
