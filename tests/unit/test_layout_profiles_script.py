"""``scripts/layout_profiles.sh``, the first step of issue 30's fidelity and decision matrices: it
checks the profiles already in OUT against this machine before an hour of runs is predicted from
them. ``baton`` is a stand-in here (``BATON``) that says whether the machine drifted, the fault
injected, and records what the script asked of it; the script itself runs for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "layout_profiles.sh"

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
if [ "$1 $2" = "profile --check" ]; then exit "$DRIFTED"; fi
prev=""
for a in "$@"; do
  if [ "$prev" = --output ]; then echo '{}' > "$a"; fi
  prev=$a
done
"""


def run(tmp_path: Path, out: Path, drifted: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    baton = tmp_path / "baton"
    baton.write_text(STAND_IN)
    baton.chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    environ = {**os.environ, "BATON": str(baton), "CALLS": str(calls), "DRIFTED": str(drifted), **env}
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], env=environ, capture_output=True, text=True, timeout=60
    )
    return proc, calls.read_text().splitlines()


@pytest.fixture
def profiled(tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("profile-all-cores.json", "profile-one-core.json"):
        (out / name).write_text("{}")
    return out


def test_a_machine_that_drifted_from_the_stored_profiles_stops_before_any_run(tmp_path, profiled):
    proc, calls = run(tmp_path, profiled, drifted=1)
    assert proc.returncode == 1, proc.stderr
    assert calls == [f"profile --check {profiled}/profile-all-cores.json"]
    assert "drifted" in proc.stderr and "CHECK_PROFILE=0" in proc.stderr
    assert not list(profiled.glob("served-*.json"))


def test_a_machine_like_the_profiles_goes_on_to_the_served_profiles(tmp_path, profiled):
    proc, calls = run(tmp_path, profiled, drifted=0)
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == f"profile --check {profiled}/profile-all-cores.json"
    served = [c for c in calls if c.startswith("bench served-profile")]
    assert len(served) == 3 and sorted(p.name for p in profiled.glob("served-*.json")) == [
        "served-1p1d.json",
        "served-colocated-2.json",
        "served-colocated.json",
    ]


def test_fresh_profiles_are_not_checked_and_the_check_can_be_skipped(tmp_path, profiled):
    fresh = tmp_path / "fresh"
    proc, calls = run(tmp_path, fresh, drifted=1)  # nothing stored: nothing to check
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in calls if "--check" in c]
    assert [c for c in calls if c.startswith("profile --output")] == [
        f"profile --output {fresh}/profile-all-cores.json",
        f"profile --output {fresh}/profile-one-core.json",
    ]
    proc, calls = run(tmp_path, profiled, drifted=1, CHECK_PROFILE="0")
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in calls if "--check" in c]
