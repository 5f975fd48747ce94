"""Synthetic worker profiles for the planner's tests: cost models whose answers a test can reason
about, in the shape `baton profile` writes (planner/profile.py)."""

from __future__ import annotations

from typing import Any

from baton.planner.profile import EngineShape, Linear, Machine, Profile

SHAPE: dict[str, Any] = dict(
    model="m",
    dtype="bfloat16",
    quantization=None,
    kv_cache_dtype="auto",
    tensor_parallel_size=1,
    block_size=16,
    max_num_batched_tokens=2048,
    max_num_seqs=256,
    kv_capacity_tokens=1 << 20,
)


def synthetic_profile(
    prefill: Linear,
    decode: Linear,
    *,
    transfer: dict[str, Linear] | None = None,
    gateway_ms: float = 1.0,
    cores: int = 1,
    cpu: str = "test",
    isa: str = "avx2",
    points: dict[str, list[dict[str, float]]] | None = None,
    **engine: Any,
) -> Profile:
    """A profile with these step models; ``engine`` overrides fields of ``SHAPE``."""
    return Profile(
        machine=Machine(cpu=cpu, isa=isa, cores=cores),
        engine=EngineShape(**{**SHAPE, **engine}),
        prefill=prefill,
        decode=decode,
        transfer=transfer if transfer is not None else {"ucx": Linear(1.0, 0.001)},
        gateway_ms=gateway_ms,
        taken_at="2026-12-05T00:00:00Z",
        points=points or {},
    )
