"""The engine half of ``baton profile``: prefill and decode step times of a real ``LLMEngine``.

Each step is timed as the engine runs it (``LLMEngine.step``: schedule, forward, sample, update),
and its shape is read from the ``SchedulerOutput`` it ran, not assumed from the request: a point
is what the step computed.

- **Prefill**: ``pieces`` prompts of ``tokens`` new tokens each in one step, each after ``prior``
  tokens already in the cache. With prefix caching on, the prior tokens are a real prefix hit (a
  prefix prefilled once beforehand, shared by every repeat); with it off, the prompt's first
  ``prior`` tokens are kept as landed KV (``resume_remote`` with a ``LandedPrefix``, the path of a
  remote prefill that failed part-way) and the rest is computed. Fresh random new tokens every
  repeat, so nothing but the prefix hits. A chunked prompt (longer than the step's budget) is run
  whole as well, every one of its steps a point.
- **Decode**: ``batch`` requests of ``context`` tokens each are put straight into the running batch
  as a decode worker receives them after a remote prefill (``reserve_remote`` + ``resume_remote``
  with their first token: no prefill is computed), distinct random prompts (no shared prefix, so
  no cascade attention); after ``warmup`` steps, ``steps`` steady decode steps are timed.

Medians of the repeats; the first round of prefill points is a warm-up and not kept, but for a
step of a second or more, which is measured once (``LONG_STEP_MS``).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from baton.planner.profile import attention_pairs

MAX_DRAIN_STEPS = 10_000
"""Bound on the steps that finish a point's requests (a point needs a handful)."""
LONG_STEP_MS = 1000.0
"""A prefill point whose first step takes this long is timed that once, the first run kept: its
one-time costs (a shape's first use, after the engine's warm-up ran every padded shape) are
milliseconds against seconds, and its repeats were most of the default grid's time on a slow CPU
(AVX2-only Zen 3, bf16: the 37 points' four rounds took 1,161 s, one round 302 s). The chunked
prompt is run again only while its steps are shorter."""


@dataclass(frozen=True)
class PrefillPoint:
    pieces: int
    """Prompts sharing the step."""
    tokens: int
    """New tokens of each prompt in the step."""
    prior: int
    """Tokens of each prompt already cached before the step."""


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    """Tokens each sequence attends to at the first timed step."""


class StepTimer:
    """Times ``engine.step()`` and keeps the ``SchedulerOutput`` the step ran (the engine's
    ``on_step_computed`` hook, which this owner of the engine is free to use)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._sched = None
        engine.on_step_computed = self._seen

    def _seen(self, sched) -> None:
        self._sched = sched

    def step(self):
        """One step: (milliseconds, the SchedulerOutput it ran or None when it ran nothing)."""
        self._sched = None
        started = time.perf_counter()
        self.engine.step()
        return (time.perf_counter() - started) * 1e3, self._sched

    def drain(self) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished_requests():
                return
            self.engine.step()
        raise RuntimeError(f"the engine did not finish its requests in {MAX_DRAIN_STEPS} steps")


class Prompts:
    """Random token ids (as W1's, from [100, 40000)), never the same twice; request ids."""

    def __init__(self, seed: int, vocab: int) -> None:
        self._rng = random.Random(seed)
        self._top = min(40_000, vocab)
        self._ids = itertools.count()

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(100, self._top) for _ in range(n)]

    def request_id(self, kind: str) -> str:
        return f"profile-{kind}-{next(self._ids)}"


def _params(max_tokens: int):
    from baton.common.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _pieces(sched) -> list[tuple[int, int]]:
    """(new tokens, prior tokens) of each request in a step."""
    return [(r.num_tokens, r.start_pos) for r in sched.requests] if sched is not None else []


def _point(shape: list[tuple[int, int]], ms: list[float], **extra: float) -> dict[str, float]:
    tokens = sum(t for t, _ in shape)
    return {"tokens": tokens, "pairs": attention_pairs(shape), **extra, "ms": statistics.median(ms)}


# -- prefill ---------------------------------------------------------------------------------------
class PrefillRunner:
    def __init__(self, engine, prompts: Prompts) -> None:
        self.engine = engine
        self.timer = StepTimer(engine)
        self.prompts = prompts
        self.caching = engine.config.enable_prefix_caching
        self._prefixes: dict[int, list[int]] = {}

    def prefix(self, prior: int) -> list[int]:
        """The shared prefix of ``prior`` tokens; with prefix caching, prefilled once into the cache."""
        if prior not in self._prefixes:
            tokens = self.prompts.tokens(prior)
            if self.caching and prior:
                self.engine.add_request(self.prompts.request_id("prefix"), tokens, _params(1))
                self.timer.drain()
            self._prefixes[prior] = tokens
        return self._prefixes[prior]

    def once(self, point: PrefillPoint) -> tuple[float, list[tuple[int, int]]]:
        """One step of ``point``: its milliseconds and the pieces it computed."""
        from baton.common.engine.llm_engine import LandedPrefix

        prefix = self.prefix(point.prior)
        for _ in range(point.pieces):
            rid, prompt = self.prompts.request_id("prefill"), prefix + self.prompts.tokens(point.tokens)
            if self.caching:
                self.engine.add_request(rid, prompt, _params(1))
            else:
                if self.engine.reserve_remote(rid, prompt, _params(1)) is None:
                    raise RuntimeError(f"no room in the KV cache for {point}")
                self.engine.resume_remote(rid, LandedPrefix(point.prior))
        ms, sched = self.timer.step()
        self.timer.drain()
        return ms, _pieces(sched)

    def chunked(self, prompt_len: int) -> list[tuple[float, list[tuple[int, int]]]]:
        """Every step of one prompt of ``prompt_len`` fresh tokens, as the scheduler chunks it."""
        self.engine.add_request(
            self.prompts.request_id("chunked"), self.prompts.tokens(prompt_len), _params(1)
        )
        steps = []
        for _ in range(MAX_DRAIN_STEPS):
            ms, sched = self.timer.step()
            pieces = [(t, p) for t, p in _pieces(sched) if p < prompt_len and t > 1]
            if pieces:
                steps.append((ms, pieces))
            if not self.engine.has_unfinished_requests():
                return steps
        raise RuntimeError(f"a {prompt_len}-token prompt did not finish in {MAX_DRAIN_STEPS} steps")


