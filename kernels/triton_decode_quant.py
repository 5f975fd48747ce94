"""Triton paged decode attention over a quantized KV cache (``kv_rows``' row layout: D 1-byte codes,
then the row's bf16 scale). The program layout is ``triton_decode``'s: one program per (sequence,
kv head), the G query heads of the group as one [G_PAD, D_PAD] tile, an online softmax in fp32.

The codes are read as bytes and decoded with integer ops, so the kernel is the same under the
interpreter (numpy has no fp8) and on the GPU: int8 sign-extends; an e5m2 code is the high byte of
an fp16; an e4m3fn code, sign-extended and shifted left by 7 (bit 14 cleared), is the fp16 of its
value times 2^-8, and the 2^8 joins the row's scale. Each K row's scale multiplies its scores, each V
row's scale its softmax weight.

Imports triton at the top: import it only where triton is installed. The torch reference is
``kv_quant.paged_decode_attention_quant_ref``; tests/kernels/test_kv_quant.py compares them under
TRITON_INTERPRET=1, tests/gpu/test_kv_quant_gpu.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.kv_rows import SCALE_BYTES, split_rows
from baton.kernels.triton_common import MODEL_DTYPES, online_softmax_step, pow2_at_least

_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


@triton.jit
def _decode_codes(raw, FMT: tl.constexpr):
    """uint8 codes -> fp32 values (e4m3: times 2^-8, see the module docstring)."""
    if FMT == 0:
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 2:
        return (raw.to(tl.int16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        h = (raw.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16385  # 0xBFFF: bit 14 cleared
        return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _paged_decode_quant_kernel(
    q_ptr,
    k_ptr,  # uint8 view of the K codes
    v_ptr,
    ks_ptr,  # bf16 view of the K scales
    vs_ptr,
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
    stride_ksn,
    stride_ksh,
    stride_kst,
    stride_vsn,
    stride_vsh,
    stride_vst,
    stride_ob,
    stride_oh,
    stride_btb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    FMT: tl.constexpr,
    FACTOR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, N_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    n_in_block = offs_n < BLOCK_SIZE

    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

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
        k = _decode_codes(tl.load(k_ptrs, mask=kv_mask, other=0), FMT)  # [N_PAD, D_PAD]
        ks_ptrs = ks_ptr + block * stride_ksn + kv_head * stride_ksh + offs_n * stride_kst
        ks = tl.load(ks_ptrs, mask=n_mask, other=0.0).to(tl.float32) * FACTOR  # [N_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (ks[None, :] * scale)  # [G_PAD, N_PAD]
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, s)

        v_ptrs = (
            v_ptr + block * stride_vn + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        )
        v = _decode_codes(tl.load(v_ptrs, mask=kv_mask, other=0), FMT)
        vs_ptrs = vs_ptr + block * stride_vsn + kv_head * stride_vsh + offs_n * stride_vst
        vs = tl.load(vs_ptrs, mask=n_mask, other=0.0).to(tl.float32) * FACTOR
        acc = acc * alpha[:, None] + tl.dot(p * vs[None, :], v, input_precision=PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_decode_attention_quant_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D + 2], quantized, any dim-0 stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``kv_quant.paged_decode_attention_quant_ref``; ValueError on bad inputs."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [B, H, D] and both caches [num_blocks, KV, block_size, D + 2]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in _CODES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"not a quantized KV cache: {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in MODEL_DTYPES:
        raise ValueError(f"q dtype must be one of {MODEL_DTYPES}; got {q.dtype}")
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, row = k_cache.shape
    if row != head_dim + SCALE_BYTES:
        raise ValueError(f"cache rows of {row} bytes do not hold head_dim {head_dim} plus a 2-byte scale")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1 or t.stride(2) != row or t.stride(1) != block_size * row:
            raise ValueError(f"{name}: the last 3 dims must be contiguous; strides {t.stride()}")
    if q.stride(2) != 1:
        raise ValueError(f"q must be contiguous in its last dim; strides {q.stride()}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if batch == 0 or num_heads == 0:
        return out
    k_codes, k_scales = split_rows(k_cache)
    v_codes, v_scales = split_rows(v_cache)
    k_codes, v_codes = k_codes.view(torch.uint8), v_codes.view(torch.uint8)
    fmt = _CODES[k_cache.dtype]
    group = num_heads // num_kv_heads
    _paged_decode_quant_kernel[(batch, num_kv_heads)](
        q,
        k_codes,
        v_codes,
        k_scales,
        v_scales,
        out,
        block_tables,
        context_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_codes.stride(0),
        k_codes.stride(1),
        k_codes.stride(2),
        v_codes.stride(0),
        v_codes.stride(1),
        v_codes.stride(2),
        k_scales.stride(0),
        k_scales.stride(1),
        k_scales.stride(2),
        v_scales.stride(0),
        v_scales.stride(1),
        v_scales.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        G_PAD=pow2_at_least(group),
        D_PAD=pow2_at_least(head_dim),
        N_PAD=pow2_at_least(block_size),
        FMT=fmt,
        FACTOR=256.0 if fmt == 1 else 1.0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
