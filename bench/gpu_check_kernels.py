"""The Triton kernels' checks of ``make gpu-check``: each kernel of ``kernels/`` compiled for the GPU
(never under TRITON_INTERPRET) against its torch reference on the CPU, in every dtype it takes,
with the tolerances of tests/gpu; and decode attention's achieved memory bandwidth.

The kernels (``grep -l @triton.jit kernels/``): ``triton_decode`` (paged decode), ``triton_cascade``
(shared-prefix decode), ``triton_decode_quant`` (int8 / fp8 KV cache), ``triton_quant`` (fp8 weights).
"""

from __future__ import annotations

import os

import torch

# (batch, heads, kv_heads, head_dim, block_size, context lengths): SmolLM2's heads, Llama's, odd sizes.
DECODE_CASES = [
    (5, 9, 3, 64, 16, [1, 16, 17, 100, 0]),
    (4, 32, 8, 128, 16, [1, 255, 256, 1000]),
    (3, 14, 2, 64, 32, [7, 64, 513]),
    (5, 6, 2, 48, 32, [31, 32, 33, 1, 70]),
]
KERNEL_MODULES = {
    "triton_decode": "triton_decode",
    "triton_cascade": "triton_cascade",
    "triton_decode_quant": "triton_decode_quant",
    "triton_quant": "triton_fp8_linear",
    "triton_common": "triton_decode",  # its @triton.jit helpers run inside the attention kernels
}
"""Every module of kernels/ with a ``@triton.jit`` -> the gpu-check check that compiles it."""
DECODE_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
CASCADE_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FP8_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Peak HBM bandwidth by device name (vendors' figures, bytes/s), for the fraction beside the copy's.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


def _refuse_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: nothing would be compiled")


def _paged_case(case, seed: int, layers: int = 2):
    """A random paged cache (a layer's strided view of a 6-D cache), shuffled block tables (-1
    beyond each row's blocks), queries and context lengths, on the CPU in fp32."""
    batch, heads, kv_heads, head_dim, bs, lens = case
    gen = torch.Generator().manual_seed(seed)
    nbs = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(nbs) + 3
    full = torch.randn(num_blocks, layers, 2, kv_heads, bs, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((batch, max(nbs) + 1), -1, dtype=torch.int32)
    for b, nb in enumerate(nbs):
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    return q, full, tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (1 + |ref|): at most ``tol`` exactly when ``torch.allclose(out, ref,
    atol=tol, rtol=tol)``, the criterion of tests/gpu."""
    if not ref.numel():
        return 0.0
    ref = ref.float()
    return ((out.cpu().float() - ref).abs() / (1 + ref.abs())).max().item()


def _verdict(errors: dict[str, float], tolerances: dict[str, float]) -> dict:
    bad = [f"{k}: {e:.3g} > {tolerances[k]:.3g}" for k, e in errors.items() if not e <= tolerances[k]]
    figures: dict = {
        "max_err": {k: float(f"{e:.3g}") for k, e in errors.items()},
        "err_is": "max |out - ref| / (1 + |ref|), the reference torch code on the CPU",
        "tolerance": tolerances,
    }
    return figures | ({"error": "; ".join(bad)} if bad else {})


def check_triton_decode() -> dict:
    _refuse_interpreter()
    from baton.kernels.reference import paged_decode_attention_ref
    from baton.kernels.triton_decode import paged_decode_attention_triton

    errors, tols = {}, {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        worst = 0.0
        for i, case in enumerate(DECODE_CASES):
            q, full, bt, cl, scale = _paged_case(case, seed=i)
            q, full = q.to(dtype), full.to(dtype)
            k, v = full[:, 1, 0], full[:, 1, 1]
            ref = paged_decode_attention_ref(q, k, v, bt, cl, scale)
            on = full.cuda()
            out = paged_decode_attention_triton(
                q.cuda(), on[:, 1, 0], on[:, 1, 1], bt.cuda(), cl.cuda(), scale
            )
            worst = max(worst, _max_err(out, ref))
        errors[name], tols[name] = worst, DECODE_TOL[dtype]
    return {"cases": len(DECODE_CASES)} | _verdict(errors, tols)


def _cascade_case(dtype: torch.dtype, seed: int):
    """SmolLM2's heads; rows 0, 2, 3 share 5 blocks and rows 4, 5 share 4; row 1 is alone."""
    heads, kv, head_dim, bs = 9, 3, 64, 16
    groups, own = [([0, 2, 3], 5), ([4, 5], 4)], [1, 7, 16, 33, 0, 20]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(n for _, n in groups) + sum((n + bs - 1) // bs for n in own)
    full = torch.randn(num_blocks, 2, 2, kv, bs, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = [[] for _ in own]
    lens = [0] * len(own)
    for members, n in groups:
        shared = [perm.pop() for _ in range(n)]
        for r in members:
            tables[r], lens[r] = list(shared), n * bs
    for b, n in enumerate(own):
        tables[b] += [perm.pop() for _ in range((n + bs - 1) // bs)]
        lens[b] += n
    bt = torch.full((len(own), max(map(len, tables)) + 1), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(own), heads, head_dim, generator=gen).to(dtype)
    return q, full, bt, torch.tensor(lens, dtype=torch.int32), groups, head_dim**-0.5


def check_triton_cascade() -> dict:
    _refuse_interpreter()
    from baton.kernels.cascade import CascadeGroups, cascade_decode_attention_ref
    from baton.kernels.triton_cascade import cascade_decode_attention_triton
    from baton.kernels.triton_decode import paged_decode_attention_triton

    errors, tols = {}, {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        q, full, bt, cl, groups, scale = _cascade_case(dtype, seed=3)
        ref = cascade_decode_attention_ref(
            q, full[:, 1, 0], full[:, 1, 1], bt, cl, CascadeGroups.build(groups), scale
        )
        on = full.cuda()
        args = (q.cuda(), on[:, 1, 0], on[:, 1, 1], bt.cuda(), cl.cuda())
        out = cascade_decode_attention_triton(*args, CascadeGroups.build(groups, "cuda"), scale)
        errors[name], tols[name] = _max_err(out, ref), CASCADE_TOL[dtype]
        plain = paged_decode_attention_triton(*args, scale)  # the kernel it replaces, same answer
        errors[f"{name}_vs_plain"], tols[f"{name}_vs_plain"] = _max_err(out, plain.cpu()), CASCADE_TOL[dtype]
    return _verdict(errors, tols)


def check_triton_decode_quant() -> dict:
    _refuse_interpreter()
    from baton.kernels import kv_quant
    from baton.kernels.triton_decode_quant import paged_decode_attention_quant_triton

    errors, tols = {}, {}
    for fmt_name, fmt in kv_quant.FORMATS.items():
        for dtype in DTYPES:
            key = f"{fmt_name}/{str(dtype).removeprefix('torch.')}"
            worst = 0.0
            for i, case in enumerate(DECODE_CASES[:2]):
                q, full, bt, cl, scale = _paged_case(case, seed=10 + i)
                cache = kv_quant.quantize_rows_ref(full * 2, fmt)[:, 1]  # a layer's view, codes + scales
                q = q.to(dtype)
                ref = kv_quant.paged_decode_attention_quant_ref(q, cache[:, 0], cache[:, 1], bt, cl, scale)
                on = cache.cuda()
                out = paged_decode_attention_quant_triton(
                    q.cuda(), on[:, 0], on[:, 1], bt.cuda(), cl.cuda(), scale
                )
                worst = max(worst, _max_err(out, ref))
            errors[key], tols[key] = worst, 1e-4 if dtype == torch.float32 else 3e-2
    return _verdict(errors, tols)


def check_triton_fp8_linear() -> dict:
    _refuse_interpreter()
    from baton.common.model.quant import quantize_fp8
    from baton.kernels.triton_quant import fp8_linear, fp8_linear_ref

    errors, tols = {}, {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        worst = 0.0
        for m, n, k in [(1, 960, 576), (8, 3072, 576), (64, 576, 1536), (300, 960, 576), (4, 49152, 576)]:
            gen = torch.Generator().manual_seed(m + n)
            w, scale = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05)
            x = torch.randn(m, k, generator=gen).to(dtype)
            ref = fp8_linear_ref(x, w, scale)
            out = fp8_linear(x.cuda(), w.cuda(), scale.cuda())
            worst = max(worst, _max_err(out, ref))
        errors[name], tols[name] = worst, FP8_TOL[dtype]
    return _verdict(errors, tols)


# --- bandwidth -------------------------------------------------------------------------------------


def _time_ms(fn, repeats: int = 20) -> float:
    """Median ms of ``fn`` on the GPU, by CUDA events, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s a device-to-device copy moves (each byte read once and written once: 2x its size)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def decode_bandwidth(
    batch: int, context: int, heads: int, kv_heads: int, head_dim: int, bs: int = 16
) -> dict:
    """The Triton decode kernel over a bf16 cache of ``batch`` rows of ``context`` tokens each: the
    K and V bytes it must read, the median time, the bytes/s achieved."""
    from baton.kernels.triton_decode import paged_decode_attention_triton

    per_seq = -(-context // bs)
    cache = torch.randn(batch * per_seq, 2, kv_heads, bs, head_dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(batch * per_seq, device="cuda").to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    ms = _time_ms(
        lambda: paged_decode_attention_triton(q, cache[:, 0], cache[:, 1], tables, lens, head_dim**-0.5, out)
    )
    read = batch * context * kv_heads * head_dim * 2 * cache.element_size()
    return {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "bytes_read": read, "ms": round(ms, 4), "bytes_per_s": read / (ms / 1e3)}  # fmt: skip


def check_decode_bandwidth() -> dict:
    _refuse_interpreter()
    name = torch.cuda.get_device_name()
    peak = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
    copy = copy_bandwidth()
    shapes = {
        "smollm2": decode_bandwidth(256, 8192, 9, 3, 64),  # 2.4 GB of K/V
        "llama8b": decode_bandwidth(64, 8192, 32, 8, 128),  # 2.1 GB
    }
    figures: dict = {"device_name": name, "copy_bytes_per_s": copy, "peak_bytes_per_s": peak}
    figures["peak_source"] = "vendor table by name" if peak else "no table entry: copy only"
    for key, shape in shapes.items():
        shape["fraction_of_copy"] = round(shape["bytes_per_s"] / copy, 3)
        if peak:
            shape["fraction_of_peak"] = round(shape["bytes_per_s"] / peak, 3)
        figures[key] = shape
    return figures
