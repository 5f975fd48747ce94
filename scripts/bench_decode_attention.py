"""Time the CPU paged decode attention kernel against gather + SDPA at the W1 decode shape.

Shape: B=64 sequences, context 256..384 tokens (random per sequence), H=9, KV=3, D=64, block size 16,
bf16, 2 threads. The cache has the engine's layout, [num_blocks, num_layers, 2, KV, bs, D], with
shuffled block tables, and each timed call attends one layer's view of it. Two regimes:

  hot   the same layer every call: its ~16 MB of K/V stay in the 32 MB L3
  cold  calls cycle through all layers (~470 MB of cache), as a decode step does: K/V come from DRAM

"GB/s" is the K/V bytes a call must read (its minimum traffic) divided by its time. The "read floor"
row is a plain streaming read of as many bytes (int32 amax over a slice of the same cache), i.e. what
the machine's memory gives. Times are per call, over single calls: min and median (the machine may be
shared; the min is the less noisy figure).

Transparent huge pages matter for the cold case (2 KB runs at random places in ~0.5 GB thrash the
TLB): run with THP_MEM_ALLOC_ENABLE=1 to have torch's allocator madvise large tensors.

    PYTHONPATH=... python scripts/bench_decode_attention.py [--layers 30] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from baton.kernels.cpu_ops import load, paged_decode_attention
from baton.kernels.reference import paged_decode_attention_ref


def make_inputs(batch, num_layers, num_heads, num_kv, head_dim, bs, lo, hi, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen, dtype=torch.int32)
    n_blocks = [(int(n) + bs - 1) // bs for n in lens]
    max_blocks = max(n_blocks)
    num_blocks = sum(n_blocks) + 8
    cache = torch.empty(num_blocks, num_layers, 2, num_kv, bs, head_dim, dtype=dtype)
    cache.normal_(generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    for b, nb in enumerate(n_blocks):
        block_tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, cache, block_tables, lens


def gather_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale, max_len):
    """The copy-based baseline, done about as well as torch allows on CPU: gather each sequence's
    blocks (index_select), make them dense [B, KV, T, D], and run SDPA with the G query heads of a
    group as G query positions (one-token SDPA with enable_gqa is several times slower on CPU)."""
    batch, num_heads, head_dim = q.shape
    num_kv, bs = k_cache.shape[1], k_cache.shape[2]
    nb = (max_len + bs - 1) // bs
    idx = block_tables[:, :nb].clamp_min(0).flatten()

    def dense(cache):
        blocks = torch.index_select(cache, 0, idx).view(batch, nb, num_kv, bs, head_dim)
        return blocks.transpose(1, 2).reshape(batch, num_kv, nb * bs, head_dim)

    pad = torch.arange(nb * bs) >= context_lens.view(-1, 1)
    mask = torch.zeros(batch, 1, 1, nb * bs, dtype=q.dtype).masked_fill_(
        pad.view(batch, 1, 1, -1), float("-inf")
    )
    qg = q.view(batch, num_kv, num_heads // num_kv, head_dim)
    out = F.scaled_dot_product_attention(qg, dense(k_cache), dense(v_cache), attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def per_call(fn, calls, warmup=5):
    """(min, median) seconds of single calls; fn gets the call index."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0], times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads, kv, dim = 9, 3, 64
    scale = dim**-0.5
    q, cache, bt, lens = make_inputs(
        args.batch, args.layers, heads, kv, dim, args.block_size, args.min_len, args.max_len, dtype
    )
    max_len = int(lens.max())
    kv_bytes = int(lens.sum()) * kv * dim * 2 * cache.element_size()
    layers = [(cache[:, i, 0], cache[:, i, 1]) for i in range(args.layers)]
    ops = load()

    k0, v0 = layers[0]
    ref = paged_decode_attention_ref(q, k0, v0, bt, lens, scale).float()
    out = torch.empty_like(q)
    err = (paged_decode_attention(q, k0, v0, bt, lens, scale, out=out).float() - ref).abs().max().item()
    err_sdpa = (gather_sdpa(q, k0, v0, bt, lens, scale, max_len).float() - ref).abs().max().item()
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(
        f"B={args.batch} ctx {args.min_len}..{args.max_len} (mean {lens.float().mean():.0f}) H={heads} "
        f"KV={kv} D={dim} bs={args.block_size} {args.dtype} threads={args.threads} "
        f"layers={args.layers} THP_MEM_ALLOC_ENABLE={thp}"
    )
    print(
        f"K/V bytes per layer call: {kv_bytes / 1e6:.1f} MB; max abs err vs reference: "
        f"kernel {err:.1e}, gather+SDPA {err_sdpa:.1e}"
    )

    def gbs(t):
        return kv_bytes / t / 1e9

    cases = {
        "kernel": lambda k, v: paged_decode_attention(q, k, v, bt, lens, scale, out=out),
        "kernel (raw op)": lambda k, v: ops.paged_decode_attention(out, q, k, v, bt, lens, scale),
        "gather+SDPA": lambda k, v: gather_sdpa(q, k, v, bt, lens, scale, max_len),
    }
    print(
        f"{'us per call':18s} {'hot min':>8s} {'median':>7s} {'GB/s':>5s} | {'cold min':>8s} {'median':>7s} {'GB/s':>5s}"
    )
    for name, fn in cases.items():
        calls = args.calls if "SDPA" not in name else max(10, args.calls // 10)
        hot = per_call(lambda i, fn=fn: fn(k0, v0), calls)
        cold = per_call(lambda i, fn=fn: fn(*layers[i % args.layers]), calls)
        print(
            f"{name:18s} {hot[0] * 1e6:8.0f} {hot[1] * 1e6:7.0f} {gbs(hot[0]):5.1f} | "
            f"{cold[0] * 1e6:8.0f} {cold[1] * 1e6:7.0f} {gbs(cold[0]):5.1f}"
        )

    flat = cache.view(-1)
    n = kv_bytes // cache.element_size() // 2 * 2
    chunks = max(1, flat.numel() // n)
    floor = per_call(
        lambda i: flat[(i % chunks) * n : (i % chunks + 1) * n].view(torch.int32).amax(), args.calls
    )
    print(
        f"{'read floor':18s} {'':8s} {'':7s} {'':5s} | {floor[0] * 1e6:8.0f} {floor[1] * 1e6:7.0f} {gbs(floor[0]):5.1f}"
    )


if __name__ == "__main__":
    main()
