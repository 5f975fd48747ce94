"""Loading a Llama safetensors directory: a tiny random Llama written by transformers, and the real
weights re-saved by transformers, both compared with transformers itself."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids)),
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, llm_fp32):
    """A random Llama unlike SmolLM2: untied LM head, head_dim 32, 4 query and 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=llm_fp32.get_tokenizer().vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=5000.0,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so greedy has clear winners
        for p in hf.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    llm_fp32.get_tokenizer().save_pretrained(path)
    return path, hf


def test_tiny_random_llama_matches_transformers(tiny_dir):
    path, hf = tiny_dir
    llm = LLM(model=str(path), dtype="float32", kv_cache_gib=0.05)
    cfg = llm.engine.model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 32)
    assert not cfg.tie_word_embeddings
    prompts = [[11, 200, 3000, 45, 9], [700] * 20, list(range(100, 140))]
    ours = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, ours):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_real_weights_resaved_as_safetensors(tmp_path, llm_fp32, hf_fp32):
    """transformers' own state dict and config (it refuses save_pretrained on a GGUF-loaded model)."""
    import json

    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_fp32.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = hf_fp32.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm_fp32.get_tokenizer().save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_gib=0.1, max_model_len=1024)
    prompt = "The three laws of robotics are"
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == (
        llm_fp32.generate([prompt], GREEDY)[0].outputs[0].token_ids
    )


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a safetensors directory"):
        LLM(model=str(tmp_path / "nothing-here"))
