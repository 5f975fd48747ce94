"""``baton bench served-profile``: a layout's served profile, calibrated through the real layout.

    baton bench served-profile --profile P.json --layout L --output Q.json [-- baton up flags]

It starts ``baton up --layout L``, replays the calibration trace (``planner/served.py``: prompts
alone, batches of 1-16 streams, prompts during a batch's decoding, a steady Poisson stream; about
a minute and a half) with ``bench serve``'s trace replay, fits the served path's four factors by
simulating the same trace, and writes ``P`` with them folded in (``served`` says which layout, the
factors, the fit's error against the engine profile's, and every calibration request as sent and
measured). ``baton simulate``, ``plan`` and ``bench fidelity`` read the result like any profile; it
holds for the layout it was taken on.
``--refit S.json`` fits again on the calibration ``S`` recorded (a changed model, no new run).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import threading
from pathlib import Path

from baton.bench.breakdown import start_cluster, stop_cluster
from baton.bench.serve import BenchConfig, run_benchmark
from baton.planner.layout import parse_layout
from baton.planner.profile import Profile
from baton.planner.served import calibration_trace, fit_served, served_profile

SEED = 0x5E4
"""Prompt ids of the calibration's own (no prefix shared with a later run's prompts)."""


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
                ttft, tpot, raw = measure(f"http://127.0.0.1:{port}", rows)
            finally:
                stop_cluster(proc)
        if raw["failed"]:
            print(f"error: {raw['failed']} calibration requests failed: {raw['errors']}", file=sys.stderr)
            return 1
    fit = fit_served(profile, layout, rows, ttft, tpot)
    out = served_profile(profile, fit.prefill_scale, fit.step_ms, fit.stream_ms, fit.mixed_scale)
    out = dataclasses.replace(
        out,
        served={
            **dataclasses.asdict(fit),
            "engine_profile_taken_at": profile.taken_at,
            "up_args": list(up_args),
            "calibration": {"rows": rows, "ttft_ms": ttft, "tpot_ms": tpot},
        },
    )
    out.save(a.output)
    print(
        f"{layout}: prefill x{fit.prefill_scale:.2f} (x{fit.mixed_scale:.2f} more beside decodes), "
        f"decode +{fit.step_ms:.1f} ms a step and "
        f"+{fit.stream_ms:.1f} ms a streamed token; "
        f"log error {fit.error:.3f} (engine profile alone {fit.engine_error:.3f}); wrote {a.output}"
    )
    return 0
