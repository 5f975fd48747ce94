"""The paged decode attention the engine calls, dispatched by device.

CUDA tensors go to the Triton kernel; CPU tensors to the C++ kernel built from ``cpu/``; a quantized
cache (``--kv-cache-dtype``) to the kernels of ``kv_quant``, which dequantize as they read.
"""

from __future__ import annotations

import torch

from baton.kernels import kv_quant


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if kv_quant.is_quantized(k_cache):
        return kv_quant.paged_decode_attention_quant(
            q, k_cache, v_cache, block_tables, context_lens, scale, out
        )
    if q.is_cuda:
        from baton.kernels.triton_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)
    from baton.kernels import cpu_ops

    return cpu_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out)


def paged_prefill_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, bs, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk's new tokens over its paged context (CPU kernel only)."""
    if q.is_cuda:
        raise NotImplementedError("no paged prefill kernel for CUDA yet; use SDPA")
    if kv_quant.is_quantized(k_cache):
        return kv_quant.paged_prefill_attention_quant(
            q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=out
        )
    from baton.kernels import cpu_ops

    return cpu_ops.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out=out
    )
