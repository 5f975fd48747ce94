"""The ``baton`` command as a user runs it: a real process, real weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from baton.common.llm import SamplingParams

BATON = os.path.join(os.path.dirname(sys.executable), "baton")


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([BATON, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_json_matches_the_python_api(llm_fp32):
    r = _run(
        "generate", "--prompt", "The quick brown fox", "--max-tokens", "8", "--dtype", "float32", "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ref = llm_fp32.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[
        0
    ]
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == ref.text


def test_generate_chat_and_progress_bar():
    r = _run("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Loading weights" in r.stderr  # the progress bar on model load


def test_generate_rejects_bad_parameters_by_name():
    r = _run("generate", "--prompt", "hi", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr
    r = _run("generate", "--prompt", "hi", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr


def test_bench_offline_writes_its_figures(tmp_path):
    path = tmp_path / "w1.json"
    r = _run(
        "bench", "offline", "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
        "--kv-cache-gib", "0.5", "--output-json", str(path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(path.read_text())
    assert result["num_requests"] == 3
    assert result["elapsed_s"] > 0
    expected = (3 * 16 + 3 * 4) / result["elapsed_s"]
    assert abs(result["total_token_throughput"] - expected) < 1e-6 * expected
    assert abs(result["output_token_throughput"] - 12 / result["elapsed_s"]) < 1e-6 * expected
