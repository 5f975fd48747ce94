"""``baton bench autoscale``: issue 30's three autoscaler figures measured with EMULATED workers
(or, with ``--real``, with real workers computing on this machine's cores).

It starts ``baton up --emulate PROFILE --layout L --autoscale --profile PROFILE --slo ...`` on free
ports (real gateway, Redis, gRPC services and autoscaler; each engine step sleeps the profile's time,
``services/emulated.py``), waits for it to say it is ready, then sends a seeded Poisson load through
the gateway: ``--rate`` requests/s for ``--phase-a`` seconds, then twice that for ``--phase-b``
(``autoscale_figures.step_trace``; each request ``bench serve``'s kind, streamed, ``ignore_eos``).
Meanwhile it keeps every line ``baton up`` prints about autoscaling (its decisions with their
reasons, ``autoscale: started ...``, ``retiring ...``), stamped with the seconds since the load
began, and polls the gateway's ``/workers`` for the registered workers of each role.
At the end it stops ``baton up`` (which stops everything it started) and computes the figures
(``autoscale_figures.figures``): the decision delay after the step, reversals at constant load,
requests out of SLO after the step against ``(cold start + 10 s) x 2 x rate``. One JSON holds the
decisions, the log lines, the worker timeline, every request, the figures and the CPU (``lscpu``),
all labelled ``emulated`` (``real`` with ``--real``: ``baton up`` without ``--emulate``, the
profile then only the autoscaler's; new workers share the cores of the old here). Requests that
failed (a lost stream) are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from baton.bench.autoscale_figures import (
    Phases,
    RequestRecord,
    figures,
    parse_decision,
    step_trace,
)
from baton.bench.breakdown import start_cluster, stop_cluster
from baton.bench.serve_client import RequestResult, discover_model, send_request
from baton.bench.serve_workload import trace_requests, warm_up_request
from baton.planner.sim_result import parse_slo


@dataclass(frozen=True)
class AutoscaleBench:
    profile: str
    """The profile the workers emulate and the autoscaler decides with."""
    layout: str
    """The layout ``baton up`` starts with (``1p2d``, ``colocated:2``)."""
    rate: float
    """Requests/s of the constant phase; the step doubles it."""
    phase_a_s: float
    phase_b_s: float
    input_len: int
    output_len: int
    slo: tuple[float, float]
    """(TTFT, TPOT) SLOs in ms."""
    interval_s: float = 10.0
    cold_start_s: float = 30.0
    cooldown_s: float = 60.0
    settle_s: float = 0.0
    """Reversals of the constant phase are counted from this second of it."""
    seed: int = 0
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    up_args: tuple[str, ...] = ()
    """Further ``baton up`` flags (the pools' bounds: ``--autoscale-max-decode 6`` ...)."""
    emulated: bool = True
    """False: real workers (``baton up`` without ``--emulate``)."""


def up_command(b: AutoscaleBench) -> list[str]:
    """``baton up``'s flags (port and log folder are ``start_cluster``'s)."""
    ttft, tpot = b.slo
    args = ["--emulate", b.profile] if b.emulated else []
    args += ["--layout", b.layout, "--autoscale", "--profile", b.profile]
    args += ["--slo", f"ttft:{ttft:g}", f"tpot:{tpot:g}", "--autoscale-interval", f"{b.interval_s:g}"]
    args += ["--autoscale-cold-start", f"{b.cold_start_s:g}", "--autoscale-cooldown", f"{b.cooldown_s:g}"]
    return [*args, *b.up_args]


class UpLog(threading.Thread):
    """Reads ``baton up``'s output to its end (so that its pipe never fills), keeping the lines about
    autoscaling (the decisions, the workers started and retired) with the ``perf_counter`` at which
    each was read."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines = proc, []

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "autoscal" in line or "retired" in line or parse_decision(line, 0.0) is not None:
                self.lines.append((time.perf_counter(), line.rstrip("\n")))


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all this machine's CPUs since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(v) - v[3] - v[4], sum(v)


class WorkerPoll(threading.Thread):
    """Every ``every_s`` until ``stop`` is set: the gateway's registered workers by role, and the
    share of this machine's CPU time busy since the last poll (anyone's: emulated steps keep their
    time only while the cores keep up)."""

    def __init__(self, base: str, every_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.base, self.every_s, self.stop = base, every_s, threading.Event()
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.busy: list[tuple[float, float]] = []

    def run(self) -> None:
        last = cpu_jiffies()
        while not self.stop.wait(self.every_s):
            now = cpu_jiffies()
            if now[1] > last[1]:
                self.busy.append((time.perf_counter(), (now[0] - last[0]) / (now[1] - last[1])))
            last = now
            try:
                with urllib.request.urlopen(f"{self.base}/workers", timeout=5) as r:
                    workers = json.loads(r.read())["workers"]
            except (OSError, ValueError, KeyError):
                continue
            counts: dict[str, int] = {}
            for w in workers:
                counts[w["role"]] = counts.get(w["role"], 0) + 1
            self.samples.append((time.perf_counter(), counts))


async def send_load(base: str, rows: list[tuple[float, int, int]], seed: int, timeout_s: float):
    """One warm-up request, then each row's request at its second after ``t0`` (absolute times: a
    late send does not delay the rest). Returns ``t0`` (a ``perf_counter``) and the results in
    row order."""
    import httpx

    specs, _ = trace_requests(rows, seed)
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        model = await discover_model(client, base)
        warm = await send_request(client, url, model, warm_up_request(rows[0][1], seed), False)
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + rows[i][0] - time.perf_counter()))
            return await send_request(client, url, model, specs[i], False)

        results = await asyncio.gather(*(one(i) for i in range(len(rows))))
    return t0, list(results)


def records(t0: float, results: list[RequestResult]) -> list[RequestRecord]:
    return [
        RequestRecord(
            arrival_s=r.start - t0,
            ttft_ms=r.ttft * 1000.0 if r.success else 0.0,
            tpot_ms=r.tpot * 1000.0 if r.success else 0.0,
            output_len=r.output_len,
            error=r.error if not r.success else "",
        )
        for r in results
    ]


def cpu_kind() -> dict[str, str]:
    """``lscpu``'s model name, family, model and CPU count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    keys = ("Model name", "CPU family", "Model", "CPU(s)", "Hypervisor vendor")
    return {k: fields[k].strip() for k in keys if k in fields}


