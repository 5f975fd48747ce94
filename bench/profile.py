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

``--check`` re-measures a reduced grid at the stored profile's own points, prints each model's drift
(``planner.profile.drift``) and exits 1 when any exceeds ``--tolerance``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from baton.bench.profile_engine import DecodePoint, PrefillPoint
from baton.planner.profile import EngineShape, Linear, Machine, Profile, drift, fit

TOLERANCE = 0.10
GATEWAY_PROMPT = "The quick brown fox jumps over the lazy dog. " * 24
"""About 250 tokens of text, tokenized and hashed by the gateway like a client's prompt."""


@dataclass(frozen=True)
class Plan:
    """What one run measures (before the engine's limits drop the points that cannot run)."""

    prefill: tuple[PrefillPoint, ...]
    chunked: bool
    """Also run one prompt of 2.5 chunks and keep each of its steps."""
    prefill_repeats: int
    decode: tuple[DecodePoint, ...]
    decode_steps: int
    decode_warmup: int
    transfer_tokens: tuple[int, ...]
    transports: tuple[str, ...]
    transfer_repeats: int
    gateway_requests: int


def grid_plan(quick: bool) -> Plan:
    """The default grid (<= 10 minutes on 2 cores), or ``--quick``'s (well under a minute)."""
    if quick:
        tokens, priors, packed = (32, 256, 1024), (0, 1024), ()
        batches, contexts = (1, 8, 32), (128, 1024)
    else:
        tokens, priors = (16, 64, 256, 512, 1024, 1536, 2048), (0, 512, 2048, 4096)
        packed = ((4, 256), (8, 128), (16, 64))
        batches, contexts = (1, 4, 16, 64, 128, 256), (128, 512, 2048, 4096)
    prefill = [PrefillPoint(1, t, p) for p in priors for t in tokens]
    prefill += [PrefillPoint(n, t, p) for n, t in packed for p in priors[:2]]
    return Plan(
        prefill=tuple(prefill),
        chunked=not quick,
        prefill_repeats=2 if quick else 3,
        decode=tuple(DecodePoint(b, c) for b in batches for c in contexts),
        decode_steps=3 if quick else 5,
        decode_warmup=1 if quick else 2,
        transfer_tokens=(256, 2048) if quick else (256, 1024, 4096, 8192),
        transports=("ucx", "gloo"),
        transfer_repeats=2 if quick else 5,
        gateway_requests=10 if quick else 40,
    )


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


def fit_points(points: dict[str, list[dict[str, float]]]) -> tuple[Linear, Linear, dict[str, Linear]]:
    """The prefill, decode and per-transport models, least squares of the relative error over the
    points (their times span milliseconds to seconds: a plain fit would serve the large ones only)."""

    def cols(name: str, x: str, y: str | None) -> tuple[list, ...]:
        pts = points[name]
        ms = [p["ms"] for p in pts]
        return [p[x] for p in pts], [p[y] if y else 0.0 for p in pts], ms, [1 / max(m, 1e-6) for m in ms]

    prefill = fit(*cols("prefill", "tokens", "pairs"))
    decode = fit(*cols("decode", "batch", "context"))
    transfer = {
        name.removeprefix("transfer."): fit(*cols(name, "tokens", None))
        for name in points
        if name.startswith("transfer.")
    }
    return prefill, decode, transfer


def run_profile(
    plan: Plan,
    engine_kwargs: dict,
    seed: int = 0,
    expect: EngineShape | None = None,
    log: Callable[[str], None] = print,
) -> Profile:
    """Measure ``plan`` with an engine of ``engine_kwargs``, fit, and return the profile. With
    ``expect``, raise ``ShapeMismatch`` before measuring when the engine's shape differs from it."""
    from baton.common.engine.llm_engine import EngineConfig, LLMEngine

    started = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(**engine_kwargs))
    shape, where = engine_shape(engine), machine(engine)
    if expect is not None and (diff := shape_mismatch(expect, shape)):
        raise ShapeMismatch(diff)
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


# -- fit quality and the check ---------------------------------------------------------------------
def fit_errors(profile: Profile) -> dict[str, float]:
    """Model -> the median relative error of its fit at its own points."""
    pts, out = profile.points, {}

    def median_error(pairs: list[tuple[float, float]]) -> float:
        return statistics.median(abs(pred - ms) / ms for pred, ms in pairs) if pairs else 0.0

    out["prefill"] = median_error(
        [(profile.prefill(p["tokens"], p["pairs"]), p["ms"]) for p in pts["prefill"]]
    )
    out["decode"] = median_error([(profile.decode(p["batch"], p["context"]), p["ms"]) for p in pts["decode"]])
    for name, model in profile.transfer.items():
        out[f"transfer.{name}"] = median_error(
            [(model(p["tokens"]), p["ms"]) for p in pts[f"transfer.{name}"]]
        )
    return out


class ShapeMismatch(ValueError):
    """The engine flags give another engine than the stored profile's."""


def shape_mismatch(stored: EngineShape, now: EngineShape) -> list[str]:
    """The fields (but the KV capacity, which only sizes) where the two engines differ."""
    return [
        f"{f.name}: stored {getattr(stored, f.name)!r}, now {getattr(now, f.name)!r}"
        for f in dataclasses.fields(EngineShape)
        if f.name != "kv_capacity_tokens" and getattr(stored, f.name) != getattr(now, f.name)
    ]


