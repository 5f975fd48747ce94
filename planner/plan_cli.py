"""``baton plan``'s arguments, handler and report (stdlib argparse: the planner stays pure).

``cli/main.py`` registers it with ``add_plan_parser(subparsers)``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from baton.planner.kustomize import overlay
from baton.planner.plan import DEFAULT_ATTAINMENT, Budget, Evaluation, Plan, fmt_ms, missed, plan
from baton.planner.profile import Profile
from baton.planner.sim_result import parse_slo
from baton.planner.simulate import REMOTE_PREFILL_THRESHOLD
from baton.planner.workload import Workload, load_trace, parse_lengths

DEFAULT_NUM_PROMPTS = 1000
"""Requests each candidate is simulated with (one seed for all)."""


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="the layout that meets a workload's SLOs with the fewest workers (simulated)",
        description="Search colocated:N and every <P>p<D>d within the budget (and the chunk sizes the "
        "profile measured) with `baton simulate`'s model; print the fewest workers meeting the rate at "
        "the attainment target, why the runners-up lost, and the closed-form baseline.",
    )
    p.add_argument("--profile", required=True, help="a profile JSON written by `baton profile`")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (a trace: its own)")
    p.add_argument("--input-len", default="256", help="prompt tokens: N, uniform:LO:HI or geometric:MEAN")
    p.add_argument("--output-len", default="128", help="output tokens: N, uniform:LO:HI or geometric:MEAN")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--cv", type=float, default=1.0, help="gaps' coefficient of variation (gamma)")
    p.add_argument("--trace", default=None, help="JSONL or CSV of timestamp,input_len,output_len to replay")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests a candidate is simulated with (default {DEFAULT_NUM_PROMPTS}; a trace: all rows)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", nargs="+", default=[], metavar="ttft:MS|tpot:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument(
        "--attainment", type=float, default=DEFAULT_ATTAINMENT, help="share of requests within both SLOs"
    )
    p.add_argument("--max-workers", type=int, default=None, help="workers in all (prefill + decode)")
    p.add_argument("--cores", type=int, default=None, help="CPU cores in all (a worker: the profile's)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (a worker: its tensor-parallel ranks)")
    p.add_argument("--transport", default=None, help="the profile's transfer model to use (default ucx)")
    p.add_argument("--remote-prefill-threshold", type=int, default=REMOTE_PREFILL_THRESHOLD)
    p.add_argument(
        "--kustomize", default=None, metavar="DIR", help="write a kustomize overlay of the plan here"
    )
    p.add_argument(
        "--kustomize-base",
        default=None,
        help="the overlay's base (default k8s/overlays/gpu for a GPU profile, else k8s/overlays/cpu, "
        "from the current folder)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)
    return p


def run_plan(a: argparse.Namespace) -> int:
    try:
        profile = Profile.load(a.profile)
        slo = parse_slo(a.slo)
        trace = load_trace(a.trace) if a.trace else None
        workload = Workload(
            rate=a.rate,
            num_prompts=a.num_prompts if a.num_prompts is not None else (0 if trace else DEFAULT_NUM_PROMPTS),
            input_len=parse_lengths(a.input_len),
            output_len=parse_lengths(a.output_len),
            arrival=a.arrival,
            cv=a.cv,
            trace=trace,
        )
        budget = Budget(a.max_workers, a.cores, a.gpus)
        result = plan(
            profile,
            workload,
            slo,
            budget,
            a.attainment,
            a.seed,
            transport=a.transport,
            remote_prefill_threshold=a.remote_prefill_threshold,
        )
        if a.kustomize:
            write_overlay(result, Path(a.kustomize), a.kustomize_base or _default_base(profile))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(finite(plan_json(result))) if a.json else format_plan(result))
    return 0


def _default_base(profile: Profile) -> str:
    return os.path.join("k8s", "overlays", "gpu" if profile.machine.gpu else "cpu")


def write_overlay(p: Plan, folder: Path, base: str) -> Path:
    """``folder/kustomization.yaml`` (JSON, which is YAML) setting the plan on ``base``."""
    if not (Path(base) / "kustomization.yaml").is_file():
        raise ValueError(f"--kustomize-base {base}: no kustomization.yaml there")
    folder.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(Path(base).resolve(), folder.resolve())
    b = p.baseline
    body = overlay(
        p.chosen.layout, rel, p.budget_workers, p.slo, b.prefill_tok_s, b.decode_batch, p.chosen.chunk
    )
    head = f"# baton plan: {p.chosen.layout} (chunk {p.chosen.chunk}); kubectl apply -k {folder}\n"
    path = folder / "kustomization.yaml"
    path.write_text(head + json.dumps(body, indent=2) + "\n")
    return path


def finite(v):
    """NaN and infinity as null, all the way down: strict JSON has neither."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v


