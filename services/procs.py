"""Child processes of ``baton up``: started together, restarted when they exit (``Supervisor``),
and stopped with nothing left."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.common.launch import python_module

log = logging.getLogger(__name__)


def _libc_prctl():
    """libc's ``prctl``, looked up here, in the parent: a dlopen between fork and exec can hang
    for good in a child of a threaded process (another thread may have held the loader's lock at
    the fork; seen: a child that never started, in a test process with gRPC threads)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def _child_setup(cpus: tuple[int, ...]) -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cpus:
        os.sched_setaffinity(0, cpus)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # see _restart


def _popen(
    args: Sequence[str], env: dict | None, log_path: str | None, cpus: Sequence[int] = ()
) -> subprocess.Popen:
    """A child that dies with this process, in its own process group: a terminal's Ctrl-C reaches
    only ``baton up``, which then stops its children once each (a second signal would make a
    worker skip its drain)."""
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed below, the child has its own
    try:
        return subprocess.Popen(
            list(args),
            env={**os.environ, **(env or {})},
            stdout=out or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=functools.partial(_child_setup, tuple(cpus)),
            process_group=0,
        )
    finally:
        if out is not None:
            out.close()


@dataclass
class ProcessGroup:
    """Processes started with ``spawn`` and stopped together by ``stop``."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    signalled: set[str] = field(default_factory=set)
    """Children already sent SIGTERM (retired): ``stop`` does not signal them again, as a second
    signal makes a worker skip its drain."""

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        env: dict | None = None,
        log_path: str | None = None,
        cpus: Sequence[int] = (),
    ) -> None:
        """Start ``args`` as the child ``name``, its output appended to ``log_path`` (default:
        stdout dropped, stderr inherited), on ``cpus`` if given."""
        self.procs.append((name, _popen(args, env, log_path, cpus)))

    def dead(self) -> list[tuple[str, int]]:
        """Children that have exited, with their exit codes."""
        return [(name, p.returncode) for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout: float = 15.0, names: Sequence[str] | None = None) -> None:
        """SIGTERM every child (or those in ``names``), wait up to ``timeout``, then SIGKILL what
        is left."""
        procs = [(n, p) for n, p in self.procs if names is None or n in names]
        for name, p in procs:
            if p.poll() is None and name not in self.signalled:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", name, timeout)
                p.kill()
                p.wait(5)


@dataclass(frozen=True)
class Backoff:
    """When a ``Supervisor`` restarts a child that exited: after ``initial_s``, doubling with each
    exit in a row up to ``max_s``. It never gives up, as Kubernetes does not (CrashLoopBackOff: 10 s
    doubling to 5 min): a cluster whose Redis or model file comes back heals by itself."""

    initial_s: float = 0.5
    """Wait before restarting a child that exited for the first time (in a row)."""
    max_s: float = 30.0
    """Longest wait between restarts."""
    reset_after_s: float = 60.0
    """A child that ran this long before it exited counts as healthy: back to ``initial_s``."""

    def next(self, ran_s: float, exits_in_a_row: int) -> tuple[float, int]:
        """The wait before restarting a child that exited after running ``ran_s``, having exited
        ``exits_in_a_row`` times in a row before; and the new count."""
        n = 0 if ran_s >= self.reset_after_s else exits_in_a_row
        return min(self.max_s, self.initial_s * 2**n), n + 1


@dataclass
class _Child:
    """What a ``Supervisor`` knows of one child, to start it again the same way."""

    args: tuple[str, ...]
    env: dict | None
    log_path: str | None
    cpus: tuple[int, ...]
    started: float
    exits_in_a_row: int = 0
    restart_at: float | None = None
    """When it is due to start again; None while it runs."""
    retire_by: float | None = None
    """Retired (``Supervisor.retire``): killed if still running at this time; None otherwise."""


@dataclass
class Supervisor(ProcessGroup):
    """A ``ProcessGroup`` whose children are restarted, with ``backoff``, whenever they exit (any
    code, or a signal) and ``supervise`` is called; ``stop`` ends them for good (nothing is
    restarted while stopping, as ``supervise`` is not called then). ``on_restart(name, code)`` is
    told each restart and the exit code before it."""

    backoff: Backoff = field(default_factory=Backoff)
    on_restart: Callable[[str, int], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _children: dict[str, _Child] = field(default_factory=dict, init=False, repr=False)

    def spawn(
        self,
        name: str,
        args: Sequence[str],
        env: dict | None = None,
        log_path: str | None = None,
        cpus: Sequence[int] = (),
    ) -> None:
        if name in self._children:
            raise ValueError(f"a child named {name!r} exists already")
        super().spawn(name, args, env, log_path, cpus)
        self._children[name] = _Child(tuple(args), env, log_path, tuple(cpus), self.clock())

    def remove(self, name: str) -> None:
        """Stop supervising ``name`` (which has exited, or is killed now)."""
        for i, (n, p) in enumerate(self.procs):
            if n == name:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)
                del self.procs[i]
                break
        self._children.pop(name, None)

    def retire(self, name: str, timeout_s: float) -> None:
        """Stop ``name`` for good: SIGTERM now (a worker drains what it has in flight), never
        restarted; ``supervise`` drops it once it has exited, and kills it past ``timeout_s``."""
        child = self._children[name]
        child.restart_at, child.retire_by = None, self.clock() + timeout_s
        self.signalled.add(name)
        for n, p in self.procs:
            if n == name and p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def retiring(self) -> list[str]:
        """Children retired and not yet exited."""
        return [n for n, _ in self.procs if n in self._children and self._children[n].retire_by is not None]

    def _reap(self, name: str, p: subprocess.Popen, child: _Child, now: float) -> bool:
        """For a retired child: drop it once exited (True), kill it past its deadline."""
        if p.poll() is not None:
            log.info("%s retired: exited with %s", name, describe_exit(p.returncode))
            self.procs = [(n, q) for n, q in self.procs if n != name]
            self._children.pop(name, None)
            self.signalled.discard(name)
            return True
        if child.retire_by is not None and now > child.retire_by:
            log.warning("%s did not drain in time: killing it", name)
            p.kill()
        return False

    def supervise(self) -> None:
        """One round: note each child that exited (its restart is due after the backoff), and
        start again those whose wait is over; retired children are reaped, not restarted."""
        now = self.clock()
        for name, p in list(self.procs):
            child = self._children[name]
            if child.retire_by is not None:
                self._reap(name, p, child, now)
        for i, (name, p) in enumerate(self.procs):
            child = self._children[name]
            if child.retire_by is not None:
                continue
            if child.restart_at is None and p.poll() is not None:
                ran = now - child.started
                wait, child.exits_in_a_row = self.backoff.next(ran, child.exits_in_a_row)
                child.restart_at = now + wait
                log.warning(
                    "%s exited with %s after %.1f s: restarting it in %.1f s",
                    name,
                    describe_exit(p.returncode),
                    ran,
                    wait,
                )
            elif child.restart_at is not None and now >= child.restart_at:
                self.procs[i] = (name, self._restart(name, child, now))
                if self.on_restart is not None:
                    self.on_restart(name, p.returncode)

    def _restart(self, name: str, child: _Child, now: float) -> subprocess.Popen:
        # Signals wait until the child is recorded: a Ctrl-C here must not leave one unstopped.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            proc = _popen(child.args, child.env, child.log_path, child.cpus)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.started, child.restart_at = now, None
        log.warning("%s restarted (pid %d)", name, proc.pid)
        return proc


def describe_exit(code: int) -> str:
    """``code 1``, or ``signal SIGKILL`` for a child that a signal ended (Popen's negative codes)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


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
    return python_module("baton.cli")
