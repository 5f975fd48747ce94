"""SmolLM2's 30 layers of bf16 projections at M rows: oneDNN's packed weights against Baton's
kernel (``kernels/cpu/bf16_gemm.cpp``: vdpbf16ps, or AMX tiles where the CPU has them).

Usage: python scripts/bench_bf16_gemm.py [ROWS,ROWS,...]  (default 1,4,8,16,32,64,256,512)
Prints, per M, each kernel's best of 3 (ms for the 120 products, the weights' read rate, GFLOP/s).
Run it alone: the figures are worthless beside any other load."""

import sys
import time

import torch

from baton.common.model.llama import Bf16GemmWeight, OneDNNWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate+up, down
LAYERS = 30


def main() -> None:
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = {
        name: [[cls(w) for w in layer] for layer in weights]
        for name, cls in (("onednn", OneDNNWeight), ("baton", Bf16GemmWeight))
    }
    rows = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 8, 16, 32, 64, 256, 512]
    nbytes = sum(n * k * 2 for n, k in SHAPES) * LAYERS
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        best: dict[str, float] = {}
        for _ in range(3):
            for name, layers in packed.items():
                start, runs = time.perf_counter(), 0
                while time.perf_counter() - start < 0.5:
                    for layer in layers:
                        for (_, k), p in zip(SHAPES, layer):
                            p(xs[k])
                    runs += 1
                dt = (time.perf_counter() - start) / runs
                best[name] = min(best.get(name, dt), dt)
        line = f"M={m:4d}"
        for name, dt in best.items():
            line += f"  {name}: {dt * 1e3:7.2f} ms ({nbytes / dt / 1e9:5.1f} GB/s, {m * nbytes / dt / 1e9:7.1f} GFLOP/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
