"""Our engine against Hugging Face transformers on the same GGUF weights."""

from __future__ import annotations

import copy

import pytest
import torch

from baton.common.llm import LLM, SamplingParams

from .helpers import CHAT_QUESTIONS, PLAIN_PROMPTS, prompt_logits

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, attention_mask=torch.ones(1, len(ids))
        )
    return out[0, len(ids) :].tolist()


def test_plain_prompts_token_identical_fp32(llm_fp32, hf_fp32):
    tok = llm_fp32.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False) for p in PLAIN_PROMPTS]
    ours = llm_fp32.generate(ids, GREEDY_32)  # all eight in one continuous batch
    for prompt_ids, out in zip(ids, ours):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == _hf_greedy(hf_fp32, prompt_ids, 32)


def test_chat_prompts_token_identical_fp32(llm_fp32, hf_fp32):
    tok = llm_fp32.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    ours = llm_fp32.chat(convs, GREEDY_32)
    for conv, out in zip(convs, ours):
        enc = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(enc["input_ids"])
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _hf_greedy(hf_fp32, ids, 32)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_knows_the_capital_of_france(llm_fp32):
    out = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY_32)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(dtype="bfloat16", kv_cache_gib=0.25)


def test_bf16_logits_close_to_transformers_bf16(llm_bf16, hf_fp32):
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    tok = llm_bf16.get_tokenizer()
    ids = tok.encode(" ".join(PLAIN_PROMPTS), add_special_tokens=False)
    with torch.no_grad():
        ref32 = hf_fp32(torch.tensor([ids])).logits[0].float()
        ref16 = hf_bf16(torch.tensor([ids])).logits[0].float()
    ours = prompt_logits(llm_bf16.engine, ids)
    assert ours.shape == ref16.shape
    diff = (ours - ref16).abs()
    # bf16 keeps 8 bits of mantissa: logits of magnitude ~20 move by ~0.1 between two bf16
    # implementations. Ours must be as close to transformers' bf16 as that is to fp32.
    hf_err = (ref16 - ref32).abs()
    assert diff.mean() < 2 * hf_err.mean() + 1e-3, (diff.mean(), hf_err.mean())
    assert diff.max() < 2 * hf_err.max() + 0.05, (diff.max(), hf_err.max())
    # ...and at least as close to the fp32 truth as transformers' bf16 is.
    assert (ours - ref32).abs().mean() <= 1.1 * hf_err.mean(), ((ours - ref32).abs().mean(), hf_err.mean())
    agree = (ours.argmax(-1) == ref16.argmax(-1)).float().mean()
    assert agree > 0.9, agree


def test_fp32_logits_match_transformers(llm_fp32, hf_fp32):
    tok = llm_fp32.get_tokenizer()
    ids = tok.encode(PLAIN_PROMPTS[1] + PLAIN_PROMPTS[7], add_special_tokens=False)
    with torch.no_grad():
        ref = hf_fp32(torch.tensor([ids])).logits[0].float()
    ours = prompt_logits(llm_fp32.engine, ids)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)
