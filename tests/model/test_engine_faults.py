"""An engine that fails safely, on the real model: a step that raises fails only its own requests
(their streams end, their suspect KV leaves the prefix cache) and the engine goes on; a NaN row
fails only its request; too many failed steps in a row, or a block pool whose books no longer
balance, are fatal; a fatal engine fails every stream with ``EngineDeadError`` and calls
``on_fatal`` once; the waiting queue is capped; tiny temperatures are greedy."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace

import pytest

from baton.common.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from baton.common.engine.llm_engine import EngineFullError, EngineStepError, LLMEngine
from baton.common.llm import SamplingParams

from .helpers import wait_engine_idle

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PROMPT = list(range(500, 540))  # 40 tokens: two full blocks and a partial one
OTHER = list(range(900, 930))


def _engine(llm, **changes) -> LLMEngine:
    """A fresh engine (its own small KV cache and prefix cache) over the session's fp32 weights."""
    src = llm.engine
    block_bytes = src.kv_cache[0].numel() * src.kv_cache.element_size()
    cfg = replace(src.config, kv_cache_gib=64 * block_bytes / 2**30, max_model_len=512, **changes)
    return LLMEngine(cfg, src.model, src.tokenizer, src.eos_token_ids)


def _run(engine: LLMEngine, max_steps: int = 500) -> dict:
    """Step until idle; every request's final ``CompletionOutput`` and ``num_cached_tokens``."""
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        for o in engine.step():
            outs[o.request_id] = (o.outputs[0], o.num_cached_tokens)
    raise AssertionError(f"still unfinished after {max_steps} steps: {list(engine.scheduler.requests)}")


def _idle_and_balanced(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.pool.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.fixture(scope="module")
def refs(llm_fp32):
    """Offline greedy outputs of the prompts used here, computed before any fault is injected."""
    return {
        "prompt": llm_fp32.generate([PROMPT], GREEDY)[0].outputs[0].token_ids,
        "other": llm_fp32.generate([OTHER], GREEDY)[0].outputs[0].token_ids,
    }


def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(llm_fp32, refs, monkeypatch):
    engine = _engine(llm_fp32, max_num_seqs=1)  # one running at a time: "other" waits
    real = engine.runner.execute

    def broken(sched, *args):
        real(sched, *args)
        for r in sched.requests:  # what a fault mid-step leaves behind: KV nobody may trust
            engine.kv_cache[list(r.block_ids)] = float("nan")
        raise RuntimeError("injected step fault")

    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("other", OTHER, GREEDY)
    monkeypatch.setattr(engine.runner, "execute", broken)
    outs = engine.step()
    monkeypatch.undo()
    assert [(o.request_id, o.outputs[0].finish_reason, o.finished) for o in outs] == [("a", "error", True)]
    assert "injected step fault" in outs[0].outputs[0].error
    assert engine.num_failed_steps_total == 1 and engine.num_failed_requests_total == 1
    engine.pool.check_integrity()
    # The request the failed step did not carry goes on; the same prompt again computes its KV
    # afresh (no poisoned block is a prefix hit) and matches the offline engine.
    engine.add_request("again", PROMPT, GREEDY)
    done = _run(engine)
    assert done["other"][0].token_ids == refs["other"]
    assert done["again"][0].token_ids == refs["prompt"] and done["again"][1] == 0
    _idle_and_balanced(engine)
    assert engine.pool.take_events().removed  # the uncached blocks left the prefix index too


def test_a_step_hook_that_raises_fails_the_step_not_the_engine(llm_fp32, refs):
    """``on_step_computed`` (the prefill worker's KV push) raising is a failed step: its requests
    end with an error, the engine thread lives and serves the next request exactly."""
    engine = _engine(llm_fp32)

    def broken_hook(sched) -> None:
        raise RuntimeError("injected hook fault")

    engine.on_step_computed = broken_hook
    engine.add_request("a", PROMPT, GREEDY)
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "error")]
    assert "injected hook fault" in outs[0].outputs[0].error
    engine.pool.check_integrity()
    engine.on_step_computed = None
    engine.add_request("again", PROMPT, GREEDY)
    assert _run(engine)["again"][0].token_ids == refs["prompt"]
    _idle_and_balanced(engine)


