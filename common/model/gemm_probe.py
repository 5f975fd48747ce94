"""What this CPU does well, measured on the model's own GEMMs: ``--dtype auto`` and ``baton up``'s
layout come from it.

The fastest dtype flips between the CPUs the project runs on: bf16 matrix products run at ~2x
fp32's speed on an AMD EPYC with AVX-512 BF16, at ~4-7x on a Xeon with AMX, and at a fraction of
it in oneDNN on a CPU with no instruction that multiplies bf16 (``../shared/FIELD-NOTES.md``), where
Baton's own GEMM widens bf16 weights into fp32 FMAs instead (AVX2). So the dtype is the CPU's: bf16
where its flags show such an instruction or AVX2 and FMA, fp32 where they show neither
(``auto_dtypes``). It is not decided by timing both: the prefill and decode workers of a
cluster exchange KV and must agree on the dtype, and each decides on its own (a container or a pod
of its own); timed beside two more workers starting on the same 2 cores, a prefill worker once
found fp32 cheaper while its decode workers found bf16 (tests/e2e/test_compose.py, CI). Only
where the flags cannot be read are both timed, the cheaper winning.

``probe`` times the chosen dtype on the model's projections (q|k|v, o, gate|up, down and the LM
head, as the model runs them: bf16 weights prepacked for oneDNN) for what one W2-like request costs
a server: a 256-token prefill, and 256 decode steps at a batch of 8 over weights that do not fit in
any cache (decode streams them from memory). It also times the decode step on fewer threads, which
tells ``baton up`` what a core taken from decoding costs (``services/layout.py``).

    python -m baton.common.model.gemm_probe [--model PATH] [--threads N] [--decode-threads 1,2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from baton.common.model.config import LlamaConfig

if TYPE_CHECKING:  # torch is imported where GEMMs run: a cached result is read without it
    import torch

CANDIDATES = ("bfloat16", "float32")
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16")
"""``/proc/cpuinfo`` flags of instructions that multiply bf16 (x86: AVX512-BF16, AMX-BF16,
AVX-NE-CONVERT; Arm: BF16). Without one, oneDNN converts bf16 in scalar code: on a 2-core AMD EPYC
with AVX2 only, a bf16 2048-cube matmul ran at ~1 GFLOP/s against fp32's ~140, and a probe taken
beside the test suite's load once picked bf16 anyway (its decode figure is the noisiest)."""
BF16_WIDENED_FLAGS = ("avx2", "fma")
"""Where none of ``BF16_DOT_FLAGS`` is there but these are (x86's AVX2 CPUs: AMD Zen 2 and 3, Intel
Haswell to Alder Lake), bf16 still wins: Baton's GEMM (``kernels/cpu/bf16_gemm.cpp``) widens the
bf16 weights into fp32 FMAs as it streams them, half fp32's bytes. Every kernel build (each ISA
level of ``kernels/isa.py``) has it. On a 2-core AVX2-only EPYC (Zen 3), W1 418-453 tokens/s
against fp32's 265, batch-1 13.2-14.8 ms a token against 47.7, perplexity 1.0019x fp32's (2026-12-06,
``docs/benchmarks.md``)."""
PREFILL_ROWS = 256
DECODE_ROWS = 8
DECODE_STEPS = 256
_COLD_BYTES = 384 << 20
"""Distinct weights streamed per decode measurement: past any cache of the machines here."""


@dataclass(frozen=True)
class GemmProbe:
    cpu: str
    threads: int
    """Torch threads of the dtype comparison."""
    dtype: str
    """The dtype chosen: the CPU's (``auto_dtypes``), or the cheaper ``request_ms`` where both
    were timed."""
    prefill_ms: dict[str, float]
    """Per dtype: the projections of a 256-token prefill, all layers."""
    decode_step_ms: dict[str, float]
    """Per dtype: the projections of one decode step at batch 8, all layers, weights from memory."""
    request_ms: dict[str, float]
    """Per dtype: a prefill plus 256 decode steps."""
    decode_step_ms_by_threads: dict[str, float] = field(default_factory=dict)
    """The chosen dtype's decode step on other thread counts (keys: the count, as text)."""

    def describe(self) -> str:
        parts = [
            f"{d} {self.request_ms[d]:.0f} ms (prefill {self.prefill_ms[d]:.0f}, decode step "
            f"{self.decode_step_ms[d]:.1f})"
            for d in self.request_ms
        ]
        return f"{self.dtype}: the GEMMs of a W2-like request on {self.threads} threads take " + ", ".join(
            parts
        )


