"""CPU kernels (a torch C++ extension, built ahead of serving) and their Python wrappers.

``build(level)`` compiles every ``cpu/*.cpp`` into one module (``cpu/bindings.cpp`` holds the Python
bindings; the ``cpu/*.h`` headers what several kernels share) with ``-O3 -ffp-contract=off`` and the
level's ``-march`` into ``$BATON_KERNEL_CACHE`` (default ``~/.cache/baton/kernels``), in a folder
named by a hash of the sources and headers, the flags and the torch version. The ``native`` level
(``-march=native``, what ``make install`` builds) is named by the CPU's flags too, so another machine
rebuilds; the portable levels of ``isa.LEVELS`` (what an image's builder makes, ``baton build-kernels
--isa all``) are not, and ``load()`` imports the best one the CPU runs: a pod on another CPU neither
recompiles nor needs a compiler. Importing this module builds nothing; a worker's warm-up builds
``native`` when nothing built fits, before it reports ready.
Building needs a C++ compiler and ``ninja``; importing a build writes nothing."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from baton.env import KERNEL_CACHE, KERNEL_ISA
from baton.kernels import isa

_SOURCE_DIR = Path(__file__).resolve().parent / "cpu"


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


def _headers() -> list[Path]:
    """The headers the sources include: compiled only through them, but hashed into the build's
    name like a source, so that an edited header never leaves a stale build in use."""
    return sorted(_SOURCE_DIR.glob("*.h"))


def _openmp_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags so at::parallel_for runs on torch's own OpenMP pool.

    ATen's parallel_for is inline: under OpenMP it is a ``#pragma omp parallel`` in the header, so
    without -fopenmp it runs serially. We link against the libgomp torch ships (same soname, so the
    loader reuses the copy torch already loaded) rather than pulling in a second runtime.
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return ["-fopenmp-simd"], []
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    bundled = torch_lib / "libgomp.so.1"
    if bundled.exists():
        return ["-fopenmp"], [str(bundled), f"-Wl,-rpath,{torch_lib}"]
    return ["-fopenmp"], ["-fopenmp"]


_loaded: ModuleType | None = None


def _ops() -> ModuleType:
    return _loaded if _loaded is not None else load()


def loaded() -> ModuleType | None:
    """The extension module if this process has loaded it (``load()``), else None."""
    return _loaded


def cache_root() -> Path:
    """Where built kernels live: ``$BATON_KERNEL_CACHE``, else ``~/.cache/baton/kernels``. Read
    at each call (not at import) so that ``baton build-kernels --cache-dir`` and an image's ENV
    both reach the workers' processes, which inherit it."""
    return Path(KERNEL_CACHE.get())


@dataclass(frozen=True)
class _Spec:
    """One build of the extension: its name (which carries the build's hash) and its inputs."""

    name: str
    sources: list[Path]
    cflags: list[str]
    ldflags: list[str]


def _spec(level: str = isa.NATIVE) -> _Spec:
    """The build for ``level``: ``native`` (``-march=native``, named by this CPU's flags too, so that
    another CPU never imports it) or one of ``isa.LEVELS`` (portable: the same name on any CPU)."""
    omp_cflags, omp_ldflags = _openmp_flags()
    arch = ["-march=native"] if level == isa.NATIVE else list(isa.by_name(level).cflags)
    cflags = ["-O3", *arch, "-ffp-contract=off", *omp_cflags]
    sources = _sources()
    key = hashlib.sha256()
    for src in [*sources, *_headers()]:
        key.update(src.name.encode())
        key.update(hashlib.sha256(src.read_bytes()).digest())
    parts = [repr(cflags), repr(omp_ldflags), torch.__version__]
    if level == isa.NATIVE:
        parts.append(isa.cpu_flags_line())
    for part in parts:
        key.update(part.encode())
    tag = "" if level == isa.NATIVE else level.replace("-", "_") + "_"
    return _Spec(f"baton_cpu_kernels_{tag}{key.hexdigest()[:16]}", sources, cflags, omp_ldflags)


