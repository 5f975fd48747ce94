"""Time the CPU paged prefill attention kernel against what the engine does without it (SDPA).

Shapes (SmolLM2: H=9, KV=3, D=64; block size 16; bf16; 2 threads by default):

  fresh    B=8 sequences x 256 new tokens, nothing cached before. Baseline: one
           ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`` on dense
           [8, H, 256, D] / [8, KV, 256, D] tensors (the engine's fresh-run path; the K/V copy it
           already has is not counted).
  context  1 sequence, 256 new tokens after 1024 cached ones. Baseline: gather the 1280 cached
           tokens from the paged cache, expand K/V to H heads, SDPA with an additive causal mask
           (the engine's context-prefill path, gather and mask included).

The cache has the engine's layout, [num_blocks, num_layers, 2, KV, bs, D], with shuffled block
tables; q is a strided view into a fused qkv buffer. Times are per call over single calls: min and
median (the machine may be shared; the min is the less noisy figure).

    python scripts/bench_prefill_attention.py [--threads 2] [--calls 50]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from baton.kernels.cpu_ops import load, paged_prefill_attention
from baton.kernels.reference import gather_kv, paged_prefill_attention_ref

H, KV, D, BS, LAYERS = 9, 3, 64, 16, 4


def make_inputs(new_lens, ctx_lens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [(c + BS - 1) // BS for c in ctx_lens]
    num_blocks = sum(n_blocks) + 8
    cache = torch.randn(num_blocks, LAYERS, 2, KV, BS, D, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(ctx_lens), max(n_blocks)), -1, dtype=torch.int32)
    for s, nb in enumerate(n_blocks):
        block_tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    n = sum(new_lens)
    qkv = torch.randn(n, H + 2 * KV, D, generator=gen).to(dtype)
    q = qkv[:, :H]  # strided rows, as in the engine
    qsl = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    return q, k_cache, v_cache, block_tables, torch.tensor(ctx_lens, dtype=torch.int32), qsl


def per_call(fn, calls, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def check(out, q, k_cache, v_cache, bt, cl, qsl, scale):
    err = 0.0
    for s in range(len(cl)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        ref = paged_prefill_attention_ref(q[rows], k_cache, v_cache, bt[s], int(cl[s]), scale)
        err = max(err, (out[rows].float() - ref.float()).abs().max().item())
    return err


def bench_fresh(dtype, calls):
    batch, t = 8, 256
    q, k_cache, v_cache, bt, cl, qsl = make_inputs([t] * batch, [t] * batch, dtype)
    scale = D**-0.5
    out = torch.empty(q.shape, dtype=dtype)
    # the dense K/V the engine has at hand for a fresh run: [B, KV, T, D]
    k4 = torch.stack([gather_kv(k_cache, bt[s], t) for s in range(batch)]).contiguous()
    v4 = torch.stack([gather_kv(v_cache, bt[s], t) for s in range(batch)]).contiguous()
    q4 = q.reshape(batch, t, H, D).transpose(1, 2)  # [B, H, T, D] view, like the engine's

    def sdpa():
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)

    def kernel():
        return paged_prefill_attention(q, k_cache, v_cache, bt, cl, qsl, scale, out=out)

    err_k = check(kernel(), q, k_cache, v_cache, bt, cl, qsl, scale)
    err_s = check(sdpa().transpose(1, 2).reshape(-1, H, D), q, k_cache, v_cache, bt, cl, qsl, scale)
    return {
        "sdpa (is_causal, enable_gqa)": (per_call(sdpa, calls), err_s),
        "kernel": (per_call(kernel, calls), err_k),
    }


def bench_context(dtype, calls):
    t, prior = 256, 1024
    ctx = prior + t
    q, k_cache, v_cache, bt, cl, qsl = make_inputs([t], [ctx], dtype, seed=1)
    scale = D**-0.5
    out = torch.empty(q.shape, dtype=dtype)
    group = H // KV

    def gather_sdpa():
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        ks = gather_kv(k_cache, bt[0], ctx).repeat_interleave(group, 0).unsqueeze(0)
        vs = gather_kv(v_cache, bt[0], ctx).repeat_interleave(group, 0).unsqueeze(0)
        pos_q = torch.arange(prior, ctx).view(-1, 1)
        visible = torch.arange(ctx).view(1, -1) <= pos_q
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)

    def kernel():
        return paged_prefill_attention(q, k_cache, v_cache, bt, cl, qsl, scale, out=out)

    err_k = check(kernel(), q, k_cache, v_cache, bt, cl, qsl, scale)
    err_s = check(gather_sdpa()[0].transpose(0, 1), q, k_cache, v_cache, bt, cl, qsl, scale)
    return {
        "gather + masked sdpa": (per_call(gather_sdpa, calls), err_s),
        "kernel": (per_call(kernel, calls), err_k),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    load()
    print(f"threads={args.threads} dtype={args.dtype} H={H} KV={KV} D={D} bs={BS}")
    for name, fn in (
        ("fresh: 8 x 256 new tokens", bench_fresh),
        ("context: 256 new + 1024 cached", bench_context),
    ):
        print(f"\n{name}")
        res = fn(dtype, args.calls)
        base = next(iter(res.values()))[0][0]
        for label, ((tmin, tmed), err) in res.items():
            print(
                f"  {label:30s} min {tmin:7.3f} ms  median {tmed:7.3f} ms  x{base / tmin:5.2f}  max err vs ref {err:.2e}"
            )


if __name__ == "__main__":
    main()
