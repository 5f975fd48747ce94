"""``baton bench transfer`` — workload W5 of BENCHMARKS.md: the KV transport alone.

For each token count, the blocks that hold that many tokens of the model's KV cache (the engine's
layout, ``[num_blocks, layers, 2, KV, block_size, D]``) move from a sender process to a receiver
process through each of Baton's transports (``KVSender``/``KVReceiver``: ``ucx``, and ``nccl``,
which is gloo on a CPU host), and, in the same run between the same two processes, through a plain
loopback TCP socket; a ``torch`` copy of the same bytes in one process is the ceiling. Each figure
is the median of ``--repeats`` after ``--warmup``; transports take turns within each repeat, so a
noisy neighbour hits them alike. The receiver checks every transfer's bytes against the sender's.

The time to prefill the same number of tokens with the real engine (one prompt of random token
ids, greedy, one output token) puts each transfer in proportion. Counts that do not fit the model's
context are reported as not measured, with the reason.

Importing this module is cheap (``baton``'s parser imports it): torch loads in the functions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from baton.bench.transfer_peers import KV_TRANSPORTS, TCP, KVGeometry, Peer, PeerError, PeerSpec
from baton.kernels import kv_cache_dtypes

if TYPE_CHECKING:
    from baton.common.model.config import LlamaConfig
    from baton.common.model.source import ModelSource

TRANSPORTS = KV_TRANSPORTS
MEMCPY = "memcpy"
BAR_TOKENS = 4096
BAR_FRACTION_OF_PREFILL = 0.10
"""The issue's bars: a 4k-token KV moves in at most 10% of its prefill time, no slower than TCP."""


@dataclass(frozen=True)
class TransferBenchConfig:
    tokens: tuple[int, ...] = (1024, 4096, 16384)
    transports: tuple[str, ...] = TRANSPORTS
    repeats: int = 5
    """Timed transfers per token count and transport (the median is reported)."""
    warmup: int = 1
    """Untimed transfers first (connection set-up, page faults)."""
    block_size: int = 16
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    """The cache's storage (``--kv-cache-dtype``): quantized blocks are ~half the bytes of bf16 ones."""
    model: str | None = None
    """Whose KV shape (and prefill) to measure; None is the engine's default model."""
    blocks_per_send: int = 0
    """Blocks per ``KVSender.send`` call; 0: one call for all (the prefill worker sends per chunk)."""
    prefill: bool = True
    """Measure the prefill time of each count with the real engine."""
    prefill_seconds: dict[int, float] = field(default_factory=dict)
    """Given prefill times (token count -> seconds), used instead of measuring those counts."""
    timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if bad or not self.transports:
            raise ValueError(f"transports must be among {TRANSPORTS}, got {list(self.transports)}")
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"token counts must be positive, got {list(self.tokens)}")
        if self.repeats < 1 or self.warmup < 0 or self.block_size < 1 or self.blocks_per_send < 0:
            raise ValueError("--repeats and --block-size must be >= 1, --warmup and --blocks-per-send >= 0")


