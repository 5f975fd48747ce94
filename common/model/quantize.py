"""``baton quantize``: a model loaded, quantized and written as a compressed-tensors checkpoint.
It sits above the loader (which quantizes what it loads through ``quant``), so that ``quant`` and
``quant_checkpoint`` never import the loader."""

from __future__ import annotations

import torch

from baton.common.model.loader import load_model
from baton.common.model.quant_checkpoint import save_quantized
from baton.common.model.source import ModelSource, load_tokenizer


def write_checkpoint(model: str | None, quantization: str, dtype: str, out_dir: str) -> None:
    """``baton quantize``: load ``model`` (None: the default SmolLM2), quantize it at load exactly
    as ``--quantization`` would, and save it with ``save_quantized``; loading ``out_dir`` then
    gives the same weights, hence the same tokens."""
    source = ModelSource.resolve(model)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    loaded = load_model(source, torch_dtype, quantization=quantization)
    save_quantized(loaded, quantization, torch_dtype, out_dir, load_tokenizer(source))
