"""``tests.procs.die_with_parent``: a process the tests start does not outlive a killed parent (a
pytest-xdist worker that died), so no orphaned cluster keeps the CI machine's cores busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The child starts a grandchild that would sleep a minute, with the helper, then waits for it.
CHILD = """
import subprocess, sys
from tests.procs import die_with_parent
grandchild = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent
)
print(grandchild.pid, flush=True)
grandchild.wait()
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie: an orphan is reaped by whoever adopted it, perhaps not at once."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_grandchild_started_with_it_dies_with_its_killed_parent():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the child imports tests.procs
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()  # the child prints it once the grandchild runs
    assert line.strip().isdigit(), f"the child did not start its grandchild: {line!r}"
    grandchild = int(line)
    try:
        assert _alive(grandchild)
        child.kill()  # SIGKILL: nothing of the child's own runs, as when the OOM killer takes a worker
        child.wait(10)
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(grandchild), f"grandchild {grandchild} outlived its SIGKILLed parent"
    finally:
        child.kill()
        child.wait(10)
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass
