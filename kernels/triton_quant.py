"""Triton GEMM with fp8 (e4m3) weights and per-output-channel scales: ``--quantization fp8`` on a GPU.

``out[M, N] = (x[M, K] @ dequant(W)[N, K].T)`` with ``dequant(W)[n, k] = e4m3(W[n, k]) * scale[n]``.
One program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K steps: it loads a tile of codes
(1 byte each: half the bytes of bf16 weights), decodes them to floats in registers, and
accumulates ``tl.dot`` in fp32; the channel scale factors out of the sum and is applied once at the
end. The codes arrive as their uint8 bits and are decoded with integer ops (sign, 4-bit exponent
with bias 7, 3-bit mantissa, subnormals), which runs the same on every GPU and under
``TRITON_INTERPRET=1``, where the tests compare it with ``fp8_linear_ref``.

This module imports triton at the top: import it only where triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.triton_common import MODEL_DTYPES


@triton.jit
def _decode_e4m3(bits):
    """uint8 e4m3fn bits -> fp32 values (no NaN codes are ever written by ``quantize_fp8``)."""
    b = bits.to(tl.int32)
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = (b & 0x7).to(tl.float32)
    normal = (1.0 + mant * 0.125) * tl.exp2((exp - 7).to(tl.float32))
    subnormal = mant * 0.001953125  # 2^-9: mantissa / 8 * 2^-6
    return sign * tl.where(exp == 0, subnormal, normal)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )  # [BM, BK]
        bits = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0,
        )  # [BK, BN]
        w = _decode_e4m3(bits)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            # Every e4m3 value is exact in bf16/fp16: the product runs on the tensor cores.
            acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def fp8_linear(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32, last dim contiguous
    qweight: torch.Tensor,  # [N, K] float8_e4m3fn (or its uint8 bits), contiguous
    scale: torch.Tensor,  # [N] fp32
    out: torch.Tensor | None = None,  # [M, N] in x's dtype
    fp32_dot: bool | None = None,
) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T`` in x's dtype. ``fp32_dot`` (default: x is fp32 or
    the interpreter runs) multiplies in fp32 instead of x's dtype."""
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and qweight {tuple(qweight.shape)} do not multiply")
    if x.dtype not in MODEL_DTYPES:
        raise ValueError(f"x must be one of {MODEL_DTYPES}, got {x.dtype}")
    if qweight.dtype not in (torch.float8_e4m3fn, torch.uint8) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous float8_e4m3fn codes, got {qweight.dtype}")
    n, k = qweight.shape
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 of shape ({n},), got {scale.dtype} {tuple(scale.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with a contiguous last dim")
    if fp32_dot is None:
        fp32_dot = x.dtype == torch.float32 or x.device.type == "cpu"
    bits = qweight.view(torch.uint8)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp8_linear_kernel[grid](
        x, bits, scale, out, m, n, k, x.stride(0), bits.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, FP32_DOT=fp32_dot,
    )  # fmt: skip
    return out


def fp8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch reference, in fp32: [M, N] in x's dtype."""
    w = qweight.view(torch.float8_e4m3fn).float() * scale.float()[:, None]
    return (x.float() @ w.t()).to(x.dtype)
