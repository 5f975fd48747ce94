"""``baton up --plan``: a ``baton plan --json`` output naming 1p1d starts one prefill and one decode
worker (not the layout rule's choice), and a completion's KV crosses from one to the other."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.up_process import start_up, stop_up

# Serial: its cluster is pinned with --cpus auto, as test_up_colocated's.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up-plan")
    plan = tmp / "plan.json"
    plan.write_text(json.dumps({"layout": "1p1d", "met": True, "slo_attainment": 0.95}))
    args = [
        "--plan",
        str(plan),
        "--cpus",
        "auto",
        "--dtype",
        "float32",
        "--kv-cache-gib",
        "0.3",
        "--max-model-len",
        "2048",
    ]
    port, proc = start_up(args, tmp)
    yield f"http://127.0.0.1:{port}", proc
    stop_up(proc)


def test_the_plans_layout_runs_and_kv_crosses(cluster):
    base, proc = cluster
    workers = httpx.get(f"{base}/workers", timeout=10).json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    layout = next(line for line in proc.startup_lines if line.startswith("Layout: "))
    assert "1 prefill worker" in layout
    prompt = list(range(1000, 1300))  # past the remote-prefill threshold: the prefill worker computes it
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"].get("kv_transfer_bytes", 0) > 0
