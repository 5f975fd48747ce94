"""The timed calls of ``baton bench kv-step`` (``bench/kv_step.py``, the command): a KV cache of each
dtype filled as the engine would fill it, one layer's decode attention and a whole decode step over it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.bench.kv_step_config import KVStepConfig
from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.kernels import kv_quant, paged_attention


@dataclass(frozen=True)
class Timing:
    best_s: float
    median_s: float
    best_cpu_s: float

    def as_dict(self) -> dict:
        return {
            "best_ms": self.best_s * 1e3,
            "median_ms": self.median_s * 1e3,
            "best_cpu_ms": self.best_cpu_s * 1e3,
        }


def time_calls(fn: Callable[[], object], repeats: int) -> Timing:
    fn()  # warm-up: page faults, oneDNN primitives, Triton compiles
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    return Timing(min(wall), statistics.median(wall), min(cpu))


def _block_tables(cfg: KVStepConfig) -> torch.Tensor:
    """[batch, blocks per request] int32: every block used once, in a random order (as a pool that
    has been serving a while hands them out)."""
    per = -(-cfg.context // cfg.block_size)
    gen = torch.Generator().manual_seed(cfg.seed)
    return torch.randperm(cfg.batch * per, generator=gen).view(cfg.batch, per).to(torch.int32)


def _fill(cache: torch.Tensor, seed: int) -> None:
    """Random K/V in every block, quantized as the engine writes them, a few blocks at a time."""
    gen = torch.Generator().manual_seed(seed)
    fmt = kv_quant.format_of(cache)
    head_dim = cache.shape[-1] - (kv_quant.SCALE_BYTES if fmt else 0)
    for start in range(0, cache.shape[0], 256):
        part = cache[start : start + 256]
        dense = torch.randn((*part.shape[:-1], head_dim), generator=gen)
        if fmt is None:
            part.copy_(dense)
        else:
            part.view(torch.uint8).copy_(kv_quant.quantize_rows_ref(dense, fmt).view(torch.uint8))


def _decode_step(cfg: KVStepConfig, tables: torch.Tensor) -> SchedulerOutput:
    return SchedulerOutput(
        tuple(
            ScheduledRequest(f"r{b}", (b + 7,), cfg.context - 1, tuple(tables[b].tolist()), True)
            for b in range(cfg.batch)
        )
    )


@torch.inference_mode()
def measure(model, cfg: KVStepConfig, kv_cache_dtype: str) -> dict:
    mcfg = model.config
    tables = _block_tables(cfg)
    num_blocks = tables.numel()
    dtype = model.embed_tokens.weight.dtype
    cache = allocate_kv_cache(model, num_blocks + 1, cfg.block_size, dtype, "cpu", kv_cache_dtype)
    _fill(cache, cfg.seed)
    q = torch.randn(cfg.batch, mcfg.num_heads, mcfg.head_dim, dtype=dtype)
    lens = torch.full((cfg.batch,), cfg.context, dtype=torch.int32)
    out = torch.empty_like(q)
    layer = cache[:, 0]
    scale = mcfg.head_dim**-0.5

    def attention() -> None:
        paged_attention.paged_decode_attention(q, layer[:, 0], layer[:, 1], tables, lens, scale, out=out)

    runner = ModelRunner(model, cache, cfg.block_size, scratch_block=num_blocks)
    sched = _decode_step(cfg, tables)

    def step() -> None:
        inputs = runner.prepare(sched)
        hidden = model(inputs.input_ids, inputs.positions, cache, inputs.meta)
        model.greedy_tokens(hidden[inputs.logits_indices])

    result = {
        "kv_cache_dtype": kv_cache_dtype,
        "cache_gib": cache.nbytes / 2**30,
        "kv_bytes_per_token": cache[0].nbytes // cfg.block_size,
        "attention": time_calls(attention, cfg.repeats).as_dict(),
        "step": time_calls(step, cfg.repeats).as_dict(),
    }
    return result


def run_kv_step(cfg: KVStepConfig, kv_cache_dtypes: list[str]) -> dict:
    from baton.common.engine.llm_engine import parse_dtype
    from baton.common.model.loader import load_model
    from baton.common.model.source import ModelSource

    model = load_model(ModelSource.resolve(cfg.model), parse_dtype(cfg.dtype), "cpu")
    if cfg.num_layers is not None:
        model.layers = model.layers[: cfg.num_layers]
        model.config = dataclasses.replace(model.config, num_layers=cfg.num_layers)
    runs = [measure(model, cfg, d) for d in kv_cache_dtypes]
    base = runs[0]
    for r in runs:
        for part in ("attention", "step"):
            for key in ("best_ms", "best_cpu_ms"):
                r[part][f"speedup_{key}"] = base[part][key] / r[part][key]
    return {
        "config": vars(cfg) | {"threads": torch.get_num_threads(), "layers": model.config.num_layers},
        "runs": runs,
    }
