"""The names of the weight quantizations (``--quantization``), torch-free so that a config can check
them without loading torch; ``baton.common.model.quant`` holds the layers behind them."""

from __future__ import annotations

QUANTIZATIONS = ("int8", "fp8")
"""``int8``: W8A8 (dynamic per-token activations); ``fp8``: e4m3 weights."""


def check_quantization(quantization: str | None) -> None:
    """ValueError unless ``quantization`` is one of ``QUANTIZATIONS`` or None."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
