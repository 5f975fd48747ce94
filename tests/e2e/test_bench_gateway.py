"""``baton bench gateway``: the real gateway in its own process, streaming a synthetic decode
worker's tokens to concurrent clients; every token arrives and the CPU it cost is reported."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gateway_cost_from_the_command_line(tmp_path):
    out = tmp_path / "gw.json"
    cmd = [sys.executable, "-m", "baton.cli", "bench", "gateway", "--streams", "3", "--tokens", "200",
           "--output-json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens/s; gateway CPU" in run.stdout
    cost = json.loads(out.read_text())
    assert (cost["streams"], cost["tokens_per_stream"]) == (3, 200)  # run() checks all 600 arrived
    assert cost["tokens_per_s"] == 600 / cost["seconds"]
    assert 0 < cost["gateway_cpu_ms_per_token"] < 100 and cost["client_cpu_ms_per_token"] > 0
