"""CPU kernels (a torch C++ extension, JIT-built on first use) and their Python wrappers.

``load()`` compiles ``cpu/paged_attention.cpp`` with ``-O3 -march=native`` into
``$BATON_KERNEL_CACHE`` (default ``~/.cache/baton/kernels``), in a folder named by a hash of the
source, the flags, the torch version and the CPU, so an edit or another machine rebuilds. Importing
this module builds nothing. Building needs a C++ compiler and ``ninja``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).resolve().parent / "cpu" / "paged_attention.cpp"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


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


@functools.cache
def load() -> ModuleType:
    """Build (once per source/flags/machine) and import the CPU kernel extension."""
    from torch.utils import cpp_extension

    omp_cflags, omp_ldflags = _openmp_flags()
    cflags = ["-O3", "-march=native", *omp_cflags]
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        repr(cflags).encode(),
        repr(omp_ldflags).encode(),
        torch.__version__.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    digest = key.hexdigest()[:16]
    name = f"baton_cpu_kernels_{digest}"
    root = Path(os.environ.get("BATON_KERNEL_CACHE", Path.home() / ".cache" / "baton" / "kernels"))
    build_dir = root.expanduser() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        extra_cflags=cflags,
        extra_ldflags=omp_ldflags,
        build_directory=str(build_dir),
        verbose=False,
    )
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