def failing(drifts: dict[str, float], tolerance: float = TOLERANCE) -> list[str]:
    """The models whose drift exceeds ``tolerance``, in name order: ``--check`` fails on any."""
    return sorted(name for name, d in drifts.items() if d > tolerance)


def _spread(values: set[float]) -> set[float]:
    """The smallest, the middle and the largest."""
    ordered = sorted(values)
    return {ordered[0], ordered[len(ordered) // 2], ordered[-1]} if ordered else set()


def reduced_plan(stored: Profile, quick: bool = True) -> tuple[Plan, Profile]:
    """The check's grid: of the stored single-prompt prefill points, those at the smallest, middle
    and largest token counts and the smallest and largest priors; of the decode points, those at
    the smallest, middle and largest batch and the shortest and longest context; every stored
    transfer count. Returns it with the stored profile cut to those points (where drift is read)."""
    pts = stored.points
    single = [p for p in pts.get("prefill", []) if p.get("pieces", 1) == 1]
    for p in single:
        p.setdefault("prior", (p["pairs"] - p["tokens"] * (p["tokens"] + 1) / 2) / p["tokens"])
    tokens, priors = _spread({p["tokens"] for p in single}), {p["prior"] for p in single}
    priors = {min(priors), max(priors)} if priors else set()
    prefill = [p for p in single if p["tokens"] in tokens and p["prior"] in priors]
    dec = pts.get("decode", [])
    for p in dec:
        p.setdefault("context_per_seq", round(p["context"] / p["batch"]))
    batches, ctx = _spread({p["batch"] for p in dec}), {p["context_per_seq"] for p in dec}
    ctx = {min(ctx), max(ctx)} if ctx else set()
    decode = [p for p in dec if p["batch"] in batches and p["context_per_seq"] in ctx]
    transports = tuple(t for t in ("ucx", "gloo") if f"transfer.{t}" in pts)
    counts = sorted({int(p["tokens"]) for t in transports for p in pts[f"transfer.{t}"]})
    base = grid_plan(quick)
    plan = dataclasses.replace(
        base,
        prefill=tuple(PrefillPoint(1, int(p["tokens"]), int(p["prior"])) for p in prefill),
        chunked=False,
        decode=tuple(DecodePoint(int(p["batch"]), int(p["context_per_seq"])) for p in decode),
        transfer_tokens=tuple(counts),
        transports=transports,
        gateway_requests=base.gateway_requests if stored.gateway_ms > 0 else 0,
    )
    cut = {"prefill": prefill, "decode": decode} | {f"transfer.{t}": pts[f"transfer.{t}"] for t in transports}
    return plan, dataclasses.replace(stored, points=cut)


def format_drift(drifts: dict[str, float], tolerance: float) -> str:
    return "\n".join(
        f"{name:<16} drift {d:7.1%}  {'FAIL' if d > tolerance else 'ok'} (tolerance {tolerance:.0%})"
        for name, d in sorted(drifts.items())
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
def register(subparsers, engine_args: Callable, engine_kwargs: Callable) -> None:
    """``baton profile``, with ``baton generate``'s engine flags (``engine_args`` declares them on a
    parser, ``engine_kwargs`` turns the parsed flags into ``EngineConfig`` fields)."""
    p = subparsers.add_parser("profile", help="measure this machine's costs for the simulator and planner")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--output", metavar="P.json", help="measure, fit and write the profile here")
    what.add_argument(
        "--check", metavar="P.json", help="re-measure at this profile's points; exit 1 past --tolerance"
    )
    p.add_argument("--quick", action="store_true", help="a small grid (tests; well under a minute)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="--check's bound on each model's drift")
    p.add_argument("--seed", type=int, default=0)
    engine_args(p)
    p.set_defaults(func=lambda a: cmd_profile(a, engine_kwargs(a)))


def cmd_profile(a: argparse.Namespace, engine_kwargs: dict) -> int:
    if engine_kwargs.get("data_parallel_size", 1) > 1:
        print("error: profile one engine (--data-parallel-size 1); replicas scale it", file=sys.stderr)
        return 2
    log = lambda line: print(line, flush=True)  # noqa: E731
    started = time.perf_counter()
    if a.output:
        profile = run_profile(grid_plan(a.quick), engine_kwargs, a.seed, log=log)
        profile.save(a.output)
        print(format_profile(profile))
        print(f"wrote {a.output} in {time.perf_counter() - started:.0f} s")
        return 0
    try:
        stored = Profile.load(a.check)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: --check {a.check}: {e}", file=sys.stderr)
        return 2
    plan, at_points = reduced_plan(stored, a.quick)
    try:
        measured = run_profile(plan, engine_kwargs, a.seed, expect=stored.engine, log=log)
    except ShapeMismatch as e:
        print(
            f"error: these engine flags are not the profile's engine: {'; '.join(e.args[0])}", file=sys.stderr
        )
        return 2
    drifts = drift(at_points, measured)
    print(format_drift(drifts, a.tolerance))
    bad = failing(drifts, a.tolerance)
    took = f"{time.perf_counter() - started:.0f} s"
    if bad:
        print(f"drifted past {a.tolerance:.0%}: {', '.join(bad)} ({took})")
        return 1
    print(f"within {a.tolerance:.0%} of {a.check} ({took})")
    return 0
