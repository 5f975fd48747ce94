"""Triton paged decode attention (one query token per sequence) for grouped-query attention.

Layout (see ``reference.py``): k_cache/v_cache are [num_blocks, num_kv_heads, block_size, head_dim]
views, any stride on dim 0 (the real cache is [num_blocks, num_layers, 2, KV, bs, D]), inner three
dims contiguous. One program per (sequence, kv_head): it loads the G = H // KV query heads of the
group as one [G_PAD, D_PAD] tile (G padded to >= 16 so ``tl.dot`` applies), walks the sequence's
blocks through its block table, and keeps an online softmax in fp32.

This module imports triton at the top: import it only where triton is installed (nothing in the
package imports it at package import time). ``paged_decode_attention_ref`` in ``reference.py`` is the
torch reference; ``tests/kernels/test_triton_decode.py`` compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.triton_common import MODEL_DTYPES, interpreting, online_softmax_step, pow2_at_least


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_kt,
    stride_vn,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_oh,
    stride_btb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, N_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    n_in_block = offs_n < BLOCK_SIZE

    # The group's query heads: [G_PAD, D_PAD], zero in the padding.
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    context_len = tl.load(context_lens_ptr + seq)
    n_blocks = tl.cdiv(context_len, BLOCK_SIZE)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)

    for j in range(0, n_blocks):
        block = tl.load(block_tables_ptr + seq * stride_btb + j).to(tl.int64)
        tok = j * BLOCK_SIZE + offs_n
        n_mask = n_in_block & (tok < context_len)
        kv_mask = n_mask[:, None] & d_mask[None, :]

        k_ptrs = (
            k_ptr + block * stride_kn + kv_head * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [N_PAD, D_PAD]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, N_PAD] fp32
        s = tl.where(n_mask[None, :], s, float("-inf"))

        # Every visited block holds >= 1 valid token, so the new max is finite.
        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, s)

        v_ptrs = (
            v_ptr + block * stride_vn + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [N_PAD, D_PAD]
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    # context_len == 0 leaves l_i == 0: write zeros (as the reference does) instead of NaN.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def _check_inner_contiguous(name: str, t: torch.Tensor, inner: int) -> None:
    """The last ``inner`` dims of ``t`` must be laid out contiguously (any stride before them)."""
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(
                f"{name}: the last {inner} dim(s) must be contiguous; got shape {tuple(t.shape)} "
                f"strides {t.stride()}"
            )
        expected *= t.shape[dim]


def paged_decode_attention_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D], any dim-0 stride
    v_cache: torch.Tensor,  # [num_blocks, KV, bs, D], any dim-0 stride
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D], q's dtype
) -> torch.Tensor:
    """Paged decode attention; same contract as ``reference.paged_decode_attention_ref``.

    Raises ValueError on bad shapes, dtypes, devices or strides. Does not check on the host that
    ``context_lens[b] <= max_blocks * block_size`` or that block ids are in range (that would sync).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D]; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"k_cache and v_cache must be [num_blocks, KV, block_size, D]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {kv_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 1 or head_dim < 1:
        raise ValueError(f"block_size ({block_size}) and head_dim ({head_dim}) must be positive")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks]; got {tuple(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [B={batch}]; got {tuple(context_lens.shape)}")

    if q.dtype not in MODEL_DTYPES:
        raise ValueError(f"q dtype must be one of {MODEL_DTYPES}; got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache dtypes must match; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(
            f"block_tables and context_lens must be int32; got {block_tables.dtype}, {context_lens.dtype}"
        )

    device = q.device
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("context_lens", context_lens),
    ):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q is on {device}")

    _check_inner_contiguous("q", q, 1)
    _check_inner_contiguous("k_cache", k_cache, 3)
    _check_inner_contiguous("v_cache", v_cache, 3)
    _check_inner_contiguous("block_tables", block_tables, 1)
    _check_inner_contiguous("context_lens", context_lens, 1)

    if out is None:
        out = torch.empty_like(q)
    else:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != device:
            raise ValueError(
                f"out must be {tuple(q.shape)} {q.dtype} on {device}; got {tuple(out.shape)} "
                f"{out.dtype} on {out.device}"
            )
        _check_inner_contiguous("out", out, 1)

    if batch == 0 or num_heads == 0:
        return out

    group = num_heads // num_kv_heads
    grid = (batch, num_kv_heads)
    _paged_decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        G_PAD=pow2_at_least(group),
        D_PAD=pow2_at_least(head_dim),
        N_PAD=pow2_at_least(block_size),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584): upcast there.
        DOT_FP32=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=4,
    )
    return out
