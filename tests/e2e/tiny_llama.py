"""A tiny random Llama checkpoint directory (safetensors, HF names, SmolLM2's tokenizer), written
without transformers' model code: for tests of processes and plumbing, where the real weights are
not the point and their load and step times would only slow the test down."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 49152
"""SmolLM2's vocabulary, so that its tokenizer fits."""


def write_tiny_llama(
    path: Path, hidden: int = 128, layers: int = 2, max_len: int = 4096, seed: int = 0
) -> Path:
    """Write the checkpoint into ``path`` (4 query heads, 2 KV heads, tied embeddings) and return
    it. Weights are scaled up from a plain normal draw so that greedy decoding has clear winners."""
    import torch
    from safetensors.torch import save_file

    from baton.common.model.source import ModelSource, load_tokenizer

    heads, kv_heads, inter = 4, 2, 2 * hidden
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (2.0 / shape[-1] ** 0.5)

    state = {"model.embed_tokens.weight": w(VOCAB, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config))
    load_tokenizer(ModelSource.resolve(None)).save_pretrained(path)
    return path
