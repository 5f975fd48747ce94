"""``baton profile``: measure this machine's costs for the simulator and the planner (issue 30).

    baton profile --output P.json [--quick] [engine flags]     # measure, fit, write the profile
    baton profile --check P.json [--tolerance 0.10] [engine flags]

What is measured, each the median of repeats after a warm-up (``bench/profile_engine.py`` for the
engine's half):

- prefill step ms over tokens in the step and prior context (prefix hits and a chunked prompt),
  fitted to ``a + b * tokens + c * attention pairs``;
- decode step ms over batch size x context length (a filled batch, steady steps), fitted to
  ``a + b * batch + c * context tokens``; with ``--speculative`` on, the engine's own proposals and
  verification are inside the timed steps (sampling is greedy; structured outputs are a request's
  option, not the engine's, and are not profiled);
- KV transfer ms over tokens between two real processes, per transport (``ucx``, and ``gloo``: the
  ``nccl`` transport on CPU caches), with ``baton bench transfer``'s peers; fitted to ``a + b * tokens``;
- the gateway's own ms per request: the real gateway in its own process against a synthetic decode
  worker that answers at once (``baton bench gateway``'s), time to the first streamed token.

Each model is fitted to its points by least squares of the relative error. ``--check`` re-measures
a reduced grid at the stored profile's own points, prints each model's drift
(``planner.profile.drift``) and exits 1 when any exceeds ``--tolerance``. The grids, fits and the
check's decision are ``bench/profile_plan.py`` (pure).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from baton.bench.profile_engine import PrefillPoint
from baton.bench.profile_plan import (
    CHECK_ROUNDS,
    TOLERANCE,
    Plan,
    ShapeMismatch,
    failing,
    fit_errors,
    fit_points,
    flag_mismatch,
    format_drift,
    grid_plan,
    least_drift,
    reduced_plan,
    shape_mismatch,
)
from baton.bench.transfer_peers import PeerError
from baton.common.engine import config_flags
from baton.planner.profile import EngineShape, Machine, Profile, drift, time_ratio

GATEWAY_PROMPT = "The quick brown fox jumps over the lazy dog. " * 24
"""About 250 tokens of text, tokenized and hashed by the gateway like a client's prompt."""


# -- the machine -----------------------------------------------------------------------------------
def cpu_name() -> str:
    """/proc/cpuinfo's model name, family and model, e.g. "AMD EPYC (family 25 model 17)"."""
    import platform

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


def kernel_level() -> str:
    """The kernel level this process runs: the forced or built portable one, else the best level
    the CPU's flags allow (what a native build's macros select)."""
    from baton.kernels import cpu_ops, isa

    level = cpu_ops.choose()
    if level == isa.NATIVE:
        best = isa.runnable(isa.cpu_flags())
        return best[0].name if best else isa.NATIVE
    return level


def machine(engine) -> Machine:
    import torch

    gpu = None
    if engine.config.device != "cpu":
        gpu = torch.cuda.get_device_name(torch.device(engine.config.device))
    return Machine(cpu=cpu_name(), isa=kernel_level(), cores=torch.get_num_threads(), gpu=gpu)


def engine_shape(engine) -> EngineShape:
    c = engine.config
    return EngineShape(
        model=engine.model_name,
        dtype=c.dtype,
        quantization=c.quantization,
        kv_cache_dtype=c.kv_cache_dtype,
        tensor_parallel_size=c.tensor_parallel_size,
        block_size=c.block_size,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        kv_capacity_tokens=engine.pool.num_blocks * c.block_size,
    )


# -- measuring -------------------------------------------------------------------------------------
def runnable_prefill(plan: Plan, engine) -> list[PrefillPoint]:
    """The plan's prefill points that fit one step and the context; priors on whole blocks (a
    prefix hit is whole blocks)."""
    c = engine.config
    out = []
    for p in plan.prefill:
        p = dataclasses.replace(p, prior=p.prior - p.prior % c.block_size)
        if (
            p.pieces * p.tokens <= c.max_num_batched_tokens
            and p.pieces <= c.max_num_seqs
            and p.prior + p.tokens + 1 < engine.max_model_len
        ):
            out.append(p)
    return list(dict.fromkeys(out))


