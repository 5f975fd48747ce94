"""Time the fused elementwise CPU ops against their eager torch references (µs per call).

Shapes are SmolLM2-135M's: hidden 576, 9 q heads, 3 kv heads, head_dim 64, intermediate 1536;
the KV cache has the engine's layout [num_blocks, num_layers, 2, KV, bs, D] and each call writes one
layer's strided view of it, at shuffled slots. N is the number of token rows in the step: 1 is a
single-sequence decode step, 2048 a prefill chunk. The figures are the min over repeats of the mean
of a timed loop (the machine may be shared; the min is the less noisy figure).

    python scripts/bench_fused_ops.py [--rows 1 2048] [--dtype bf16 fp32] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from baton.kernels.cpu_ops import add_rms_norm, load, rope_and_cache, silu_mul
from baton.kernels.reference import add_rms_norm_ref, rope_and_cache_ref, silu_mul_ref

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
BLOCK, LAYERS, MAX_POS = 16, 30, 8192
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def timeit(fn, min_seconds: float = 0.2, repeats: int = 5) -> float:
    """µs per call."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_seconds / repeats:  # calibrate
        fn()
        reps += 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def rope_tables():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def bench(n: int, dtype: torch.dtype) -> list[tuple[str, float, float]]:
    gen = torch.Generator().manual_seed(n)
    rows = []

    residual = torch.randn(n, HIDDEN, generator=gen)
    delta = torch.randn(n, HIDDEN, generator=gen).to(dtype) * 1e-3  # small: the residual stays bounded
    weight = torch.randn(HIDDEN, generator=gen)
    out = torch.empty(n, HIDDEN, dtype=dtype)
    rows.append(
        (
            "add_rms_norm",
            timeit(lambda: add_rms_norm(residual, delta, weight, 1e-5, out)),
            timeit(lambda: add_rms_norm_ref(residual, delta, weight, 1e-5, out)),
        )
    )

    gate_up = torch.randn(n, 2 * INTER, generator=gen).to(dtype)
    act = torch.empty(n, INTER, dtype=dtype)
    rows.append(("silu_mul", timeit(lambda: silu_mul(gate_up, act)), timeit(lambda: silu_mul_ref(gate_up))))

    cos, sin = rope_tables()
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(n, width, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (n,), generator=gen)
    num_blocks = (n + BLOCK - 1) // BLOCK + 4
    cache = torch.zeros(num_blocks, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:n]
    blocks, offsets = slots // BLOCK, slots % BLOCK
    kv_layer = cache[:, LAYERS // 2]
    args = (qkv, positions, cos, sin, kv_layer, blocks, offsets, HEADS, KV_HEADS, HEAD_DIM)
    # RoPE of the same qkv over and over: values stay bounded (a rotation), timing is unaffected.
    rows.append(
        ("rope_and_cache", timeit(lambda: rope_and_cache(*args)), timeit(lambda: rope_and_cache_ref(*args)))
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2048])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'op':16} {'dtype':5} {'N':>5} {'fused µs':>10} {'torch µs':>10} {'speedup':>8}")
    for name in args.dtype:
        for n in args.rows:
            for op, fused_us, torch_us in bench(n, DTYPES[name]):
                print(
                    f"{op:16} {name:5} {n:5d} {fused_us:10.2f} {torch_us:10.2f} {torch_us / fused_us:7.1f}x"
                )


if __name__ == "__main__":
    main()
