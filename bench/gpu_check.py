"""``make gpu-check``: the GPU path proved in one run, written to one JSON.

    python -m baton.bench.gpu_check --output gpu-check.json

Each check runs in its own process (a CUDA fault such as an illegal address poisons the whole
context; a hung kernel is killed at its budget), so one failing check records ``failed`` with its
error and the rest still run. The JSON: ``{"device": ..., "checks": {name: {"status": "passed" |
"failed" | "needs-gpu", "seconds": ..., "budget_s": ..., ...figures}}}``. Without CUDA every GPU
check is ``needs-gpu`` and only the CPU half runs (the seeded model, the engine on the CPU against
transformers on it): CI runs that half (tests/e2e/test_gpu_check.py) so that the script cannot rot.

Budgets (seconds, each a hard limit; the run stops starting checks past ``--total-budget``, 450 s
by default, so that the whole stays within 8 minutes on one H200) are in ``CHECKS``. Nothing is
downloaded: the model is SmolLM2-135M's shape with seeded random weights (``gpu_check_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Check:
    name: str
    gpu: bool
    """Runs only with CUDA (else ``needs-gpu``)."""
    budget_s: float
    needs_model: bool
    what: str


CHECKS = [
    Check("seeded_model", False, 120, False, "a Llama of SmolLM2-135M's shape, seeded random weights, saved"),
    Check("engine_cpu_fp32_vs_transformers", False, 300, True, "the engine on the CPU, fp32, greedy"),
    Check("engine_cuda_fp32_vs_transformers", True, 90, True, "the engine on CUDA, fp32, greedy"),
    Check("engine_cuda_bf16_vs_transformers", True, 90, True, "the engine on CUDA, bf16, greedy"),
    Check("triton_decode", True, 45, False, "paged decode attention, fp32/bf16/fp16"),
    Check("triton_cascade", True, 45, False, "cascade decode attention, fp32/bf16/fp16"),
    Check("triton_decode_quant", True, 90, False, "decode over an int8/fp8 KV cache"),
    Check("triton_fp8_linear", True, 45, False, "the fp8-weight GEMM at SmolLM2's shapes"),
    Check("cuda_graph_decode", True, 60, True, "a decode step replayed from a CUDA graph vs eager"),
    Check("decode_bandwidth", True, 45, False, "decode attention's bytes/s vs the GPU's"),
    Check("w1_throughput", True, 120, True, "W1 (64 x 256 in, 128 out) tokens/s, bf16"),
]
BY_NAME = {c.name: c for c in CHECKS}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""Added to the checks' environment: transformers and the hub never reach for a network."""
CPU_HALF = {"engine_cpu_fp32_vs_transformers"}
"""Checks left out where CUDA is available, unless asked for by name."""


def _run_one(name: str, model_dir: str, layers: int | None) -> dict:
    """The body of one check, in this (child) process; returns its figures (``error`` if failed)."""
    from baton.bench import gpu_check_kernels as kernels
    from baton.bench import gpu_check_model as model

    bodies: dict[str, Callable[[], dict]] = {
        "seeded_model": lambda: model.write_seeded_model(Path(model_dir), num_layers=layers),
        "engine_cpu_fp32_vs_transformers": lambda: model.check_engine_vs_transformers(
            model_dir, "cpu", "float32"
        ),
        "engine_cuda_fp32_vs_transformers": lambda: model.check_engine_vs_transformers(
            model_dir, "cuda", "float32"
        ),
        "engine_cuda_bf16_vs_transformers": lambda: model.check_engine_vs_transformers(
            model_dir, "cuda", "bfloat16"
        ),
        "triton_decode": kernels.check_triton_decode,
        "triton_cascade": kernels.check_triton_cascade,
        "triton_decode_quant": kernels.check_triton_decode_quant,
        "triton_fp8_linear": kernels.check_triton_fp8_linear,
        "cuda_graph_decode": lambda: model.check_cuda_graph_decode(model_dir),
        "decode_bandwidth": kernels.check_decode_bandwidth,
        "w1_throughput": lambda: model.check_w1(model_dir),
    }
    return bodies[name]()


def _child_main(name: str, model_dir: str, layers: int | None, result_path: str) -> int:
    try:
        figures = _run_one(name, model_dir, layers)
    except Exception as e:  # the check failed: say how, in the JSON
        figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(result_path, "w") as f:
        json.dump(figures, f, default=str)
    return 0


