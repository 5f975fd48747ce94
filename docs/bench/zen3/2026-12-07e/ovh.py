"""One bf16 GEMM call of one row, repeated on the same weight (so from L2): through
`Bf16GemmWeight` and `cpu_ops.bf16_gemm` straight, best of 5 x 2,000 calls."""

import time

import torch

from baton.common.model.llama import Bf16GemmWeight
from baton.kernels import cpu_ops

torch.manual_seed(0)
for n, k in [(64, 64), (576, 576), (960, 576), (3072, 576)]:
    w = Bf16GemmWeight(torch.randn(n, k).bfloat16() * 0.02)
    x = torch.randn(1, k).bfloat16()
    packed = cpu_ops.bf16_gemm_pack(torch.randn(n, k).bfloat16())
    out = torch.empty(1, n, dtype=torch.bfloat16)
    calls = {
        "Weight()": lambda w=w, x=x: w(x),
        "cpu_ops.bf16_gemm": lambda x=x, p=packed, o=out: cpu_ops.bf16_gemm(x, p, o),
    }
    for name, f in calls.items():
        for _ in range(200):
            f()
        best = 1e9
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(2000):
                f()
            best = min(best, (time.perf_counter() - s) / 2000)
        print(f"{n}x{k} {name}: {best * 1e6:.1f} us  ({n * k * 2 / best / 1e9:.1f} GB/s L2-resident)")
