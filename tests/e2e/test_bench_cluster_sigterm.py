"""A benchmark that started ``baton up`` (``bench.breakdown.start_cluster``: the cluster in a session
of its own, which a signal to the benchmark does not reach) and is stopped with SIGTERM unwinds
through its ``finally`` and stops the cluster: no worker, gateway or Redis of it is left running.
The cluster serves the tiny Llama (what is tested is the processes' ends, not the model's load)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.e2e.tiny_llama import write_tiny_llama
from tests.procs import die_with_parent

BENCH = """
import sys, time
from pathlib import Path
from baton.bench.breakdown import start_cluster, stop_cluster

up = ("--model", sys.argv[2], "--layout", "colocated:1", "--dtype", "float32", "--kv-cache-gib", "0.05")
proc, port = start_cluster(up, Path(sys.argv[1]), 600.0)
try:
    print(proc.pid, flush=True)
    time.sleep(600)
finally:
    stop_cluster(proc)
"""


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_a_benchmark_stops_the_cluster_it_started(tmp_path):
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(tmp_path), str(write_tiny_llama(tmp_path / "tiny"))],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )
    pgid = None
    try:
        line = bench.stdout.readline()  # the cluster's pid once it is ready (start_cluster's bound)
        assert line.strip().isdigit(), f"the cluster did not come up: {line!r}, exit {bench.poll()}"
        pgid = int(line)  # its own session: the process group of baton up and its children
        assert _alive(pgid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pgid), (
            f"processes of the cluster's group {pgid} still run after the benchmark exited"
        )
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(30)
        if pgid is not None and _alive(pgid):  # the test failed: stop what it started anyway
            os.killpg(pgid, signal.SIGKILL)
