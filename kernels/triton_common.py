"""What the Triton kernels share: the activation dtypes they take, whether they run under the
interpreter (``TRITON_INTERPRET=1``: bf16 dots go through fp32 there) and their power-of-two tile
sizes. Imports triton at the top, like the kernels that use it."""

from __future__ import annotations

import os

import torch
import triton

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The dtypes of the queries, outputs and unquantized caches the kernels accept."""


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on the CPU) rather than compiling them."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2_at_least(n: int, floor: int = 16) -> int:
    """A tile dimension: the next power of two of ``n``, at least ``floor``."""
    return max(floor, triton.next_power_of_2(n))
