"""The machine's ceilings and SmolLM2-135M's floors under them (``baton bench roofline``).

Measures this machine's memory read bandwidth (a 1 GiB ``torch.sum``, repeated, median; with one
thread and with all of torch's threads: ``torch.sum`` splits a large reduction across its intra-op
threads, and one core alone reads less than the socket can, 24.6 vs 32.4 GB/s on two Zen 4 cores)
and its GEMM peaks per dtype, the best of its kernels (``torch.mm`` fp32 and bf16, Baton's own
bf16 GEMM where built, ``torch._int_mm`` int8; 2048³ by default, smaller for a kernel too slow to
measure there within ``GEMM_BUDGET_S``). From them, the floors a model cannot beat here:

- batch-1 decode: every weight is read once per token, so ms/token >= weight bytes / bandwidth;
- W1 (BENCHMARKS.md: 64 x 256 prompt + 128 output tokens): tokens/s <= tokens / (flops / peak),
  the flops being the projections, the LM head on sampled rows only, and attention.

Given measured figures (``--batch1-ms``, ``--w1-tok-s``, or the JSON that ``baton bench latency``
/ ``baton bench offline --output-json`` write), each is printed as a fraction of its floor
(1.0 = at the floor). The arithmetic (``ModelShape``, ``floors``) imports no torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}
"""Bytes a weight takes in memory per dtype (int8: the code; its per-channel scale is counted apart)."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 576
    intermediate: int = 1536
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    vocab: int = 49152
    tied_embeddings: bool = True

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's four projections (q|k|v, o, gate|up, down)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return qkv + o + 3 * self.hidden * self.intermediate

    @property
    def head_weights(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter, norms and embedding included (SmolLM2-135M: 134.5 M)."""
        norms = (2 * self.layers + 1) * self.hidden
        embed = self.head_weights * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_weights + embed + norms

    def decode_bytes(self, dtype: str) -> float:
        """Bytes one decode step reads at the least: every projection and the LM head once (the
        embedding rows of the batch and the norms are negligible; int8 adds a 4-byte scale per
        output channel)."""
        weights = self.layers * self.layer_weights + self.head_weights
        size = weights * BYTES_PER_WEIGHT[dtype]
        if dtype == "int8":
            channels = self.layers * (
                (self.heads + 2 * self.kv_heads) * self.head_dim + 2 * self.hidden + 2 * self.intermediate
            )
            size += 4 * (channels + self.vocab)
        return size

    def request_flops(self, prompt: int, output: int) -> float:
        """Flops of one request: projections on every computed token (prompt + output - 1), the LM
        head on the ``output`` sampled rows, and attention (q.k and p.v) over each token's context."""
        computed = prompt + output - 1
        body = 2.0 * self.layers * self.layer_weights * computed
        head = 2.0 * self.head_weights * output
        contexts = computed * (computed + 1) / 2  # token i attends to i + 1 positions
        attention = 4.0 * self.layers * self.heads * self.head_dim * contexts
        return body + head + attention


SMOLLM2 = ModelShape()


@dataclass(frozen=True)
class Ceilings:
    read_gb_s: float
    """The best read bandwidth measured, GB/s (1e9 bytes)."""
    gemm_gflops: dict[str, float]
    """GEMM peak per dtype, GFLOP/s."""


def floors(
    shape: ModelShape, ceilings: Ceilings, prompt: int = 256, output: int = 128, num_requests: int = 64
) -> dict:
    """Per dtype: batch-1 ms/token floor (memory) and W1 total tokens/s ceiling (compute)."""
    out: dict = {"batch1_ms": {}, "w1_tok_s": {}}
    for dtype in BYTES_PER_WEIGHT:
        out["batch1_ms"][dtype] = shape.decode_bytes(dtype) / (ceilings.read_gb_s * 1e9) * 1e3
    tokens = num_requests * (prompt + output)
    flops = num_requests * shape.request_flops(prompt, output)
    for dtype, gflops in ceilings.gemm_gflops.items():
        if gflops > 0:
            out["w1_tok_s"][dtype] = tokens / (flops / (gflops * 1e9))
    return out


def fractions(floor: dict, dtype: str, batch1_ms: float | None, w1_tok_s: float | None) -> dict:
    """Measured figures against the floors of ``dtype``: floor/measured for batch-1 (time: 1.0 is
    at the floor, 0.5 twice as slow) and measured/ceiling for W1; also each measured figure's ratio
    the other way round (``x_floor``: 1.49 = 1.49x the floor's time)."""
    out: dict = {}
    if batch1_ms is not None and dtype in floor["batch1_ms"]:
        f = floor["batch1_ms"][dtype]
        out["batch1"] = {
            "measured_ms": batch1_ms,
            "floor_ms": f,
            "fraction": f / batch1_ms,
            "x_floor": batch1_ms / f,
        }
    if w1_tok_s is not None and dtype in floor["w1_tok_s"]:
        c = floor["w1_tok_s"][dtype]
        out["w1"] = {"measured_tok_s": w1_tok_s, "ceiling_tok_s": c, "fraction": w1_tok_s / c}
    return out


# --- measurement (torch) ---------------------------------------------------------------------------


def _median_s(fn, repeats: int) -> float:
    fn()  # first touch, thread pool start
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


GEMM_BUDGET_S = 20.0
"""About the most one kernel's GEMM measurement may take. A kernel that would take longer at the
asked size (torch's bf16 ``mm`` on a CPU without a bf16 instruction: ~1.3 GFLOP/s on AVX2, 13 s a
2048³ product, 2.5 minutes with the repeats) is measured on the largest smaller cube (halving,
not below 256) that fits, and reported with it: a kernel that slow is compute-bound at any size."""


def gemm_gflops(
    product, size: int, repeats: int, budget_s: float = GEMM_BUDGET_S, time_s=_median_s
) -> tuple[float, int]:
    """(GFLOP/s, the cube's size) of ``product(n)``, a function that makes an n³ product's operands
    and returns the call to time, at ``size`` or the largest smaller size whose calls (the repeats
    and a first one) fit ``budget_s`` as a 256³ probe projects them. ``time_s(call, repeats)`` is the
    median seconds of a call (a test passes a nominal clock)."""
    probe = min(size, 256)
    per_flop = time_s(product(probe), 1) / probe**3
    while size > 256 and per_flop * size**3 * (repeats + 1) > budget_s:
        size //= 2
    return 2.0 * size**3 / time_s(product(size), repeats) / 1e9, size


def read_bandwidth(nbytes: int, repeats: int, threads: int) -> float:
    """GB/s of ``torch.sum`` over an fp32 tensor of ``nbytes`` with ``threads`` intra-op threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        return x.nbytes / _median_s(lambda: x.sum(), repeats) / 1e9
    finally:
        torch.set_num_threads(before)


def gemm_peak(dtype: str, size: int, repeats: int) -> tuple[float, int] | None:
    """(GFLOP/s, the size measured) of a ``size``³ product (``gemm_gflops``: smaller where a
    kernel is too slow for it): ``torch.mm`` for fp32/bf16, ``torch._int_mm`` (int8 x int8 ->
    int32) for int8; None where this torch has no such kernel on this device."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def product(n: int):
        if dtype == "int8":
            a = torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=gen)
            b = torch.randint(-127, 128, (n, n), dtype=torch.int8, generator=gen)
            return lambda: torch._int_mm(a, b)
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        a = torch.randn(n, n, generator=gen).to(torch_dtype)
        b = torch.randn(n, n, generator=gen).to(torch_dtype)
        return lambda: torch.mm(a, b)

    try:
        return gemm_gflops(product, size, repeats)
    except (RuntimeError, NotImplementedError):
        return None


