"""The row counts a step runs as: a few padded shapes instead of every token count. Pure: no torch."""

from __future__ import annotations


def padded_num_tokens(n: int) -> int:
    """A step of ``n`` tokens runs as this many rows: up to 64 exactly, then rounded up to a
    multiple of 16 (to 512), 64 (to 2048) or 256. oneDNN builds a GEMM primitive for every new row
    count (5-20 ms for each of a layer's four products, measured on a 2-core Xeon with AMX), so an
    unpadded server keeps compiling as prompt lengths and batch mixes vary; with buckets there are
    ~120 shapes up to 2048 rows, all built before the worker is ready (``ModelRunner.warm_up``),
    for at most 12% of the rows computed in vain."""
    if n <= 64:
        return n
    step = 16 if n <= 512 else 64 if n <= 2048 else 256
    return -(-n // step) * step


def token_buckets(max_tokens: int) -> list[int]:
    """Every row count ``padded_num_tokens`` gives for steps of 1 to ``max_tokens`` tokens."""
    return sorted({padded_num_tokens(n) for n in range(1, max_tokens + 1)})
