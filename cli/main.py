"""The ``baton`` command: one front for every entry point. Each subcommand is declared by the
module it runs (``register(subparsers)``); this one only assembles them.

baton build-kernels [--cache-dir DIR]       # compile the CPU kernels ahead of serving
baton generate --prompt TEXT [--chat] [--max-tokens N] [--temperature T] [--json]
baton bench offline --num-prompts 64 --input-len 256 --output-len 128 --seed 0
baton bench latency --input-len 32 --output-len 512
baton bench transfer --tokens 1024,4096,16384 --output-json w5.json
baton bench breakdown --runs 3 -- --colocated    # where a served token's time goes
baton bench goodput --base-url http://127.0.0.1:8000 --rates 0.25,0.5,1   # W2 goodput: a rate search
baton bench serve --base-url http://127.0.0.1:8000 --workload w2 --request-rate 1 --goodput ttft:1500 tpot:60
baton profile --output P.json [--quick] | --check P.json    # this machine's costs, for the planner
baton plan --profile P.json --rate 20 --slo ttft:2000 tpot:100 --max-workers 16 --json > plan.json
baton up --plan plan.json | --layout 2p3d | --layout colocated:2   # a layout baton plan/simulate named
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import sys

from baton.bench import cli as bench_cli
from baton.cli import tools
from baton.planner.cli import add_simulate_parser
from baton.planner.plan_cli import add_plan_parser
from baton.services import up_cli
from baton.services.autoscaler import add_autoscaler_parser
from baton.services.decode import cli as decode_cli
from baton.services.gateway import cli as gateway_cli
from baton.services.prefill import cli as prefill_cli

REGISTRATIONS = (
    add_simulate_parser,  # baton simulate (planner/cli.py)
    add_plan_parser,  # baton plan (planner/plan_cli.py)
    add_autoscaler_parser,  # baton autoscaler (services/autoscaler.py)
    tools.register,  # generate, quantize, build-kernels, secrets (cli/tools.py)
    up_cli.register,  # baton up (services/up_cli.py)
    decode_cli.register,  # baton decode (services/decode/cli.py)
    prefill_cli.register,  # baton prefill (services/prefill/cli.py)
    gateway_cli.register,  # baton gateway (services/gateway/cli.py)
    bench_cli.register,  # baton bench ..., baton profile (bench/cli.py)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton", description="LLM serving with disaggregated prefill and decode"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRATIONS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A crash in native code (UCX, a kernel) prints every thread's Python stack to stderr first.
    with contextlib.suppress(io.UnsupportedOperation):  # stderr without a descriptor (a test's capture)
        faulthandler.enable()
    a = build_parser().parse_args(argv)
    if (code := _bad_gpu_memory_utilization(a)) is not None:
        return code
    return a.func(a)


def _bad_gpu_memory_utilization(a: argparse.Namespace) -> int | None:
    """2 (after saying why) for ``--gpu-memory-utilization`` out of (0, 1] or off a GPU, before
    ``baton up`` starts workers that would each refuse it."""
    if getattr(a, "gpu_memory_utilization", None) is None:
        return None
    from baton.common.engine.kv_budget import check_gpu_memory_utilization

    try:
        check_gpu_memory_utilization(a.gpu_memory_utilization, a.device, a.data_parallel_size)
    except ValueError as e:
        print(f"error: --gpu-memory-utilization: {e}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
