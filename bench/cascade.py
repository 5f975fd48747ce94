"""Cascade attention micro-benchmark: a decode step over requests that share one long prefix.

    python -m baton.bench.cascade [--requests 64 --shared-len 2048 --suffix-len 64 --dtype bfloat16]
    python -m baton.bench.cascade --calibrate   # fit the cost model's constants (cascade_plan)

The KV cache has SmolLM2's shape (30 layers, 3 KV heads of 64, 9 query heads) and random values;
every request's block table starts with the same shared blocks (as prefix caching hands them out)
and ends with blocks of its own. Reported, plain kernel vs cascade kernel on the same inputs:

- attention: one layer's decode attention (the kernel call alone), and times 30 for a step;
- step: the whole decode step through the real model (``ModelRunner.prepare`` + forward + greedy
  token), with the runner's cascade on (every group kept) and off.

Times are the minimum over ``--iters`` runs (the machine is shared: the minimum is the run least
disturbed by other processes), ratios plain / cascade.

And the roofline: both kernels do the same arithmetic (``attention_flop``: q.k and p.v, 2 x D flops
each per query head and context token), so their rates are comparable with this machine's vdpbf16ps
rate (``cpu_ops.bf16_dot_peak_gflops``, same threads). Where the shared prefix stays in cache the
plain kernel is compute-bound too, and no exact kernel beats it by more than ``speedup_bound`` =
peak / the plain kernel's rate (bf16 without AMX tiles; None otherwise).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from baton.common.engine.cascade_plan import CascadeConfig, CascadeCostModel
from baton.kernels import cpu_ops
from baton.kernels.cascade import cascade_decode_attention
from baton.kernels.cascade_groups import CascadeGroups
from baton.kernels.paged_attention import paged_decode_attention

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16
ALWAYS = CascadeConfig(
    cost=CascadeCostModel(shared_per_query=0.0, shared_per_token=0.0, per_group=0.0, per_merged_row=0.0)
)


@dataclass(frozen=True)
class Batch:
    """One decode step's attention inputs: ``requests`` rows sharing ``shared_len`` tokens."""

    q: torch.Tensor  # [B, H, D]
    k: torch.Tensor  # [num_blocks, KV, bs, D], a layer's view of the cache
    v: torch.Tensor
    tables: torch.Tensor  # [B, max_blocks] int32
    lens: torch.Tensor  # [B] int32
    groups: CascadeGroups
    cache: torch.Tensor  # [num_blocks, layers, 2, KV, bs, D]