def _eval_json(e: Evaluation) -> dict:
    r = e.result
    return {
        "layout": str(e.layout),
        "chunk": e.chunk,
        "workers": e.workers,
        "rate_req_s": e.rate,
        "slo_attainment": r.slo_attainment,
        "goodput_req_s": r.goodput_req_s,
        "goodput_per_worker": e.goodput_per_worker,
        "p90_ttft_ms": r.ttft_ms.p90,
        "p90_tpot_ms": r.tpot_ms.p90,
        "pool_utilisation": r.pool_utilisation,
    }


def plan_json(p: Plan) -> dict:
    """The plan as one JSON object: the choice's fields at the top (``layout``,
    ``slo_attainment``, ...), then the runners-up, the baseline and how the search went."""
    b = p.baseline
    return {
        **_eval_json(p.chosen),
        "met": p.met,
        "asked_rate_req_s": p.rate,
        "max_rate_req_s": p.max_rate,
        "attainment_target": p.target,
        "slo": {"ttft_ms": p.slo.ttft_ms, "tpot_ms": p.slo.tpot_ms},
        "budget_workers": p.budget_workers,
        "budget_bound": p.budget_bound,
        "chunks_searched": list(p.chunks),
        "runners_up": [{**_eval_json(e), "why": why} for e, why in p.runners_up],
        "baseline": {
            "rule": "replicas = load / profiled throughput per worker",
            "prefill_tok_s_per_worker": b.prefill_tok_s,
            "decode_tok_s_per_worker": b.decode_tok_s,
            "decode_batch": b.decode_batch,
            "disaggregated": _eval_json(b.disaggregated_eval),
            "colocated": _eval_json(b.colocated_eval),
        },
        "notes": p.notes,
        "simulations": p.simulations,
        "wall_s": p.wall_s,
    }


def _line(e: Evaluation) -> str:
    r = e.result
    pools = ", ".join(f"{k} {v:.0%}" for k, v in r.pool_utilisation.items())
    return (
        f"attainment {r.slo_attainment:.2f}, goodput {r.goodput_req_s:.2f} req/s "
        f"({e.goodput_per_worker:.2f} a worker), TTFT p90 {fmt_ms(r.ttft_ms.p90)}, "
        f"TPOT p90 {fmt_ms(r.tpot_ms.p90)}; busy: {pools}"
    )


def format_plan(p: Plan) -> str:
    c = p.chosen
    workers = f"{p.budget_workers} worker{'s' if p.budget_workers != 1 else ''}"
    if p.met:
        head = (
            f"{c.layout} (chunk {c.chunk}): meets {p.rate:.2f} req/s at {p.target:.2f} SLO attainment "
            f"with {c.workers} worker{'s' if c.workers != 1 else ''}, the fewest within {p.budget_workers}"
        )
    elif p.max_rate:
        head = (
            f"unmet: no layout of at most {workers} serves {p.rate:.2f} req/s at {p.target:.2f} SLO "
            f"attainment; best at the budget: {c.layout} (chunk {c.chunk}), at most {p.max_rate:.2f} req/s"
        )
    else:
        head = (
            f"unmet: within {workers}, not even {c.rate:.3g} req/s meets {p.target:.2f} SLO attainment; "
            f"closest: {c.layout} (chunk {c.chunk}), {missed(c.result, p.slo, p.target)}"
        )
    rows = [head, f"  predicted at {c.rate:.3g} req/s: {_line(c)}", "runners-up:"]
    rows += [f"  {str(e.layout) + ' @' + str(e.chunk):<18} {why}" for e, why in p.runners_up]
    b = p.baseline
    rows.append(
        f"baseline (replicas = load / profiled throughput: prefill {b.prefill_tok_s:.0f} tok/s a worker, "
        f"decode {b.decode_tok_s:.0f} tok/s a worker at batch {b.decode_batch}):"
    )
    for e in (b.disaggregated_eval, b.colocated_eval):
        over = f" (over the budget of {p.budget_workers})" if e.workers > p.budget_workers else ""
        rows.append(f"  {str(e.layout) + over:<18} {_line(e)}")
    rows += [f"note: {n}" for n in p.notes]
    rows.append(f"{p.simulations} simulations in {p.wall_s:.1f} s")
    return "\n".join(rows)
