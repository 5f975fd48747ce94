"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Plain ``nn.Module``s configured by ``LlamaConfig``. Projections are fused (q|k|v and gate|up) so
that a layer runs four GEMMs. Tokens of all requests in a step are one flat batch ``[N, ...]``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baton.common.model.attention import AttentionMetadata, paged_attention
from baton.common.model.config import LlamaConfig
from baton.env import BF16_GEMM, ONE_CALL_LAYERS
from baton.kernels import fused, kv_quant


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose bf16 CPU weight can be prepacked (``prepack_weight``): for
    Baton's AVX512-BF16 kernel or oneDNN's blocked layout, either 1.2-2x faster than ``F.linear``
    on the plain layout at the small row counts of decode. The plain weight is dropped once packed.
    """

    packed: PackedWeight | None = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.dtype = self.weight.dtype

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.weight is not None:
            self.dtype = self.weight.dtype
        return self

    def prepack(self) -> None:
        self.packed = prepack_weight(self.weight)
        if self.packed is not None:
            del self.weight
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight)


class PackedWeight:
    """A weight [N, K] in the layout of the kernel that multiplies it; called as ``F.linear``."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class OneDNNWeight(PackedWeight):
    """oneDNN's blocked layout (``mkldnn._reorder_linear_weight``), through ``_linear_pointwise``.
    On a CPU with AMX-BF16 tiles it runs on them."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class Bf16GemmWeight(PackedWeight):
    """Baton's AVX512-BF16 layout (``cpu_ops.bf16_gemm``; AMX tiles read it too, and AVX2's fp32
    FMAs after widening): on a 2-core Zen 4 EPYC it streams a decode step's weights 1.3-2.3x faster
    than oneDNN (1-16 rows) and equals it from 64 rows; on a 2-core Xeon with AMX 1.4-1.5x faster
    (1-64 rows) and equal from 256; on a 2-core AVX2-only EPYC 1.2-3.7x faster than fp32 MKL."""

    def __init__(self, weight: torch.Tensor):
        from baton.kernels import cpu_ops

        super().__init__(weight)
        self.packed = cpu_ops.bf16_gemm_pack(weight.detach())
        self._gemm = cpu_ops.load().bf16_gemm  # the extension's function: ~120 calls a step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._rows(x, self._gemm, self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] weight's product with x ([..., I]):
        ``cpu_ops.bf16_gemm_silu_mul``, the bits of the product followed by ``fused.silu_mul``."""
        from baton.kernels import cpu_ops

        return self._rows(x, cpu_ops.bf16_gemm_silu_mul, self.out_features // 2)

    def _rows(self, x: torch.Tensor, kernel, width: int) -> torch.Tensor:
        """kernel(x, packed, out) over x as 2-d contiguous bf16 rows, out [..., width]."""
        if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous():
            lead = x.shape[:-1]
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            return self._rows(rows, kernel, width).view(*lead, width)
        out = torch.empty((x.shape[0], width), dtype=torch.bfloat16)
        kernel(x, self.packed, out)
        return out


def own_bf16_gemm() -> bool:
    """Whether bf16 weights go to Baton's kernel rather than oneDNN: wherever it was compiled in
    (AVX512-BF16; on a CPU with AMX-BF16 it runs the same packed weights on the tiles; on AVX2 it
    widens them into fp32 FMAs, where oneDNN has no bf16 product at all). It reads a
    decode step's weights at ~29-30 GB/s where oneDNN's small-M products read ~13-20 (Zen 4; a Xeon
    with AMX) and ties with oneDNN from 64-256 rows (``kernels/cpu/bf16_gemm.cpp``).
    ``BATON_BF16_GEMM=onednn`` keeps oneDNN anyway (to compare the two); ``baton`` is the default
    where it was compiled in."""
    from baton.kernels import cpu_ops

    choice = BF16_GEMM.get()
    if choice not in ("auto", "baton", "onednn"):
        raise ValueError(f"{BF16_GEMM.name} must be auto, baton or onednn, not {choice!r}")
    return choice != "onednn" and cpu_ops.bf16_gemm_available()


def prepack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """A bf16 CPU weight packed for the fastest kernel here (``own_bf16_gemm``), or None where no
    packed path exists (fp32 runs MKL's GEMM on the plain layout)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if weight.shape[1] % 2 == 0 and own_bf16_gemm():
        return Bf16GemmWeight(weight)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return OneDNNWeight(weight)
    except (RuntimeError, AttributeError):
        return None


class RMSNorm(nn.Module):
    """Weight of an RMSNorm over the fp32 residual stream; the op itself is fused with the
    residual add (``kernels.fused.add_rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def __call__(
        self, residual: torch.Tensor, delta: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``residual += delta`` in place, then the normalized residual in ``dtype``."""
        out = torch.empty(residual.shape, dtype=dtype, device=residual.device)
        return fused.add_rms_norm(residual, delta, self.weight.float(), self.eps, out)


class Rotary(nn.Module):
    """Rotate-half RoPE tables as transformers' Llama builds them: ``cat(freqs, freqs)``, fp32."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        # On the CPU even under ``torch.device("meta")`` (the loader's): meta ops run through
        # torch._refs, whose first call imports torch._dynamo (~1 s of every worker's start).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim)
        )
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq
        )  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden], model dtype
        positions: torch.Tensor,  # [N]
        rotary: Rotary,
        kv_layer: torch.Tensor,  # [num_blocks, 2, KV, bs, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [N, (H + 2 KV) * D]
        fused.rope_and_cache(
            qkv,
            positions,
            rotary.cos,
            rotary.sin,
            kv_layer,
            meta.slot_blocks,
            meta.slot_offsets,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, kv_layer[:, 0], kv_layer[:, 1], meta, self.scale)
        return self.o_proj(o.view(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(self.gate_up_proj, "packed", None)  # quantized projections have their own
        if isinstance(packed, Bf16GemmWeight):
            # silu_mul in the product's epilogue: the same bits, no [N, 2I] product in memory (AMX).
            return self.down_proj(packed.silu_mul(x))
        gate_up = self.gate_up_proj(x)  # [N, 2I]
        act = torch.empty((x.shape[0], self.intermediate), dtype=gate_up.dtype, device=x.device)
        return self.down_proj(fused.silu_mul(gate_up, act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, residual, delta, positions, rotary, kv_layer, meta):
        """Adds the previous layer's output ``delta`` into the fp32 ``residual`` stream (in place:
        in bf16 its rounding errors would add up over layers) and returns this layer's output."""
        dtype = self.self_attn.o_proj.dtype
        h = self.input_layernorm(residual, delta, dtype)
        attn = self.self_attn(h, positions, rotary, kv_layer, meta)
        return self.mlp(self.post_attention_layernorm(residual, attn, dtype))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        # Its own empty weight: nn.Embedding's random init would import torch._dynamo (~1.5 s of a
        # worker's start) to fill a weight that loading replaces.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.lm_head_packed: PackedWeight | None = None
        self.lm_head_quant: nn.Module | None = None
        """A quantized copy of the LM head (``quant.quantize_model``), used in its place."""
        self.one_call_weights: list[torch.Tensor] | None = None
        """Every layer's weights as the extension's ``llama_layers`` reads them (set by ``prepack``
        where every layer is this module's plain Llama layer with Baton-packed bf16 projections)."""

    def prepack(self) -> None:
        """Ready the loaded weights for inference: norm weights in fp32 (they scale the fp32
        residual stream), every projection and the LM head packed for oneDNN where that applies."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
            elif isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.float()
        if self.lm_head_quant is None:
            self.lm_head_packed = prepack_weight(self.lm_head_weight)
        self.one_call_weights = self._one_call_weights()

    def _one_call_weights(self) -> list[torch.Tensor] | None:
        """[input norm, qkv, o, post-attention norm, gate_up, down] of each layer, or None where a
        layer is not exactly ``LlamaDecoderLayer`` with fp32 norms of one eps and projections packed
        for ``bf16_gemm`` (quantized, sharded or oneDNN-packed weights run the Python layers)."""
        weights: list[torch.Tensor] = []
        eps = {self.norm.eps}
        for layer in self.layers:
            if type(layer) is not LlamaDecoderLayer:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
                return None
            if any(type(n) is not RMSNorm for n in norms):
                return None
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            packed = [p.packed if type(p) is Linear else None for p in projections]
            if any(type(w) is not Bf16GemmWeight for w in packed):
                return None
            plain = cast(tuple[RMSNorm, RMSNorm], norms)
            if any(n.weight.dtype != torch.float32 for n in plain):
                return None
            eps |= {n.eps for n in plain}
            qkv, o, gate_up, down = (cast(Bf16GemmWeight, w).packed for w in packed)
            weights += [plain[0].weight, qkv, o, plain[1].weight, gate_up, down]
        return weights if len(eps) == 1 else None

    def _layers_in_one_call(self, n: int, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step runs every layer in the extension's ``llama_layers``: packed weights
        (``prepack``), a CPU cache of this model's layers, no cascade groups, no prefill chunk over
        a quantized cache, and ``BATON_ONE_CALL_LAYERS`` not 0."""
        prefill = meta.prefill_context_lens.numel() > 0
        return (
            self.one_call_weights is not None
            and kv_cache.is_cpu
            and kv_cache.dim() == 6
            and kv_cache.shape[1] == len(self.layers)
            and meta.cascade is None
            and not (prefill and kv_quant.is_quantized(kv_cache))
            and meta.num_decode_tokens + meta.num_padding_tokens <= n
            and ONE_CALL_LAYERS.get() != "0"
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, KV, bs, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, hidden] in the model dtype."""
        residual = self.embed_tokens(input_ids).float()  # [N, hidden], fp32
        delta = None
        if self._layers_in_one_call(residual.shape[0], kv_cache, meta):
            from baton.kernels import cpu_ops

            first = cast(LlamaDecoderLayer, self.layers[0])  # plain: ``one_call_weights`` checked
            attn, mlp = cast(LlamaAttention, first.self_attn), cast(LlamaMLP, first.mlp)
            delta = cpu_ops.load().llama_layers(
                residual, None, self.one_call_weights, positions, self.rotary.cos, self.rotary.sin,
                kv_cache, meta.slot_blocks, meta.slot_offsets, meta.num_decode_tokens,
                meta.decode_block_tables, meta.decode_context_lens, meta.prefill_block_tables,
                meta.prefill_context_lens, meta.prefill_query_start_loc, meta.num_padding_tokens,
                attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate, self.norm.eps,
                attn.scale, kv_quant.is_quantized(kv_cache),
            )  # fmt: skip
            return self.norm(residual, delta, self.embed_tokens.weight.dtype)
        for i, layer in enumerate(self.layers):
            delta = layer(residual, delta, positions, self.rotary, kv_cache[:, i], meta)
        return self.norm(residual, delta, self.embed_tokens.weight.dtype)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_quant is not None:
            return self.lm_head_quant(hidden)
        if self.lm_head_packed is not None:
            return self.lm_head_packed(hidden)
        return F.linear(hidden, self.lm_head_weight)

    # In bf16 the LM head's output is rounded to 8 bits of mantissa: logits near 25 move in steps
    # of 0.125, so the two best tokens often tie and argmax would pick by token id. The best few
    # candidates of each row are recomputed in fp32 from the same bf16 operands, which makes greedy
    # choices those of the exact product, at the cost of a few dot products.
    REFINE_TOP = 8

    def _refine(self, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = fused.row_topk(logits, self.REFINE_TOP)  # [M, k]
        rows = self.lm_head_weight[top].float()  # [M, k, hidden]
        exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)  # [M, k]
        return top, exact

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] in fp32 (the best candidates exact, see ``_refine``)."""
        logits = self._lm_head(hidden)
        if logits.dtype == torch.float32:
            return logits
        top, exact = self._refine(hidden, logits)
        return logits.float().scatter_(1, top, exact)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M] argmax token ids, without materializing fp32 logits."""
        logits = self._lm_head(hidden)
        if logits.dtype == torch.float32:
            return logits.argmax(dim=-1)
        top, exact = self._refine(hidden, logits)
        return top.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)
