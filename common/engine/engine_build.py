"""Building an engine's parts over a loaded model: the KV cache sized to its budget
(``num_kv_blocks``), the block pool and KV cache manager over it, the scheduler, the model runner
and the structured outputs. ``EngineCore`` runs them; the model comes from
``parallel.engine_factory``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.cascade_plan import cascade_config
from baton.common.engine.config import EngineConfig
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_budget import gpu_kv_cache_bytes
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache, kv_cache_block_bytes
from baton.common.engine.scheduler import Scheduler, SchedulerConfig
from baton.common.engine.structured import StructuredOutputs

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def gpu_memory(device: str) -> tuple[int, int]:
    """``device``'s total memory and what is in use on it now, every process counted (the CUDA
    context, this one's tensors); blocks torch's allocator caches but no tensor holds are freed first."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total, total - free


def num_kv_blocks(
    config: EngineConfig, model, dtype: torch.dtype, max_model_len: int, draft_model=None
) -> int:
    """Blocks in the pool: what the budget (``kv_cache_gib``, or ``gpu_memory_utilization`` of
    this device measured now, the model loaded and no cache yet) holds. Tensor- and pipeline-
    parallel ranks allocate as many blocks of their own shape: rank 0 sizes the cache for all,
    its stage holding the most layers (``stage_layers``)."""
    block_bytes = kv_cache_block_bytes(model, config.block_size, dtype, config.kv_cache_dtype)
    if config.gpu_memory_utilization is None:
        budget, what = int(config.kv_cache_gib * 2**30), f"kv_cache_gib={config.kv_cache_gib}"
    else:
        budget = gpu_kv_cache_bytes(config.gpu_memory_utilization, *gpu_memory(config.device))
        what = f"gpu_memory_utilization={config.gpu_memory_utilization} ({budget / 2**30:.2f} GiB)"
        if draft_model is not None:  # its cache has as many blocks, out of the same memory
            block_bytes += kv_cache_block_bytes(draft_model, config.block_size, dtype)
    # One block of the budget is the scratch block where a step's padding rows store their KV
    # (ModelRunner.prepare); the pool never hands it out.
    num_blocks = budget // block_bytes - 1
    if num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"{what} holds {max(num_blocks, 0) * config.block_size} tokens, "
            f"less than max_model_len={max_model_len}"
        )
    return num_blocks


@dataclass(frozen=True)
class EngineParts:
    """What ``build_parts`` makes: the pieces an engine runs, over one KV cache."""

    dtype: torch.dtype
    max_model_len: int
    """The config's, at most the model's context."""
    kv_cache: torch.Tensor
    """``allocate_kv_cache``'s, of the pool's blocks and one more: the scratch block, the last."""
    pool: BlockPool
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    structured: StructuredOutputs


def build_parts(
    config: EngineConfig, model, tokenizer, eos_token_ids: frozenset[int], draft_model=None
) -> EngineParts:
    """Size and allocate the KV cache for ``model`` (and ``draft_model``'s share of the budget,
    for ``speculative="draft"``), then build the pieces over it."""
    mcfg = model.config
    dtype = parse_dtype(config.dtype)
    max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
    num_blocks = num_kv_blocks(config, model, dtype, max_model_len, draft_model)
    kv_cache = allocate_kv_cache(
        model, num_blocks + 1, config.block_size, dtype, config.device, config.kv_cache_dtype
    )
    pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
    kv = KVCacheManager(pool, BlockHasher(config.block_size))
    scheduler = Scheduler(
        SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_model_len), kv
    )
    runner = ModelRunner(
        model,
        kv_cache,
        config.block_size,
        scratch_block=num_blocks,
        cascade=cascade_config(
            config.cascade, config.cascade_min_shared_blocks, str(dtype).removeprefix("torch.")
        ),
    )
    structured = StructuredOutputs(
        tokenizer, mcfg.vocab_size, sorted(eos_token_ids), max_model_len, config.jump_forward
    )
    runner.grammars = structured
    return EngineParts(dtype, max_model_len, kv_cache, pool, kv, scheduler, runner, structured)
