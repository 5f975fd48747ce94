"""Quantized weights: ``--quantization int8`` (W8A8) and ``fp8`` (e4m3 weights), quantized at load
from the bf16/fp32 weights or read from a compressed-tensors checkpoint (the layout vLLM reads).

- **int8**: symmetric per-output-channel int8 weights. Rows of activations are quantized per token
  (dynamic, symmetric; one pass, ``cpu_ops.int8_quantize_rows``, stored + 128 as uint8 with zero
  point 128, the form oneDNN's fast kernels take) and multiplied on the CPU's integer dot-product
  instructions (AMX-INT8 or AVX512-VNNI, oneDNN's ``qlinear_pointwise``; on an x86 CPU without
  them, 7-bit activation codes: ``act_qmax``);
  the int32 product is scaled back by the channel's scale (inside oneDNN) and the token's. Below
  ``WEIGHT_ONLY_BELOW`` rows a weight-only int8 kernel (``torch._weight_int8pack_mm``: int8
  weights, activations in the model dtype) is faster: the product is bound by reading the
  weights, and quantizing the activations would only add work. Before quantizing, the model is
  smoothed (SmoothQuant, ``quant_calibration``: per-channel scales folded between each norm and the
  q/k/v or gate/up projection it feeds, set from one prefill of ``CALIBRATION_TEXT``), and the LM
  head stays bf16: SmolLM2's perplexity goes from 1.061x bf16's to 1.024x (``baton bench accuracy``).
- **fp8**: e4m3 weights with a per-output-channel scale. A per-channel scale factors out of the
  product, so the codes are widened to the model dtype block by block right before the GEMM
  (``cpu_ops.fp8_widen``, a table lookup) and the output columns are scaled; on a GPU, a Triton kernel does the same in registers
  (``kernels.triton_quant``).

The model is built and loaded as usual; ``quant_calibration.prepare_quantization`` smooths it
(int8) and ``quantize_model`` then swaps its projections (and the LM head where
``QUANTIZE_LM_HEAD`` says) for the modules here, so ``llama.py`` knows nothing of the formats.
Checkpoints in the compressed-tensors layout are read and written by ``quant_checkpoint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from baton.common.model.quant_names import check_quantization

if TYPE_CHECKING:
    from baton.common.model.llama import LlamaForCausalLM

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448

WEIGHT_ONLY_BELOW = 4
"""Without the fused VNNI kernel, projections of fewer rows take the weight-only kernel: at 1-3
rows (batch-1 decode) it reads the int8 weight at ~1.5-2.5x the speed of the bf16 oneDNN GEMM,
and quantizing the activations costs more than their product saves; from 4 rows up its time grows
with the rows and W8A8 wins (SmolLM2's shapes, one thread of a Xeon with AMX; the LM head stays
bf16: ``QUANTIZE_LM_HEAD``)."""
FUSED_BELOW = 64
"""Below this many rows (a decode step's batch), W8A8 runs in one call of Baton's own VNNI kernel
(``cpu_ops.int8_gemm``) where the CPU has it, from the first row (the weight-only kernel is then
not used); from here up (prefill chunks, big batches) in oneDNN's, whose blocking (and AMX where
the CPU has it) wins once the product is big. ``python -m baton.bench.gemm --threads 2`` on a
2-core AMD EPYC with AVX512-VNNI (ms for all 30 layers' projections): 1 row 6.7 fused against
9.0 weight-only and 12.9 oneDNN W8A8 (bf16 16.0); 32 rows 15.8 / 18.3; 64 rows 27.2 / 26.8;
128 rows 49.9 / 45.4."""
ACT_QMAX = 127
"""The W8A8 activations' codes lie in [-ACT_QMAX, ACT_QMAX]; oneDNN gets them + ACT_QMAX + 1 as
uint8 (zero point 128)."""
ACT_QMAX_NO_VNNI = 63
"""The same on an x86 CPU without VNNI or AMX-INT8: oneDNN multiplies uint8 by int8 there with
vpmaddubsw, which adds pairs of products into int16 and saturates past 32,767 (255 x 127 x 2 is
64,770): 7-bit codes + 64 keep every pair sum exact (127 x 127 x 2 = 32,258). Measured on a
2-core AMD EPYC with AVX2 only: 8-bit codes gave a relative error of ~0.02 against the exact
integer product; 7-bit ones match it, at ~0.015 against fp32 (8-bit with VNNI: ~0.008)."""
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""x86 flags of instructions that add uint8 x int8 products into int32 without saturating."""


def exact_u8s8_products() -> bool:
    """Whether oneDNN's uint8 x int8 GEMM is exact for 8-bit codes on this CPU: anything but an
    x86 CPU without ``INT8_DOT_FLAGS`` (unreadable flags count as able)."""
    from baton.kernels.isa import cpu_flags

    flags = cpu_flags()
    x86 = "sse2" in flags
    return not x86 or bool(flags & set(INT8_DOT_FLAGS))


FP8_BLOCK_ROWS = 1024
"""Output channels widened at once in the CPU fp8 path: a block of bf16 weights stays in L2."""


# -- quantize / dequantize ----------------------------------------------------------------------
def _channel_scale(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """[N, K] -> [N] fp32 symmetric scales; an all-zero row gets scale 1 (its codes are 0)."""
    amax = w.detach().float().abs().amax(dim=1)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``w ~= q * scale[:, None]``; q in [-127, 127]."""
    scale = _channel_scale(w, INT8_MAX)
    q = torch.round(w.float() / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: ``w ~= q.float() * scale[:, None]``; |q| <= 448."""
    scale = _channel_scale(w, FP8_MAX)
    q = (w.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (int8 or e4m3) and per-channel scales [N] -> fp32 weights [N, K]."""
    return q.float() * scale.float()[:, None]


def quantize_rows_int8(x: torch.Tensor, qmax: int = ACT_QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 of activations [M, K] -> codes [M, K] in [-qmax, qmax] and fp32
    scales [M, 1]."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).div_(qmax).clamp_(min=1e-12)
    return torch.round(xf * scale.reciprocal()).clamp_(-qmax, qmax).to(torch.int8), scale


# -- quantized projections ----------------------------------------------------------------------
class QuantLinear(nn.Module):
    """A projection ``y = x @ W.T`` with quantized W ([out, in] codes, [out] fp32 scales).

    ``dtype`` is the activation dtype (the model's), as ``llama.Linear.dtype`` is; ``out_dtype`` the
    output's (the model dtype, or fp32 for the LM head, whose logits are wanted in fp32)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype
    ):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.dtype, self.out_dtype = dtype, out_dtype
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())

    def weight_fp32(self) -> torch.Tensor:
        """The dequantized weight (for references and tests)."""
        return dequantize(self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, codes={self.qweight.dtype}"


class Int8Linear(QuantLinear):
    """W8A8 int8 (dynamic per-token activations, oneDNN's u8 x s8 GEMM on AMX-INT8/VNNI) from
    ``weight_only_below`` rows up; below, weight-only int8 (activations stay in the model dtype).

    ``None`` for ``weight_only_below`` and ``act_qmax`` means this CPU's: ``WEIGHT_ONLY_BELOW`` and
    ``ACT_QMAX`` where its integer products are exact (``exact_u8s8_products``); elsewhere W8A8 at
    every row count (torch's weight-only kernel has no fast path there: 5-30x slower than oneDNN's
    int8 GEMM on an AVX2 EPYC) with ``ACT_QMAX_NO_VNNI``."""

    scale_act: torch.Tensor
    zero_points: torch.Tensor

    def __init__(
        self,
        qweight,
        scale,
        dtype,
        out_dtype,
        weight_only_below: int | None = None,
        fused_below: int = FUSED_BELOW,
        act_qmax: int | None = None,
    ):
        super().__init__(qweight, scale, dtype, out_dtype)
        exact = exact_u8s8_products() if weight_only_below is None or act_qmax is None else True
        self.act_qmax = act_qmax if act_qmax is not None else (ACT_QMAX if exact else ACT_QMAX_NO_VNNI)
        # The fused kernel runs 8-bit codes on VNNI: only where they are exact.
        fuse = fused_below > (weight_only_below or 0) and self.act_qmax == ACT_QMAX
        self.fused = pack_fused_int8(self.qweight) if fuse else None
        self.fused_below = fused_below if self.fused is not None else 0
        if weight_only_below is None:
            # The fused kernel beats the weight-only one from the first row (it reads the same
            # int8 weight and multiplies in int32); without it, W8A8 from WEIGHT_ONLY_BELOW rows.
            weight_only_below = WEIGHT_ONLY_BELOW if exact and self.fused is None else 0
        self.weight_only_below = weight_only_below
        # The weight-only kernel wants its scales in the activations' dtype.
        self.register_buffer("scale_act", self.scale.to(dtype))
        self.packed = prepack_int8(self.qweight)
        self.register_buffer("zero_points", _zero_points(self.scale), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if x.device.type != "cpu":
            return F.linear(x, self.weight_fp32().to(x.dtype)).to(self.out_dtype)
        m = x.shape[0]
        if m < self.weight_only_below:
            return weight_only_int8_mm(x, self.qweight, self.scale_act).to(self.out_dtype)
        if self.fused is not None and m < self.fused_below:
            return fused_int8_mm(x, self.fused, self.scale, self.out_dtype)
        return w8a8_int8_mm(
            x, self.qweight, self.scale, self.out_dtype, self.packed, self.zero_points, self.act_qmax
        )


def pack_fused_int8(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weight in ``cpu_ops.int8_gemm``'s layout and its column sums, or None where that kernel
    cannot run it (no AVX512-VNNI, not on the CPU, K not a multiple of 4)."""
    from baton.kernels import cpu_ops

    if qweight.device.type != "cpu" or qweight.shape[1] % 4 or not cpu_ops.int8_gemm_available():
        return None
    return cpu_ops.int8_gemm_pack(qweight)


def fused_int8_mm(
    x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The W8A8 product in one call of ``cpu_ops.int8_gemm`` (quantize, VNNI product, scales)."""
    from baton.kernels import cpu_ops

    packed, sums = fused
    out = torch.empty((x.shape[0], scale.shape[0]), dtype=x.dtype)
    cpu_ops.int8_gemm(x.contiguous(), packed, sums, scale, out)
    return out if out_dtype == x.dtype else out.to(out_dtype)


def prepack_int8(qweight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of an int8 weight for ``qlinear_pointwise``, or None without it."""
    if qweight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.onednn.qlinear_prepack(qweight, None)
    except (RuntimeError, AttributeError):
        return None


def weight_only_int8_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp32) @ (qweight [N, K] int8 * scale [N]).T -> [M, N] in x's dtype."""
    return torch._weight_int8pack_mm(x.contiguous(), qweight, scale)


def w8a8_int8_mm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    packed: torch.Tensor | None = None,
    zero_points: torch.Tensor | None = None,
    act_qmax: int = ACT_QMAX,
) -> torch.Tensor:
    """Per-token int8 x [M, K] (codes in [-act_qmax, act_qmax]) times per-channel int8 W [N, K] ->
    [M, N] in ``out_dtype``: the int32 product scaled by the channel's scale (inside oneDNN where
    ``packed``, whose weight zero points are ``zero_points``, int64 zeros of scale's shape) and the
    token's."""
    from baton.kernels import cpu_ops

    m, k = x.shape
    xs = torch.empty(m, dtype=torch.float32)
    if packed is None:
        xq = torch.empty((m, k), dtype=torch.int8)
        cpu_ops.int8_quantize_rows(x.contiguous(), xq, xs, act_qmax)
        out = torch.empty((m, qweight.shape[0]), dtype=out_dtype)
        cpu_ops.int8_scale_output(torch._int_mm(xq, qweight.t()), xs, scale, out)
        return out
    if zero_points is None:
        zero_points = _zero_points(scale)
    # oneDNN's VNNI GEMM takes uint8 activations with a zero point (the symmetric codes + 128);
    # given int8 ones it runs its scalar reference kernel (~1000x slower at 64 rows).
    xu = torch.empty((m, k), dtype=torch.uint8)
    cpu_ops.int8_quantize_rows(x.contiguous(), xu, xs, act_qmax)
    # Activation scale 1 and fp32 out: oneDNN applies the channel scales; the token's follow.
    y = torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, act_qmax + 1, packed, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    out = y if out_dtype == torch.float32 else torch.empty(y.shape, dtype=out_dtype)
    cpu_ops.int8_scale_rows(y, xs, out)
    return out


def _zero_points(scale: torch.Tensor) -> torch.Tensor:
    return torch.zeros(scale.shape, dtype=torch.int64)


class Fp8Linear(QuantLinear):
    """e4m3 weights; on CPU widened to the activations' dtype one block of output channels at a
    time right before the product, the per-channel scale applied to the output (it factors out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if x.is_cuda:
            from baton.kernels.triton_quant import fp8_linear

            return fp8_linear(x, self.qweight, self.scale).to(self.out_dtype)
        return fp8_linear_cpu(x, self.qweight, self.scale, self.out_dtype)


def fp8_linear_cpu(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] @ (qweight [N, K] e4m3 * scale [N]).T -> [M, N] in ``out_dtype``."""
    from baton.kernels import cpu_ops

    n = qweight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    for start in range(0, n, FP8_BLOCK_ROWS):
        stop = min(start + FP8_BLOCK_ROWS, n)
        w = torch.empty((stop - start, qweight.shape[1]), dtype=x.dtype)  # [B, K]
        cpu_ops.fp8_widen(qweight[start:stop], w)  # exact: every e4m3 value is a bf16
        y = F.linear(x, w)
        out[:, start:stop] = y.mul_(scale[start:stop].to(y.dtype))
    return out


_MODULES = {"int8": Int8Linear, "fp8": Fp8Linear}
_QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}

QUANTIZE_LM_HEAD = {"int8": False, "fp8": False}
"""Whether the LM head is quantized too (the embedding never is). Neither is, as llm-compressor's
W8A8 recipes leave it (``ignore: [lm_head]``): with int8 (smoothed) SmolLM2's perplexity was 1.031x
bf16's against 1.024x with it in bf16; fp8's widening of the 49152-row head each step costs more
than its product saves."""


def quantize_model(
    model: LlamaForCausalLM,
    quantization: str,
    prequantized: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Swap every ``llama.Linear`` of a loaded model (before ``prepack``) for its quantized module,
    quantizing its weight, or taking the codes and scales of ``prequantized`` (module name ->
    (codes, scales), from a checkpoint). The LM head gets a quantized copy (``lm_head_quant``)
    where ``QUANTIZE_LM_HEAD`` says so; a tied embedding itself stays as it is."""
    from baton.common.model.llama import Linear

    check_quantization(quantization)
    prequantized = prequantized or {}
    cls, quantize = _MODULES[quantization], _QUANTIZERS[quantization]
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        q, scale = prequantized.get(name) or quantize(module.weight)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, cls(q, scale, module.dtype, module.dtype))
    if QUANTIZE_LM_HEAD[quantization]:
        dtype = model.embed_tokens.weight.dtype
        # W8A8 at every row count: 49152 rows of int8 through oneDNN beat both other kernels.
        model.lm_head_quant = Int8Linear(*quantize(model.lm_head_weight), dtype, torch.float32, 0)
