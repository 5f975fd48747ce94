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

from baton.kernels import paged_attention as kernels
from baton.kernels.reference import gather_kv


@dataclass(frozen=True)
class PrefillSegment:
    start: int
    """First row of the chunk in the step's token batch."""
    end: int
    context_len: int
    """Tokens cached for the sequence once this chunk is written (prior + chunk)."""
    block_table: torch.Tensor
    """[num_blocks] int32 blocks of the sequence."""

    @property
    def num_prior(self) -> int:
        return self.context_len - (self.end - self.start)


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
    prefills: tuple[PrefillSegment, ...]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's new K/V ([N, KV, D]) into their slots."""
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, KV, D]
    v: torch.Tensor,  # [N, KV, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output [N, H, D] for the step's tokens; writes their K/V into the cache first."""
    write_kv(k_cache, v_cache, k, v, meta)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        kernels.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out=out[:nd]
        )
    for seg in meta.prefills:
        qs = q[seg.start : seg.end].transpose(0, 1)  # [H, T, D]
        if seg.num_prior == 0:
            ks = k[seg.start : seg.end].transpose(0, 1)  # [KV, T, D]
            vs = v[seg.start : seg.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = gather_kv(k_cache, seg.block_table, seg.context_len)  # [KV, S, D]
            vs = gather_kv(v_cache, seg.block_table, seg.context_len)
            pos_q = torch.arange(seg.num_prior, seg.context_len).view(-1, 1)
            mask = torch.arange(seg.context_len).view(1, -1) <= pos_q  # [T, S]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seg.start : seg.end] = o.transpose(0, 1)
    return out