def test_failed_steps_in_a_row_are_fatal_and_a_good_step_resets_the_count(llm_fp32, monkeypatch):
    engine = _engine(llm_fp32, max_consecutive_failed_steps=3)
    real = engine.runner.execute

    def boom(*args):
        raise RuntimeError("injected")

    def fail_once(rid: str) -> None:
        engine.add_request(rid, PROMPT, GREEDY)
        assert [o.outputs[0].finish_reason for o in engine.step()] == ["error"]

    monkeypatch.setattr(engine.runner, "execute", boom)
    fail_once("1")
    fail_once("2")
    monkeypatch.setattr(engine.runner, "execute", real)
    engine.add_request("ok", OTHER, GREEDY)
    _run(engine)
    monkeypatch.setattr(engine.runner, "execute", boom)
    fail_once("3")
    fail_once("4")
    engine.add_request("5", PROMPT, GREEDY)
    with pytest.raises(EngineStepError, match="3 engine steps in a row failed"):
        engine.step()


def test_a_pool_out_of_balance_after_a_failed_step_is_fatal(llm_fp32, monkeypatch):
    engine = _engine(llm_fp32)

    def corrupting(*args):
        engine.pool.blocks[-1].ref_cnt += 1  # a free block that claims an owner
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "execute", corrupting)
    engine.add_request("a", PROMPT, GREEDY)
    with pytest.raises(EngineStepError, match="block pool is inconsistent"):
        engine.step()


@pytest.mark.parametrize("path", ["greedy", "sampler"])
def test_a_nan_row_fails_only_its_own_request(llm_fp32, path, monkeypatch):
    """Rows whose hidden state is NaN (the greedy path checks hidden states, the sampler path the
    logits): that request fails, the others in the same step match the offline engine."""
    magic = 4321
    bad_prompt = list(range(700, 729)) + [magic]
    good = GREEDY if path == "greedy" else SamplingParams(temperature=0.7, seed=5, max_tokens=8, logprobs=2)
    want = llm_fp32.generate([PROMPT, OTHER], good)
    model = llm_fp32.engine.model
    real_forward = model.forward

    def poisoned(input_ids, *args):
        hidden = real_forward(input_ids, *args)
        return hidden.masked_fill((input_ids == magic).view(-1, 1), float("nan"))

    engine = _engine(llm_fp32)
    monkeypatch.setattr(model, "forward", poisoned)
    engine.add_request("good-1", PROMPT, good)
    engine.add_request("bad", bad_prompt, GREEDY)
    engine.add_request("good-2", OTHER, good)
    done = _run(engine)
    assert done["bad"][0].finish_reason == "error" and "not finite" in done["bad"][0].error
    for rid, ref in zip(("good-1", "good-2"), want):
        assert done[rid][0].token_ids == ref.outputs[0].token_ids
        assert done[rid][0].logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)  # batched apart
    assert engine.num_failed_steps_total == 0  # the step served its other rows: not a failed step
    engine.add_request("bad-alone", bad_prompt, GREEDY)
    assert _run(engine)["bad-alone"][0].finish_reason == "error"
    assert engine.num_failed_steps_total == 1  # nothing in that step came out right
    monkeypatch.undo()
    # None of the failed request's blocks stayed in the prefix cache.
    engine.add_request("bad-again", bad_prompt, GREEDY)
    assert _run(engine)["bad-again"][1] == 0
    _idle_and_balanced(engine)


def test_a_tiny_temperature_is_greedy_and_finite(llm_fp32, refs):
    tiny = SamplingParams(temperature=1e-30, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm_fp32.generate([PROMPT], tiny)[0].outputs[0]
    assert out.token_ids == refs["prompt"]
    assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs)


