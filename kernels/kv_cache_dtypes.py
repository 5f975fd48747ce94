"""The names of the KV cache dtypes (``--kv-cache-dtype``), torch-free so that the command line can
offer them without loading torch; ``baton.kernels.kv_quant`` holds the formats behind them."""

from __future__ import annotations

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's names of the 1-byte formats."""
KV_CACHE_DTYPES = ("auto", *QUANTIZED)
"""The ``kv_cache_dtype`` names; ``auto`` is the model dtype (no quantization)."""
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
"""Other names vLLM accepts: its ``--kv-cache-dtype fp8`` is e4m3."""
CHOICES = (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)
"""Every name a ``--kv-cache-dtype`` flag accepts."""


def canonical_kv_cache_dtype(name: str) -> str:
    """``name`` with vLLM's aliases resolved (``fp8`` -> ``fp8_e4m3``); ValueError for an unknown one."""
    name = KV_CACHE_DTYPE_ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        aliases = ", ".join(f"{a} ({n})" for a, n in KV_CACHE_DTYPE_ALIASES.items())
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, {aliases}, got {name!r}"
        )
    return name
