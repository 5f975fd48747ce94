"""Mixtral (transformers' ``MixtralForCausalLM``): Llama's decoder with a sparse mixture-of-experts
block (``moe.SparseMoE``) in place of the dense MLP. Attention, norms, RoPE, the paged KV cache and
the LM head are Llama's own modules.

Checkpoints come in transformers' two layouts, both read here: the original one on disk
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{j}.w1|w2|w3``, what ``save_pretrained``
writes) and transformers 5's fused one in memory (``mlp.gate``, ``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).

``sliding_window``: transformers masks keys more than ``sliding_window`` positions back. Within
the window that mask is the plain causal one, so the context is capped at the window, where this
model and transformers' agree exactly (Mixtral-8x7B's own config has no window).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from baton.common.model.config import LlamaConfig
from baton.common.model.llama import LlamaForCausalLM
from baton.common.model.moe import SparseMoE

ARCHITECTURES = frozenset({"MixtralForCausalLM"})


def is_mixtral(hf: dict) -> bool:
    """Whether a config.json describes a Mixtral model."""
    return hf.get("model_type") == "mixtral" or bool(ARCHITECTURES & set(hf.get("architectures") or ()))


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    num_experts: int = 8
    """Experts per MoE block (transformers' ``num_local_experts``)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""

    @classmethod
    def from_hf(cls, cfg: dict) -> MixtralConfig:
        base = asdict(LlamaConfig.from_hf(cfg))
        window = cfg.get("sliding_window")
        if window:  # see the module's docstring
            base["max_position_embeddings"] = min(base["max_position_embeddings"], int(window))
        return cls(
            **base,
            num_experts=int(cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        )


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's model with every layer's MLP a ``SparseMoE`` over ``cfg.num_experts`` experts of
    ``cfg.intermediate_size`` columns each."""

    def __init__(self, cfg: MixtralConfig):
        super().__init__(cfg)  # the dense MLPs it builds are dropped here (built on meta by the loader)
        for layer in self.layers:
            layer.mlp = SparseMoE(cfg, cfg.num_experts, cfg.num_experts_per_tok)


_ORIGINAL = re.compile(r"layers\.(\d+)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)$")
_FUSED = re.compile(r"layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def assemble_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the loader's names, ``model.`` stripped) with the MoE tensors under this model's
    module names: ``layers.{i}.mlp.gate.weight`` and, per expert ``j``,
    ``layers.{i}.mlp.experts.{j}.gate_up_proj.weight`` (w1|w3) and ``...down_proj.weight`` (w2)."""
    out: dict[str, torch.Tensor] = {}
    w13: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if m := _ORIGINAL.match(name):
            layer, what, expert, w = m.groups()
            if expert is None:
                out[f"layers.{layer}.mlp.gate.weight"] = t
            elif w == "w2":
                out[f"layers.{layer}.mlp.experts.{expert}.down_proj.weight"] = t
            else:
                w13.setdefault((layer, expert), {})[w] = t
        elif m := _FUSED.match(name):
            layer, what = m.groups()
            if what == "gate.weight":
                out[name] = t
            else:
                proj = "gate_up_proj" if what.endswith("gate_up_proj") else "down_proj"
                for j, part in enumerate(t.unbind(0)):
                    out[f"layers.{layer}.mlp.experts.{j}.{proj}.weight"] = part.contiguous()
        else:
            out[name] = t
    for (layer, expert), p in w13.items():
        out[f"layers.{layer}.mlp.experts.{expert}.gate_up_proj.weight"] = torch.cat([p["w1"], p["w3"]])
    return out
