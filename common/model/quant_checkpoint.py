"""Compressed-tensors checkpoints (the layout vLLM reads) of int8/fp8 models: their
``quantization_config``, the codes and scales taken out of a loaded state dict for
``quant.quantize_model``, and a quantized model written back (``save_quantized``, for
``baton quantize``)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from baton.common.model.quant import FP8_DTYPE, QuantLinear

if TYPE_CHECKING:
    from baton.common.model.llama import LlamaForCausalLM

# vLLM's compressed-tensors layout: each quantized Linear stores ``weight`` as codes and
# ``weight_scale`` [out, 1]; config.json names the scheme under ``quantization_config``.
_FORMATS = {"int8": "int-quantized", "fp8": "float-quantized"}
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def quantization_config(quantization: str) -> dict:
    """The ``quantization_config`` of config.json for a checkpoint written by ``save_quantized``."""
    weights: dict[str, object] = {
        "num_bits": 8,
        "type": "int" if quantization == "int8" else "float",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    # int8 is W8A8: activations quantized per token at run time. fp8 is weight-only here.
    acts = (
        {**weights, "strategy": "token", "dynamic": True, "observer": None}
        if quantization == "int8"
        else None
    )
    return {
        "quant_method": "compressed-tensors",
        "format": _FORMATS[quantization],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def checkpoint_quantization(hf_config: dict) -> str | None:
    """``int8``/``fp8`` for a compressed-tensors config.json that this module reads, else None;
    a scheme it does not read (other bits, group or tensor scales) is refused."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"quantization method {qc.get('quant_method')!r} is not supported (compressed-tensors)"
        )
    groups = list(qc.get("config_groups", {}).values())
    if len(groups) != 1:
        raise ValueError("compressed-tensors checkpoints with other than one config group are not supported")
    w = groups[0]["weights"]
    kind = {("int", 8): "int8", ("float", 8): "fp8"}.get((w.get("type"), w.get("num_bits")))
    if kind is None or w.get("strategy") != "channel" or not w.get("symmetric", True):
        raise ValueError(f"compressed-tensors weights {w} are not supported (8-bit symmetric per channel)")
    return kind


def take_prequantized(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pop the codes and scales of every quantized projection out of an assembled state dict
    (fused names, see ``loader._assemble``: codes already concatenated, scales still per part) and
    return them by module name, scales concatenated as the codes are."""
    out = {}
    for key in [k for k in state if k.endswith(".weight") and state[k].dtype in (torch.int8, FP8_DTYPE)]:
        module = key.removesuffix(".weight")
        parts = _FUSED.get(_tail(module))
        names = [f"{_head(module)}.{p}" for p in parts] if parts else [module]
        scales = [state.pop(f"{n}.weight_scale").float().reshape(-1) for n in names]
        out[module] = (state.pop(key), torch.cat(scales))
    return out


def _tail(module: str) -> str:
    """``layers.3.self_attn.qkv_proj`` -> ``self_attn.qkv_proj``."""
    return ".".join(module.split(".")[-2:])


def _head(module: str) -> str:
    """``layers.3.self_attn.qkv_proj`` -> ``layers.3``."""
    return ".".join(module.split(".")[:-2])


def keeps_dtype(name: str, t: torch.Tensor) -> bool:
    """Tensors a loader must not cast to the model dtype: codes and their scales."""
    return t.dtype in (torch.int8, FP8_DTYPE) or name.endswith(".weight_scale")


def _hf_name(module: str) -> str:
    return f"model.{module}"


def quantized_state(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A quantized model's tensors under Hugging Face names in the compressed-tensors layout:
    fused projections split back into q/k/v and gate/up, codes as ``weight`` and [out, 1] fp32
    ``weight_scale``; the embedding and norms in ``dtype``. The LM head, quantized or not, is
    written only where it is not tied to the embedding (as a plain weight: ``ignore``)."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and name != "lm_head_quant":
            parts = _FUSED.get(_tail(name))
            if parts is None:
                splits = [(name, module.qweight, module.scale)]
            else:
                sizes = _part_sizes(model, _tail(name))
                qs, ss = module.qweight.split(sizes), module.scale.split(sizes)
                splits = [(f"{_head(name)}.{p}", q, s) for p, q, s in zip(parts, qs, ss)]
            for part, q, s in splits:
                state[_hf_name(part) + ".weight"] = q.contiguous()
                state[_hf_name(part) + ".weight_scale"] = s.reshape(-1, 1).contiguous()
    state["model.embed_tokens.weight"] = model.embed_tokens.weight.detach().to(dtype)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            state[_hf_name(name)] = p.detach().to(dtype)
    if not model.config.tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head_weight.detach().to(dtype)
    return state


def _part_sizes(model: LlamaForCausalLM, tail: str) -> list[int]:
    cfg = model.config
    if tail == "self_attn.qkv_proj":
        kv = cfg.num_kv_heads * cfg.head_dim
        return [cfg.num_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def save_quantized(
    model: LlamaForCausalLM, quantization: str, dtype: torch.dtype, out_dir: str, tokenizer
) -> None:
    """Write a quantized model as a compressed-tensors checkpoint directory: model.safetensors,
    config.json (with ``quantization_config``) and the tokenizer."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(quantized_state(model, dtype), os.path.join(out_dir, "model.safetensors"))
    config = model.config.to_hf() | {
        "torch_dtype": str(dtype).removeprefix("torch."),
        "quantization_config": quantization_config(quantization),
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(out_dir)
