"""How many CPUs this process may use under its cgroup's quota (a container's CPU limit).

A pod with ``limits: cpu: "2"`` on a 64-core node sees 64 cores (``os.sched_getaffinity``), and
torch would start 64 threads that the kernel lets run 2 CPUs' worth at a time: each parallel loop
then waits on throttled threads. So a worker started without ``--cpus`` sizes torch's pool by the
quota. cgroup v2 keeps it in ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``), v1 in
``cpu.cfs_quota_us`` (``-1`` for none) and ``cpu.cfs_period_us``; the limit that applies is the
smallest along the process's cgroup and its parents (a pod's limit sits on the pod's cgroup).
"""

from __future__ import annotations

import math
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_limit(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _up_from(base: Path, relative: str) -> list[Path]:
    """``base/relative`` and each of its parents up to ``base`` (the folders that exist)."""
    here = base / relative.strip("/")
    folders = [here, *here.parents]
    return [f for f in folders[: folders.index(base) + 1] if f.is_dir()] if base in folders else [base]


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The CPUs (quota / period) this process's cgroup may use, or None without a limit.

    ``root`` is where cgroups are mounted and ``self_cgroup`` this process's membership
    (``/proc/self/cgroup``). In a container with its own cgroup namespace the path is ``/`` and
    ``root`` itself is the container's cgroup; outside one, the path names it under ``root``."""
    limits: list[float] = []
    for line in (_read(self_cgroup) or "0::/").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            limits += [q for f in _up_from(root, path) if (q := _v2_limit(f)) is not None]
        elif "cpu" in controllers.split(","):
            for mount in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):
                if (root / mount).is_dir():
                    limits += [q for f in _up_from(root / mount, path) if (q := _v1_limit(f)) is not None]
                    break
    return min(limits) if limits else None


def quota_threads(quota: float | None, available: int) -> int:
    """Threads for a parallel pool on ``available`` cores under ``quota`` CPUs: the quota rounded
    down (a thread past it would only be throttled, and a parallel loop waits for its slowest
    thread), at least 1, at most the cores."""
    if quota is None:
        return available
    return max(1, min(available, math.floor(quota + 1e-9)))
