"""A quantized paged KV cache (``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2``): the format, torch
references for writing and reading it, and the dispatch to the kernels that read it in place.

Format. The cache keeps its block-major shape ``[num_blocks, num_layers, 2, KV, block_size, R]``
and every block stays one contiguous region (transfers, block hashing and prefix caching see no
difference), but each (token, kv head) row holds ``R = head_dim + 2`` bytes: the head's ``head_dim``
values in 1-byte codes (int8, or fp8 e4m3fn / e5m2), then their scale as a bf16. The cache's torch
dtype names the code (``int8``, ``float8_e4m3fn``, ``float8_e5m2``), so a layout string built from
dtype and shape tells the three formats and bf16 apart.

Why a scale per token and head (inside the block), not one per block and head: a block fills one
token per decode step, so a per-block scale must either be fixed at the block's first write (a later,
larger token then clips) or requantize the earlier tokens each time it grows (each requantization
rounds again, and two tokens of one block written in the same step race). A scale per row is exact
to its format's rounding for every token whenever it is written, needs no read-modify-write, and
costs 2 bytes per 64 (the cache holds 2 x 64 / 66 = 1.94x the bf16 tokens at head_dim 64).

Quantizing a row x: ``amax = max|x|``; ``scale = bf16(amax / QMAX)`` (round to nearest); codes
``q = code(x / scale)`` (int8: round half to even, clamped to +-127; fp8: clamped to +-QMAX, then
round to nearest even by the format); a zero row has scale 0 and zero codes. Dequantized value:
``float(q) * float(scale)``. Because the bf16 scale is at least ``amax / 127.25``, no value clips
beyond its half step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.kernels.kv_cache_dtypes import (  # noqa: F401  (re-exported)
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    QUANTIZED,
    canonical_kv_cache_dtype,
)
from baton.kernels.kv_rows import SCALE_BYTES, split_rows


@dataclass(frozen=True)
class KVFormat:
    name: str
    """vLLM's name of the cache dtype (``--kv-cache-dtype``)."""
    storage: torch.dtype
    """The torch dtype of the cache tensor (1-byte codes)."""
    qmax: float
    """The largest code magnitude used: a row's absolute maximum maps to it."""


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
assert tuple(FORMATS) == QUANTIZED, "kv_cache_dtypes.QUANTIZED names every format"

_BY_STORAGE = {f.storage: f for f in FORMATS.values()}


def kv_format(name: str) -> KVFormat | None:
    """The format of ``name`` (an alias included); None for ``auto``."""
    return FORMATS.get(canonical_kv_cache_dtype(name))


def format_of(cache: torch.Tensor) -> KVFormat | None:
    """The format a cache (or a view of one) is stored in; None for an unquantized cache."""
    return _BY_STORAGE.get(cache.dtype)


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _BY_STORAGE


def row_elems(head_dim: int, fmt: KVFormat | None) -> int:
    """Elements of one (token, kv head) row of the cache: the values, plus the scale if quantized."""
    return head_dim if fmt is None else head_dim + SCALE_BYTES


# --- torch references -------------------------------------------------------------------------


def quantize_rows_ref(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows ``[..., D]`` (any float dtype) -> quantized rows ``[..., D + 2]`` in ``fmt.storage``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / fmt.qmax).to(torch.bfloat16)  # [..., 1]
    sf = scale.float()
    scaled = torch.where(sf > 0, xf / sf.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    if fmt.storage == torch.int8:
        codes = scaled.round().clamp_(-fmt.qmax, fmt.qmax).to(torch.int8)
    else:
        codes = scaled.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=fmt.storage, device=x.device)
    values, scales = split_rows(out)
    values.copy_(codes)
    scales.copy_(scale.squeeze(-1))
    return out


