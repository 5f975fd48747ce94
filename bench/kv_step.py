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
import json

from baton.bench.kv_step_config import KVStepConfig
from baton.kernels import kv_cache_dtypes


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
    # The measuring side needs torch; the command line (``baton``'s parser) does not.
    from baton.bench.kv_step_measure import run_kv_step

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