def baton_bf16_peak(size: int, repeats: int) -> tuple[float, int] | None:
    """(GFLOP/s, the size measured) of Baton's own bf16 GEMM (``cpu_ops.bf16_gemm``, what
    ``llama.Linear`` runs on a CPU without AMX: AVX512-BF16 dot products, or AVX2's fp32 FMAs) on
    a ``size``³ product; None where it is not built or not compiled in (nothing is built here:
    that takes minutes)."""
    import torch

    from baton.kernels import cpu_ops

    if not cpu_ops.is_built() or not cpu_ops.bf16_gemm_available():
        return None
    gen = torch.Generator().manual_seed(0)

    def product(n: int):
        x = torch.randn(n, n, generator=gen).bfloat16()
        packed = cpu_ops.bf16_gemm_pack(torch.randn(n, n, generator=gen).bfloat16())
        out = torch.empty(n, n, dtype=torch.bfloat16)
        return lambda: cpu_ops.bf16_gemm(x, packed, out)

    return gemm_gflops(product, size, repeats)


def measure(nbytes: int, gemm_size: int, repeats: int) -> dict:
    """The read bandwidth by thread count, and each dtype's GEMM peak: the best of its kernels."""
    import torch

    threads = torch.get_num_threads()
    reads = {"1": read_bandwidth(nbytes, repeats, 1)}
    if threads > 1:
        reads[str(threads)] = read_bandwidth(nbytes, repeats, threads)
    found = {f"{d} torch": gemm_peak(d, gemm_size, repeats) for d in BYTES_PER_WEIGHT}
    found["bf16 baton"] = baton_bf16_peak(gemm_size, repeats)
    measured = {k: m for k, m in found.items() if m is not None}
    kernels = {k: g for k, (g, _) in measured.items()}
    best: dict[str, float] = {}
    for kernel, g in kernels.items():
        dtype = kernel.split()[0]
        best[dtype] = max(best.get(dtype, 0.0), g)
    return {
        "threads": threads,
        "read_bytes": nbytes,
        "read_gb_s_by_threads": reads,
        "gemm_size": gemm_size,
        "gemm_gflops_by_kernel": kernels,
        # where a kernel was too slow for gemm_size within GEMM_BUDGET_S: the size it was measured at
        "gemm_size_by_kernel": {k: n for k, (_, n) in measured.items() if n != gemm_size},
        "gemm_gflops": best,
    }