def measure_engine(plan: Plan, engine, seed: int, log: Callable[[str], None]) -> dict[str, list]:
    from baton.bench.profile_engine import Prompts, fits, measure_decode, measure_prefill

    prompts = Prompts(seed, engine.model.config.vocab_size)
    started = time.perf_counter()
    chunk = engine.config.max_num_batched_tokens
    chunked = min(chunk * 5 // 2, engine.max_model_len - 2) if plan.chunked else 0
    prefill = measure_prefill(
        engine,
        runnable_prefill(plan, engine),
        chunked if chunked > chunk else 0,
        plan.prefill_repeats,
        prompts,
    )
    log(f"prefill: {len(prefill)} points in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    extra = plan.decode_warmup + plan.decode_steps + 2
    points = [p for p in plan.decode if fits(engine, p, extra)]
    decode = measure_decode(engine, points, plan.decode_steps, plan.decode_warmup, prompts)
    log(f"decode: {len(decode)} points in {time.perf_counter() - started:.0f} s")
    return {"prefill": prefill, "decode": decode}


def measure_transfer(plan: Plan, shape: EngineShape, model: str | None) -> dict[str, list]:
    """``transfer.<name>`` -> [{"tokens", "ms"}]: the KV of that many tokens between two processes."""
    from baton.bench.transfer import TransferBenchConfig, kv_geometry, measure_transfers

    links = {"ucx": "ucx", "gloo": "nccl"}  # the nccl transport is gloo between CPU caches
    config = TransferBenchConfig(
        tokens=plan.transfer_tokens,
        transports=tuple(links[t] for t in plan.transports),
        repeats=plan.transfer_repeats,
        block_size=shape.block_size,
        dtype=shape.dtype,
        kv_cache_dtype=shape.kv_cache_dtype,
        model=model,
        prefill=False,
    )
    geometry = kv_geometry(model, shape.block_size, shape.dtype, shape.kv_cache_dtype)
    sizes = measure_transfers(config, geometry)["sizes"]
    return {
        f"transfer.{name}": [
            {"tokens": s["tokens"], "ms": s["links"][links[name]]["seconds"] * 1e3} for s in sizes
        ]
        for name in plan.transports
    }


def measure_gateway(plan: Plan, model: str | None) -> float:
    from baton.bench.gateway import first_token_ms, synthetic_gateway

    with synthetic_gateway(model=model) as (base, _):
        return statistics.median(first_token_ms(base, GATEWAY_PROMPT, plan.gateway_requests))


def run_profile(
    plan: Plan,
    engine_kwargs: dict,
    seed: int = 0,
    expect: EngineShape | None = None,
    log: Callable[[str], None] = print,
) -> Profile:
    """Measure ``plan`` with an engine of ``engine_kwargs``, fit, and return the profile. With
    ``expect``, raise ``ShapeMismatch`` before measuring when the engine's shape differs from it."""
    from baton.common.llm import LLM

    started = time.perf_counter()
    engine = LLM(**engine_kwargs).engine  # the offline front's engine: one LLMEngine (no replicas)
    shape, where = engine_shape(engine), machine(engine)
    if expect is not None and (diff := shape_mismatch(expect, shape)):
        raise ShapeMismatch(diff)
    if plan.warm_engine:
        engine.warm_up()
    log(f"engine loaded and warm in {time.perf_counter() - started:.0f} s ({where.cores} threads)")
    points = measure_engine(plan, engine, seed, log)
    model = engine_kwargs.get("model")
    del engine  # its KV cache, before two more processes allocate theirs
    started = time.perf_counter()
    points |= measure_transfer(plan, shape, model)
    log(f"transfer: {', '.join(plan.transports)} in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    gateway_ms = measure_gateway(plan, model) if plan.gateway_requests else 0.0
    log(f"gateway: {plan.gateway_requests} requests in {time.perf_counter() - started:.0f} s")
    prefill, decode, transfer = fit_points(points)
    return Profile(
        machine=where,
        engine=shape,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        gateway_ms=gateway_ms,
        taken_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        points=points,
    )


def format_profile(profile: Profile) -> str:
    errors = fit_errors(profile)
    m = profile.machine
    lines = [f"{m.cpu}, kernels {m.isa}, {m.cores} threads; {profile.engine.model} {profile.engine.dtype}"]
    models = {"prefill": profile.prefill, "decode": profile.decode}
    models |= {f"transfer.{k}": v for k, v in profile.transfer.items()}
    for name, lin in models.items():
        n = len(profile.points.get(name, []))
        lines.append(
            f"{name:<16} ms = {lin.a:.4g} + {lin.b:.4g} x + {lin.c:.4g} y"
            f"   ({n} points, median fit error {errors[name]:.1%})"
        )
    lines.append(f"{'gateway':<16} {profile.gateway_ms:.2f} ms per request")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------
def register(subparsers) -> None:
    """``baton profile``, with ``baton generate``'s engine flags."""
    p = subparsers.add_parser("profile", help="measure this machine's costs for the simulator and planner")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--output", metavar="P.json", help="measure, fit and write the profile here")
    what.add_argument(
        "--check", metavar="P.json", help="re-measure at this profile's points; exit 1 past --tolerance"
    )
    p.add_argument("--quick", action="store_true", help="a small grid (tests; well under a minute)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="--check's bound on each model's drift")
    p.add_argument(
        "--rounds",
        type=int,
        default=CHECK_ROUNDS,
        help="--check measures again while a model is past the tolerance, this many times in all,"
        " and keeps each model's least drift",
    )
    p.add_argument("--seed", type=int, default=0)
    config_flags.add_engine_args(p)
    p.set_defaults(func=lambda a: cmd_profile(a, config_flags.engine_kwargs(a)))


def cmd_profile(a: argparse.Namespace, engine_kwargs: dict) -> int:
    if engine_kwargs.get("data_parallel_size", 1) > 1:
        print("error: profile one engine (--data-parallel-size 1); replicas scale it", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        code = _output(a, engine_kwargs) if a.output else _check(a, engine_kwargs)
    except ShapeMismatch as e:
        print(
            f"error: these engine flags are not the profile's engine: {'; '.join(e.args[0])}", file=sys.stderr
        )
        return 2
    except (PeerError, RuntimeError, TimeoutError, OSError) as e:  # a peer, the gateway, the output file
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"took {time.perf_counter() - started:.0f} s")
    return code


def _log(line: str) -> None:
    print(line, flush=True)


def _output(a: argparse.Namespace, engine_kwargs: dict) -> int:
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)  # fail now, not after the run
    Path(a.output).touch()
    profile = run_profile(grid_plan(a.quick), engine_kwargs, a.seed, log=_log)
    profile.save(a.output)
    print(format_profile(profile))
    print(f"wrote {a.output}")
    return 0


def _check(a: argparse.Namespace, engine_kwargs: dict) -> int:
    try:
        stored = Profile.load(a.check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --check {a.check}: {e}", file=sys.stderr)
        return 2
    if diff := flag_mismatch(stored.engine, engine_kwargs):
        raise ShapeMismatch(diff)
    plan, at_points = reduced_plan(stored, a.quick)
    drifts: dict[str, float] = {}
    ratios: dict[str, float] = {}
    rounds = max(1, a.rounds)
    for round_ in range(rounds):
        measured = run_profile(plan, engine_kwargs, a.seed, expect=stored.engine, log=_log)
        now = drift(at_points, measured)
        ratio = time_ratio(at_points, measured)
        # each model's ratio from the round its (least) drift came from
        ratios |= {k: v for k, v in ratio.items() if not drifts or now.get(k, 1.0) < drifts.get(k, 0.0)}
        drifts = least_drift(drifts, now) if drifts else now
        if not (bad := failing(drifts, a.tolerance)) or round_ + 1 == rounds:
            break
        _log(f"past {a.tolerance:.0%}: {', '.join(bad)}; measuring again (a drift that is real stays)")
    print(format_drift(drifts, a.tolerance, ratios))
    bad = failing(drifts, a.tolerance)
    if bad:
        print(f"drifted past {a.tolerance:.0%}: {', '.join(bad)}")
        return 1
    print(f"within {a.tolerance:.0%} of {a.check}")
    return 0
