"""Emulated workers (``--emulate PROFILE``, issue 30 part 5): the real engine and services around
a model that is not there, each step's time taken from a ``baton profile`` instead of computed.

What is real: the gRPC services, the scheduler and block pool (the profile's KV capacity in blocks,
prefix caching, preemption), Redis registration and the prefix index, metrics, and the KV transfer
path, which moves real blocks over the real transport, only small ones: the cache has one layer
of one KV head of ``EMULATED_HEAD_DIM``. What is modelled: the forward pass (``EmulatedModelRunner``
sleeps the profile's step time and samples stand-in tokens), and a transfer's duration, which the
prefill worker stretches to the profile's ``transfer_ms`` (``hold_transfer``). No weights are
loaded; the tokenizer is, for the engine's text. Every figure such a worker gives is labelled: its
registry record's ``settings`` carry ``emulated`` (the profile's path; ``GET /workers`` shows it)
and its metrics the gauge ``baton:emulated 1``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from baton.common.engine.config import EngineConfig
from baton.common.engine.emulated_runner import EmulatedModelRunner, FakeVocab, StepCosts
from baton.common.engine.llm_engine import LLMEngine, parse_dtype
from baton.common.engine.model_runner import kv_cache_block_bytes
from baton.common.model.loader import read_config
from baton.common.model.source import ModelSource, eos_token_ids, load_tokenizer
from baton.planner.profile import Profile

log = logging.getLogger(__name__)

EMULATED_HEAD_DIM = 8
"""The emulated cache's row: 1 layer x K and V x 1 head x block_size x 8 values per block."""


class EmulatedModel:
    """What the engine reads of a model when none runs: its shape (the real vocabulary and context,
    a cache shape cut to one layer and one small head)."""

    def __init__(self, config):
        self.config = config


def profile_shape(config: EngineConfig, profile: Profile) -> EngineConfig:
    """``config`` with the profile's engine shape where ``config`` leaves the default: the block
    size, the chunk (``max_num_batched_tokens``) and ``max_num_seqs`` the times were measured at,
    and its dtype and KV cache dtype (named in the worker's settings; the tiny cache stores them)."""
    e, default = profile.engine, EngineConfig()

    def pick(name: str, measured: int) -> int:
        given = getattr(config, name)
        return measured if given == getattr(default, name) else given

    return dataclasses.replace(
        config,
        block_size=pick("block_size", e.block_size),
        max_num_batched_tokens=pick("max_num_batched_tokens", e.max_num_batched_tokens),
        max_num_seqs=pick("max_num_seqs", e.max_num_seqs),
        dtype=e.dtype if e.dtype in ("bfloat16", "float32") else "bfloat16",
        kv_cache_dtype=e.kv_cache_dtype,
    )


def emulated_config(config: EngineConfig) -> EngineConfig:
    """``config`` in the shape of its ``emulate`` profile (``profile_shape``): what the command
    line builds, so that the worker's own settings (block size, chunk) are the engine's."""
    assert config.emulate is not None
    return profile_shape(config, Profile.load(config.emulate))


def step_costs(profile: Profile) -> StepCosts:
    return StepCosts(profile.prefill_ms, profile.decode_ms, min(profile.prefill.a, profile.decode.a))


def create_emulated_engine(config: EngineConfig) -> LLMEngine:
    """The engine of an emulated worker: ``config.emulate``'s profile sets its costs and its KV
    capacity (``kv_capacity_tokens`` / block size blocks); the model named by ``config.model`` (its
    tokenizer, vocabulary and context) must be the profile's."""
    assert config.emulate is not None
    profile = Profile.load(config.emulate)
    source = ModelSource.resolve(config.model)
    if source.name != profile.engine.model:
        raise ValueError(
            f"the profile {config.emulate} is of {profile.engine.model}, the model is {source.name}:"
            " emulate a profile of the model served (--model)"
        )
    config = profile_shape(config, profile)
    real = read_config(source)
    model = EmulatedModel(
        dataclasses.replace(real, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=EMULATED_HEAD_DIM)
    )
    bs = config.block_size
    num_blocks = profile.engine.kv_capacity_tokens // bs
    if num_blocks < 1:
        raise ValueError(
            f"the profile's KV capacity ({profile.engine.kv_capacity_tokens} tokens) holds no block"
        )
    block_bytes = kv_cache_block_bytes(model, bs, parse_dtype(config.dtype), config.kv_cache_dtype)
    max_len = min(config.max_model_len or real.max_position_embeddings, num_blocks * bs)
    config = dataclasses.replace(
        config,
        kv_cache_gib=(num_blocks + 1) * block_bytes / 2**30,  # + the scratch block: exact in binary
        gpu_memory_utilization=None,
        device="cpu",
        max_model_len=max_len,
    )
    tokenizer = load_tokenizer(source)
    eos = eos_token_ids(source, tokenizer)
    engine = LLMEngine(config, model, tokenizer, eos, model_name=source.name)
    special = [int(i) for i in getattr(tokenizer, "all_special_ids", [])]
    first = min(max(special, default=-1) + 1, real.vocab_size - 1)
    vocab = FakeVocab(first, real.vocab_size, frozenset(eos))
    # The engine built a ModelRunner over the stand-in model; this one takes its place (the same
    # interface: execute, warm_up, grammars), so that everything around the forward pass is real.
    engine.runner = EmulatedModelRunner(step_costs(profile), vocab)
    log.warning(
        "EMULATED engine: no model runs; each step sleeps the time %s predicts (%s, taken %s on %s);"
        " %d KV blocks of %d tokens, max_num_seqs %d, chunk %d. Every figure of this worker is emulated.",
        config.emulate, profile.engine.model, profile.taken_at, profile.machine.cpu,
        num_blocks, bs, config.max_num_seqs, config.max_num_batched_tokens,
    )  # fmt: skip
    return engine


def transfer_model(engine: LLMEngine, transport: str):
    """The profile's model of moving KV over ``transport`` (ms over tokens) if ``engine`` is
    emulated and the profile measured that transport, else None (the sends take what they take)."""
    if engine.config.emulate is None:
        return None
    return Profile.load(engine.config.emulate).transfer.get(transport)


async def hold_transfer(transfer_ms, tokens: int, started: float | None) -> None:
    """An emulated prefill worker's sends last what the profile says moving ``tokens`` tokens' KV
    takes (``transfer_ms``, from ``transfer_model``): the wait the tiny blocks did not already
    take since ``started`` (``time.monotonic()`` of the first send)."""
    if transfer_ms is None or started is None:
        return
    left = transfer_ms(tokens) / 1000.0 - (time.monotonic() - started)
    if left > 0:
        await asyncio.sleep(left)
