"""A tiny random-weight Mixtral, written by transformers itself (``MixtralForCausalLM`` with
SmolLM2's tokenizer, fp32 safetensors), and transformers' greedy decoding of it: the reference
that Baton's Mixtral is checked against, one process or spread over ranks."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 49152
"""SmolLM2's vocabulary, so that its tokenizer fits."""
NUM_EXPERTS = 4
HIDDEN = 64


def write_tiny_mixtral(path: Path, seed: int = 0) -> Path:
    """2 layers, 4 query / 2 KV heads of 16, 4 experts of 96 columns, top-2, untied LM head. Weights
    are drawn larger than transformers' init (std 0.02) so that greedy choices and the router's
    top-2 have clear winners, not near-ties that fp32 rounding could flip."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from baton.common.model.source import ModelSource, load_tokenizer

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=None,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[-1] ** 0.5))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    load_tokenizer(ModelSource.resolve(None)).save_pretrained(path)
    return path


def hf_greedy(
    path: str, prompts: list[list[int]], max_tokens: int, top: int = 5
) -> list[tuple[list[int], list]]:
    """transformers' greedy decoding of each prompt (whole-sequence forward passes, no cache):
    the tokens and, at each step, the ``top`` (ids, log-probabilities)."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, tops = list(prompt), []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1).topk(top)
                tops.append((lp.indices.tolist(), lp.values.tolist()))
                ids.append(int(logits.argmax()))
            out.append((ids[len(prompt) :], tops))
    return out


def assert_matches_hf(outputs, reference, lengths: list[int] | None = None, atol: float = 1e-4) -> None:
    """Baton's ``RequestOutput``s (greedy, ``logprobs=5``) against ``hf_greedy``'s, request by
    request: exactly ``lengths[i]`` tokens (by default all of the reference's, so a short or empty
    output fails), the reference's first ones, and at every step the same top ids with
    log-probabilities within ``atol``."""
    if lengths is None:
        lengths = [len(tokens) for tokens, _ in reference]
    for out, (tokens, tops), n in zip(outputs, reference, lengths, strict=True):
        got = out.outputs[0]
        assert 0 < n <= len(tokens), f"expected {n} tokens of a reference of {len(tokens)}"
        assert got.token_ids == tokens[:n]
        for step, (ids, lps) in zip(got.top_logprobs, tops[:n], strict=True):
            assert list(step.token_ids) == ids
            assert torch.allclose(torch.tensor(step.logprobs), torch.tensor(lps), atol=atol, rtol=0)