def run_check(check: Check, model_dir: str, layers: int | None, budget_s: float) -> dict:
    """Run one check in a child process within ``budget_s``; its entry for the JSON."""
    fd, result_path = tempfile.mkstemp(prefix=f"gpu-check-{check.name}-", suffix=".json")
    os.close(fd)
    from baton.common.launch import python_module

    cmd = python_module("baton.bench.gpu_check") + ["--child", check.name, "--model-dir", model_dir]
    cmd += ["--result", result_path] + (["--layers", str(layers)] if layers else [])
    t = time.monotonic()
    entry: dict = {}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s, env=os.environ | OFFLINE)
        with open(result_path) as f:
            text = f.read()
        entry = json.loads(text) if text else {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    except subprocess.TimeoutExpired:
        entry = {"error": f"timed out after its budget of {budget_s:.0f} s"}
    except (OSError, ValueError) as e:
        entry = {"error": f"{type(e).__name__}: {e}"}
    finally:
        os.unlink(result_path)
    status = "failed" if "error" in entry else "passed"
    return {"status": status, **entry, "seconds": round(time.monotonic() - t, 2), "budget_s": budget_s}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"no CUDA device ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_all(
    names: list[str],
    total_budget_s: float,
    layers: int | None,
    with_cpu_half: bool = False,
    log=print,
    save=None,
) -> dict:
    """Every named check in order; GPU checks are ``needs-gpu`` without CUDA, and a check whose
    model failed, or that would start past the total budget, is ``failed`` without running.
    ``save`` gets the result so far after each check (a run cut short still leaves its JSON)."""
    has_cuda = cuda_available()
    result: dict = {"device": device_name(), "checks": {}}
    checks: dict[str, dict] = result["checks"]
    deadline = time.monotonic() + total_budget_s
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as model_dir:
        for name in names:
            check = BY_NAME[name]
            left = deadline - time.monotonic()
            if check.gpu and not has_cuda:
                entry = {"status": "needs-gpu", "budget_s": check.budget_s}
            elif has_cuda and name in CPU_HALF and not with_cpu_half:
                continue  # CI runs it; on a GPU machine its minutes go to the GPU checks
            elif check.needs_model and checks.get("seeded_model", {}).get("status") != "passed":
                entry = {"status": "failed", "error": "needs the seeded model, which was not built"}
            elif left < 5:
                entry = {
                    "status": "failed",
                    "error": f"not started: the run's {total_budget_s:.0f} s were spent",
                }
            else:
                entry = run_check(check, model_dir, layers, min(check.budget_s, left))
            entry["what"] = check.what
            checks[name] = entry
            log(f"{name}: {entry['status']} {entry.get('seconds', '')} {entry.get('error', '')}".rstrip())
            if save is not None:
                save(result)
    return result


def _checkout_off_path() -> None:
    """Run from the checkout (``python -m`` without ``-P``, Python < 3.11), its ``kernels/`` would
    shadow Hugging Face's ``kernels`` package that transformers imports (``common/launch.py``)."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != root]


def main(argv: list[str] | None = None) -> int:
    _checkout_off_path()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="gpu-check.json")
    p.add_argument("--checks", default=None, help=f"comma-separated, of: {', '.join(BY_NAME)} (default all)")
    p.add_argument("--total-budget", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument(
        "--layers", type=int, default=None, help="the seeded model's layers (default SmolLM2's 30)"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return _child_main(a.child, a.model_dir, a.layers, a.result)
    names = list(BY_NAME) if a.checks is None else a.checks.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown checks {unknown}")
    if any(BY_NAME[n].needs_model for n in names) and "seeded_model" not in names:
        names.insert(0, "seeded_model")

    def save(result: dict) -> None:
        with open(a.output + ".tmp", "w") as f:
            json.dump(result, f, indent=2, default=str)
            f.write("\n")
        os.replace(a.output + ".tmp", a.output)

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = run_all(names, a.total_budget, a.layers, a.checks is not None, log, save)
    save(result)
    failed = [n for n, c in result["checks"].items() if c["status"] == "failed"]
    print(
        f"{a.output}: {len(result['checks'])} checks, failed: {', '.join(failed) or 'none'}", file=sys.stderr
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