def test_the_waiting_queue_is_capped_in_requests_and_tokens(llm_fp32):
    engine = _engine(llm_fp32, max_num_seqs=1, max_waiting_requests=2, max_waiting_tokens=100)
    engine.add_request("a", PROMPT, LONG)
    engine.add_request("b", PROMPT[:20], LONG)
    with pytest.raises(EngineFullError, match="max_waiting_requests=2"):
        engine.add_request("c", OTHER, GREEDY)
    engine.step()  # "a" runs; "b" waits with 20 tokens
    with pytest.raises(EngineFullError, match="max_waiting_tokens=100"):
        engine.add_request("c", list(range(81)), GREEDY)
    engine.add_request("c", list(range(80)), GREEDY)
    with pytest.raises(EngineFullError):  # a parked remote reservation counts as waiting too
        engine.reserve_remote("r", OTHER, GREEDY)
    assert not issubclass(EngineFullError, ValueError)  # not the client's fault: 429, not 400
    assert engine.num_refused_requests_total == 3
    engine.abort_request(["a", "b", "c"])
    assert engine.reserve_remote("r", OTHER, GREEDY) is not None
    engine.abort_request("r")
    engine.add_request("big", list(range(150)), GREEDY)  # alone, a request over the token cap fits
    assert _run(engine)["big"][0].finish_reason == "length"
    _idle_and_balanced(engine)


async def _drain(stream) -> list[int]:
    return [t async for d in stream for t in d.token_ids]


def test_a_failed_request_raises_from_its_stream_and_the_engine_serves_on(llm_fp32, refs, monkeypatch):
    engine = _engine(llm_fp32)
    real = engine.runner.execute
    faults = iter([RuntimeError("injected")])

    def once(*args):
        fault = next(faults, None)
        if fault is not None:
            raise fault
        return real(*args)

    monkeypatch.setattr(engine.runner, "execute", once)
    ae = AsyncEngine(engine)
    ae.start()
    try:

        async def main():
            start = time.perf_counter()
            with pytest.raises(RequestFailedError, match="injected"):
                await _drain(ae.generate("x", PROMPT, GREEDY))
            failed = time.perf_counter()
            tokens, first = [], None
            async for d in ae.generate("y", PROMPT, GREEDY):
                if first is None and d.token_ids:
                    first = time.perf_counter()
                tokens += d.token_ids
            print(
                f"[reliability] failed request: its stream raised {1e3 * (failed - start):.0f} ms after "
                f"it was sent; the next request's first token {1e3 * (first - failed):.0f} ms later"
            )
            return tokens

        assert asyncio.run(asyncio.wait_for(main(), 120)) == refs["prompt"]
        assert ae.is_running and ae.error is None
        wait_engine_idle(engine)
    finally:
        ae.stop()
    _idle_and_balanced(engine)


def test_a_fatal_engine_fails_every_stream_and_calls_on_fatal_once(llm_fp32, monkeypatch):
    engine = _engine(llm_fp32)
    fatal: list[BaseException] = []
    fatal_at: list[float] = []
    ae = AsyncEngine(engine, on_fatal=lambda e: (fatal_at.append(time.perf_counter()), fatal.append(e)))
    ae.start()
    boom = RuntimeError("injected fatal")

    marks: list[float] = []  # the fault, then its stream raising

    def dead_step(*args, **kwargs):
        raise boom

    async def main():
        stream = ae.generate("s", PROMPT, LONG)
        first = await stream.__anext__()  # streaming, then the engine dies under it
        assert first.token_ids
        marks.append(time.perf_counter())
        monkeypatch.setattr(engine, "step", dead_step)
        with pytest.raises(EngineDeadError) as got:
            await _drain(stream)
        marks.append(time.perf_counter())
        assert got.value.__cause__ is boom
        with pytest.raises(EngineDeadError):  # and so does every later request
            await _drain(ae.generate("later", OTHER, GREEDY))

        async def no_prefill(block_ids, num_cached):
            raise AssertionError("a dead engine reserved blocks")

        with pytest.raises(EngineDeadError):
            await _drain(ae.generate_remote("remote", OTHER, GREEDY, no_prefill))

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
        deadline = time.monotonic() + 10  # on_fatal runs on the engine thread, after the streams fail
        while not fatal:
            assert time.monotonic() < deadline, "on_fatal was never called"
            time.sleep(0.01)
        assert fatal == [boom]
        print(
            f"[reliability] fatal engine: the open stream raised EngineDeadError {1e3 * (marks[1] - marks[0]):.0f}"
            f" ms after the fault; on_fatal ran {1e3 * (fatal_at[0] - marks[0]):.0f} ms after it"
        )
        assert not ae.is_running and ae.error is boom
    finally:
        ae.stop()
