"""Decode time against the KV cache dtype (``baton bench kv-step``): the decode attention of one layer
and a whole decode step (prepare, forward over every layer, greedy sampling) of ``--batch``
requests at ``--context`` tokens each, for every ``--kv-cache-dtype`` given, in one process, one
after another, each against the first (the baseline, ``auto``: the model dtype).

The cache of each run is sized to exactly the batch's blocks (64 x 4096 SmolLM2 tokens: 6.0 GB in
bf16, 3.1 GB in int8), filled with random K/V quantized as the engine would, and freed before the
next. ``--num-layers`` keeps only the first layers of the model for a machine without that memory
(the attention share of the step then stays the same per layer).

Times are the best and the median of ``--repeats`` calls, wall clock and this thread's CPU time
(on a shared machine the CPU time is the steadier figure, the wall time the true one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.kernels import kv_cache_dtypes, kv_quant, paged_attention


@dataclass(frozen=True)
class KVStepConfig:
    model: str | None = None
    """A .gguf file or a Llama safetensors directory; None: the default SmolLM2."""
    dtype: str = "bfloat16"
    """Model (and ``auto`` cache) dtype."""
    batch: int = 64
    """Decoding requests in the step."""
    context: int = 4096
    """Tokens each request attends to (its new one included)."""
    block_size: int = 16
    repeats: int = 5
    """Timed calls per measurement (after one warm-up call)."""
    num_layers: int | None = None
    """Keep only this many layers of the model (None: all)."""
    seed: int = 0


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


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"decode at {c['batch']} x {c['context']} tokens, {c['dtype']} model, {c['layers']} layers, "
        f"{c['threads']} threads (speedup vs {result['runs'][0]['kv_cache_dtype']}: wall / cpu)",
        f"{'kv cache':<10} {'GiB':>5} {'B/token':>8} {'attn ms':>8} {'speedup':>13} {'step ms':>8} {'speedup':>13}",
    ]
    for r in result["runs"]:
        a, s = r["attention"], r["step"]
        lines.append(
            f"{r['kv_cache_dtype']:<10} {r['cache_gib']:>5.2f} {r['kv_bytes_per_token']:>8} "
            f"{a['best_ms']:>8.1f} {a['speedup_best_ms']:>6.2f}/{a['speedup_best_cpu_ms']:<6.2f} "
            f"{s['best_ms']:>8.1f} {s['speedup_best_ms']:>6.2f}/{s['speedup_best_cpu_ms']:<6.2f}"
        )
    return "\n".join(lines)


# -- CLI ------------------------------------------------------------------------------------------
def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("kv-step", help="decode attention and decode step time by KV cache dtype")
    p.add_argument("--model", default=None, help="a .gguf file or a Llama safetensors directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=list(kv_cache_dtypes.KV_CACHE_DTYPES),
        choices=list(kv_cache_dtypes.CHOICES),
        help="the caches to time; the first is the baseline",
    )
    p.add_argument("--batch", type=int, default=KVStepConfig.batch)
    p.add_argument("--context", type=int, default=KVStepConfig.context)
    p.add_argument("--block-size", type=int, default=KVStepConfig.block_size)
    p.add_argument("--repeats", type=int, default=KVStepConfig.repeats)
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first layers (memory)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_kv_step)


def cmd_kv_step(a: argparse.Namespace) -> int:
    cfg = KVStepConfig(a.model, a.dtype, a.batch, a.context, a.block_size, a.repeats, a.num_layers)
    result = run_kv_step(cfg, a.kv_cache_dtype)
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(line + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.bench.kv_step")
    register(parser.add_subparsers(dest="bench", required=True))
    return cmd_kv_step(parser.parse_args(["kv-step", *(argv or [])]))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