def measure_prefill(
    engine, points: Sequence[PrefillPoint], chunked_len: int, repeats: int, prompts: Prompts
) -> list[dict[str, float]]:
    """The median step time of every point (and of every step of a ``chunked_len`` prompt, when
    not 0), over ``repeats`` rounds after one untimed round; the rounds take the points in turn.
    A point whose first step takes ``LONG_STEP_MS`` or more keeps that step and runs no more (the
    chunked prompt, timed from its first run, runs no more once a step of it is that long)."""
    runner = PrefillRunner(engine, prompts)
    samples: dict[PrefillPoint, list[float]] = {p: [] for p in points}
    shapes: dict[PrefillPoint, list[tuple[int, int]]] = {}
    done: set[PrefillPoint] = set()
    chunk_ms: list[list[float]] = []
    chunk_shapes: list[list[tuple[int, int]]] = []
    for round_ in range(1 + repeats):
        for point in points:
            if point in done:
                continue
            ms, pieces = runner.once(point)
            if not round_ and ms >= LONG_STEP_MS:
                done.add(point)  # its first step kept, the only one
            if round_ or point in done:
                samples[point].append(ms)
                shapes[point] = pieces
        chunk_long = any(ms[0] >= LONG_STEP_MS for ms in chunk_ms if ms)
        if chunked_len and round_ and not chunk_long:
            steps = runner.chunked(chunked_len)
            chunk_ms = chunk_ms or [[] for _ in steps]
            chunk_shapes = [pieces for _, pieces in steps]
            for i, (ms, _) in enumerate(steps[: len(chunk_ms)]):
                chunk_ms[i].append(ms)
    out = [
        _point(shapes[p], samples[p], prior=shapes[p][0][1], pieces=len(shapes[p]))
        for p in points
        if shapes.get(p)
    ]
    for pieces, ms in zip(chunk_shapes, chunk_ms):
        out.append(_point(pieces, ms, prior=pieces[0][1], pieces=len(pieces), chunked=1))
    engine.on_step_computed = None
    return out


# -- decode ----------------------------------------------------------------------------------------
def fill_batch(engine, prompts: Prompts, point: DecodePoint, max_tokens: int) -> list[str] | None:
    """Put ``point.batch`` requests of ``point.context`` tokens straight into the running batch, as
    after a remote prefill; None (having aborted them) when the cache cannot hold them all."""
    from baton.common.engine.scheduler import SampledToken

    rids: list[str] = []
    for _ in range(point.batch):
        rid = prompts.request_id("decode")
        prompt = prompts.tokens(point.context - 1)  # the first token makes the context
        if engine.reserve_remote(rid, prompt, _params(max_tokens)) is None:
            engine.abort_request(rids)
            return None
        engine.resume_remote(rid, SampledToken(prompts.tokens(1)[0]))
        rids.append(rid)
    return rids


def measure_decode(
    engine, points: Sequence[DecodePoint], steps: int, warmup: int, prompts: Prompts
) -> list[dict[str, float]]:
    """The median of ``steps`` steady decode steps at each point, after ``warmup`` untimed ones."""
    timer = StepTimer(engine)
    out = []
    for point in points:
        rids = fill_batch(engine, prompts, point, warmup + steps + 2)
        if rids is None:
            continue
        ms, batch, context = [], [], []
        for i in range(warmup + steps):
            took, sched = timer.step()
            if i >= warmup:
                ms.append(took)
                batch.append(len(sched.requests))
                context.append(sum(r.start_pos + r.num_tokens for r in sched.requests))
        engine.abort_request(rids)
        timer.drain()
        engine.pool.reset_prefix_cache()
        out.append(
            {
                "batch": statistics.median(batch),
                "context": statistics.median(context),
                "context_per_seq": point.context,
                "ms": statistics.median(ms),
            }
        )
    engine.on_step_computed = None
    return out


def fits(engine, point: DecodePoint, extra_tokens: int) -> bool:
    """Whether ``point``'s sequences, grown by ``extra_tokens``, fit the model and the KV cache."""
    bs = engine.config.block_size
    per_seq = -(-(point.context + extra_tokens) // bs)
    return (
        point.context + extra_tokens < engine.max_model_len
        and point.batch <= engine.config.max_num_seqs
        and point.batch * per_seq <= engine.pool.num_blocks
    )