def choose(root: Path | None = None) -> str:
    """The build this process imports: ``BATON_KERNEL_ISA`` if set; else this CPU's own
    (``native``) where it is built; else the best built level this CPU runs (an image's); else
    ``native``, compiled (a compiler is then needed)."""
    forced = KERNEL_ISA.get()
    if forced:
        return isa.parse(forced)[0]
    if is_built(root, isa.NATIVE):
        return isa.NATIVE
    for level in isa.runnable(isa.cpu_flags()):
        if is_built(root, level.name):
            return level.name
    return isa.NATIVE


def build_dir(root: Path | None = None, level: str | None = None) -> Path:
    """The folder ``level``'s build (default: ``choose(root)``) lives in under ``root`` (default
    ``cache_root()``): a new name whenever a source, a flag or torch changes (and, for ``native``,
    the CPU), so a stale build is never reused."""
    return (root or cache_root()).expanduser() / _spec(level or choose(root)).name


def library(root: Path | None = None, level: str | None = None) -> Path:
    """The shared library of ``level``'s build (default: ``choose(root)``) under ``root``."""
    level = level or choose(root)
    return build_dir(root, level) / f"{_spec(level).name}.so"


def is_built(root: Path | None = None, level: str | None = None) -> bool:
    """Whether ``level``'s library (default: the one ``load(root)`` would import) exists, so that
    loading it only imports (a missing library, such as an interrupted build's, means a compile)."""
    if level is None:
        level = choose(root)
    return (build_dir(root, level) / f"{_spec(level).name}.so").is_file()


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One build at a time per folder, across processes. torch's own ``lock`` file outlives a
    build that was killed (a worker stopped while compiling) and torch then waits on it forever;
    an flock is dropped by the kernel with its process, so under it no live build holds torch's
    file and a leftover one is removed."""
    with open(directory / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def build(root: Path | None = None, level: str = isa.NATIVE) -> Path:
    """Compile ``level``'s build under ``root`` unless it is there; import nothing (a level this
    CPU cannot run is built all the same: an image's builder makes every level). Returns the
    library. torch's own ``load`` would import what it builds."""
    spec = _spec(level)
    directory = build_dir(root, level)
    lib = directory / f"{spec.name}.so"
    if lib.is_file():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        if not lib.is_file():
            _compile(spec, directory)
    return lib


def _compile(spec: _Spec, directory: Path) -> None:
    """torch.utils.cpp_extension.load minus its import (torch is pinned; test_build_kernels runs it)."""
    from torch.utils import cpp_extension

    cpp_extension._write_ninja_file_and_build_library(
        name=spec.name,
        sources=[str(src) for src in spec.sources],
        extra_cflags=spec.cflags,
        extra_cuda_cflags=[],
        extra_sycl_cflags=[],
        extra_ldflags=spec.ldflags,
        extra_include_paths=[],
        build_directory=str(directory),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
    )


def check(level: str) -> None:
    """Compile and link ``level`` at ``-O0`` (a third of ``-O3``'s time) in a temporary folder, keeping
    nothing; intrinsics are ``always_inline``, so one the level lacks still fails. Raises as ``build``."""
    import tempfile

    spec = _spec(level)
    cflags = ["-O0" if flag == "-O3" else flag for flag in spec.cflags]
    with tempfile.TemporaryDirectory(prefix="baton-kernels-check-") as directory:
        _compile(_Spec(f"{spec.name}_check", spec.sources, cflags, spec.ldflags), Path(directory))


