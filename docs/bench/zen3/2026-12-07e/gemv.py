"""SmolLM2's 121 projections of one token (30 layers and the LM head, bf16, from DRAM) through
`Bf16GemmWeight`, beside `torch.sum`s over the same bytes and over 1 GiB of fp32, six rounds."""

import time

import torch

from baton.common.model.llama import Bf16GemmWeight

torch.manual_seed(0)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [[Bf16GemmWeight(torch.randn(n, k).bfloat16() * 0.02) for n, k in SHAPES] for _ in range(30)]
head = Bf16GemmWeight(torch.randn(49152, 576).bfloat16() * 0.02)
nbytes = (sum(n * k for n, k in SHAPES) * 30 + 49152 * 576) * 2
xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}
big = torch.ones(nbytes // 2, dtype=torch.bfloat16)
g1 = torch.ones(256 * 1024 * 1024)


def gemv() -> None:
    for layer in layers:
        for (_, k), p in zip(SHAPES, layer):
            p(xs[k])
    head(xs[576])


def best_of(f, n: int = 5) -> float:
    best = 1e9
    for _ in range(n):
        s = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - s)
    return best


for _ in range(6):
    a = best_of(gemv)
    b = best_of(big.sum)
    c = best_of(g1.sum, 3)
    floor = nbytes / (4 * g1.numel() / c)
    print(
        f"gemv {a * 1e3:.2f} ms {nbytes / a / 1e9:.1f} GB/s | bf16 sum same bytes {nbytes / b / 1e9:.1f} GB/s"
        f" | 1GiB fp32 sum {4 * g1.numel() / c / 1e9:.1f} GB/s | gemv/floor(1GiB) {a / floor:.3f}",
        flush=True,
    )
