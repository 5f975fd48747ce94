"""The model's projections per kernel and row count: bf16 as ``llama.Linear`` runs it here
(``bf16``) and each bf16 kernel by name (``bf16-onednn``: oneDNN's blocked layout; ``bf16-baton``:
Baton's bf16 GEMM, AVX512-BF16/AMX or AVX2's fp32 FMAs, where compiled in), W8A8 int8 in Baton's fused VNNI kernel and in
oneDNN's, weight-only int8 (the kernels ``quant.Int8Linear`` chooses from), fp32 for reference.

    .venv/bin/python -m baton.bench.gemm --rows 1,8,64,256,2048 --threads 2 --output-json gemm.json

Each kernel runs SmolLM2's four projections of every layer in turn (qkv, o, gate_up, down; fresh
weights per layer, as many layers as the model), so the weights come from memory as in a decode
step rather than from the cache; the figure is the median over ``--repeats`` of one pass over
all layers, in ms. Activations are random: these kernels' time does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# SmolLM2-135M: hidden 576, intermediate 1536, 30 layers; (in, out) of each fused projection.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
NUM_LAYERS = 30


def _layers(num_layers: int, kernel: str) -> list[dict]:
    """Per layer, projection name -> (in features, the module the model would run)."""
    from baton.common.model import quant
    from baton.common.model.llama import Bf16GemmWeight, Linear, OneDNNWeight

    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(num_layers):
        layer = {}
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            if kernel in ("bf16", "fp32"):
                lin = Linear(k, n)
                with torch.no_grad():
                    lin.weight.copy_(w)
                lin = lin.to(torch.bfloat16 if kernel == "bf16" else torch.float32)
                lin.prepack()  # bf16: the packed copy the loaded model has
            elif kernel == "bf16-onednn":
                lin = OneDNNWeight(w.bfloat16())
            elif kernel == "bf16-baton":
                lin = Bf16GemmWeight(w.bfloat16())
            else:
                # One Int8Linear kernel at every row count: weight-only, Baton's fused W8A8 or oneDNN's.
                below = 1 << 30 if kernel == "int8-weight-only" else 0
                fused = 1 << 30 if kernel == "int8-fused" else 0
                lin = quant.Int8Linear(*quant.quantize_int8(w), torch.bfloat16, torch.bfloat16, below, fused)
                if kernel == "int8-fused" and lin.fused is None:
                    raise SystemExit("int8-fused needs AVX512-VNNI (cpu_ops.int8_gemm_available())")
            layer[name] = (k, lin)
        layers.append(layer)
    return layers


def measure(kernel: str, rows: int, num_layers: int, repeats: int) -> float:
    """Median ms of one pass of ``rows`` rows through every layer's projections with ``kernel``."""
    dtype = torch.float32 if kernel == "fp32" else torch.bfloat16
    layers = _layers(num_layers, kernel)
    xs = {k: torch.randn(rows, k).to(dtype) for k, _ in SHAPES.values()}

    def one_pass() -> None:
        for layer in layers:
            for k, f in layer.values():
                f(xs[k])

    torch.set_grad_enabled(False)
    one_pass()  # oneDNN builds its primitives for these shapes
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


KERNELS = ("bf16", "bf16-onednn", "bf16-baton", "int8-fused", "int8-w8a8", "int8-weight-only", "fp32")


def _onednn_bf16() -> bool:
    """Whether oneDNN packs bf16 weights here: not on a CPU with AVX2 only (it needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT)."""
    from baton.common.model.llama import OneDNNWeight

    try:
        OneDNNWeight(torch.ones(16, 16, dtype=torch.bfloat16))
    except (RuntimeError, AttributeError):
        return False
    return True


def available_kernels() -> list[str]:
    from baton.kernels import cpu_ops

    missing = {
        "int8-fused": not cpu_ops.int8_gemm_available(),
        "bf16-baton": not cpu_ops.bf16_gemm_available(),
        "bf16-onednn": not _onednn_bf16(),
    }
    return [k for k in KERNELS if not missing.get(k, False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16,64,256,2048")
    p.add_argument("--kernels", default=None, help=f"of {', '.join(KERNELS)}; default: all this CPU runs")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--num-layers", type=int, default=NUM_LAYERS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    kernels = a.kernels.split(",") if a.kernels else available_kernels()
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        p.error(f"unknown kernels {unknown}: choose from {', '.join(KERNELS)}")
    result: dict = {"threads": a.threads, "num_layers": a.num_layers, "ms_per_pass": {}}
    for rows in (int(r) for r in a.rows.split(",")):
        row = {kernel: measure(kernel, rows, a.num_layers, a.repeats) for kernel in kernels}
        result["ms_per_pass"][str(rows)] = row
        print(
            f"rows {rows}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items()),
            file=sys.stderr,
            flush=True,
        )
    text = json.dumps(result, indent=2)
    print(text)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
