"""How ``baton up`` lays a cluster out on this machine when its flags leave it open: prefill workers
or none, which cores each worker gets, and the compute dtype. Pure: the machine's figures come in
as a ``gemm_probe.GemmProbe`` (read as a dict), the decision and its reasons go out.

The rule, from W2 on the 2-core development machines (``docs/bench/journal.md``: "The served path
against the engine" and "W2: goodput under load"): a prefill worker of its own pays when the cores
it takes cost decoding little, so that the decode worker, never stalled by a prompt, keeps its TPOT. A prefill worker gets a quarter of the cores (at least one);
if the decode step on the remaining cores is at most ``MAX_DECODE_SLOWDOWN`` times slower than on
all of them, the cluster is disaggregated, otherwise one worker prefills and decodes on every core.
On a Xeon with AMX the decode step on 1 core took 2.1x its time on 2, and colocated serving met
the SLO at rates where 1 + 1 pinned workers did not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAX_DECODE_SLOWDOWN = 1.25
"""Decode on the cores a prefill worker leaves may be at most this much slower than on all."""


@dataclass(frozen=True)
class LayoutRequest:
    """What the flags of ``baton up`` fixed; None leaves it to the plan."""

    prefill: int | None = None
    decode: int | None = None
    colocated: bool = False
    cpus: str | None = None
    """``auto`` (the plan's split), ``none`` (no pinning), or ``|``-separated cpu lists."""
    dtype: str = "auto"


@dataclass(frozen=True)
class Layout:
    prefill: int
    decode: int
    cpus: str | None
    """``--cpus`` for ``split_cpus``: one cpu list per worker, prefill workers first; None: unpinned."""
    dtype: str
    reasons: tuple[str, ...]

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    def describe(self) -> str:
        return "; ".join(self.reasons)


def prefill_cores(num_cores: int) -> int:
    """Cores a prefill worker takes in an automatic disaggregated layout."""
    return max(1, num_cores // 4)


def probe_threads(num_cores: int) -> list[int]:
    """The decode thread counts the plan compares: all cores, and what a prefill worker leaves."""
    return sorted({num_cores, max(1, num_cores - prefill_cores(num_cores))})


def plan(cores: Sequence[int], req: LayoutRequest, probe: Mapping | None) -> Layout:
    """The layout for ``cores`` (the usable cpu ids) under ``req``; ``probe`` (a ``GemmProbe`` as a
    dict, measured with ``probe_threads``) is needed only for what ``req`` leaves open."""
    cores = sorted(cores)
    n = len(cores)
    reasons = [f"{n} core{'s' if n != 1 else ''}" + (f" ({probe['cpu']})" if probe else "")]
    dtype = req.dtype
    if dtype == "auto":
        if probe is None:
            raise ValueError("--dtype auto needs the machine's GEMM probe")
        dtype = probe["dtype"]
        if len(probe["request_ms"]) > 1:
            per = ", ".join(f"{d} {ms:.0f} ms" for d, ms in probe["request_ms"].items())
            reasons.append(f"{dtype} (the GEMMs of a W2-like request: {per})")
        elif dtype == "bfloat16":
            reasons.append(
                f"{dtype} (this CPU multiplies bf16 natively, or Baton's GEMM widens it into AVX2's fp32 FMAs)"
            )
        else:
            reasons.append(f"{dtype} (the only dtype this CPU multiplies natively)")
    decode = req.decode or 1
    if req.colocated:
        prefill, why = 0, "colocated (as asked: --colocated, --layout or --plan)"
    elif req.prefill is not None:
        prefill, why = (
            req.prefill,
            f"{req.prefill} prefill worker{'s' if req.prefill != 1 else ''} (as asked: --prefill, --layout or --plan)",
        )
    else:
        prefill, why = _auto_prefill(n, probe)
    reasons.append(why)
    cpus = req.cpus
    if cpus is None:
        cpus = "auto"
    if cpus == "none":
        cpus = None
    elif cpus == "auto":
        cpus = _auto_cpus(cores, prefill, decode)
    if cpus is not None:
        reasons.append(f"pinned: {cpus} (prefill workers first)")
    else:
        reasons.append("not pinned")
    return Layout(prefill, decode, cpus, dtype, tuple(reasons))


def _auto_prefill(n: int, probe: Mapping | None) -> tuple[int, str]:
    if n < 2:
        return 0, "colocated: one core has no room for a prefill worker"
    if probe is None:
        raise ValueError("an automatic layout needs the machine's GEMM probe")
    by_threads = probe["decode_step_ms_by_threads"]
    left = n - prefill_cores(n)
    slowdown = by_threads[str(left)] / by_threads[str(n)]
    cost = f"decoding on {left} core{'s' if left != 1 else ''} instead of {n} is {slowdown:.2f}x slower"
    if slowdown <= MAX_DECODE_SLOWDOWN:
        return (
            1,
            f"1 prefill worker on {prefill_cores(n)} of the cores: {cost} (at most {MAX_DECODE_SLOWDOWN}x)",
        )
    return 0, f"colocated: {cost} (more than {MAX_DECODE_SLOWDOWN}x), so a prefill worker does not pay"


def _auto_cpus(cores: list[int], prefill: int, decode: int) -> str | None:
    """Prefill workers share the first quarter of the cores (at least one each), decode workers
    the rest; one colocated worker is left on every core. More workers than cores: round-robin
    (``split_cpus``' ``auto``)."""
    from baton.services.procs import format_cpu_list, split_cpus

    if prefill == 0 and decode == 1:
        return None  # one worker on every core: nothing to separate
    if prefill + decode > len(cores):
        return "auto"
    front = min(len(cores) - decode, max(prefill, prefill_cores(len(cores)))) if prefill else 0
    lists = split_cpus("auto", prefill, cores[:front]) if prefill else []
    lists += split_cpus("auto", decode, cores[front:])
    return "|".join(format_cpu_list(c) for c in lists)


def fixed_layout(text: str) -> tuple[int, int, bool]:
    """``baton up --layout``: a layout as ``baton simulate`` and ``baton plan`` write it
    (``planner/layout.py``) as the flags it stands for: (``--prefill``, ``--decode``,
    ``--colocated``). ``colocated[:N]`` is N decode workers that prefill their own prompts, no
    prefill pool; ``<N>p<M>d`` is N prefill and M decode workers. Raises ``ValueError``."""
    from baton.planner.layout import parse_layout

    layout = parse_layout(text)
    return layout.prefill, layout.decode, layout.colocated


def plan_layout(plan_json: Mapping) -> tuple[str, int | None, str | None]:
    """``baton up --plan``: the layout and chunk (``max_num_batched_tokens``; None if it names
    none) a ``baton plan --json`` object chose, and a warning when that plan could not meet its
    rate (its layout is then the best at its budget, not enough)."""
    layout, chunk = plan_json.get("layout"), plan_json.get("chunk")
    if not isinstance(layout, str):
        raise ValueError("not a `baton plan --json` output: it names no layout")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"the plan's chunk {chunk!r} is not a positive number of tokens")
    if plan_json.get("met", True):
        return layout, chunk, None
    rate, best = plan_json.get("asked_rate_req_s"), plan_json.get("max_rate_req_s")
    return (
        layout,
        chunk,
        (
            f"warning: the plan's {layout} does not meet its rate ({rate} req/s; at most {best} req/s "
            "within its SLOs): it is the best layout within its budget"
        ),
    )