def dequantize_rows_ref(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows ``[..., D + 2]`` -> values ``[..., D]`` in ``dtype`` (computed in fp32)."""
    values, scales = split_rows(rows)
    return (values.float() * scales.float().unsqueeze(-1)).to(dtype)


def gather_kv_dequant(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """``reference.gather_kv`` of a quantized layer cache ``[num_blocks, KV, bs, D + 2]``, dequantized:
    one sequence's first ``length`` tokens as ``[KV, length, D]`` in ``dtype``."""
    from baton.kernels.reference import gather_kv

    return dequantize_rows_ref(gather_kv(cache, block_table, length), dtype)


def rope_and_cache_quant_ref(
    qkv: torch.Tensor,  # [N, (H + 2 KV) * D], q and k rotated in place
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,  # [num_blocks, 2, KV, block_size, D + 2], quantized
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """``reference.rope_and_cache_ref`` into a quantized cache: the rotated k and v rows of each
    token quantized (``quantize_rows_ref``) into their slots."""
    from baton.kernels.reference import rope_and_cache_ref

    fmt = format_of(kv_layer)
    assert fmt is not None, f"not a quantized cache: {kv_layer.dtype}"
    n = qkv.shape[0]
    # The rotation is rope_and_cache_ref's, into a dense scratch cache of one slot per row.
    dense = torch.empty((n, 2, num_kv_heads, 1, head_dim), dtype=qkv.dtype, device=qkv.device)
    rows = torch.arange(n, device=qkv.device)
    rope_and_cache_ref(
        qkv, positions, cos, sin, dense, rows, torch.zeros_like(rows), num_heads, num_kv_heads, head_dim
    )
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(n, num_kv_heads, head_dim)
    # index_put is not implemented for the fp8 dtypes on CPU: write the bytes.
    raw = kv_layer.view(torch.uint8)
    raw[slot_blocks, 0, :, slot_offsets] = quantize_rows_ref(k, fmt).view(torch.uint8)
    raw[slot_blocks, 1, :, slot_offsets] = quantize_rows_ref(v, fmt).view(torch.uint8)


def paged_decode_attention_quant_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D + 2], quantized
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_decode_attention_ref`` over the dequantized cache (in fp32)."""
    from baton.kernels.reference import paged_decode_attention_ref

    return paged_decode_attention_ref(
        q, dequantize_rows_ref(k_cache), dequantize_rows_ref(v_cache), block_tables, context_lens, scale
    )


WEIGHT_CHUNK = 16
"""Rows of a block whose softmax weights share one 8-bit scale in the int8 integer kernel."""


def quantize_query_ref(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q * scale`` [..., D] as symmetric int8 codes (fp32 values) and a per-head scale [..., 1]:
    how the int8 integer kernel quantizes each query head once per step."""
    qf = q.float() * scale
    amax = qf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (qf * inv).round().clamp_(-127, 127), amax / 127.0


def paged_decode_attention_int8_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D + 2], int8
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What the CPU int8 kernel on integer dot products computes (``kv_quant.cpp``), in fp32: q
    quantized per head (``quantize_query_ref``), q.k as exact integer sums of codes times the two
    scales; each row's softmax weight times its V scale quantized to 8 unsigned bits against the
    largest of its chunk (``WEIGHT_CHUNK`` rows of a block), the weighted V codes summed exactly per
    chunk; the normalizer the fp32 sum of the unquantized weights."""
    from baton.kernels.reference import gather_kv

    batch, num_heads, head_dim = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(batch):
        n = int(context_lens[b])
        if n == 0:
            continue
        k_codes, k_scales = split_rows(gather_kv(k_cache, block_tables[b], n))  # [KV, n, D], [KV, n]
        v_codes, v_scales = split_rows(gather_kv(v_cache, block_tables[b], n))
        qc, qs = quantize_query_ref(q[b], scale)  # [H, D], [H, 1]
        kc = k_codes.float().repeat_interleave(group, 0)  # [H, n, D]
        dots = torch.einsum("hd,htd->ht", qc, kc)  # exact: integers below 2^24
        s = dots * (k_scales.float().repeat_interleave(group, 0) * qs)  # [H, n]
        p = torch.exp(s - s.amax(dim=-1, keepdim=True))
        w = p * v_scales.float().repeat_interleave(group, 0)
        t = torch.arange(n)
        chunk = (t // bs) * (-(-bs // WEIGHT_CHUNK)) + (t % bs) // WEIGHT_CHUNK  # [n]
        wmax = torch.zeros(num_heads, int(chunk[-1]) + 1).scatter_reduce_(
            1, chunk.expand(num_heads, -1), w, "amax"
        )
        wmax_t = wmax[:, chunk]
        codes = torch.where(wmax_t > 0, (w * (255.0 / wmax_t.clamp_min(1e-38))).round(), 0.0)
        vc = v_codes.float().repeat_interleave(group, 0)  # [H, n, D]
        sums = torch.zeros(num_heads, wmax.shape[1], head_dim).index_add_(1, chunk, codes.unsqueeze(-1) * vc)
        num = (sums * (wmax / 255.0).unsqueeze(-1)).sum(dim=1)  # [H, D]
        out[b] = num / p.sum(dim=-1, keepdim=True)
    return out.to(q.dtype)


# --- dispatch -----------------------------------------------------------------------------------


def _ops():
    from baton.kernels import cpu_ops

    return cpu_ops.load()


def uses_integer_kernel(cache: torch.Tensor, group: int, head_dim: int) -> bool:
    """Whether CPU decode attention over this cache runs on integer dot products (an int8 cache,
    AVX512-VNNI compiled in, a supported query group and head size), whose result is
    ``paged_decode_attention_int8_ref``'s; otherwise it is ``paged_decode_attention_quant_ref``'s."""
    return cache.dtype == torch.int8 and bool(_ops().kv_int8_integer_kernel(group, head_dim))


def rope_and_cache_quant(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """``fused.rope_and_cache`` into a quantized cache: C++ on CPU, the torch reference elsewhere."""
    args = (qkv, positions, cos, sin, kv_layer, slot_blocks, slot_offsets, num_heads, num_kv_heads, head_dim)
    if qkv.is_cpu:
        _ops().rope_and_cache_quant(*args)
    else:
        rope_and_cache_quant_ref(*args)


def paged_decode_attention_quant(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D + 2], quantized
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a quantized paged cache, dequantized in the kernel (Triton on CUDA, C++
    on CPU); same contract as ``paged_decode_attention_quant_ref``."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.is_cuda:
        from baton.kernels.triton_decode_quant import paged_decode_attention_quant_triton

        return paged_decode_attention_quant_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, out=out
        )
    _ops().paged_decode_attention_quant(out, q, k_cache, v_cache, block_tables, context_lens, scale)
    return out


def paged_prefill_attention_quant(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D + 2], quantized
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cpu_ops.paged_prefill_attention`` over a quantized cache (CPU only): the blocks the chunks
    read are dequantized (C++, in parallel) into a compact cache of q's dtype, which the paged
    prefill kernel then reads. Prefill is compute-bound (each K/V row serves every query of its
    chunk), so one dequantizing pass over the context costs little next to the attention itself."""
    from baton.kernels import cpu_ops

    block_size = k_cache.shape[2]
    tables = block_tables.long()
    used = [tables[s, : (int(n) + block_size - 1) // block_size] for s, n in enumerate(context_lens.tolist())]
    ids, inverse = torch.unique(torch.cat(used), return_inverse=True) if used else (tables[:0, 0], None)
    compact_tables = torch.zeros_like(block_tables)
    at = 0
    for s, row in enumerate(used):
        compact_tables[s, : len(row)] = inverse[at : at + len(row)].to(torch.int32)
        at += len(row)
    shape = (len(ids), k_cache.shape[1], block_size, k_cache.shape[3] - SCALE_BYTES)
    k_dense = torch.empty(shape, dtype=q.dtype)
    v_dense = torch.empty(shape, dtype=q.dtype)
    ops = _ops()
    ops.dequantize_blocks(k_dense, k_cache, ids.to(torch.int32))
    ops.dequantize_blocks(v_dense, v_cache, ids.to(torch.int32))
    return cpu_ops.paged_prefill_attention(
        q, k_dense, v_dense, compact_tables, context_lens, query_start_loc, scale, out=out
    )
