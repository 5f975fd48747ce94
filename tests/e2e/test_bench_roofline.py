"""``baton bench roofline`` end to end at smoke sizes: the table, the JSON and the measured figures'
fractions, read from the JSON files the offline benchmarks write. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_roofline_quick_prints_floors_and_fractions(tmp_path):
    latency = tmp_path / "latency.json"
    latency.write_text(json.dumps({"engine": "baton", "ms_per_token": 12.5}) + "\n")
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({"engine": "baton", "total_token_throughput": 900.0}) + "\n")
    out = tmp_path / "roofline.json"
    cmd = [sys.executable, "-m", "baton.cli", "bench", "roofline", "--quick", "--json"]
    cmd += ["--latency-json", str(latency), "--offline-json", str(offline), "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "batch-1 floor ms/token" in proc.stdout and "measured W1 900 tok/s" in proc.stdout
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    machine = result["machine"]
    assert machine["read_bytes"] == 16 << 20 and machine["read_gb_s_by_threads"]["1"] > 0
    assert {"fp32", "bf16"} <= set(machine["gemm_gflops"])
    floors = result["floors"]
    bandwidth = max(machine["read_gb_s_by_threads"].values())
    assert floors["batch1_ms"]["bf16"] == 2 * (30 * 3_538_944 + 49152 * 576) / (bandwidth * 1e9) * 1e3
    got = result["measured"]["bf16"]
    assert got["batch1"]["measured_ms"] == 12.5
    assert got["batch1"]["fraction"] == floors["batch1_ms"]["bf16"] / 12.5
    assert got["w1"]["fraction"] == 900.0 / floors["w1_tok_s"]["bf16"]
