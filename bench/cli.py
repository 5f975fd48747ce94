"""``baton bench ...`` and ``baton profile``: every benchmark's subcommand, each registered by its
own module; ``bench offline`` and ``bench latency`` (``bench/offline.py``) are declared here."""

from __future__ import annotations

import argparse
import json

from baton.common.engine.config_flags import add_engine_args, engine_kwargs


def register(subparsers) -> None:
    """``baton bench <name>`` for every benchmark, and ``baton profile``."""
    from baton.bench import (
        accuracy,
        autoscale_emulated,
        breakdown,
        decisions,
        fidelity,
        gateway,
        goodput,
        kv_step,
        profile,
        roofline,
        serve,
        served_profile,
        transfer,
    )

    bench = subparsers.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _register_offline(bench)
    for module in (
        serve,
        transfer,
        breakdown,
        goodput,
        gateway,
        kv_step,
        accuracy,
        roofline,
        fidelity,
        served_profile,
        decisions,
        autoscale_emulated,
    ):
        module.register(bench)
    profile.register(subparsers)


def _register_offline(bench) -> None:
    off = bench.add_parser("offline", help="W1: offline throughput of the engine")
    off.add_argument("--num-prompts", type=int, default=64)
    off.add_argument("--input-len", type=int, default=256)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--output-json", default=None)
    add_engine_args(off)
    off.set_defaults(func=cmd_bench_offline)
    lat = bench.add_parser("latency", help="batch-1 decode time per output token")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=512)
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--output-json", default=None)
    add_engine_args(lat)
    lat.set_defaults(func=cmd_bench_latency)


def _emit(result: dict, output_json: str | None) -> None:
    """Print a benchmark's JSON line, and write it to ``output_json`` when given."""
    line = json.dumps(result)
    print(line)
    if output_json:
        with open(output_json, "w") as f:
            f.write(line + "\n")


def cmd_bench_offline(a: argparse.Namespace) -> int:
    from baton.bench.offline import run_offline_bench

    result = run_offline_bench(
        num_prompts=a.num_prompts,
        input_len=a.input_len,
        output_len=a.output_len,
        seed=a.seed,
        engine_kwargs=engine_kwargs(a),
    )
    _emit(result, a.output_json)
    return 0


def cmd_bench_latency(a: argparse.Namespace) -> int:
    from baton.bench.offline import run_latency_bench

    result = run_latency_bench(a.input_len, a.output_len, a.seed, engine_kwargs(a))
    _emit(result, a.output_json)
    return 0