def kv_geometry(model: str | None, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> KVGeometry:
    """The model's KV shape, read from its config (not its weights)."""
    from baton.common.engine.llm_engine import parse_dtype
    from baton.common.model.source import ModelSource

    source = ModelSource.resolve(model)
    cfg = _model_config(source)
    return KVGeometry(
        model=source.name,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        block_size=block_size,
        dtype=str(parse_dtype(dtype)).removeprefix("torch."),
        max_model_len=cfg.max_position_embeddings,
        kv_cache_dtype=kv_cache_dtype,
    )


def _model_config(source: ModelSource) -> LlamaConfig:

    if source.kind == "gguf":
        from gguf import GGUFReader

        from baton.common.model.loader import gguf_config

        return gguf_config(GGUFReader(source.path))
    from baton.common.model.config import LlamaConfig

    with open(os.path.join(source.path, "config.json")) as f:
        return LlamaConfig.from_hf(json.load(f))


# -- transfers -------------------------------------------------------------------------------------
def measure_transfers(config: TransferBenchConfig, geometry: KVGeometry) -> dict:
    """Every count through every transport and peer; the peers' pids and UCX environment."""
    spec = PeerSpec(
        geometry=geometry,
        num_blocks=max(geometry.blocks_for(t) for t in config.tokens),
        transports=(*config.transports, TCP),
        timeout_s=config.timeout_s,
        seed=config.seed,
    )
    receiver, sender = Peer("receiver", spec), Peer("sender", spec)
    try:
        for peer in (receiver, sender):
            peer.start()
        setup_s = config.timeout_s + 60.0  # spawning imports torch; two of them on a busy host
        descriptors = receiver.call("open", timeout_s=setup_s)
        ucx_env = sender.call("connect", descriptors, timeout_s=setup_s)
        sizes = [_measure_size(config, geometry, tokens, receiver, sender) for tokens in config.tokens]
    finally:
        for peer in (sender, receiver):
            peer.stop(10.0)
    return {"sizes": sizes, "pids": [receiver.pid, sender.pid], "ucx_env": ucx_env}


def _measure_size(config: TransferBenchConfig, geometry: KVGeometry, tokens: int, receiver, sender) -> dict:
    num_blocks = geometry.blocks_for(tokens)
    nbytes = num_blocks * geometry.bytes_per_block
    timeout = config.timeout_s
    expected_crc = sender.call("checksum", num_blocks, timeout_s=timeout)
    links = (*config.transports, TCP)
    samples: dict[str, list[float]] = {t: [] for t in links}
    verified = dict.fromkeys(links, True)
    moved = dict.fromkeys(links, 0)
    for i in range(config.warmup + config.repeats):
        for link in links:  # in turns, so that drift in the machine's load hits every link alike
            tid = f"{link}-{tokens}-{i}"
            receiver.call("arm", link, tid, num_blocks, timeout_s=timeout)
            pushed = sender.call("push", link, tid, num_blocks, config.blocks_per_send, timeout_s=timeout)
            got = receiver.call("wait", num_blocks, timeout_s=timeout)
            verified[link] &= got["crc"] == expected_crc and got["nbytes"] == nbytes
            moved[link] = got["nbytes"]
            if i >= config.warmup:
                samples[link].append(got["landed"] - pushed["started"])
    copy = sender.call("memcpy", num_blocks, config.warmup, config.repeats, timeout_s=timeout)
    samples[MEMCPY], verified[MEMCPY], moved[MEMCPY] = copy["samples"], copy["exact"], copy["nbytes"]
    return {
        "tokens": tokens,
        "blocks": num_blocks,
        "bytes": nbytes,
        "links": {link: _summary(samples[link], moved[link], verified[link]) for link in samples},
    }


def _summary(samples: list[float], nbytes: int, verified: bool) -> dict:
    seconds = statistics.median(samples)
    return {
        "seconds": seconds,
        "gbps": nbytes / max(seconds, 1e-9) / 1e9,
        "bytes": nbytes,
        "verified": verified,
        "samples_s": samples,
    }


# -- prefill ---------------------------------------------------------------------------------------
def measure_prefill(config: TransferBenchConfig, geometry: KVGeometry) -> dict[int, dict]:
    """Per count: seconds to prefill it with the real engine, or None and why not."""
    out: dict[int, dict] = {}
    todo = []
    for tokens in config.tokens:
        if tokens in config.prefill_seconds:
            out[tokens] = {"seconds": config.prefill_seconds[tokens], "source": "given"}
        elif not config.prefill:
            out[tokens] = {"seconds": None, "source": "not measured: prefill measurement disabled"}
        elif tokens + 1 > geometry.max_model_len:
            reason = (
                f"not measured: {tokens} prompt tokens + 1 output token exceed the model's context "
                f"(max_model_len {geometry.max_model_len})"
            )
            out[tokens] = {"seconds": None, "source": reason}
        else:
            todo.append(tokens)
    if todo:
        out.update(_prefill_with_engine(config, geometry, todo))
    return out


def _prefill_with_engine(config: TransferBenchConfig, geometry: KVGeometry, counts: list[int]) -> dict:
    import torch

    from baton.bench.offline import make_prompts
    from baton.common.llm import LLM, SamplingParams

    # A cache that holds one longest prompt; the engine's default budget would allocate gigabytes.
    need = geometry.max_model_len * geometry.bytes_per_token * 1.25
    llm = LLM(
        model=config.model,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        kv_cache_gib=math.ceil(need / 2**30 * 4) / 4,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(make_prompts(1, 256, config.seed + 1), params)  # warm-up: allocator, prepacking
    out = {}
    for tokens in counts:
        prompt = make_prompts(1, tokens, config.seed + tokens)
        started = time.perf_counter()
        llm.generate(prompt, params)
        seconds = time.perf_counter() - started
        out[tokens] = {"seconds": seconds, "source": f"measured: engine, {torch.get_num_threads()} threads"}
    return out


# -- the whole run ---------------------------------------------------------------------------------
def run_transfer_bench(config: TransferBenchConfig) -> dict:
    geometry = kv_geometry(config.model, config.block_size, config.dtype, config.kv_cache_dtype)
    transfers = measure_transfers(config, geometry)
    prefill = measure_prefill(config, geometry)
    sizes = transfers["sizes"]
    for size in sizes:
        pre = prefill[size["tokens"]]
        size["prefill_seconds"], size["prefill_source"] = pre["seconds"], pre["source"]
        tcp = size["links"][TCP]["gbps"]
        for stats in size["links"].values():
            stats["vs_tcp"] = stats["gbps"] / tcp
            stats["fraction_of_prefill"] = stats["seconds"] / pre["seconds"] if pre["seconds"] else None
    return {
        "workload": "W5",
        "model": geometry.model,
        "geometry": {
            **asdict(geometry),
            "block_shape": list(geometry.block_shape),
            "bytes_per_block": geometry.bytes_per_block,
            "bytes_per_token": geometry.bytes_per_token,
        },
        "config": {k: v for k, v in asdict(config).items() if k not in ("prefill_seconds",)},
        "nccl_backend": "gloo",  # the caches live on the CPU
        "time_base": "CLOCK_MONOTONIC, sender start to receiver's last byte",
        "ucx_env": transfers["ucx_env"],
        "peer_pids": transfers["pids"],
        "sizes": sizes,
        "bars": check_bars(sizes, config.transports),
    }


def check_bars(sizes: list[dict], transports: tuple[str, ...]) -> dict:
    """The issue's two bars, per transport, at 4k tokens (None where that count was not run)."""
    size = next((s for s in sizes if s["tokens"] == BAR_TOKENS), None)
    if size is None:
        return {}
    bars = {}
    for t in transports:
        stats = size["links"][t]
        fraction = stats["fraction_of_prefill"]
        bars[t] = {
            "fraction_of_prefill": fraction,
            "within_10pct_of_prefill": None if fraction is None else fraction <= BAR_FRACTION_OF_PREFILL,
            "vs_tcp": stats["vs_tcp"],
            "not_slower_than_tcp": stats["vs_tcp"] >= 1.0,
        }
    return bars


def format_table(result: dict) -> str:
    g = result["geometry"]
    c = result["config"]
    lines = [
        f"W5 KV transfer: {result['model']}, {g['dtype']} kv={g['kv_cache_dtype']}, {g['bytes_per_token']:,} B/token, "
        f"blocks of {g['block_size']} tokens; median of {c['repeats']} after {c['warmup']} warm-up",
        f"{'tokens':>7} {'MB':>8}  {'link':<12} {'GB/s':>7} {'ms':>9} {'x TCP':>6} {'of prefill':>10}  ok",
    ]
    for size in result["sizes"]:
        head = f"{size['tokens']:>7} {size['bytes'] / 1e6:>8.1f}"
        for link, s in size["links"].items():
            name = "nccl (gloo)" if link == "nccl" else link
            frac = "-" if s["fraction_of_prefill"] is None else f"{s['fraction_of_prefill']:.2%}"
            lines.append(
                f"{head}  {name:<12} {s['gbps']:>7.2f} {s['seconds'] * 1e3:>9.2f} "
                f"{s['vs_tcp']:>6.2f} {frac:>10}  {'yes' if s['verified'] else 'NO'}"
            )
            head = " " * len(head)
        pre = size["prefill_seconds"]
        shown = "-" if pre is None else f"{pre:.3f} s"
        lines.append(f"{'':>16}  prefill      {shown}  ({size['prefill_source']})")
    lines += [_bar_line(t, bar) for t, bar in result["bars"].items()]
    return "\n".join(lines)


def _bar_line(transport: str, bar: dict) -> str:
    fraction = bar["fraction_of_prefill"]
    if fraction is None:
        of_prefill = "prefill not measured"
    else:
        verdict = "pass" if bar["within_10pct_of_prefill"] else "FAIL"
        of_prefill = f"{fraction:.2%} of prefill (<= {BAR_FRACTION_OF_PREFILL:.0%}: {verdict})"
    vs_tcp = f"{bar['vs_tcp']:.2f}x TCP ({'pass' if bar['not_slower_than_tcp'] else 'FAIL'})"
    return f"bars at {BAR_TOKENS} tokens, {transport}: {of_prefill}, {vs_tcp}"


# -- command line ----------------------------------------------------------------------------------
def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _seconds_map(text: str) -> dict[int, float]:
    """``1024=1.2,4096=5.1`` -> {1024: 1.2, 4096: 5.1}."""
    pairs = (item.split("=") for item in text.split(",") if item.strip())
    return {int(k): float(v) for k, v in pairs}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=_int_list, default=(1024, 4096, 16384), help="e.g. 1024,4096,16384")
    p.add_argument(
        "--transports", type=_name_list, default=TRANSPORTS, help="ucx,nccl (nccl is gloo on a CPU host)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per count (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers first")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(kv_cache_dtypes.CHOICES))
    p.add_argument("--model", default=None, help="whose KV shape and prefill (default: the engine's)")
    p.add_argument("--blocks-per-send", type=int, default=0, help="blocks per send call (0: all in one)")
    p.add_argument(
        "--prefill-seconds",
        type=_seconds_map,
        default={},
        metavar="N=S,...",
        help="use these prefill times instead of measuring, e.g. 1024=1.1,4096=4.9",
    )
    p.add_argument("--no-prefill", action="store_true", help="do not measure prefill times")
    p.add_argument("--timeout", type=float, default=60.0, help="bound on each step, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("transfer", help="W5: the KV transport alone, beside TCP and memcpy")
    add_arguments(p)
    p.set_defaults(func=cmd_bench_transfer)


def cmd_bench_transfer(a: argparse.Namespace) -> int:
    try:
        config = TransferBenchConfig(
            tokens=a.tokens,
            transports=a.transports,
            repeats=a.repeats,
            warmup=a.warmup,
            block_size=a.block_size,
            dtype=a.dtype,
            kv_cache_dtype=a.kv_cache_dtype,
            model=a.model,
            blocks_per_send=a.blocks_per_send,
            prefill=not a.no_prefill,
            prefill_seconds=a.prefill_seconds,
            timeout_s=a.timeout,
            seed=a.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_transfer_bench(config)
    except PeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(result, f, indent=1)
    verified = all(s["verified"] for size in result["sizes"] for s in size["links"].values())
    return 0 if verified else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench transfer", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return cmd_bench_transfer(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
