"""The engine on its own thread, driven from asyncio: streams, aborts, errors, a free event loop."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from baton.common.engine.async_engine import AsyncEngine
from baton.common.engine.llm_engine import EngineFullError, LLMEngine
from baton.common.llm import SamplingParams

from .helpers import wait_engine_idle

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _own_engine(llm) -> LLMEngine:
    """An engine of its own over the session's weights: the offline reference (``llm``, stepped on
    the test's thread) and the engine thread never step the same engine."""
    src = llm.engine
    return LLMEngine(src.config, src.model, src.tokenizer, src.eos_token_ids)


@pytest.fixture
def async_engine(llm_fp32):
    llm_engine = _own_engine(llm_fp32)
    engine = AsyncEngine(llm_engine)
    engine.start()
    yield engine
    if engine.is_running:
        wait_engine_idle(llm_engine)
    engine.stop()
    assert not engine.is_running
    assert not llm_engine.has_unfinished_requests()
    llm_engine.pool.check_integrity()


async def _collect(engine, rid, ids, params):
    deltas = [d async for d in engine.generate(rid, ids, params)]
    tokens = [t for d in deltas for t in d.token_ids]
    return deltas, tokens, "".join(d.text for d in deltas)


def test_concurrent_streams_match_offline_generation(async_engine, llm_fp32):
    tok = llm_fp32.get_tokenizer()
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of"]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]

    async def main():
        return await asyncio.gather(*(_collect(async_engine, f"r{i}", x, GREEDY) for i, x in enumerate(ids)))

    results = asyncio.run(main())
    offline = llm_fp32.generate(ids, GREEDY)
    for (deltas, tokens, text), off in zip(results, offline):
        assert tokens == off.outputs[0].token_ids
        assert text == off.outputs[0].text
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert sum(1 for d in deltas if d.token_ids) > 1  # streamed, not one lump
        assert all(not d.finished for d in deltas[:-1])


def test_streamed_text_never_shows_a_stop_string(async_engine, llm_fp32):
    prompt = "1, 2, 3, 4, 5,"
    ids = llm_fp32.get_tokenizer().encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" 9"])
    deltas, _, text = asyncio.run(_collect(async_engine, "stop", ids, params))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == " 9"
    assert " 9" not in text
    assert text == llm_fp32.generate([prompt], params)[0].outputs[0].text


def test_leaving_a_stream_early_aborts_and_frees_blocks(async_engine):
    engine = async_engine.engine
    free = engine.pool.num_free_blocks
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        got = 0
        async for d in async_engine.generate("gone", list(range(100, 180)), long):
            got += len(d.token_ids)
            if got >= 3:
                break  # the client went away
        for _ in range(200):  # bounded wait for the engine thread to process the abort
            if not engine.has_unfinished_requests():
                return got
            await asyncio.sleep(0.05)
        return got

    assert asyncio.run(main()) >= 3
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == free


def test_bad_prompt_raises_before_queueing(async_engine):
    async def main():
        async for _ in async_engine.generate("bad", [], GREEDY):
            pass

    with pytest.raises(ValueError, match="prompt must not be empty"):
        asyncio.run(main())


def test_event_loop_keeps_running_while_the_engine_works(async_engine):
    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        t = asyncio.create_task(ticker())
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        await _collect(async_engine, "long", list(range(200, 600)), params)
        done.set()
        await t
        return ticks

    assert asyncio.run(main()) >= 3


def test_a_factory_builds_the_engine_on_the_engine_thread(llm_fp32):
    """The thread that steps the engine is the one that built it: one OpenMP pool per process."""
    import threading

    built_on = []
    own = _own_engine(llm_fp32)

    def build():
        built_on.append(threading.get_ident())
        return own

    engine = AsyncEngine(build)
    assert engine.start() is own
    try:
        assert built_on and built_on[0] != threading.get_ident()
        assert built_on[0] == engine._thread.ident
        _, tokens, _ = asyncio.run(_collect(engine, "f", [1, 2, 3, 4], GREEDY))
        assert tokens == llm_fp32.generate([[1, 2, 3, 4]], GREEDY)[0].outputs[0].token_ids
    finally:
        engine.stop()


def test_a_factory_that_fails_fails_start():
    def build():
        raise OSError("no such model")

    engine = AsyncEngine(build)
    with pytest.raises(RuntimeError, match="building the engine failed") as info:
        engine.start()
    assert isinstance(info.value.__cause__, OSError)
    assert not engine.is_running


def test_a_burst_past_the_waiting_cap_is_refused_before_it_reaches_the_engine(llm_fp32):
    """Requests on their way to a busy engine thread count against ``max_waiting_requests``: the
    command queue stays bounded, the one past the cap gets ``EngineFullError`` at once, and every
    request admitted completes."""
    src = llm_fp32.engine
    config = replace(src.config, max_waiting_requests=2)
    llm_engine = LLMEngine(config, src.model, src.tokenizer, src.eos_token_ids)
    entered, release = threading.Event(), threading.Event()
    real_step = llm_engine.step

    def held_step(*args, **kwargs):
        entered.set()
        assert release.wait(60), "the test never released the engine thread"
        return real_step(*args, **kwargs)

    llm_engine.step = held_step
    engine = AsyncEngine(llm_engine)
    engine.start()

    async def main():
        first = asyncio.ensure_future(_collect(engine, "first", [500, 501, 502], GREEDY))
        assert await asyncio.to_thread(entered.wait, 60), "the engine never stepped"
        queued = [asyncio.ensure_future(_collect(engine, f"q{i}", [600 + i, 7, 8], GREEDY)) for i in range(2)]
        for _ in range(10):  # let both reach the command queue (each yields once it is queued)
            await asyncio.sleep(0)
        with pytest.raises(EngineFullError, match="max_waiting_requests=2"):
            await _collect(engine, "over", [9, 10, 11], GREEDY)
        release.set()
        return await asyncio.wait_for(asyncio.gather(first, *queued), 120)

    try:
        results = asyncio.run(main())
    finally:
        release.set()
        wait_engine_idle(llm_engine)
        engine.stop()
    assert [len(tokens) for _, tokens, _ in results] == [16, 16, 16]
    llm_engine.pool.check_integrity()
