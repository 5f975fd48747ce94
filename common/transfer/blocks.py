"""The KV cache seen as bytes: one row per block, so a run of blocks is one contiguous slice."""

from __future__ import annotations

import torch


def as_block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[num_blocks, ...]`` as a uint8 ``[num_blocks, bytes_per_block]`` view, no copy.

    Transports receive straight into slices of this view, so the cache must be contiguous.
    """
    if cache.dim() < 2 or not cache.is_contiguous():
        raise ValueError(f"KV cache must be a contiguous [num_blocks, ...] tensor, got {tuple(cache.shape)}")
    num_blocks = cache.shape[0]
    return cache.view(torch.uint8).view(num_blocks, -1)  # [N, bytes_per_block]
