"""``baton profile`` end to end with the real SmolLM2 (bf16): ``--quick --output`` writes a profile
whose models are real fits of its measured points and rise where the costs do; ``--check`` fails
against that profile with every coefficient halved and names the models. (Whether an unchanged
machine passes ``--check`` is a timing on a shared machine, not tested here: the decision itself is
unit-tested on fixed numbers in tests/unit/test_profile_check.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from baton.bench.profile_plan import fit_errors
from baton.planner.profile import Profile

# It times the engine: alone (the serial phase), never beside another module's model, which on CI's
# 2 cores turned the decode fit's context term negative.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

FIT_TOLERANCE = 0.25
"""Median relative error of each model at its own points."""
ENGINE = ["--dtype", "bfloat16", "--kv-cache-gib", "1"]


def _run(*args: str, engine: list[str] = ENGINE) -> subprocess.CompletedProcess:
    """``baton profile --quick`` on one thread: with two OpenMP threads on two shared cores a step
    waits at every barrier for a thread the neighbours' tests descheduled (tenfold outliers); one
    thread is only slowed in proportion. ``Machine.cores`` records the one."""
    cmd = [sys.executable, "-m", "baton.cli", "profile", "--quick", *args, *engine]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "p.json"
    run = _run("--output", str(path))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    print(run.stdout)
    return path, run.stdout


def test_the_quick_profile_is_a_fit_of_its_own_points(quick_profile):
    path, stdout = quick_profile
    profile = Profile.load(path)
    assert profile.engine.dtype == "bfloat16" and profile.engine.kv_capacity_tokens > 0
    assert profile.machine.cores == 1 and profile.machine.isa and profile.machine.cpu
    assert set(profile.transfer) == {"ucx", "gloo"} and profile.gateway_ms > 0
    for name in ("prefill", "decode", "transfer.ucx", "transfer.gloo"):
        assert len(profile.points[name]) >= 2, name
    assert any(p["prior"] > 0 for p in profile.points["prefill"])  # prefix hits were measured
    errors = fit_errors(profile)
    assert max(errors.values()) <= FIT_TOLERANCE, errors
    assert "median fit error" in stdout and f"wrote {path}" in stdout


def test_the_quick_profile_rises_with_tokens_batch_and_context(quick_profile):
    profile = Profile.load(quick_profile[0])
    assert profile.prefill_ms([(512, 0)]) > profile.prefill_ms([(16, 0)])
    assert profile.decode_ms(32, 32 * 128) > profile.decode_ms(1, 128)  # batch, at the same context each
    assert profile.decode_ms(32, 32 * 1024) > profile.decode_ms(32, 32 * 128)  # context, same batch
    assert profile.transfer_ms(2048, "ucx") > profile.transfer_ms(256, "ucx")
    # The measured points agree, apart from the fit.
    decode = {(p["batch"], p["context_per_seq"]): p["ms"] for p in profile.points["decode"]}
    assert decode[(32, 1024)] > decode[(1, 128)]


def test_check_fails_against_the_profile_with_every_coefficient_halved(quick_profile, tmp_path):
    stored = json.loads(quick_profile[0].read_text())

    def halve(model: dict) -> dict:
        return {k: v / 2 for k, v in model.items()}

    stored["prefill"], stored["decode"] = halve(stored["prefill"]), halve(stored["decode"])
    stored["transfer"] = {name: halve(model) for name, model in stored["transfer"].items()}
    stored["gateway_ms"] /= 2
    halved = tmp_path / "halved.json"
    halved.write_text(json.dumps(stored))
    run = _run("--check", str(halved), "--rounds", "2")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    assert "measuring again" in run.stdout + run.stderr  # a drift past the tolerance is measured twice
    verdict = next((line for line in run.stdout.splitlines() if line.startswith("drifted past 10%:")), "")
    assert verdict, run.stdout[-2000:]
    for name in ("prefill", "decode", "transfer.ucx", "transfer.gloo"):
        assert name in verdict and f"{name:<16} drift" in run.stdout


def test_check_refuses_another_engine(quick_profile):
    engine = [("float32" if flag == "bfloat16" else flag) for flag in ENGINE]
    run = _run("--check", str(quick_profile[0]), engine=engine)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "dtype: stored 'bfloat16', now 'float32'" in run.stderr
