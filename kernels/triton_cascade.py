"""Triton cascade decode attention (see ``cascade.py`` for the contract).

Two kernels per call:
  * shared pass, one program per (group, kv head, tile of M_TILE query rows): the rows are the
    group's (member, query head) pairs, all against the group's shared blocks, so each block's K/V
    tile is loaded once for M_TILE rows and the scores are one ``tl.dot`` of [M_TILE, D] x [D, bs];
    it writes each row's normalized partial output and log-sum-exp (fp32 scratch);
  * suffix pass, one program per (sequence, kv head): the paged decode kernel of
    ``triton_decode`` over the sequence's own blocks only, its online softmax started from the
    shared pass's state (max = lse, sum = 1, acc = partial output), which is the log-sum-exp merge.
``cascade.cascade_decode_attention_ref`` is the torch reference; ``tests/kernels/test_cascade.py``
compares them under TRITON_INTERPRET=1. This module imports triton at the top.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.cascade_groups import CascadeGroups
from baton.kernels.triton_common import MODEL_DTYPES, interpreting, online_softmax_step, pow2_at_least

M_TILE = 16
"""Query rows per shared-pass program (the smallest ``tl.dot`` tile)."""


@triton.jit
def _shared_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,  # [B, H, D] fp32
    lse_ptr,  # [B, H] fp32
    block_tables_ptr,
    group_rows_ptr,
    group_starts_ptr,
    group_blocks_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_kt,
    stride_vn,
    stride_vh,
    stride_vt,
    stride_btb,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    M_TILE: tl.constexpr,
    D_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    first = tl.load(group_starts_ptr + g)
    n_rows = (tl.load(group_starts_ptr + g + 1) - first) * GROUP

    offs_m = tile * M_TILE + tl.arange(0, M_TILE)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, N_PAD)
    m_mask = offs_m < n_rows
    d_mask = offs_d < HEAD_DIM
    n_mask = offs_n < BLOCK_SIZE  # shared blocks are full
    kv_mask = n_mask[:, None] & d_mask[None, :]

    rows = tl.load(group_rows_ptr + first + offs_m // GROUP, mask=m_mask, other=0).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP
    q_ptrs = q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [M_TILE, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)

    table = block_tables_ptr + tl.load(group_rows_ptr + first).to(tl.int64) * stride_btb
    # Programs past the group's rows walk no blocks (the grid is sized for the largest group).
    n_blocks = tl.where(tile * M_TILE < n_rows, tl.load(group_blocks_ptr + g), 0)

    m_i = tl.full([M_TILE], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M_TILE], dtype=tl.float32)
    acc = tl.zeros([M_TILE, D_PAD], dtype=tl.float32)
    for j in range(0, n_blocks):
        block = tl.load(table + j).to(tl.int64)
        k_ptrs = (
            k_ptr + block * stride_kn + kv_head * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [N_PAD, D_PAD]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M_TILE, N_PAD]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
        v_ptrs = (
            v_ptr + block * stride_vn + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    state = rows * NUM_HEADS + heads
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o_ptrs = o_ptr + state[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=m_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + state, m_i + tl.log(l_safe), mask=m_mask)


@triton.jit
def _suffix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    o_state_ptr,  # [B, H, D] fp32
    lse_state_ptr,  # [B, H] fp32, -inf: no shared pass
    block_tables_ptr,
    context_lens_ptr,
    start_blocks_ptr,  # [B] int32
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
    NUM_HEADS: tl.constexpr,
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

    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # The shared pass's result as the starting state of the online softmax.
    state = seq * NUM_HEADS + heads
    lse = tl.load(lse_state_ptr + state, mask=g_mask, other=float("-inf"))
    has_shared = lse > float("-inf")
    o_prev = tl.load(
        o_state_ptr + state[:, None] * HEAD_DIM + offs_d[None, :],
        mask=has_shared[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = lse
    l_i = tl.where(has_shared, 1.0, 0.0)
    acc = o_prev

    context_len = tl.load(context_lens_ptr + seq)
    n_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    for j in range(tl.load(start_blocks_ptr + seq), n_blocks):
        block = tl.load(block_tables_ptr + seq * stride_btb + j).to(tl.int64)
        tok = j * BLOCK_SIZE + offs_n
        n_mask = n_in_block & (tok < context_len)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = (
            k_ptr + block * stride_kn + kv_head * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, s)  # every visited block has a token
        v_ptrs = (
            v_ptr + block * stride_vn + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def _start_blocks(groups: CascadeGroups, batch: int, device: torch.device) -> torch.Tensor:
    """[B] int32: each row's first own block (its group's shared count; 0 outside groups)."""
    start = torch.zeros(batch, dtype=torch.int32, device=device)
    counts = (groups.starts[1:] - groups.starts[:-1]).long()
    per_row = groups.shared_blocks.repeat_interleave(counts, output_size=groups.rows.numel())
    start[groups.rows.long()] = per_row
    return start


def _check(q, k_cache, v_cache, block_tables, context_lens, groups: CascadeGroups, out) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D]; got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, KV, block_size, D]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    if k_cache.shape[3] != head_dim or num_kv == 0 or num_heads % num_kv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if q.dtype not in MODEL_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache dtypes must match and be one of {MODEL_DTYPES}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables must be [B, max_blocks] and context_lens [B]")
    for t in (block_tables, context_lens, groups.rows, groups.starts, groups.shared_blocks):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError("block_tables, context_lens and the groups must be int32 on q's device")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables must be contiguous in their last dim")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")


def cascade_decode_attention_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D], any dim-0 stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    groups: CascadeGroups,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cascade decode attention; same contract as ``cascade.cascade_decode_attention_ref``.
    Raises ValueError on bad shapes, dtypes, devices or strides (group contents are trusted: the
    planner built them, and checking would sync)."""
    _check(q, k_cache, v_cache, block_tables, context_lens, groups, out)
    out = torch.empty_like(q) if out is None else out
    batch, num_heads, head_dim = q.shape
    num_kv, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    if batch == 0:
        return out
    o_state = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse_state = torch.full((batch, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    common = dict(
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        D_PAD=pow2_at_least(head_dim),
        N_PAD=pow2_at_least(block_size),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584): upcast there.
        DOT_FP32=q.dtype == torch.bfloat16 and interpreting(),
        num_warps=4,
    )
    strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    if groups.num_groups:
        tiles = triton.cdiv(groups.rows.numel() * group, M_TILE)
        _shared_kernel[(groups.num_groups, num_kv, tiles)](
            q, k_cache, v_cache, o_state, lse_state, block_tables,
            groups.rows, groups.starts, groups.shared_blocks, float(scale),
            q.stride(0), q.stride(1), *strides, block_tables.stride(0),
            M_TILE=M_TILE, **common,
        )  # fmt: skip
    _suffix_kernel[(batch, num_kv)](
        q, k_cache, v_cache, out, o_state, lse_state, block_tables, context_lens,
        _start_blocks(groups, batch, q.device), float(scale),
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1), block_tables.stride(0),
        G_PAD=pow2_at_least(group), **common,
    )  # fmt: skip
    return out
