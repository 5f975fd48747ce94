"""``baton up`` in its own process group, for tests that drive a whole local cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.common.net import free_port
from tests.procs import die_with_parent


def start_up(args: list[str], logs: Path, timeout: float = 300.0) -> tuple[int, subprocess.Popen]:
    """Start ``baton up ARGS`` on a free port and wait (bounded) until it says it is ready; what
    it printed until then is ``proc.startup_lines``."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "baton.cli",
            "up",
            "--port",
            str(port),
            "--log-dir",
            str(logs),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: we can check that nothing outlives it
        preexec_fn=die_with_parent,
    )
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Baton is ready" in line:
            proc.startup_lines = lines  # type: ignore[attr-defined]
            return port, proc
    stop_up(proc)
    logs_text = "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
    pytest.fail(f"baton up did not become ready:\n{''.join(lines)}\n{logs_text}")


def stop_up(proc: subprocess.Popen) -> None:
    """SIGTERM ``baton up`` (it stops its children), then make sure the whole group is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def worker_pids(up_pid: int) -> dict[str, int]:
    """The service processes of a ``baton up`` (``prefill``/``decode``/``gateway``), by role-and-pid."""
    out = {}
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            stat = (proc_dir / "stat").read_text()
            cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == up_pid and b"baton.cli" in cmd:
            role = cmd[cmd.index(b"baton.cli") + 1].decode()
            if role in ("prefill", "decode", "gateway"):
                out[f"{role}-{proc_dir.name}"] = int(proc_dir.name)
    return out


def allowed_cpus(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))
