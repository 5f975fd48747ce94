"""Building an engine from its config: the model loaded in this process, or across tensor- or
pipeline-parallel ranks, then the tokenizer, the draft model and the ``LLMEngine`` over them.

It sits above both the engine and the parallel drivers (the engine takes a model and never asks
where it runs), so that ``common/engine`` imports nothing of ``common/parallel``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine, parse_dtype
from baton.common.model.loader import load_model
from baton.common.model.source import ModelSource, eos_token_ids, load_tokenizer


def create_engine(config: EngineConfig, progress: bool = False) -> LLMEngine:
    """The engine ``config`` describes, its model loaded (``dtype="auto"`` decided here first)."""
    if config.emulate is not None:  # the services build those (services/emulated.py)
        raise ValueError("emulate is for the workers (baton prefill/decode/up --emulate), not this engine")
    source = ModelSource.resolve(config.model)
    if config.device != "cpu" and not _device_available(config.device):
        raise ValueError(
            f"device {config.device!r} is not available to this torch ({torch.__version__}): a GPU"
            " needs a CUDA build of torch and a visible device; or run with --device cpu"
        )
    if config.dtype == "auto":
        config = replace(config, dtype=_auto_dtype(config, source))
    model = _load(config, source, progress)
    tokenizer = load_tokenizer(source)
    draft = None
    if config.speculative == "draft":
        draft_source = ModelSource.resolve(config.draft_model)
        draft = load_model(draft_source, parse_dtype(config.dtype), config.device)
    eos = eos_token_ids(source, tokenizer)
    return LLMEngine(config, model, tokenizer, eos, model_name=source.name, draft_model=draft)


def _auto_dtype(config: EngineConfig, source: ModelSource) -> str:
    """``--dtype auto``: the probe measures this CPU's GEMMs; on a GPU bf16 is the fast dtype."""
    if config.device != "cpu":
        return "bfloat16"
    from baton.common.model.gemm_probe import cached_probe

    return cached_probe(source.path, torch.get_num_threads()).dtype


def _load(config: EngineConfig, source: ModelSource, progress: bool):
    """The engine's model: this process's, or rank 0's over tensor- or pipeline-parallel ranks."""
    dtype = parse_dtype(config.dtype)
    if config.pipeline_parallel_size > 1:
        from baton.common.parallel.pipeline_driver import load_pipeline_parallel

        return load_pipeline_parallel(config, dtype, progress)
    if config.tensor_parallel_size > 1:
        from baton.common.parallel.driver import load_tensor_parallel

        return load_tensor_parallel(config, dtype, progress)
    return load_model(source, dtype, config.device, progress=progress, quantization=config.quantization)


def _device_available(device: str) -> bool:
    """Whether torch can allocate on ``device`` (``cuda``, ``cuda:1``) here."""
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError):  # no CUDA build, no GPU, or no such index
        return False
    return True
