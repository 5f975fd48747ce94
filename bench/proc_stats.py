"""What the processes of a local cluster cost: CPU time and wake-ups from ``/proc`` (Linux), and the
children of a ``baton up`` by role. Pure reading, no torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcSample:
    """One process's counters at one moment, summed over its threads."""

    cpu_s: float
    """User plus system CPU time."""
    wakeups: int
    """Voluntary context switches: each is a thread that slept and was woken."""


def sample(pid: int) -> ProcSample:
    """The counters of ``pid`` now; raises ``OSError`` if it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: the whole process
    wakeups = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    wakeups += int(line.split()[1])
        except OSError:
            continue  # a thread that ended meanwhile
    return ProcSample(cpu, wakeups)


def cluster_pids(up_pid: int) -> dict[str, int]:
    """The services a ``baton up`` started, as ``{"decode-0": pid, ...}`` in start order per role,
    plus ``redis`` for an embedded Redis."""
    children = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            stat = (proc_dir / "stat").read_text()
            cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == up_pid:
            children.append((int(proc_dir.name), cmd))
    out: dict[str, int] = {}
    counts: dict[str, int] = {}
    for pid, cmd in sorted(children):
        if b"baton.cli" in cmd:
            role = cmd[cmd.index(b"baton.cli") + 1].decode()
        elif cmd and cmd[0].endswith(b"redis-server"):
            role = "redis"
        else:
            continue
        n = counts.get(role, 0)
        counts[role] = n + 1
        out[role if role in ("gateway", "redis") else f"{role}-{n}"] = pid
    return out


def usage(before: dict[str, ProcSample], after: dict[str, ProcSample], seconds: float) -> dict[str, dict]:
    """Per process: CPU used (seconds and share of one core) and wake-ups per second between two
    samples ``seconds`` apart."""
    out = {}
    for name, a in after.items():
        b = before.get(name)
        if b is None:
            continue
        cpu = a.cpu_s - b.cpu_s
        out[name] = {
            "cpu_s": cpu,
            "cpu_percent": 100.0 * cpu / seconds if seconds > 0 else 0.0,
            "wakeups_per_s": (a.wakeups - b.wakeups) / seconds if seconds > 0 else 0.0,
        }
    return out