def projection_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's four fused projections."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def _linear(out_f: int, in_f: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch
    import torch.nn.functional as F

    from baton.common.model.llama import prepack_weight

    # Filled, not zeros: untouched zero pages would all read from the kernel's one zero page.
    w = torch.full((out_f, in_f), 0.01, dtype=dtype)
    packed = prepack_weight(w)  # the kernel the model would run
    if packed is None:
        return lambda x: F.linear(x, w)
    return packed


def _rows(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.full((n, k), 0.01, dtype=dtype)


ROUNDS = 7
"""Each case is timed once per round, rounds interleaving the cases, and its fastest time kept: a
neighbour that steals the cores for a while slows one round of every case, not one case."""


def _prefill_case(cfg: LlamaConfig, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """One layer's projections at PREFILL_ROWS (compute-bound: a cache holds one layer), scaled by
    the layers."""
    layer = [(_linear(o, i, dtype), _rows(PREFILL_ROWS, i, dtype)) for o, i in projection_shapes(cfg)]

    def run() -> None:
        for f, x in layer:
            f(x)

    return run, float(cfg.num_layers)


def _decode_case(cfg: LlamaConfig, dtype: torch.dtype) -> tuple[Callable[[], object], float]:
    """One decode step's projections at DECODE_ROWS over distinct weights (as many layers as fit in
    ``_COLD_BYTES``, scaled to all of them): memory-bound, as in serving."""
    import torch

    shapes = projection_shapes(cfg)
    layer_bytes = sum(o * i for o, i in shapes) * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(cfg.num_layers, _COLD_BYTES // layer_bytes))
    layers = [[_linear(o, i, dtype) for o, i in shapes] for _ in range(copies)]
    xs = [_rows(DECODE_ROWS, i, dtype) for _, i in shapes]

    def run() -> None:
        for layer in layers:
            for f, x in zip(layer, xs):
                f(x)

    return run, cfg.num_layers / copies


def _head_case(cfg: LlamaConfig, dtype: torch.dtype, rows: int) -> tuple[Callable[[], object], float]:
    """The LM head on ``rows`` rows (a prefill samples one, a decode step every sequence)."""
    head, x = _linear(cfg.vocab_size, cfg.hidden_size, dtype), _rows(rows, cfg.hidden_size, dtype)
    return (lambda: head(x)), 1.0


def _interleaved_ms(cases: dict, rounds: int = ROUNDS) -> dict:
    """``{key: (fn, scale, threads)}`` -> ``{key: ms}``: each fn's fastest of ``rounds``, scaled."""
    import torch

    saved = torch.get_num_threads()
    best = {key: math.inf for key in cases}
    try:
        with torch.inference_mode():
            for fn, _, threads in cases.values():  # builds every primitive once
                torch.set_num_threads(threads)
                fn()
            for _ in range(rounds):
                for key, (fn, _, threads) in cases.items():
                    torch.set_num_threads(threads)
                    t = time.perf_counter()
                    fn()
                    best[key] = min(best[key], time.perf_counter() - t)
    finally:
        torch.set_num_threads(saved)
    return {key: 1e3 * best[key] * cases[key][1] for key in cases}


def auto_dtypes() -> tuple[str, ...]:
    """The dtypes ``--dtype auto`` chooses among here: bf16 alone where the CPU has an instruction
    that multiplies it (``BF16_DOT_FLAGS``) or AVX2 and FMA for Baton's GEMM to widen it into
    (``BF16_WIDENED_FLAGS``), fp32 alone where it has neither, and both (timed, the cheaper wins)
    where its flags cannot be read. Every worker on a CPU of one kind comes to the same dtype,
    whatever else runs beside it."""
    flags = cpu_flags()
    if not flags:
        return CANDIDATES
    if flags & set(BF16_DOT_FLAGS) or set(BF16_WIDENED_FLAGS) <= flags:
        return ("bfloat16",)
    return ("float32",)


def probe(
    cfg: LlamaConfig,
    threads: int,
    decode_threads: Sequence[int] = (),
    candidates: Sequence[str] | None = None,
) -> GemmProbe:
    """Time each candidate dtype (default: ``auto_dtypes()``, one where the CPU's flags decide)
    on ``cfg``'s GEMMs on ``threads`` torch threads (the cheapest W2-like request wins; a tie goes to
    the first candidate, bf16: half the memory), and the winner's decode step on each of
    ``decode_threads``."""
    import torch

    if candidates is None:
        candidates = auto_dtypes()

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    counts = sorted({threads, *decode_threads})
    cases: dict = {}
    for name in candidates:
        run, scale = _prefill_case(cfg, dtypes[name])
        cases[("prefill", name, threads)] = (run, scale, threads)
        run, scale = _head_case(cfg, dtypes[name], 1)
        cases[("head", name, threads)] = (run, scale, threads)
        for kind, (run, scale) in (
            ("decode", _decode_case(cfg, dtypes[name])),
            ("decode_head", _head_case(cfg, dtypes[name], DECODE_ROWS)),
        ):
            for n in counts:
                cases[(kind, name, n)] = (run, scale, n)
    ms = _interleaved_ms(cases)

    def step(name: str, n: int) -> float:
        return ms[("decode", name, n)] + ms[("decode_head", name, n)]

    prefill = {name: ms[("prefill", name, threads)] + ms[("head", name, threads)] for name in candidates}
    decode = {name: step(name, threads) for name in candidates}
    request = {name: prefill[name] + DECODE_STEPS * decode[name] for name in candidates}
    best = min(candidates, key=lambda d: request[d])
    by_threads = {str(n): step(best, n) for n in decode_threads}
    return GemmProbe(cpu_model(), threads, best, prefill, decode, request, by_threads)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's word for it."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), or an empty set."""
    from baton.kernels import isa

    return set(isa.cpu_flags())


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


def default_cache_dir() -> str:
    """``gemm-probe`` under Baton's cache directory (``BATON_CACHE_DIR``, default ``~/.cache/baton``),
    beside the tokenizer and the assembled weights: an image or a pod that moves that directory
    keeps its probes there too."""
    from baton.common.model.source import cache_dir

    return os.path.join(cache_dir(), "gemm-probe")


def _model_stamp(model_path: str) -> list:
    """What identifies a model's files: path, size and mtime of the file (or of a directory's files)."""
    paths = [model_path]
    if os.path.isdir(model_path):
        paths = sorted(os.path.join(model_path, f) for f in os.listdir(model_path))
    return [
        [os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths if os.path.isfile(p)
    ]


_RULE = "dtype-by-flags-avx2-bf16"
"""In the cache key: a probe remembered under an older rule (both dtypes timed, the cheaper kept;
fp32 on AVX2 before Baton's GEMM widened bf16 there) is not reused."""


def _cache_path(model_path: str, threads: int, decode_threads: Sequence[int], cache_dir: str) -> str:
    from importlib.metadata import version

    from baton.kernels import isa

    flags = isa.cpu_flags_line() if isa.cpu_flags() else ""
    key = json.dumps(
        [
            _RULE,
            cpu_model(),
            flags,
            version("torch"),
            threads,
            sorted(decode_threads),
            _model_stamp(model_path),
        ]
    )
    return os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def cached(
    model_path: str, threads: int, decode_threads: Sequence[int] = (), cache_dir: str | None = None
) -> GemmProbe | None:
    """The probe this machine already ran for this model file, torch and these thread counts (read
    without torch), or None."""
    try:
        with open(_cache_path(model_path, threads, decode_threads, cache_dir or default_cache_dir())) as f:
            return GemmProbe(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def cached_probe(
    model_path: str, threads: int, decode_threads: Sequence[int] = (), cache_dir: str | None = None
) -> GemmProbe:
    """``probe`` of the model at ``model_path`` (a .gguf file or a checkpoint directory),
    remembered in ``cache_dir`` for this CPU, its flags, torch and that file: a restart does not
    pay the ~6 s of measuring again."""
    found = cached(model_path, threads, decode_threads, cache_dir)
    if found is not None:
        return found
    from baton.common.model.loader import read_config
    from baton.common.model.source import ModelSource

    result = probe(read_config(ModelSource.resolve(model_path)), threads, decode_threads)
    path = _cache_path(model_path, threads, decode_threads, cache_dir or default_cache_dir())
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(asdict(result), f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache directory: measured again at the next start
        print(f"warning: the GEMM probe is not remembered ({e})", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    from baton.common.model.loader import read_config
    from baton.common.model.source import ModelSource

    ap = argparse.ArgumentParser(description="time the model's GEMMs in bf16 and fp32 on this CPU")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-threads", default="", help="also time the decode step on these, e.g. 1,2")
    ap.add_argument("--no-cache", action="store_true", help="measure even if this machine was measured")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    source = ModelSource.resolve(a.model)
    decode_threads = [int(n) for n in a.decode_threads.split(",") if n]
    if a.no_cache:
        result = probe(read_config(source), a.threads, decode_threads)
    else:
        result = cached_probe(source.path, a.threads, decode_threads)
    print(json.dumps(asdict(result)) if a.json else result.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
