"""``baton bench serve`` against a real ``baton up`` (1 prefill + 1 decode worker, pinned with
``--prefill 1 --cpus auto``): the three serving workloads, the JSON, the table and the plot."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from baton.bench.serve import BenchConfig, run_benchmark
from baton.services.procs import split_cpus
from tests.e2e.up_process import allowed_cpus, start_up, stop_up, worker_pids

# Serial: its cluster is pinned with --cpus auto, and once lost its decode worker (503 at warm-up)
# beside another module's cluster on the same two cores.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("bench-serve-logs")
    port, proc = start_up(["--prefill", "1", "--kv-cache-gib", "1", "--cpus", "auto"], logs)
    yield f"http://127.0.0.1:{port}", proc
    stop_up(proc)


def _bench(base: str, **kw) -> dict:
    return asyncio.run(run_benchmark(BenchConfig(base_url=base, progress=False, timeout_s=120, **kw)))


def test_services_are_pinned_to_their_share_of_the_cores(cluster):
    _, proc = cluster
    workers = worker_pids(proc.pid)
    roles = sorted(name.split("-")[0] for name in workers)
    assert roles == ["decode", "gateway", "prefill"]
    want = split_cpus("auto", 2, sorted(os.sched_getaffinity(proc.pid)))
    prefill = next(pid for name, pid in workers.items() if name.startswith("prefill"))
    decode = next(pid for name, pid in workers.items() if name.startswith("decode"))
    gateway = next(pid for name, pid in workers.items() if name.startswith("gateway"))
    assert allowed_cpus(prefill) == set(want[0]) and allowed_cpus(decode) == set(want[1])
    assert allowed_cpus(gateway) == set(want[0])  # the front shares the prefill worker's cores


def test_w2_from_the_command_line(cluster, tmp_path):
    base, _ = cluster
    out, png = tmp_path / "w2.json", tmp_path / "w2.png"
    cmd = [sys.executable, "-m", "baton.cli", "bench", "serve", "--base-url", base,
           "--workload", "w2", "--num-prompts", "6", "--input-len", "64", "--output-len", "8",
           "--request-rate", "20", "--goodput", "ttft:600000", "tpot:600000",
           "--output-json", str(out), "--plot", str(png), "--disable-tqdm"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Serving Benchmark Result" in run.stdout and "Request goodput (req/s):" in run.stdout
    s = json.loads(out.read_text())
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["input_lens"] == [64] * 6 and s["output_lens"] == [8] * 6
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])  # every request meets lax SLOs
    for key in ("request_throughput", "p99_ttft_ms", "p99_tpot_ms", "median_itl_ms", "mean_e2el_ms"):
        assert s[key] > 0, key
    for ttft, tpot, e2el, itls in zip(s["ttfts"], s["tpots"], s["e2els"], s["itls"]):
        assert 0 < ttft < e2el
        assert tpot == pytest.approx((e2el - ttft) / 7)
        assert len(itls) >= 1 and sum(itls) <= e2el - ttft + 1e-6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    strict = _bench(base, workload="w2", num_prompts=2, input_len=32, output_len=4, goodput={"ttft": 0.001})
    assert strict["completed"] == 2 and strict["request_goodput"] == 0.0


def test_w3_serves_shared_prefixes_from_cache(cluster):
    base, _ = cluster
    s = _bench(base, workload="w3", num_prompts=6, num_groups=2, prefix_len=64, input_len=32, output_len=4,
               max_concurrency=1)  # fmt: skip
    assert s["failed"] == 0
    w3 = s["w3"]
    assert w3["cacheable_prefix_tokens"] == 4 * 64
    assert w3["num_cold"] == 2 and s["cached_tokens"][0] == 0
    # Every later request should hit; one may miss if its group's first request was prefilled on the
    # decode worker (a registry heartbeat starved on a loaded machine), leaving the prefill worker
    # without the prefix. A broken cache or report would miss them all.
    assert w3["prefix_hit_rate"] >= 0.75 and w3["num_hits"] >= 3, (w3, s["cached_tokens"])


def test_w4_moves_only_the_new_turns_kv(cluster):
    base, _ = cluster
    s = _bench(base, workload="w4", num_prompts=6, num_turns=3, input_len=64, output_len=16, request_rate=10)
    assert s["failed"] == 0 and s["completed"] == 6
    assert sorted(s["input_lens"]) == [64, 64, 144, 144, 224, 224]  # history + replies + 64 new tokens
    w4 = s["w4"]
    bpt = w4["kv_bytes_per_token"]
    # SmolLM2's 30 layers x (K, V) x 3 KV heads x 64, in the dtype `--dtype auto` chose here
    # (the start-up GEMM probe: bf16 or fp32, whichever this CPU ran faster).
    workers = httpx.get(f"{base}/workers", timeout=10).json()["workers"]
    (dtype,) = {w["settings"]["dtype"] for w in workers}
    assert bpt == 30 * 2 * 3 * 64 * {"bfloat16": 2, "float32": 4}[dtype], dtype
    # Each turn's 64 new tokens are 4 whole blocks, and the decode worker caches the whole history
    # (its final block included: 64 + 16 tokens end on a block boundary), so exactly the delta moves.
    for turn in ("1", "2", "3"):
        assert w4["per_turn"][turn]["bytes_over_delta"] == 1.0, w4["per_turn"]


def test_a_server_that_refuses_is_an_error_not_a_figure(cluster, tmp_path):
    base, _ = cluster
    cmd = [sys.executable, "-m", "baton.cli", "bench", "serve", "--base-url", base, "--model", "nope",
           "--num-prompts", "2", "--disable-tqdm"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "warm-up request failed" in run.stderr and "404" in run.stderr
    bad_slo = [*cmd[:7], "--goodput", "ttft"]
    bad = subprocess.run(bad_slo, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--goodput takes KEY:MS" in bad.stderr
