"""Fused per-layer elementwise ops, dispatched by device: the C++ kernels on CPU, their torch
references elsewhere. Each replaces several small torch ops whose dispatch cost dominates a
batch-1 decode step."""

from __future__ import annotations

import torch

from baton.kernels import kv_quant, reference


def add_rms_norm(
    residual: torch.Tensor,  # [N, H] fp32, updated in place
    delta: torch.Tensor | None,  # [N, H] model dtype
    weight: torch.Tensor,  # [H] fp32
    eps: float,
    out: torch.Tensor,  # [N, H] model dtype
) -> torch.Tensor:
    """``residual += delta``; ``out = rms_norm(residual) * weight`` in out's dtype."""
    if residual.is_cpu:
        from baton.kernels import cpu_ops

        cpu_ops.add_rms_norm(residual, delta, weight, eps, out)
    else:
        reference.add_rms_norm_ref(residual, delta, weight, eps, out)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(gate) * up`` for ``gate_up = [gate | up]``."""
    if gate_up.is_cpu:
        from baton.kernels import cpu_ops

        cpu_ops.silu_mul(gate_up, out)
    else:
        reference.silu_mul_ref(gate_up, out)
    return out


def row_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [M, k] of each row's k largest values, largest first: the C++ scan on CPU (ties in
    index order, k <= 32), ``torch.topk`` elsewhere."""
    cpu_ok = x.is_cpu and x.dim() == 2 and x.stride(-1) == 1 and 1 <= k <= min(32, x.shape[-1])
    if cpu_ok and x.dtype in (torch.bfloat16, torch.float32):
        from baton.kernels import cpu_ops

        return cpu_ops.row_topk(x, k)
    return x.topk(k, dim=-1).indices


def rope_and_cache(
    qkv: torch.Tensor,  # [N, (H + 2 KV) * D], q and k rotated in place
    positions: torch.Tensor,  # [N] int64
    cos: torch.Tensor,  # [max_pos, D] fp32
    sin: torch.Tensor,
    kv_layer: torch.Tensor,  # [num_blocks, 2, KV, block_size, D]
    slot_blocks: torch.Tensor,  # [N] int64
    slot_offsets: torch.Tensor,  # [N] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotary embedding on q and k (rotate-half), then k and v stored into their cache slots
    (quantized there if the cache is, ``kv_quant``)."""
    args = (qkv, positions, cos, sin, kv_layer, slot_blocks, slot_offsets, num_heads, num_kv_heads, head_dim)
    if kv_quant.is_quantized(kv_layer):
        kv_quant.rope_and_cache_quant(*args)
    elif qkv.is_cpu:
        from baton.kernels import cpu_ops

        cpu_ops.rope_and_cache(*args)
    else:
        reference.rope_and_cache_ref(*args)
