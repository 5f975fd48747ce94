"""What the Triton kernels share: the activation dtypes they take, whether they run under the
interpreter (``TRITON_INTERPRET=1``: bf16 dots go through fp32 there), their power-of-two tile
sizes, and the online-softmax step of their attention loops. Imports triton at the top, like the
kernels that use it."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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


@triton.jit
def online_softmax_step(m_i, l_i, s):
    """One key block of the online softmax, for rows of scaled scores ``s`` [M, N] (masked keys
    -inf; every row at least one finite score, or a finite ``m_i``). Returns the new running max
    ``m_i`` [M], ``alpha`` [M] (what the accumulator is to be multiplied by before the block's
    ``p @ v`` is added), the block's probabilities ``p`` [M, N] and the new running sum ``l_i`` [M].
    A jitted function is inlined into its caller: the kernels compile as when each spelt it out."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, alpha, p, l_i
