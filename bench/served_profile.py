"""``baton bench served-profile``: a layout's served profile, calibrated through the real layout.

    baton bench served-profile --profile P.json --layout L --output Q.json [-- baton up flags]

It starts ``baton up --layout L``, replays the calibration trace (``planner/served.py``: prompts
alone, batches of 1-16 streams, prompts during a batch's decoding, a steady Poisson stream; about
a minute and a half) with ``bench serve``'s trace replay, fits the served path's four factors by
simulating the same trace, and writes ``P`` with them folded in (``served`` says which layout, the
factors, the fit's error against the engine profile's, and every calibration request as sent and
measured). Meanwhile it measures the host's CPU a streamed token (``host_ms``): what the gateway,
Redis and this process (the client) spent over the replay, less what they spend idle (``IDLE_S``
before it), over the tokens streamed. ``baton simulate``, ``plan`` and ``bench fidelity`` read the
result like any profile; it holds for the layout it was taken on.
``--refit S.json`` fits again on the calibration ``S`` recorded (a changed model, no new run), with
the host cost ``S`` measured or ``--host-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path

from baton.bench import proc_stats
from baton.bench.breakdown import start_cluster, stop_cluster
from baton.bench.serve import BenchConfig, run_benchmark
from baton.planner.layout import parse_layout
from baton.planner.profile import Profile
from baton.planner.served import calibration_trace, fit_served, served_profile

SEED = 0x5E4
"""Prompt ids of the calibration's own (no prefix shared with a later run's prompts)."""
IDLE_S = 3.0
"""Seconds the host's processes are sampled idle before the replay."""
HOST_ROLES = ("gateway", "redis")
"""``baton up``'s processes that are not workers: their CPU (and the client's) is the host's."""


def measure(base_url: str, rows: list[tuple[float, int, int]]) -> tuple[list, list, dict]:
    """Replay ``rows``; each request's TTFT and TPOT in ms (None where it failed or had one output
    token), and the raw result."""
    measured = asyncio.run(
        run_benchmark(BenchConfig(base_url, trace=rows, seed=SEED, progress=False, timeout_s=600.0))
    )
    ttft, tpot = [], []
    for t, p, out, e in zip(
        measured["ttfts"], measured["tpots"], measured["output_lens"], measured["errors"]
    ):
        ttft.append(None if e else t * 1000.0)
        tpot.append(None if e or out <= 1 else p * 1000.0)
    return ttft, tpot, measured


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "served-profile",
        help="a layout's served profile: the engine profile calibrated through baton up --layout",
    )
    p.add_argument("--profile", required=True, help="the `baton profile` JSON of the layout's workers")
    p.add_argument("--layout", required=True, help="colocated[:N] or <N>p<M>d, as baton up --layout")
    p.add_argument("--output", required=True, help="where the served profile is written")
    p.add_argument(
        "--refit",
        default=None,
        metavar="SERVED.json",
        help="fit again on the calibration this served profile recorded (no cluster started)",
    )
    p.add_argument(
        "--host-ms",
        type=float,
        default=None,
        help="the host's CPU ms a streamed token, instead of the one measured (or recorded)",
    )
    p.add_argument("up_args", nargs=argparse.REMAINDER, help="-- then further flags for baton up")
    p.set_defaults(func=cmd_served_profile)


def cmd_served_profile(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(a.profile)
        layout = parse_layout(a.layout)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton bench served-profile: {e}", file=sys.stderr)
        return 2
    if profile.served:
        print("error: baton bench served-profile: --profile is a served profile already", file=sys.stderr)
        return 2
    up_args = tuple(x for x in a.up_args if x != "--")
    if a.refit:
        try:
            recorded = Profile.load(a.refit).served
            cal = recorded["calibration"]
            rows, ttft, tpot = [tuple(r) for r in cal["rows"]], cal["ttft_ms"], cal["tpot_ms"]
            up_args = tuple(recorded.get("up_args", ()))
            host = recorded.get("host", {})
        except (OSError, ValueError, KeyError) as e:
            print(f"error: baton bench served-profile: --refit {a.refit}: {e}", file=sys.stderr)
            return 2
    else:
        rows = calibration_trace(profile, layout)
        print(f"{layout}: {len(rows)} calibration requests over {rows[-1][0]:.0f} s", flush=True)
        with tempfile.TemporaryDirectory(prefix="baton-served-") as logs:
            proc, port = start_cluster(("--layout", a.layout, *up_args), Path(logs), 900.0)
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
            try:
                pids = {n: p for n, p in proc_stats.cluster_pids(proc.pid).items() if n in HOST_ROLES}
                idle = host_cpu_s(pids, lambda: time.sleep(IDLE_S))[0]
                busy, (ttft, tpot, raw) = host_cpu_s(pids, lambda: measure(f"http://127.0.0.1:{port}", rows))
            finally:
                stop_cluster(proc)
        if raw["failed"]:
            print(f"error: {raw['failed']} calibration requests failed: {raw['errors']}", file=sys.stderr)
            return 1
        host = host_cost(idle, busy, sum(raw["output_lens"]))
    host_ms = a.host_ms if a.host_ms is not None else host.get("host_ms", 0.0)
    fit = fit_served(profile, layout, rows, ttft, tpot, host_ms=host_ms)
    out = served_profile(profile, fit.prefill_scale, fit.step_ms, fit.stream_ms, fit.mixed_scale, fit.host_ms)
    out = dataclasses.replace(
        out,
        served={
            **dataclasses.asdict(fit),
            "engine_profile_taken_at": profile.taken_at,
            "up_args": list(up_args),
            "host": host,
            "calibration": {"rows": rows, "ttft_ms": ttft, "tpot_ms": tpot},
        },
    )
    out.save(a.output)
    print(
        f"{layout}: prefill x{fit.prefill_scale:.2f} (x{fit.mixed_scale:.2f} more beside decodes), "
        f"decode +{fit.step_ms:.1f} ms a step and "
        f"+{fit.stream_ms:.1f} ms a streamed token; the host {fit.host_ms:.2f} ms a streamed token "
        f"({fit.host_share:.0%} of the {host_ms:.2f} measured); "
        f"log error {fit.error:.3f} (engine profile alone {fit.engine_error:.3f}); wrote {a.output}"
    )
    return 0


def host_cpu_s(pids: dict[str, int], work):
    """``((CPU seconds of the processes ``pids`` and of this one, wall seconds), work())`` over
    ``work()``."""
    before = {n: proc_stats.sample(p) for n, p in pids.items()}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = work()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    after = {n: proc_stats.sample(p) for n, p in pids.items()}
    used = sum(u["cpu_s"] for u in proc_stats.usage(before, after, wall1 - wall0).values())
    return (used + cpu1 - cpu0, wall1 - wall0), result


def host_cost(idle: tuple[float, float], busy: tuple[float, float], tokens: int) -> dict:
    """The host's CPU ms a streamed token: the replay's CPU (``busy``: seconds used, wall seconds)
    less the idle rate's (``idle``) over as long, over the ``tokens`` streamed."""
    idle_rate = idle[0] / idle[1] if idle[1] > 0 else 0.0
    extra = max(0.0, busy[0] - idle_rate * busy[1])
    return {
        "cpu_s": busy[0],
        "wall_s": busy[1],
        "idle_cpu_per_s": idle_rate,
        "tokens": tokens,
        "host_ms": 1e3 * extra / tokens if tokens else 0.0,
    }
