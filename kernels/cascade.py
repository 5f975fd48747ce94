"""Cascade decode attention: a shared-prefix pass per group of sequences, a suffix pass per
sequence, merged exactly by log-sum-exp. Dispatch by device, and the torch reference.

A group is decode rows whose block tables start with the same ``num_shared_blocks`` physical
blocks (prefix caching gives requests with a common prompt prefix the same ids). All the group's
queries attend to those blocks at once (a GEMM-shaped problem: the shared K/V read once, not once
per row), each row then attends to its own blocks, and the two partial softmaxes are merged
(FlashInfer's ``merge_state``). Rows in no group attend to their whole context. The result is
exact attention over each row's context: ``reference.paged_decode_attention_ref``.

CUDA tensors go to the Triton kernels (``triton_cascade``); CPU tensors to the C++ kernel
(``cpu/cascade.cpp``). ``cascade_decode_attention_ref`` below is the torch reference.
"""

from __future__ import annotations

import torch

from baton.kernels.cascade_groups import CascadeGroups
from baton.kernels.reference import gather_kv


def cascade_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    groups: CascadeGroups,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of every row over its paged context, attending each group's shared blocks
    once for the whole group. Same result as ``paged_decode_attention`` (to rounding)."""
    if q.is_cuda:
        from baton.kernels.triton_cascade import cascade_decode_attention_triton

        return cascade_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, groups, scale, out=out
        )
    from baton.kernels import cpu_ops

    return cpu_ops.cascade_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, groups.rows, groups.starts,
        groups.shared_blocks, scale, out=out,
    )  # fmt: skip


# --- torch reference --------------------------------------------------------------------------


def attention_with_lse_ref(
    q: torch.Tensor,  # [M, H, D]
    k: torch.Tensor,  # [KV, T, D]
    v: torch.Tensor,  # [KV, T, D]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row against the same T keys: normalized output [M, H, D] and log-sum-exp of
    the scaled scores [M, H], both fp32. T == 0 gives zeros and -inf."""
    m_rows, num_heads, head_dim = q.shape
    num_kv = k.shape[0]
    qg = q.float().view(m_rows, num_kv, num_heads // num_kv, head_dim)  # [M, KV, G, D]
    scores = torch.einsum("mkgd,ktd->mkgt", qg, k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)  # [M, KV, G]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    o = torch.einsum("mkgt,ktd->mkgd", probs, v.float())
    return o.reshape(m_rows, num_heads, head_dim), lse.reshape(m_rows, num_heads)


def merge_state(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from attention over each: outputs [..., D] weighted by
    exp(lse - lse_total). Either side may be empty (lse -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def cascade_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    groups: CascadeGroups,
    scale: float,
) -> torch.Tensor:
    """The cascade spelled out: per group one shared pass over all its queries, per row a suffix
    pass over its own blocks, merged by log-sum-exp. Returns [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    bs = k_cache.shape[2]
    o_shared = torch.zeros(batch, num_heads, head_dim)
    lse_shared = torch.full((batch, num_heads), float("-inf"))
    start = [0] * batch
    for members, n_blocks in groups.as_lists():
        table = block_tables[members[0]].cpu()
        k = gather_kv(k_cache.cpu(), table, n_blocks * bs)
        v = gather_kv(v_cache.cpu(), table, n_blocks * bs)
        o_shared[members], lse_shared[members] = attention_with_lse_ref(q[members].cpu(), k, v, scale)
        for r in members:
            start[r] = n_blocks
    out = torch.empty_like(q)
    for b in range(batch):
        table = block_tables[b, start[b] :].cpu()
        length = int(context_lens[b]) - start[b] * bs
        k = gather_kv(k_cache.cpu(), table, length)
        v = gather_kv(v_cache.cpu(), table, length)
        o_own, lse_own = attention_with_lse_ref(q[b : b + 1].cpu(), k, v, scale)
        o, _ = merge_state(o_shared[b : b + 1], lse_shared[b : b + 1], o_own, lse_own)
        out[b] = o[0].to(q.dtype)
    return out