def _import(lib: Path) -> ModuleType:
    """Import a built library as the Python module it is (nothing is written: a read-only cache
    or root filesystem serves)."""
    name = lib.name.removesuffix(".so")
    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the CPU kernels from {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(root: Path | None = None) -> ModuleType:
    """Import the build ``choose(root)`` names, compiling it first if it is missing (once per
    source/flags/machine). Workers call it through their warm-up, before they report ready."""
    level = choose(root)
    if level != isa.NATIVE and level not in {lv.name for lv in isa.runnable(isa.cpu_flags())}:
        raise RuntimeError(
            f"{KERNEL_ISA.name}={level}: this CPU lacks {sorted(isa.by_name(level).requires - isa.cpu_flags())}"
        )
    module = _import(build(root, level))
    global _loaded
    _loaded = module
    return module


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, block_size, D], any dim-0 stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache, read in place. Returns ``out`` ([B, H, D], q's dtype).

    Same contract as ``reference.paged_decode_attention_ref``; block ids past a sequence's length
    are never read (may be -1); a zero context length gives a zero row. q, out: last dim contiguous
    (any other strides); caches: last three dims contiguous, any dim-0 stride.

    Shapes, dtypes, strides, devices, context lengths and the block ids used are validated in the
    extension (cheaper than in Python: this runs once per layer per step) and raise ValueError.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _ops().paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale)
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, block_size, D], any dim-0 stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32, tokens cached per sequence, its new ones included
    query_start_loc: torch.Tensor,  # [S + 1] int32, cumulative q row offsets
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill attention over the paged cache, read in place. Returns ``out`` ([N, H, D],
    q's dtype).

    Rows ``query_start_loc[s] .. query_start_loc[s+1]-1`` of q are the last T_s tokens of sequence
    s (positions ``context_lens[s] - T_s ..``), whose K/V are already in the cache; the query at
    position p attends to the sequence's cached positions 0..p. Per sequence, the same contract as
    ``reference.paged_prefill_attention_ref``. Rows outside every sequence are not written. Block
    ids past a sequence's length are never read (may be -1). q, out: last dim contiguous (any
    other strides, e.g. q a view into a fused qkv buffer); caches: last three dims contiguous, any
    dim-0 stride. bf16 uses AVX512-BF16 dot products where the CPU has them (probabilities rounded
    to bf16 for P.V, fp32 accumulation); fp32 and fp16 compute in fp32.

    Shapes, dtypes, strides, devices, lengths, offsets and the block ids used are validated in the
    extension and raise ValueError.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _ops().paged_prefill_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale
    )
    return out


