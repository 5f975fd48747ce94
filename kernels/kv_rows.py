"""The row layout of a quantized KV cache: each (token, kv head) row is D 1-byte codes, then the
row's bf16 scale in two bytes. Shared by the formats and references (``kv_quant``) and the Triton
kernel (``triton_decode_quant``)."""

from __future__ import annotations

import torch

SCALE_BYTES = 2
"""Bytes of the bf16 scale at the end of each (token, kv head) row."""


def split_rows(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of a quantized cache ``[..., D + 2]``: codes ``[..., D]`` and bf16 scales ``[...]``."""
    d = cache.shape[-1] - SCALE_BYTES
    return cache[..., :d], cache[..., d:].view(torch.bfloat16).squeeze(-1)
