"""Torch references for the paged attention kernels. Slow and obvious on purpose.

KV cache layout used by every kernel (one layer's view of the block-major cache):
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]  (any strides on dim 0)
Token t of a sequence lives in block ``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached tokens as a dense [num_kv_heads, length, head_dim]."""
    block_size = cache.shape[2]
    n_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [nb, KV, bs, D]
    kv = blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], n_blocks * block_size, cache.shape[3])
    return kv[:, :length]


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens to attend to (including the current one)
    scale: float,
) -> torch.Tensor:
    """Single-query attention of each sequence over its paged context. Returns [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        k = gather_kv(k_cache, block_tables[b], length).float()  # [KV, T, D]
        v = gather_kv(v_cache, block_tables[b], length).float()
        qb = q[b].float().view(num_kv_heads, group, head_dim)  # [KV, G, D]
        scores = torch.einsum("kgd,ktd->kgt", qb, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("kgt,ktd->kgd", probs, v).reshape(num_heads, head_dim).to(q.dtype)
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, H, D], the new tokens of one sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,  # tokens cached for the sequence, including the T new ones
    scale: float,
) -> torch.Tensor:
    """Causal attention of T new tokens (the last T of ``context_len``) over the paged context."""
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = gather_kv(k_cache, block_table, context_len).float().repeat_interleave(group, 0)  # [H, T, D]
    v = gather_kv(v_cache, block_table, context_len).float().repeat_interleave(group, 0)
    scores = torch.einsum("thd,hsd->hts", q.float(), k) * scale
    start = context_len - num_new
    pos_q = torch.arange(start, context_len).view(-1, 1)
    pos_k = torch.arange(context_len).view(1, -1)
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,hsd->thd", probs, v).to(q.dtype)


# --- Fused elementwise ops (baton.kernels.cpu_ops.add_rms_norm / silu_mul / rope_and_cache) ---


def add_rms_norm_ref(
    residual: torch.Tensor,  # [N, H] float32, updated in place
    delta: torch.Tensor | None,  # [N, H] model dtype
    weight: torch.Tensor,  # [H] float32
    eps: float,
    out: torch.Tensor,  # [N, H] model dtype
) -> torch.Tensor:
    """``residual += delta.float()``; ``out = rms_norm(residual) * weight`` in out's dtype."""
    if delta is not None:
        residual.add_(delta.float())
    out.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))
    return out


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up = [gate | up] ([N, 2I]), op by op in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    res = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    if out is None:
        return res
    return out.copy_(res)


def rope_and_cache_ref(
    qkv: torch.Tensor,  # [N, (H + 2 * KV) * D], rotated in place
    positions: torch.Tensor,  # [N] int64
    cos: torch.Tensor,  # [max_pos, D] float32
    sin: torch.Tensor,
    kv_layer: torch.Tensor,  # [num_blocks, 2, KV, block_size, D]
    slot_blocks: torch.Tensor,  # [N] int64
    slot_offsets: torch.Tensor,  # [N] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """transformers' Llama ``apply_rotary_pos_emb`` (rotate-half, cos/sin cast to qkv's dtype, op by
    op in that dtype) on the q and k heads of qkv, in place; then k and v of each row into the cache."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    c = cos[positions].to(qkv.dtype).unsqueeze(1)  # [N, 1, D]
    s = sin[positions].to(qkv.dtype).unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    q = qkv[:, :q_size].view(n, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(n, num_kv_heads, head_dim)
    q.copy_((q * c) + (rotate_half(q) * s))
    k.copy_((k * c) + (rotate_half(k) * s))
    kv_layer[slot_blocks, 0, :, slot_offsets] = k
    kv_layer[slot_blocks, 1, :, slot_offsets] = v
