"""The rank processes every parallel model starts: their devices and CPUs, the spawn, the ready
line, the pipes and the exit, shared by tensor (``driver``), pipeline (``pipeline_driver``) and
data parallelism (``data_parallel``).

A rank is ``python -m <module> '<json spec>'`` with its stdin a pipe of commands from rank 0 and
its stdout a pipe back; its stderr is the caller's, so that a rank's error shows.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

from baton.common.launch import python_module


class RankFailedError(RuntimeError):
    """A tensor-parallel rank has died or stopped answering: the model cannot run any more."""

    fatal = True
    """The engine gives up at once (``LLMEngine._after_failed_step``) instead of retrying steps."""


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``device`` on CPU; on CUDA the ``rank``-th device after rank 0's."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def cpu_shares(size: int) -> list[tuple[int, ...]]:
    """Each rank's CPUs: this process's cut into runs, or one each in turn where there are fewer
    CPUs than ranks (threads past the cores would only take turns, and a collective waits on the
    slowest rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return [(cpus[r % len(cpus)],) for r in range(size)]
    base, extra = divmod(len(cpus), size)
    out, start = [], 0
    for r in range(size):
        end = start + base + (r < extra)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Run this process on ``cpus`` with as many torch threads (nothing for an empty share)."""
    import torch

    if cpus:
        os.sched_setaffinity(0, set(cpus))
        torch.set_num_threads(len(cpus))


def build_kernels(device: str) -> None:
    """Build (or find built) the CPU kernel extension before any other rank starts: they then import
    it at once, instead of compiling it (or waiting for one of them to) inside their first step's
    collectives, whose timeout a build on a busy machine outlasts."""
    if not device.startswith("cuda"):
        from baton.kernels import cpu_ops

        cpu_ops.load()


def spawn(spec, module: str = "baton.common.parallel.worker") -> subprocess.Popen:
    """Start a rank running ``module`` with ``spec`` (anything with ``to_json``)."""
    # stdin: commands; stdout: the ready line; stderr: the caller's, so a rank's error shows.
    return subprocess.Popen(
        [*python_module(module), spec.to_json()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def await_ready(workers: list[subprocess.Popen], timeout_s: float, kind: str = "tensor-parallel") -> None:
    """Every other rank's ready line, or ``RankFailedError`` for the first that exits or is late."""
    deadline = time.monotonic() + timeout_s
    for r, p in enumerate(workers, 1):
        assert p.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailedError(f"{kind} rank {r} did not load its shard in {timeout_s:.0f} s")
            readable, _, _ = select.select([p.stdout], [], [], min(left, 0.5))
            if readable:
                line = p.stdout.readline()
                if line.strip() == b"ready":
                    break
                p.wait(5)
                raise RankFailedError(f"{kind} rank {r} exited with code {p.returncode} while loading")


def wait_exit(p: subprocess.Popen, timeout: float) -> bool:
    """Whether ``p`` exited within ``timeout`` seconds."""
    try:
        p.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def close_pipes(p: subprocess.Popen) -> None:
    """Close our ends of a rank's pipes (its stdin's end of file tells it to exit)."""
    for f in (p.stdin, p.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