# --- command ----------------------------------------------------------------------------------------


def _measured_from(args: argparse.Namespace) -> tuple[float | None, float | None]:
    batch1, w1 = args.batch1_ms, args.w1_tok_s
    if args.latency_json:
        with open(args.latency_json) as f:
            batch1 = float(json.loads(f.read().strip().splitlines()[-1])["ms_per_token"])
    if args.offline_json:
        with open(args.offline_json) as f:
            w1 = float(json.loads(f.read().strip().splitlines()[-1])["total_token_throughput"])
    return batch1, w1


def report(machine: dict, floor: dict, measured: dict) -> str:
    reads = ", ".join(f"{t} thread(s) {gb:.1f}" for t, gb in machine["read_gb_s_by_threads"].items())
    smaller = machine.get("gemm_size_by_kernel", {})
    gemm = ", ".join(
        f"{k} {g:.0f}" + (f" (at {smaller[k]}^3)" if k in smaller else "")
        for k, g in machine["gemm_gflops_by_kernel"].items()
    )
    lines = [
        f"read bandwidth (torch.sum over {machine['read_bytes'] / 2**20:.0f} MiB), GB/s: {reads}",
        f"GEMM peak ({machine['gemm_size']}^3), GFLOP/s: {gemm}",
        f"{'dtype':<6} {'batch-1 floor ms/token':>24} {'W1 ceiling tok/s':>18}",
    ]
    for dtype in BYTES_PER_WEIGHT:
        w1 = floor["w1_tok_s"].get(dtype)
        w1_text = f"{w1:.0f}" if w1 is not None else "-"
        lines.append(f"{dtype:<6} {floor['batch1_ms'][dtype]:>24.2f} {w1_text:>18}")
    for dtype, got in measured.items():
        if "batch1" in got:
            b = got["batch1"]
            lines.append(
                f"measured batch-1 {b['measured_ms']:.2f} ms/token = {b['x_floor']:.2f}x the {dtype} floor"
            )
        if "w1" in got:
            w = got["w1"]
            lines.append(
                f"measured W1 {w['measured_tok_s']:.0f} tok/s = {w['fraction']:.2f} of the {dtype} ceiling"
            )
    return "\n".join(lines)


def cmd_roofline(args: argparse.Namespace) -> int:
    nbytes = 16 << 20 if args.quick else args.bytes
    size = 256 if args.quick else args.gemm_size
    repeats = 3 if args.quick else args.repeats
    machine = measure(nbytes, size, repeats)
    ceilings = Ceilings(max(machine["read_gb_s_by_threads"].values()), machine["gemm_gflops"])
    floor = floors(SMOLLM2, ceilings)
    batch1, w1 = _measured_from(args)
    measured = {args.dtype: fractions(floor, args.dtype, batch1, w1)} if batch1 or w1 else {}
    result = {
        "model": {"name": "SmolLM2-135M", **asdict(SMOLLM2), "parameters": SMOLLM2.parameters},
        "machine": machine,
        "floors": floor,
        "measured": measured,
    }
    print(report(machine, floor, measured))
    if args.json:
        print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    return 0


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("roofline", help="this machine's bandwidth and GEMM peaks; SmolLM2's floors")
    p.add_argument("--bytes", type=int, default=1 << 30, help="bytes torch.sum reads (default 1 GiB)")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="16 MiB and 256^3: a smoke run, not a figure")
    p.add_argument(
        "--dtype", default="bf16", choices=list(BYTES_PER_WEIGHT), help="the measured figures' dtype"
    )
    p.add_argument("--batch1-ms", type=float, default=None, help="a measured batch-1 ms/token")
    p.add_argument("--w1-tok-s", type=float, default=None, help="a measured W1 total tokens/s")
    p.add_argument("--latency-json", default=None, help="baton bench latency's JSON (ms_per_token)")
    p.add_argument("--offline-json", default=None, help="baton bench offline's JSON (total_token_throughput)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_roofline)
