"""``make gpu-check``'s CPU half, as CI runs it: the script (scripts/gpu_check.sh, as the Makefile
runs it) on this machine writes gpu-check.json with every GPU check ``needs-gpu``, the seeded model
built and the engine on the CPU token for token with transformers on it (4 of SmolLM2's 30 layers,
to keep this under a minute). The GPU half runs only where a GPU is lent (``make gpu-check``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from baton.bench.gpu_check import BY_NAME, CPU_HALF
from baton.bench.gpu_check_model import compare

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU checks run: make gpu-check")
def test_cpu_half_passes_and_every_gpu_check_needs_a_gpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--output", str(out), "--layers", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["device"].startswith("no CUDA device")
    checks = result["checks"]
    assert list(checks) == list(BY_NAME)  # every check, in order, none dropped
    for name, check in checks.items():
        spec = BY_NAME[name]
        assert check["budget_s"] == spec.budget_s and check["what"] == spec.what
        if spec.gpu:
            assert check["status"] == "needs-gpu", (name, check)
        else:
            assert check["status"] == "passed", (name, check.get("error"), check.get("traceback"))
            assert 0 < check["seconds"] <= spec.budget_s
    assert checks["seeded_model"]["parameters"] == 49152 * 576 + 4 * (3_538_944 + 2 * 576) + 576
    parity = checks["engine_cpu_fp32_vs_transformers"]
    assert parity["tokens"] == 4 * 24 and parity["tokens_matched"] == parity["tokens"], parity
    assert checks["seeded_model"]["context_sensitivity"] >= 0.5
    assert CPU_HALF <= set(checks)


def test_a_failing_check_is_recorded_and_the_rest_run(tmp_path):
    """Where transformers cannot be imported, the model check is ``failed`` with the error, the
    check that needs its model is ``failed`` saying so, a GPU check still gets its status, the JSON
    is written and the exit code says something failed."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "transformers.py").write_text("raise ImportError('no transformers on this machine')\n")
    out = tmp_path / "gpu-check.json"
    names = "seeded_model,engine_cpu_fp32_vs_transformers,triton_decode"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--output", str(out), "--checks", names]
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert list(checks) == names.split(",")
    assert checks["seeded_model"]["status"] == "failed"
    assert checks["seeded_model"]["error"] == "ImportError: no transformers on this machine"
    assert checks["engine_cpu_fp32_vs_transformers"] == {
        "status": "failed",
        "error": "needs the seeded model, which was not built",
        "what": BY_NAME["engine_cpu_fp32_vs_transformers"].what,
    }
    expected = "passed" if torch.cuda.is_available() else "needs-gpu"
    assert checks["triton_decode"]["status"] == expected


def test_every_triton_kernel_module_has_a_check():
    """A new ``@triton.jit`` in kernels/ must be named in KERNEL_MODULES with the check that
    compiles it, or make gpu-check would silently leave it out."""
    from baton.bench.gpu_check_kernels import KERNEL_MODULES

    jitted = {p.stem for p in (ROOT / "kernels").glob("*.py") if "@triton.jit" in p.read_text()}
    assert jitted and jitted <= set(KERNEL_MODULES), jitted - set(KERNEL_MODULES)
    assert set(KERNEL_MODULES.values()) <= set(BY_NAME)


def _ref(tokens: list[int], gaps: list[float]) -> dict:
    """A reference whose step i prefers ``tokens[i]`` by ``gaps[i]`` over token 0."""
    logits = []
    for t, g in zip(tokens, gaps):
        step = torch.full((8,), -10.0)
        step[0], step[t] = 1.0 - g, 1.0
        logits.append(step)
    return {"tokens": tokens, "logits": logits}


def test_compare_allows_divergence_only_at_a_near_tie():
    ref = [_ref([3, 4, 5], [2.0, 0.05, 2.0]), _ref([6, 6], [2.0, 2.0])]
    same = compare(ref, [[3, 4, 5], [6, 6]], 0.1)
    assert same["tokens_matched"] == 5 and "error" not in same
    tie = compare(ref, [[3, 0, 7], [6, 6]], 0.1)  # step 1 took token 0, 0.05 below the best
    assert tie["matched_per_prompt"] == [1, 2] and tie["gaps_at_divergence"] == [pytest.approx(0.05)]
    assert "error" not in tie
    bug = compare(ref, [[3, 4, 5], [0, 6]], 0.1)  # token 0 is 2.0 below: not a tie
    assert "prompt 1 step 0" in bug["error"]
    short = compare(ref, [[3, 4], [6, 6]], 0.1)
    assert "prompt 0: 2 tokens, reference 3" in short["error"]