def cascade_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, KV, block_size, D], any dim-0 stride
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    group_rows: torch.Tensor,  # [R] int32, the rows of every group, group after group
    group_starts: torch.Tensor,  # [num_groups + 1] int32
    group_blocks: torch.Tensor,  # [num_groups] int32, full blocks each group shares
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` where each group of rows, whose tables start with the same
    ``group_blocks[g]`` block ids, attends to those blocks in one GEMM-shaped pass, and each row to
    its own blocks after them; merged exactly (``cascade.cascade_decode_attention_ref``). Rows in
    no group attend to their whole context. Inputs, groups included, are validated in the
    extension (ValueError)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _ops().cascade_decode_attention(
        out, q, k_cache, v_cache, block_tables, context_lens, group_rows, group_starts, group_blocks, scale
    )
    return out


def add_rms_norm(
    residual: torch.Tensor,  # [N, H] float32, contiguous; updated in place
    delta: torch.Tensor | None,  # [N, H] bf16 or fp32, last dim contiguous
    weight: torch.Tensor,  # [H] float32
    eps: float,
    out: torch.Tensor,  # [N, H] bf16 or fp32, last dim contiguous
) -> torch.Tensor:
    """``residual += delta.float()`` (skipped when delta is None), then
    ``out = rms_norm(residual, weight, eps)`` in out's dtype. Returns ``out``.

    Same contract as ``reference.add_rms_norm_ref``; in fp32 the bits of ``F.rms_norm``. Inputs are
    validated in the extension (ValueError).
    """
    _ops().add_rms_norm(residual, delta, weight, eps, out)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = silu(gate_up[:, :I]) * gate_up[:, I:]`` for gate_up [N, 2I] and out [N, I] of one
    dtype (bf16 or fp32; last dims contiguous). Returns ``out``.

    Same contract as ``reference.silu_mul_ref``, bit-identical to the eager ``F.silu(gate) * up``
    where torch's own kernel is vectorized (all but the last I % 16 elements of a row).
    """
    _ops().silu_mul(gate_up, out)
    return out


def row_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [M, k] int64 of the k (<= 32) largest values of each row of ``x`` ([M, V] bf16 or
    fp32, last dim contiguous), largest first, equal values in index order (as
    ``torch.sort(x, descending=True, stable=True)`` orders them); NaN is never among them."""
    out = torch.empty((x.shape[0], k), dtype=torch.int64)
    _ops().row_topk(x, out)
    return out


def rope_and_cache(
    qkv: torch.Tensor,  # [N, (H + 2 * KV) * D] bf16 or fp32, last dim contiguous
    positions: torch.Tensor,  # [N] int64
    cos: torch.Tensor,  # [max_pos, D] float32 (rotate-half tables: cat(freqs, freqs).cos())
    sin: torch.Tensor,
    kv_layer: torch.Tensor,  # [num_blocks, 2, KV, block_size, D], qkv's dtype
    slot_blocks: torch.Tensor,  # [N] int64
    slot_offsets: torch.Tensor,  # [N] int64
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate the q and k heads of ``qkv`` in place (transformers' Llama rotate-half RoPE, cos/sin
    cast to qkv's dtype first) and write row n's k and v heads to
    ``kv_layer[slot_blocks[n], 0 / 1, :, slot_offsets[n]]``.

    kv_layer is a layer's view of the cache: last three dims contiguous, any strides on the first
    two. Same contract as ``reference.rope_and_cache_ref`` (fp32: identical bits; bf16: each result
    rounded once, within an ulp of the eager op-by-op rounding). Shapes, dtypes, positions, block ids
    and offsets are validated in the extension (ValueError).
    """
    _ops().rope_and_cache(
        qkv, positions, cos, sin, kv_layer, slot_blocks, slot_offsets, num_heads, num_kv_heads, head_dim
    )


def int8_quantize_rows(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, qmax: int = 127) -> None:
    """Dynamic per-row symmetric quantization of x [M, K] (bf16/fp32, contiguous) into codes [M, K]
    in [-qmax, qmax] and scales [M] fp32 (amax / qmax), in one pass: identical to
    ``quant.quantize_rows_int8``. int8 codes as they are; uint8 codes hold them + qmax + 1 (zero
    point 128 at qmax 127, what oneDNN's VNNI GEMM takes)."""
    _ops().int8_quantize_rows(x, codes, scales, qmax)


def int8_scale_output(
    acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor, out: torch.Tensor
) -> None:
    """out [M, N] (bf16/fp32) = acc [M, N] int32 * row_scales [M] * col_scales [N], in one pass."""
    _ops().int8_scale_output(acc, row_scales, col_scales, out)


def int8_scale_rows(acc: torch.Tensor, row_scales: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] (bf16/fp32; fp32 may be acc itself) = acc [M, N] fp32 * row_scales [M], in one
    pass: the token scales of a W8A8 product whose channel scales oneDNN applied."""
    _ops().int8_scale_rows(acc, row_scales, out)


def fp8_widen(codes: torch.Tensor, out: torch.Tensor) -> None:
    """out = codes (float8_e4m3fn) in out's dtype (bf16/fp32), through a 256-entry table: ~15x
    torch's element-by-element ``.to`` here."""
    _ops().fp8_widen(codes, out)


def bf16_gemm_available() -> bool:
    """Whether ``bf16_gemm`` was compiled in: on a CPU with AVX512-BF16 (vdpbf16ps, or AMX tiles
    where it has them), or with AVX2 and FMA (the bf16 weights widened to fp32 on the way into fp32
    FMAs: the same packed layout at the same bytes, the same exact products)."""
    return bool(_ops().bf16_gemm_available())


def has_avx512_bf16() -> bool:
    """Whether the kernels were built for a CPU with AVX512-BF16 (vdpbf16ps)."""
    return bool(_ops().has_avx512_bf16())


def has_amx_bf16() -> bool:
    """Whether the kernels were built for a CPU with AMX-BF16 tiles (where oneDNN's bf16 GEMM
    runs on them)."""
    return bool(_ops().has_amx_bf16())


def bf16_dot_peak_gflops(rounds: int = 10_000_000) -> float:
    """The vdpbf16ps rate of this machine on ``torch.get_num_threads()`` threads, in GFLOP/s (0.0
    without AVX512-BF16): the ceiling of the bf16 attention kernels that do not run on AMX tiles.
    A default run takes about 0.1 s on two Zen 4 cores."""
    return float(_ops().bf16_dot_peak_gflops(rounds))


def bf16_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (K even) in ``bf16_gemm``'s layout: blocks of 16 output channels, each
    [K / 2, 16, 2] (the 2 k-values of a channel side by side, as vdpbf16ps reads them; N padded to
    a multiple of 16 with zero channels)."""
    if weight.shape[1] % 2:
        raise ValueError(f"bf16_gemm needs K even, got {weight.shape[1]}")
    return _interleave(_pad_channels(weight), 2)


def _pad_channels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16) * 16, K], the added output channels zero."""
    n, k = weight.shape
    padded = torch.zeros((-(-n // 16) * 16, k), dtype=weight.dtype)
    padded[:n] = weight
    return padded


def _interleave(padded: torch.Tensor, group: int) -> torch.Tensor:
    """[16 B, K] -> [B, K / group, 16 x group]: per block of 16 channels, ``group`` consecutive
    k-values of each channel side by side, as one dot-product instruction reads them."""
    n, k = padded.shape
    blocks = n // 16
    return (
        padded.view(blocks, 16, k // group, group)
        .permute(0, 2, 1, 3)
        .reshape(blocks, k // group, 16 * group)
        .contiguous()
    )


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] bf16 = x [M, K] bf16 @ W.T, W packed by ``bf16_gemm_pack``: each output the fp32
    sum of its K products (in pairs with vdpbf16ps; one by one with AVX2's FMAs), rounded to bf16
    once."""
    _ops().bf16_gemm(x, packed, out)


def bf16_gemm_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
) -> None:
    """out [M, I] = silu(gate) * up, where x @ W.T is [gate | up] ([M, 2I], W packed by
    ``bf16_gemm_pack``): the bits of ``bf16_gemm`` followed by ``silu_mul``. On AMX tiles each tile
    pairs gate's channels with up's and the epilogue applies silu, so the [M, 2I] product is never
    written (a 2,048-token chunk's is 12 MiB on SmolLM2); elsewhere it runs the two in turn, the
    product in ``scratch`` (bf16, at least M x 2I elements) where it is given."""
    _ops().bf16_gemm_silu_mul(x, packed, out, scratch)


def int8_gemm_available() -> bool:
    """Whether ``int8_gemm``'s AVX512-VNNI kernel was compiled in (``-march=native`` on a CPU
    with VNNI); without it the W8A8 product goes to oneDNN."""
    return bool(_ops().int8_gemm_available())


def int8_gemm_pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight [N, K] (K a multiple of 4) in ``int8_gemm``'s layout: blocks of 16 output
    channels, each [K / 4, 16, 4] (the 4 k-values of a channel side by side, as vpdpbusd reads
    them; N padded to a multiple of 16 with zero channels), and each padded channel's sum of codes
    (int32), which takes the activations' zero point back out of the product."""
    if qweight.shape[1] % 4:
        raise ValueError(f"int8_gemm needs K a multiple of 4, got {qweight.shape[1]}")
    padded = _pad_channels(qweight)
    return _interleave(padded, 4), padded.sum(dim=1, dtype=torch.int32)


def int8_gemm(
    x: torch.Tensor, packed: torch.Tensor, col_sums: torch.Tensor, col_scales: torch.Tensor, out: torch.Tensor
) -> None:
    """out [M, N] (x's dtype, bf16/fp32) = the W8A8 product of x [M, K] and the weight that
    ``int8_gemm_pack`` packed, with ``col_scales`` [N] fp32 its channel scales: the rows quantized
    per token (symmetric, as ``int8_quantize_rows``), multiplied in int32 and scaled
    ``(acc * row_scale) * col_scale`` as ``int8_scale_output``, so the bits equal
    ``int8_scale_output(torch._int_mm(codes, W.T), ...)``. One call, no oneDNN."""
    _ops().int8_gemm(x, packed, col_sums, col_scales, out)