def make_batch(requests: int, shared_len: int, suffix_len: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    n_shared = shared_len // BLOCK
    n_own = -(-(suffix_len + 1) // BLOCK)  # the newest token included
    num_blocks = n_shared + requests * n_own + 1
    cache = torch.randn(num_blocks, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    shared = perm[:n_shared]
    tables = torch.empty(requests, n_shared + n_own, dtype=torch.int32)
    for b in range(requests):
        tables[b, :n_shared] = shared
        tables[b, n_shared:] = perm[n_shared + b * n_own : n_shared + (b + 1) * n_own]
    lens = torch.full((requests,), n_shared * BLOCK + suffix_len + 1, dtype=torch.int32)
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=gen).to(dtype)
    groups = CascadeGroups.build([(list(range(requests)), n_shared)])
    return Batch(q, cache[:, 3, 0], cache[:, 3, 1], tables, lens, groups, cache)


def best_of(fn: Callable[[], object], iters: int) -> float:
    """Seconds of the fastest of ``iters`` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def attention_flop(batch: Batch) -> int:
    """Flops of one layer's exact decode attention over ``batch``: per query head and context
    token, q.k (D multiply-adds) and p.v (D more), 2 flops each."""
    heads, head_dim = batch.q.shape[1], batch.q.shape[2]
    return 4 * heads * head_dim * int(batch.lens.sum())


def attention_times(batch: Batch, iters: int) -> tuple[float, float]:
    """(plain, cascade) seconds of one layer's decode attention."""
    out = torch.empty_like(batch.q)
    scale = HEAD_DIM**-0.5

    def plain():
        paged_decode_attention(batch.q, batch.k, batch.v, batch.tables, batch.lens, scale, out=out)

    def cascade():
        cascade_decode_attention(
            batch.q, batch.k, batch.v, batch.tables, batch.lens, batch.groups, scale, out=out
        )

    return best_of(plain, iters), best_of(cascade, iters)


def step_times(batch: Batch, dtype: torch.dtype, iters: int) -> tuple[float, float]:
    """(plain, cascade) seconds of a whole decode step of the real model over ``batch``'s cache."""
    from baton.common.engine.model_runner import ModelRunner
    from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
    from baton.common.model.loader import load_model
    from baton.common.model.source import ModelSource

    model = load_model(ModelSource.resolve(None), dtype, "cpu")
    runner = ModelRunner(model, batch.cache, BLOCK, scratch_block=batch.cache.shape[0] - 1)
    sched = SchedulerOutput(
        tuple(
            ScheduledRequest(
                f"r{b}", (100 + b,), int(batch.lens[b]) - 1, tuple(batch.tables[b].tolist()), True
            )
            for b in range(batch.q.shape[0])
        )
    )

    @torch.inference_mode()
    def step():
        inputs = runner.prepare(sched)
        hidden = model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
        model.greedy_tokens(hidden[inputs.logits_indices])

    runner.cascade = None
    plain = best_of(step, iters)
    runner.cascade = ALWAYS
    cascade = best_of(step, iters)
    assert runner.num_cascade_steps == iters + 1, "the cascade path did not run"
    return plain, cascade


@dataclass(frozen=True)
class Result:
    requests: int
    shared_len: int
    suffix_len: int
    dtype: str
    threads: int
    attention_plain_ms: float
    attention_cascade_ms: float
    attention_speedup: float
    attention_gflop: float
    plain_gflops: float
    cascade_gflops: float
    bf16_peak_gflops: float | None
    speedup_bound: float | None
    step_plain_ms: float | None
    step_cascade_ms: float | None
    step_speedup: float | None


def run(requests: int, shared_len: int, suffix_len: int, dtype: str, iters: int, step: bool) -> Result:
    dt = getattr(torch, dtype)
    batch = make_batch(requests, shared_len, suffix_len, dt)
    plain, cascade = attention_times(batch, iters)
    sp = sc = None
    if step:
        sp, sc = step_times(batch, dt, max(3, iters // 4))
    ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
    gflop = attention_flop(batch) / 1e9
    peak = bf16_peak(dt)
    return Result(
        requests, shared_len, suffix_len, dtype, torch.get_num_threads(),
        ms(plain), ms(cascade), round(plain / cascade, 2),
        round(gflop, 4), round(gflop / plain, 1), round(gflop / cascade, 1),
        None if peak is None else round(peak, 1),
        None if peak is None else round(peak * plain / gflop, 2),
        ms(sp), ms(sc), None if sp is None or sc is None else round(sp / sc, 2),
    )  # fmt: skip


def bf16_peak(dtype: torch.dtype) -> float | None:
    """This machine's vdpbf16ps rate in GFLOP/s (best of 3), where it bounds both kernels: a bf16
    cache on a CPU with AVX512-BF16 and no AMX tiles (the shared pass runs on tiles there)."""
    if dtype != torch.bfloat16 or cpu_ops.has_amx_bf16() or not cpu_ops.has_avx512_bf16():
        return None
    return max(cpu_ops.bf16_dot_peak_gflops() for _ in range(3))


def _fit_nonnegative(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a negative one is fixed at 0 and the rest refit."""
    x, y = np.array(rows), np.array(times)
    free = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        negative = [i for i in free if coef[i] < 0]
        if not negative:
            return [float(c) for c in coef]
        free = [i for i in free if i not in negative]


def calibrate(dtype: str, iters: int) -> dict[str, float]:
    """Fit ``CascadeCostModel`` (ns per KV head) to kernel times over a grid of group sizes M and
    shared lengths S: the plain kernel, t = per_token * M * (S + 33) + t0; the shared pass alone
    (rows whose context is just the shared blocks), t = shared_per_query * M * S +
    shared_per_token * S + per_group; then the whole cascade with 32 own tokens per row, whose
    excess over the shared pass and the own tokens at the plain rate is per_merged_row * M."""
    dt = getattr(torch, dtype)
    plain_rows, plain_t, shared_rows, shared_t, merge = [], [], [], [], []
    for m in (2, 8, 32, 64):
        for s in (256, 1024, 2048):
            batch = make_batch(m, s, 32, dt)
            plain, cascade = attention_times(batch, iters)
            shared_only = replace(batch, lens=torch.full_like(batch.lens, s))
            _, shared = attention_times(shared_only, iters)
            plain_rows.append([m * (s + 33), 1.0])
            plain_t.append(plain * 1e9 / KV_HEADS)
            shared_rows.append([m * s, s, 1.0])
            shared_t.append(shared * 1e9 / KV_HEADS)
            merge.append((m, (cascade - shared) * 1e9 / KV_HEADS))
    per_token = _fit_nonnegative(plain_rows, plain_t)[0]
    c, e, o = _fit_nonnegative(shared_rows, shared_t)
    per_row = [max(0.0, (t - per_token * m * 33) / m) for m, t in merge]
    return {
        "per_token": round(per_token, 3),
        "shared_per_query": round(c, 3),
        "shared_per_token": round(e, 3),
        "per_group": round(o, 1),
        "per_merged_row": round(float(np.median(per_row)), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.bench.cascade", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--shared-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's; --calibrate: 1)"
    )
    p.add_argument("--no-step", action="store_true", help="attention only, no whole-model step")
    p.add_argument("--calibrate", action="store_true", help="fit the cost model's constants")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cpu_ops.load()
    if a.calibrate:
        if not a.threads:  # one thread: the fit is of the kernels' work, not of the machine's load
            torch.set_num_threads(1)
        print(
            json.dumps({"dtype": a.dtype, "threads": torch.get_num_threads(), **calibrate(a.dtype, a.iters)})
        )
        return 0
    result = run(a.requests, a.shared_len, a.suffix_len, a.dtype, a.iters, not a.no_step)
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
