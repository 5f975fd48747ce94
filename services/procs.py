"""Child processes of ``baton up``: started together, watched, and stopped with nothing left."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ProcessGroup:
    """Processes started with ``spawn`` and stopped together by ``stop``."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(
        self, name: str, args: Sequence[str], env: dict | None = None, log_path: str | None = None
    ) -> None:
        out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - owned by the child
        p = subprocess.Popen(
            list(args),
            env={**os.environ, **(env or {})},
            stdout=out or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=_die_with_parent,
        )
        self.procs.append((name, p))

    def dead(self) -> list[tuple[str, int]]:
        """Children that have exited, with their exit codes."""
        return [(name, p.returncode) for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every child, wait up to ``timeout``, then SIGKILL what is left."""
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", name, timeout)
                p.kill()
                p.wait(5)


def wait_http_ok(url: str, group: ProcessGroup, timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail early if a child dies, late if ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = group.dead()
        if dead:
            raise RuntimeError(f"exited before the cluster was ready: {dead}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (Linux's cpu-list form)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad cpu list {spec!r}: expected e.g. 0-1,3") from None
        if first < 0 or last < first:
            raise ValueError(f"bad cpu list {spec!r}: ranges go low-high and cpus are >= 0")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def split_cpus(spec: str, num_workers: int, available: Sequence[int]) -> list[list[int]]:
    """Each worker's cores, from ``baton up --cpus``: ``auto`` shares ``available`` out evenly in
    order (round-robin when there are more workers than cores), else ``|``-separated cpu lists, one
    per worker in start order (prefill workers first, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``)."""
    cores = sorted(available)
    if spec == "auto":
        if num_workers <= len(cores):
            per, extra = divmod(len(cores), num_workers)
            out, i = [], 0
            for w in range(num_workers):
                n = per + (1 if w < extra else 0)
                out.append(cores[i : i + n])
                i += n
            return out
        return [[cores[w % len(cores)]] for w in range(num_workers)]
    lists = [parse_cpu_list(part) for part in spec.split("|")]
    if len(lists) != num_workers:
        raise ValueError(f"--cpus names {len(lists)} cpu lists for {num_workers} workers")
    missing = {c for cl in lists for c in cl} - set(cores)
    if missing:
        raise ValueError(f"--cpus names cpus this process cannot use: {sorted(missing)} (allowed {cores})")
    return lists


def pin_to_cpus(cpus: Sequence[int], torch_threads: bool = True) -> None:
    """Run this process on ``cpus`` only and, with ``torch_threads``, torch's thread pool as wide
    as they are (call before torch starts threads)."""
    os.sched_setaffinity(0, set(cpus))
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    if torch_threads:
        import torch

        torch.set_num_threads(len(cpus))


def baton_command() -> list[str]:
    """How to start another ``baton`` subcommand with this interpreter."""
    return [sys.executable, "-m", "baton.services.cli"]
