"""What ``baton profile`` measures and how it judges a measurement (pure: no torch, no engine).

The grids (the default, ``--quick``, and ``--check``'s reduced one cut from a stored profile's own
points), the relative-error fits of the measured points, each fit's error at its points, and the
check's decision: which models drifted past the tolerance, and whether the engine flags name the
stored profile's engine at all.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from baton.bench.profile_engine import DecodePoint, PrefillPoint
from baton.planner.profile import EngineShape, Linear, Profile, fit

TOLERANCE = 0.10
"""``--check`` fails past this drift of any model (the issue's 10%)."""
CHECK_ROUNDS = 3
"""``--check`` measures again while a model is past the tolerance, up to this many times in all, and
judges each model by its least drift (a single run's transfers moved 12% from run to run here)."""


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
    warm_engine: bool = True
    """Run ``LLMEngine.warm_up`` (every padded step shape) first; the untimed first round of each
    point warms its own shape either way."""


def grid_plan(quick: bool) -> Plan:
    """The default grid (<= 10 minutes on 2 cores: 460 s on an AVX2-only Zen 3, the slowest kind
    here, with ``LONG_STEP_MS``), or ``--quick``'s (about a minute on one thread)."""
    if quick:
        tokens, priors, packed = (16, 64, 256), (0, 256), ()
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
        prefill_repeats=3,
        decode=tuple(DecodePoint(b, c) for b in batches for c in contexts),
        decode_steps=3 if quick else 5,
        decode_warmup=1 if quick else 2,
        transfer_tokens=(256, 2048) if quick else (256, 1024, 4096, 8192),
        transports=("ucx", "gloo"),
        transfer_repeats=2 if quick else 15,
        gateway_requests=10 if quick else 40,
        warm_engine=not quick,
    )


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


# -- fit quality and the check -------------------------------------------------------------------
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


FLAG_FIELDS = (
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
)
"""Engine-shape fields the flags give as they are stored (the dtype unless ``auto``)."""


def flag_mismatch(stored: EngineShape, engine_kwargs: dict) -> list[str]:
    """Where the flags already name another engine than the stored one, before loading any."""
    now = {f: engine_kwargs[f] for f in FLAG_FIELDS if f in engine_kwargs}
    if now.get("dtype") == "auto":
        del now["dtype"]
    return [
        f"{k}: stored {getattr(stored, k)!r}, now {v!r}" for k, v in now.items() if getattr(stored, k) != v
    ]


def failing(drifts: dict[str, float], tolerance: float = TOLERANCE) -> list[str]:
    """The models whose drift exceeds ``tolerance``, in name order: ``--check`` fails on any."""
    return sorted(name for name, d in drifts.items() if d > tolerance)


def least_drift(first: dict[str, float], again: dict[str, float]) -> dict[str, float]:
    """Each model's smaller drift of two measurements: noise (a busy neighbour, a slow transfer)
    lifts one run's drift and not the next, where a machine that changed drifts in both."""
    return {name: min(d, again.get(name, d)) for name, d in first.items()}


def _spread(values: set[float]) -> set[float]:
    """The smallest, the middle and the largest."""
    ordered = sorted(values)
    return {ordered[0], ordered[len(ordered) // 2], ordered[-1]} if ordered else set()


def reduced_plan(stored: Profile, quick: bool = True) -> tuple[Plan, Profile]:
    """The check's grid: of the stored single-prompt prefill points (the costly ones), those at the
    smallest, middle and largest token counts and the smallest and largest priors; every stored
    decode point and transfer count (cheap, and a fit of a few decode corners moves past 10% from
    run to run on its own). Returns it with the stored profile cut to those points (where drift is
    read)."""
    pts = stored.points
    single = [dict(p) for p in pts.get("prefill", []) if p.get("pieces", 1) == 1]
    for p in single:
        p.setdefault("prior", (p["pairs"] - p["tokens"] * (p["tokens"] + 1) / 2) / p["tokens"])
    tokens, priors = _spread({p["tokens"] for p in single}), {p["prior"] for p in single}
    priors = {min(priors), max(priors)} if priors else set()
    prefill = [p for p in single if p["tokens"] in tokens and p["prior"] in priors]
    decode = [dict(p) for p in pts.get("decode", [])]
    for p in decode:
        p.setdefault("context_per_seq", round(p["context"] / p["batch"]))
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


def format_drift(drifts: dict[str, float], tolerance: float, ratios: dict[str, float] | None = None) -> str:
    """One line a model: its drift, the verdict and, where ``ratios`` has it, the measured time as
    a multiple of the stored (above 1x: slower now)."""
    ratios = ratios or {}
    return "\n".join(
        f"{name:<16} drift {d:7.1%}  {'FAIL' if d > tolerance else 'ok'} (tolerance {tolerance:.0%})"
        + (f"  time now {ratios[name]:.2f}x the profile's" if name in ratios else "")
        for name, d in sorted(drifts.items())
    )