def run(b: AutoscaleBench, logs: Path) -> dict:
    """Start the cluster, send the load, stop the cluster; the JSON of the run."""
    rows = step_trace(b.rate, b.phase_a_s, b.phase_b_s, b.input_len, b.output_len, b.seed)
    proc, port = start_cluster(tuple(up_command(b)), logs, b.ready_timeout_s)
    base = f"http://127.0.0.1:{port}"
    log, poll = UpLog(proc), WorkerPoll(base)
    log.start()
    poll.start()
    try:
        t0, results = asyncio.run(send_load(base, rows, b.seed, b.request_timeout_s))
    finally:
        poll.stop.set()
        poll.join(timeout=10)
        stop_cluster(proc)
        log.join(timeout=30)
    return report(b, rows, t0, results, log.lines, poll)


def report(b: AutoscaleBench, rows, t0: float, results, lines, poll: WorkerPoll) -> dict:
    stamped = [(round(t - t0, 3), text) for t, text in lines]
    decisions = [d for t, text in stamped if (d := parse_decision(text, t)) is not None]
    requests = records(t0, results)
    phases = Phases(b.phase_a_s, b.phase_a_s + b.phase_b_s, 2 * b.rate, b.settle_s)
    figs = figures(decisions, requests, phases, b.slo, b.interval_s, b.cold_start_s)
    after = [d.text for d in decisions if d.t_s >= b.phase_a_s][:1]
    figs["first_decision_after_step"] = after[0] if after else None
    late = [r.arrival_s - row[0] for r, row in zip(requests, rows)]  # the client's own lag
    figs["client_late_s"] = {"mean": round(sum(late) / len(late), 4), "max": round(max(late), 4)}
    figs["failed_requests"] = sum(1 for r in requests if r.error)
    for name, lo, hi in (("constant", 0.0, b.phase_a_s), ("after_step", b.phase_a_s, phases.end_s)):
        busy = [x for t, x in poll.busy if lo <= t - t0 < hi]
        figs[f"cpu_busy_{name}"] = round(sum(busy) / len(busy), 3) if busy else None
    what = (
        "issue 30's autoscaler figures with EMULATED workers (baton up --emulate): every step's time is"
        " the profile's, the gateway, Redis, gRPC services and autoscaler are real"
        if b.emulated
        else "issue 30's autoscaler figures with REAL workers (baton up --autoscale): new workers share"
        " this machine's cores with the old"
    )
    return {
        "label": "emulated" if b.emulated else "real",
        "what": what,
        "settings": asdict(b),
        "up_command": ["baton", "up", *up_command(b)],
        "cpu": cpu_kind(),
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_requests": len(rows),
        "figures": figs,
        "decisions": [{"t_s": d.t_s, "pools": d.pools, "rate": d.rate, "text": d.text} for d in decisions],
        "autoscale_log": [{"t_s": t, "line": text} for t, text in stamped],
        "workers": _changes(t0, poll.samples),
        "cpu_busy": [[round(t - t0, 3), round(x, 3)] for t, x in poll.busy],
        "requests": [asdict(r) for r in requests],
    }


def _changes(t0: float, samples: list[tuple[float, dict[str, int]]]) -> list[dict]:
    """The registered workers by role, at the first poll and at each poll where they changed."""
    out: list[dict] = []
    for t, counts in samples:
        if not out or counts != out[-1]["registered"]:
            out.append({"t_s": round(t - t0, 3), "registered": counts})
    return out


