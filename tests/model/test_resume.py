"""A request resumed from the output another worker already streamed (request migration): the
engine recomputes prompt + output like a preempted request and goes on exactly where the first
one stopped, tokens and text, greedy and seeded; and a request that can never fit its context is
refused up front."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.engine.async_engine import AsyncEngine
from baton.common.llm import SamplingParams

from .helpers import wait_engine_idle

PROMPT = "Write a short story about a lighthouse keeper who"


@pytest.fixture
def async_engine(llm_fp32):
    engine = AsyncEngine(llm_fp32.engine)
    engine.start()
    yield engine
    if engine.is_running:
        wait_engine_idle(llm_fp32.engine)
    engine.stop()
    assert not llm_fp32.engine.has_unfinished_requests()
    llm_fp32.engine.pool.check_integrity()


async def _run(engine, rid, ids, params, resume=(), chars=0):
    deltas = [d async for d in engine.generate(rid, ids, params, resume, chars)]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_stream_continues_without_a_gap_or_a_repeat(async_engine, llm_fp32, params, cut):
    ids = llm_fp32.get_tokenizer().encode(PROMPT, add_special_tokens=False)

    async def main():
        whole = await _run(async_engine, "whole", ids, params)
        # What a client had seen when the first worker died: the first deltas up to `cut` tokens.
        seen_tokens, seen_text = [], ""
        async for d in async_engine.generate("first", ids, params):
            seen_tokens += d.token_ids
            seen_text += d.text
            if len(seen_tokens) >= cut:
                break
        rest = await _run(async_engine, "resumed", ids, params, seen_tokens, len(seen_text))
        return whole, seen_tokens, seen_text, rest

    (tokens, text, last), seen_tokens, seen_text, (rest_tokens, rest_text, rest_last) = asyncio.run(main())
    assert len(seen_tokens) >= cut
    assert seen_tokens + rest_tokens == tokens
    assert seen_text + rest_text == text
    assert (rest_last.finish_reason, rest_last.num_prompt_tokens) == ("length", len(ids))
    assert last.finish_reason == "length"


def test_a_resumed_request_keeps_its_stop_string_held_back(async_engine, llm_fp32):
    ids = llm_fp32.get_tokenizer().encode("1, 2, 3, 4, 5,", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" 9,"])

    async def main():
        whole = await _run(async_engine, "whole", ids, params)
        seen_tokens, seen_text = [], ""
        async for d in async_engine.generate("first", ids, params):
            seen_tokens += d.token_ids
            seen_text += d.text
            if len(seen_tokens) >= 5:
                break
        return (
            whole,
            seen_tokens,
            seen_text,
            await _run(async_engine, "resumed", ids, params, seen_tokens, len(seen_text)),
        )

    (tokens, text, last), seen_tokens, seen_text, (rest_tokens, rest_text, rest_last) = asyncio.run(main())
    assert last.finish_reason == "stop" and rest_last.stop_reason == " 9,"
    assert seen_tokens + rest_tokens == tokens
    assert seen_text + rest_text == text and " 9," not in text


def test_requests_that_cannot_fit_their_context_are_refused(llm_fp32):
    engine = llm_fp32.engine
    limit = engine.max_model_len
    ids = [5] * 100
    engine.validate_request(ids, SamplingParams(max_tokens=limit - 100))
    with pytest.raises(ValueError, match=f"maximum context length is {limit} tokens") as e:
        engine.validate_request(ids, SamplingParams(max_tokens=limit - 99))
    assert f"{limit + 1} tokens (100 in the prompt, {limit - 99} in the completion)" in str(e.value)
    engine.validate_request(ids, SamplingParams(max_tokens=None))  # None: up to the context
    with pytest.raises(ValueError, match="leaves nothing to generate"):
        engine.validate_request(ids, SamplingParams(max_tokens=8), resume_token_ids=[1] * 8)
    with pytest.raises(ValueError, match="resumed token ids"):
        engine.validate_request(ids, SamplingParams(max_tokens=8), resume_token_ids=[-1])
