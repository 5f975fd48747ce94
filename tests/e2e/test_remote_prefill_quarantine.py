"""The decode engine's side of a remote prefill given up mid-message (issue 28, part 3): blocks that a
receive the transport could not cancel may still write are quarantined. The request computes in
fresh blocks, so a late write into the quarantined ones changes none of its tokens; the pool takes
them back only once the receive settles; and a request aborted while its transfer is live keeps its
blocks until the transfer is over. A real engine over the tiny random Llama, on its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from baton.common.engine.async_engine import AsyncEngine
from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LandedPrefix, Quarantine
from baton.common.llm import SamplingParams
from baton.common.parallel.engine_factory import create_engine

from .fault_cluster import ENGINE_FLAGS, tiny_model

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [(i * 104729) % 40000 + 100 for i in range(300)]  # 19 blocks of 16


@pytest.fixture(scope="module")
def engine():
    ae = AsyncEngine(lambda: create_engine(EngineConfig(model=str(tiny_model()), **ENGINE_FLAGS)))
    ae.start()
    yield ae
    ae.stop()


@pytest.fixture(scope="module")
def reference(engine):
    async def run():
        return [t async for d in engine.generate("reference", PROMPT, GREEDY) for t in d.token_ids]

    tokens = asyncio.run(run())
    _on_engine(engine, lambda e: e.pool.reset_prefix_cache())  # the tests' prompts hit nothing
    return tokens


def _on_engine(ae: AsyncEngine, fn):
    """``fn(engine)`` on the engine thread, between two steps; its result."""
    done: Future = Future()
    ae.call_soon(lambda e: done.set_result(fn(e)))
    return done.result(timeout=30)


def _scribble(ae: AsyncEngine, block_ids: list[int], stop: threading.Event) -> threading.Thread:
    """What a late receive would do: write into ``block_ids`` of the cache until ``stop``."""

    def write() -> None:
        cache = ae.engine.kv_cache
        while not stop.wait(0.001):
            cache[block_ids] = 1e4

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("room", ["fresh blocks", "no room: readmitted"])
def test_a_request_never_reads_its_quarantined_blocks_and_the_pool_gets_them_back_once_settled(
    engine, reference, room, monkeypatch
):
    llm = engine.engine
    if room != "fresh blocks":  # the pool has no block to spare at resume: start over from the queue
        monkeypatch.setattr(llm.kv, "swap_quarantined", lambda req: False)
    settled = threading.Event()
    on_settled: list = []
    quarantined: list[int] = []
    stop = threading.Event()

    async def prefill(block_ids, num_cached):
        # Blocks 3 and 4 of the reserved range have a message's receives posted into them.
        quarantined.extend(block_ids[num_cached // 16 :][3:5])
        _scribble(engine, quarantined, stop)
        return LandedPrefix(num_cached, Quarantine(tuple(quarantined), settled.is_set, on_settled.append))

    async def run():
        return [
            t async for d in engine.generate_remote(f"q-{room}", PROMPT, GREEDY, prefill) for t in d.token_ids
        ]

    assert _on_engine(engine, lambda e: e.pool.reset_prefix_cache())  # the prompt hits nothing
    free = _on_engine(engine, lambda e: e.pool.num_free_blocks)
    try:
        tokens = asyncio.run(run())
    finally:
        stop.set()
    assert tokens == reference  # the late writes went into blocks the request no longer used
    refs = _on_engine(engine, lambda e: [e.pool.blocks[b].ref_cnt for b in quarantined])
    assert refs == [1, 1]  # the quarantine's own references: out of the pool, out of use
    assert _on_engine(engine, lambda e: e.pool.num_free_blocks) == free - 2
    settled.set()
    for fn in on_settled:  # what the transfer's handle does when the receive settles
        fn()
    assert _on_engine(engine, lambda e: (e.kv.num_quarantined_blocks, e.pool.num_free_blocks)) == (0, free)
    _on_engine(engine, lambda e: e.pool.check_integrity())


def test_a_request_aborted_while_its_transfer_is_live_keeps_its_blocks_until_the_transfer_ends(engine):
    """A client that leaves mid-transfer aborts the request at once (the decode worker's Generate
    does): the blocks the transfer writes into go back only when the prefill returns."""
    free = _on_engine(engine, lambda e: e.pool.num_free_blocks)

    async def run():
        started, transfer_over = asyncio.Event(), asyncio.Event()

        async def prefill(block_ids, num_cached):
            started.set()
            await transfer_over.wait()
            return None

        stream = engine.generate_remote("aborted", PROMPT, GREEDY, prefill)
        drained = asyncio.ensure_future(_last(stream))
        await started.wait()
        engine.abort("aborted")
        await asyncio.sleep(0.3)
        held = _on_engine(engine, lambda e: e.pool.num_free_blocks)
        transfer_over.set()
        last = await drained
        return held, last

    held, last = asyncio.run(run())
    assert held == free - len(PROMPT) // 16 - 1  # still reserved while the transfer was live
    assert last.finished and last.finish_reason == "abort"
    assert _on_engine(engine, lambda e: e.pool.num_free_blocks) == free
    _on_engine(engine, lambda e: e.pool.check_integrity())


async def _last(stream):
    last = None
    async for d in stream:
        last = d
    return last