def summary(result: dict) -> str:
    f, s = result["figures"], result["settings"]
    delay = f["decision_delay_s"]
    ok = {True: "met", False: "NOT met"}
    lines = [
        f"baton bench autoscale ({result['label'].upper()} workers, {s['profile']};"
        f" CPU {result['cpu'].get('Model name', '?')})",
        f"  load: {s['rate']:g} req/s for {s['phase_a_s']:g} s, then {2 * s['rate']:g} req/s for"
        f" {s['phase_b_s']:g} s; {s['input_len']} -> {s['output_len']} tokens; {result['num_requests']} requests",
        f"  1. first scale-up decision {'none' if delay is None else f'{delay:.1f} s'} after the step"
        f" (bar <= {f['decision_delay_bar_s']:g} s): {ok[f['decision_delay_met']]}; decision no."
        f" {f['decision_delay_nth']} after the step, which came {f['step_after_last_decision_s']} s after"
        " the decision before it",
        f"  2. reversals at constant load {f['reversals_constant_phase']} over {f['constant_phase_s']:g} s"
        f" = {f['reversals_per_10min']} per 10 min (bar <= 1): {ok[f['reversals_met']]};"
        f" whole run {f['reversals_whole_run']}",
        f"  3. out of SLO after the step {f['out_of_slo_after_step']} of {f['requests_after_step']}"
        f" (bar <= {f['out_of_slo_bar']:g}): {ok[f['out_of_slo_met']]}; before it {f['out_of_slo_before_step']};"
        f" failed (lost) requests {f['failed_requests']}",
        f"  machine CPU busy (anyone's): {f['cpu_busy_constant']} before the step, {f['cpu_busy_after_step']}"
        f" after; sends late by {f['client_late_s']['mean']:.3f} s on average, {f['client_late_s']['max']:.3f} s at most",
    ]
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------
def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "autoscale",
        help="issue 30's autoscaler figures with emulated workers (starts baton up --emulate --autoscale)",
    )
    p.add_argument("--profile", required=True, help="the profile the workers emulate and the autoscaler uses")
    p.add_argument("--real", action="store_true", help="real workers: baton up without --emulate")
    p.add_argument("--layout", default="1p3d", help="the layout baton up starts with")
    p.add_argument("--rate", type=float, default=5.0, help="requests/s before the step (after: twice this)")
    p.add_argument("--phase-a", type=float, default=600.0, help="seconds at the constant rate")
    p.add_argument("--phase-b", type=float, default=180.0, help="seconds at twice the rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--slo", nargs="+", default=["ttft:1500", "tpot:50"], metavar="ttft:MS|tpot:MS")
    p.add_argument("--interval", type=float, default=10.0, help="the autoscaler's interval, seconds")
    p.add_argument("--cold-start", type=float, default=30.0, help="the autoscaler's cold start, seconds")
    p.add_argument("--cooldown", type=float, default=60.0, help="the autoscaler's cooldown, seconds")
    p.add_argument("--settle", type=float, default=0.0, help="count constant-phase reversals from here, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--output-json", required=True)
    p.add_argument("--log-dir", default=None, help="keep each service's log here (default: deleted)")
    p.add_argument("up_args", nargs=argparse.REMAINDER, help="-- then further flags for baton up")
    p.set_defaults(func=cmd_autoscale)


def cmd_autoscale(a: argparse.Namespace) -> int:
    try:
        slo = parse_slo(a.slo)
        if a.rate <= 0 or a.phase_a <= 0 or a.phase_b <= 0 or not 0 <= a.settle < a.phase_a:
            raise ValueError("--rate, --phase-a and --phase-b must be positive, --settle in [0, --phase-a)")
    except ValueError as e:
        print(f"error: baton bench autoscale: {e}", file=sys.stderr)
        return 2
    b = AutoscaleBench(
        profile=str(Path(a.profile).resolve()),
        layout=a.layout,
        rate=a.rate,
        phase_a_s=a.phase_a,
        phase_b_s=a.phase_b,
        input_len=a.input_len,
        output_len=a.output_len,
        slo=(slo.ttft_ms, slo.tpot_ms),
        interval_s=a.interval,
        cold_start_s=a.cold_start,
        cooldown_s=a.cooldown,
        settle_s=a.settle,
        seed=a.seed,
        ready_timeout_s=a.ready_timeout,
        up_args=tuple(x for x in a.up_args if x != "--"),
        emulated=not a.real,
    )
    kept = contextlib.nullcontext(a.log_dir) if a.log_dir else None
    with kept or tempfile.TemporaryDirectory(prefix="baton-autoscale-") as logs:
        try:
            result = run(b, Path(logs))
        except (RuntimeError, OSError) as e:
            print(f"error: baton bench autoscale: {e}", file=sys.stderr)
            return 1
    with open(a.output_json, "w") as f:
        json.dump(result, f)
    print(summary(result))
    return 0
