"""Paged attention for a step: metadata planned once per step, then run by every layer.

The batch is laid out as ``[decode tokens | prefill chunk 0 | prefill chunk 1 | ...]``: requests
with one new token come first and share one paged-decode kernel call; each prefill chunk attends
causally to its own tokens and to whatever its sequence has cached before it.

KV cache: one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``. A block
is contiguous across layers, so moving a block between workers is one copy; a layer's K is the
strided view ``cache[:, layer, 0]`` of shape ``[num_blocks, num_kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.kernels import kv_quant
from baton.kernels import paged_attention as kernels
from baton.kernels.cascade import cascade_decode_attention
from baton.kernels.cascade_groups import CascadeGroups
from baton.kernels.reference import gather_kv


@dataclass(frozen=True)
class PrefillSegment:
    start: int
    """First row of the chunk in the step's token batch."""
    end: int
    context_len: int
    """Tokens cached for the sequence once this chunk is written (prior + chunk)."""
    block_table: tuple[int, ...]
    """Blocks of the sequence."""

    @property
    def num_prior(self) -> int:
        return self.context_len - (self.end - self.start)


@dataclass(frozen=True)
class FreshRun:
    """``count`` consecutive chunks of ``length`` tokens each with nothing cached before them:
    attended as one batched causal SDPA over the step's own K/V."""

    start: int
    count: int
    length: int


def plan_prefills(
    segments: tuple[PrefillSegment, ...],
) -> tuple[tuple[FreshRun, ...], tuple[PrefillSegment, ...]]:
    """Split prefill chunks into batched runs of fresh equal-length chunks, and chunks that
    attend to cached context (one call each)."""
    runs: list[FreshRun] = []
    with_context: list[PrefillSegment] = []
    for seg in segments:
        n = seg.end - seg.start
        if seg.num_prior:
            with_context.append(seg)
        elif runs and runs[-1].length == n and runs[-1].start + runs[-1].count * n == seg.start:
            last = runs[-1]
            runs[-1] = FreshRun(last.start, last.count + 1, n)
        else:
            runs.append(FreshRun(seg.start, 1, n))
    return tuple(runs), tuple(with_context)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_blocks: torch.Tensor
    """[N] int64, the block each new token's K/V goes to."""
    slot_offsets: torch.Tensor
    """[N] int64, its offset inside that block."""
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    """[num_decode_tokens, max_blocks] int32."""
    decode_context_lens: torch.Tensor
    """[num_decode_tokens] int32, context including the new token."""
    fresh_runs: tuple[FreshRun, ...]
    """Prefill chunks with nothing cached before them, batched by length."""
    context_prefills: tuple[PrefillSegment, ...]
    """Prefill chunks that attend to tokens cached in earlier steps."""
    prefill_block_tables: torch.Tensor
    """[num_prefills, max_blocks] int32, for the paged prefill kernel (all chunks in one call)."""
    prefill_context_lens: torch.Tensor
    """[num_prefills] int32."""
    prefill_query_start_loc: torch.Tensor
    """[num_prefills + 1] int32: chunk i owns rows ``[loc[i], loc[i + 1])`` of the step."""
    num_padding_tokens: int = 0
    """Rows after every request's, that only round the step up to a precompiled shape: their K/V
    go to a scratch block and their attention output is zero."""
    cascade: CascadeGroups | None = None
    """Decode rows whose shared prefix blocks are attended once per group (``cascade_plan``)."""


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, KV, D]
    v: torch.Tensor,  # [N, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output [N, H, D] for the step's tokens, whose K/V are already in the cache."""
    out = torch.empty_like(q)
    if meta.num_padding_tokens:
        out[q.shape[0] - meta.num_padding_tokens :].zero_()
    nd = meta.num_decode_tokens
    # A cache in another dtype than q (quantized KV) takes the plain kernel, which dequantizes.
    if nd and meta.cascade is not None and k_cache.dtype == q.dtype:
        cascade_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, meta.cascade,
            scale, out=out[:nd],
        )  # fmt: skip
    elif nd:
        kernels.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out=out[:nd]
        )
    if meta.prefill_context_lens.numel() == 0:
        return out
    if q.is_cpu:
        kernels.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_context_lens,
            meta.prefill_query_start_loc,
            scale,
            out=out,
        )
        return out
    _sdpa_prefill(q, k, v, k_cache, v_cache, meta, scale, out)
    return out


def _sdpa_prefill(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """Prefill attention with torch's SDPA, for devices without a paged prefill kernel."""
    num_heads, group = q.shape[1], q.shape[1] // k.shape[1]
    # SDPA's fused CPU kernel wants 4-D inputs: 3-D ones fall back to the unfused path, 10-20x
    # slower here. With 4-D inputs, enable_gqa is as fast as K/V expanded by hand, without the copy.
    for run in meta.fresh_runs:
        rows = slice(run.start, run.start + run.count * run.length)
        qs = q[rows].view(run.count, run.length, num_heads, -1).transpose(1, 2)  # [B, H, T, D]
        ks = k[rows].view(run.count, run.length, k.shape[1], -1).transpose(1, 2)  # [B, KV, T, D]
        vs = v[rows].view(run.count, run.length, v.shape[1], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[rows] = o.transpose(1, 2).reshape(-1, num_heads, q.shape[2])
    for seg in meta.context_prefills:
        qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        dev = q.device  # every tensor here on q's: SDPA refuses a CPU mask for CUDA queries
        table = torch.tensor(seg.block_table, dtype=torch.int32, device=dev)
        ks = _gather(k_cache, table, seg.context_len, q.dtype).repeat_interleave(group, 0).unsqueeze(0)
        vs = _gather(v_cache, table, seg.context_len, q.dtype).repeat_interleave(group, 0).unsqueeze(0)
        pos_q = torch.arange(seg.num_prior, seg.context_len, device=dev).view(-1, 1)
        visible = torch.arange(seg.context_len, device=dev).view(1, -1) <= pos_q  # [T, S]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=dev).masked_fill_(~visible, float("-inf"))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[seg.start : seg.end] = o[0].transpose(0, 1)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``gather_kv``, dequantized if the cache is quantized (``--kv-cache-dtype``)."""
    if kv_quant.is_quantized(cache):
        return kv_quant.gather_kv_dequant(cache, table.to(cache.device), length, dtype)
    return gather_kv(cache, table, length)
