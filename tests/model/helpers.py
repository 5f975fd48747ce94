"""Helpers for model tests: prompts, and our model's logits over a whole prompt."""

from __future__ import annotations

import time

import torch

from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput

PLAIN_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three laws of robotics are",
    "import numpy as np\n",
    "Paris is the capital of",
    "1, 2, 3, 4, 5,",
    "In machine learning, a transformer is",
]

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for learning Python.",
    "What is 12 times 12?",
    "Explain gravity to a child.",
    "Name a famous painting by Leonardo da Vinci.",
    "What does a KV cache store in a transformer?",
]


@torch.inference_mode()
def prompt_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """Our model's fp32 logits at every position of one prompt, [T, V], in a scratch cache."""
    bs = engine.config.block_size
    n_blocks = -(-len(token_ids) // bs)
    cache = allocate_kv_cache(engine.model, n_blocks + 1, bs, engine.dtype, "cpu")  # + a scratch block
    runner = ModelRunner(engine.model, cache, bs, scratch_block=n_blocks)
    sched = SchedulerOutput((ScheduledRequest("x", tuple(token_ids), 0, tuple(range(n_blocks)), True),))
    inputs = runner.prepare(sched)
    hidden = engine.model(inputs.input_ids, inputs.positions, cache, inputs.meta)
    return engine.model.compute_logits(hidden[: len(token_ids)])


def wait_engine_idle(engine, timeout: float = 30.0) -> None:
    """Wait (bounded) until an engine stepped by an ``AsyncEngine`` thread is idle. A stream ends
    with its last token, but the engine computes that token's KV (``Scheduler.completing``) in one
    more step, so "every stream finished" is not yet "idle"."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, (
            f"engine not idle after {timeout} s: completing={[r.request_id for r in engine.scheduler.completing]}"
            f" running={[r.request_id for r in engine.scheduler.running]}"
        )
        time.sleep(0.01)
