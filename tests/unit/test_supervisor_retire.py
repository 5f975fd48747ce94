"""``Supervisor.retire`` (services/procs.py), which ``baton up --autoscale`` scales down with: the
child gets one SIGTERM, drains, exits and is dropped, never restarted; one that does not exit by its
deadline is killed; ``stop`` does not signal a retired child again. Real child processes."""

from __future__ import annotations

import sys
import time

from baton.services.procs import Supervisor

# A child that counts SIGTERMs into a file, then exits 0 after ``drain`` seconds (its "drain").
_DRAINER = """
import signal, sys, time
path, drain = sys.argv[1], float(sys.argv[2])
def on_term(*_):
    with open(path, "a") as f:
        f.write("TERM\\n")
    global until
    until = until or time.monotonic() + drain
until = 0.0
signal.signal(signal.SIGTERM, on_term)
open(path, "a").close()
while not until or time.monotonic() < until:
    time.sleep(0.01)
sys.exit(0)
"""


def _spawn(sup: Supervisor, name: str, path, drain: float) -> None:
    sup.spawn(name, [sys.executable, "-c", _DRAINER, str(path), str(drain)])
    deadline = time.monotonic() + 10
    while not path.exists():  # bounded: the handler is set before the file appears
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.01)


def _supervise_until(sup: Supervisor, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"still there after {timeout} s: {sup.procs}"
        sup.supervise()
        time.sleep(0.02)


def test_a_retired_child_drains_exits_and_is_not_restarted(tmp_path):
    sup, restarts = Supervisor(on_restart=lambda *a: restarts.append(a)), []
    try:
        _spawn(sup, "keep", tmp_path / "keep", 0.0)
        _spawn(sup, "gone", tmp_path / "gone", 0.3)
        proc = dict(sup.procs)["gone"]
        sup.retire("gone", timeout_s=10.0)
        assert sup.retiring() == ["gone"]
        _supervise_until(sup, lambda: [n for n, _ in sup.procs] == ["keep"])
        assert proc.returncode == 0  # it finished its drain
        assert (tmp_path / "gone").read_text() == "TERM\n"
        for _ in range(10):  # later rounds start nothing again
            sup.supervise()
        assert [n for n, _ in sup.procs] == ["keep"] and restarts == [] and sup.retiring() == []
    finally:
        sup.stop(5)


def test_a_retired_child_past_its_deadline_is_killed(tmp_path):
    sup = Supervisor()
    try:
        _spawn(sup, "slow", tmp_path / "slow", 60.0)  # drains far past the deadline
        proc = dict(sup.procs)["slow"]
        sup.retire("slow", timeout_s=0.2)
        _supervise_until(sup, lambda: not sup.procs)
        assert proc.returncode < 0  # killed
    finally:
        sup.stop(5)


def test_stop_does_not_signal_a_retired_child_twice(tmp_path):
    sup = Supervisor()
    _spawn(sup, "w", tmp_path / "w", 0.5)
    proc = dict(sup.procs)["w"]
    sup.retire("w", timeout_s=10.0)
    sup.stop(10)
    assert proc.returncode == 0
    assert (tmp_path / "w").read_text() == "TERM\n"  # one signal: the drain was not cut short
