"""``logprobs`` > 0 returns each position's most likely tokens: the same ids and log-probabilities
as Hugging Face transformers' fp32 log-softmax of the same sequence (an independent figure), most
likely first; the chosen token's own logprob is the one in its list whenever it ranks within it;
requests that ask for none get none, in the same batch."""

from __future__ import annotations

import pytest
import torch

from baton.common.llm import SamplingParams

PROMPT = "The three laws of robotics are"


@torch.no_grad()
def _hf_logprobs(hf, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token at each output position, [T, V]."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    logits = hf(ids).logits[0, len(prompt_ids) - 1 :].float()
    return logits.log_softmax(-1)


def _check_against(ref: torch.Tensor, out, k: int) -> None:
    assert len(out.top_logprobs) == len(out.token_ids)
    for pos, (top, chosen, lp) in enumerate(zip(out.top_logprobs, out.token_ids, out.logprobs)):
        assert len(top.token_ids) == len(top.logprobs) == k, pos
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True), pos
        want = ref[pos].topk(k)
        # Our logprobs against transformers' at the ids we return, and at its own top k.
        assert torch.allclose(torch.tensor(top.logprobs), ref[pos, list(top.token_ids)], atol=2e-3), pos
        assert torch.allclose(torch.tensor(top.logprobs), want.values, atol=2e-3), pos
        assert lp == pytest.approx(float(ref[pos, chosen]), abs=2e-3)
        if chosen in top.token_ids:
            assert top.logprobs[top.token_ids.index(chosen)] == lp
        else:  # ranked below the k listed: no likelier than the last of them
            assert lp <= top.logprobs[-1]


def test_greedy_top_logprobs_match_transformers(llm_fp32, hf_fp32):
    prompt_ids = llm_fp32.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out, none = (o.outputs[0] for o in llm_fp32.generate([prompt_ids, prompt_ids], [params, plain]))
    assert none.top_logprobs is None and none.logprobs is None and none.token_ids == out.token_ids
    ref = _hf_logprobs(hf_fp32, prompt_ids, out.token_ids)
    _check_against(ref, out, 5)
    assert [t.token_ids[0] for t in out.top_logprobs] == out.token_ids  # greedy: the first is chosen


def test_sampled_tokens_appear_in_their_top_list(llm_fp32, hf_fp32):
    prompt_ids = llm_fp32.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=8, ignore_eos=True, logprobs=20)
    out = llm_fp32.generate([prompt_ids], params)[0].outputs[0]
    ref = _hf_logprobs(hf_fp32, prompt_ids, out.token_ids)
    _check_against(ref, out, 20)
    assert any(t != top.token_ids[0] for t, top in zip(out.token_ids, out.top_logprobs))  # really sampled
