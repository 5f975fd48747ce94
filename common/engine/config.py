"""The engine's options (``EngineConfig``), torch-free: the command line, ``baton up`` and the
planner build and check one without loading torch; ``llm_engine`` runs it.

Every field is checked when the config is built (``__post_init__``: ValueError naming the option),
and ``kv_cache_dtype`` normalised as it is set, so that a config holds only canonical values."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.engine.cascade_plan import cascade_config
from baton.common.engine.kv_budget import check_gpu_memory_utilization
from baton.common.engine.spec_decode import SpeculativeConfig
from baton.common.model.quant_names import check_quantization
from baton.kernels.kv_cache_dtypes import canonical_kv_cache_dtype


class _KVCacheDtype:
    """The ``kv_cache_dtype`` field, with vLLM's aliases resolved as ``__init__`` sets it (``fp8`` ->
    ``fp8_e4m3``), so that the workers' settings and the layout check compare one name. A field
    whose default is a descriptor is the dataclasses way to normalise a frozen field: ``__init__``
    sets it through ``__set__``, a frozen instance refuses any later assignment, and
    ``__get__(None, cls)`` is the default."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_{name}"

    def __get__(self, obj: object, owner: type | None = None) -> str:
        return "auto" if obj is None else obj.__dict__[self._key]

    def __set__(self, obj: object, value: str) -> None:
        obj.__dict__[self._key] = canonical_kv_cache_dtype(value)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """A .gguf file or a Llama safetensors directory; None is the default SmolLM2 GGUF."""
    dtype: str = "bfloat16"
    """bfloat16 or float32, for weights, activations and the KV cache; ``auto`` (resolved by
    ``parallel.engine_factory``): whichever runs the model's GEMMs faster on this CPU (``gemm_probe``)."""
    device: str = "cpu"
    """``cpu``, or ``cuda`` (``cuda:N``) for a GPU: Triton decode attention, SDPA prefill."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_gib: float = 4.0
    """Memory budget for the KV cache; the cache never exceeds it. Unused with
    ``gpu_memory_utilization``."""
    gpu_memory_utilization: float | None = None
    """On CUDA, the KV cache's size instead (vLLM's option, off by default here): this fraction
    (0, 1] of the GPU's memory less what is in use once the model is loaded (``kv_budget``)."""
    kv_cache_dtype: str = _KVCacheDtype()  # type: ignore[assignment]  # a str, set through __set__
    """KV cache storage (vLLM's names): ``auto`` (the model dtype), ``int8``, ``fp8_e4m3`` or
    ``fp8_e5m2`` (1-byte codes with a scale per token and head; ~2x the tokens per GiB)."""
    quantization: str | None = None
    """Weights: ``int8`` (W8A8, dynamic per-token activations) or ``fp8`` (e4m3), quantized at load;
    None keeps them in ``dtype`` (a compressed-tensors checkpoint is read as it is stored)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    max_num_seqs: int = 256
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's context length."""
    enable_prefix_caching: bool = True
    seed: int = 0
    """Seed of the sampler for requests without their own seed."""
    # The queue caps' defaults bound what a worker holds for queued requests (their token ids, ~10 MB
    # at the token cap) and how long they wait (the token cap is 128 full 2048-token steps), yet sit
    # 16x above W2 all at once (64 prompts of 256 tokens: 64 requests, 16k tokens): load that can be
    # served is never refused; past them a request would wait minutes, so another worker, or the
    # client's retry, serves it sooner.
    max_waiting_requests: int = 1024
    """Most requests not yet running (waiting, preempted, parked for a remote prefill); past it a
    new one is refused (``EngineFullError``)."""
    max_waiting_tokens: int = 262_144
    """Most tokens those requests may still have to compute; past it a new one is refused."""
    max_consecutive_failed_steps: int = 3
    """Steps in a row that may fail (each fails only its own requests) before the engine gives up."""
    cascade: str = "auto"
    """Cascade attention for decode rows sharing prefix blocks: ``auto`` (a cost model decides per
    step, ``cascade_plan``) or ``off``."""
    cascade_min_shared_blocks: int = 4
    """Fewest full blocks a group of decode rows must share for a cascade."""
    jump_forward: bool = True
    """Structured outputs append a grammar's forced continuation without sampling it."""
    speculative: str | None = None
    """Speculative decoding: ``ngram`` (prompt lookup) or ``draft`` (``draft_model``); None: off."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per request per step."""
    ngram_min: int = 2
    """Shortest suffix n-gram the n-gram proposer looks up (vLLM's ``prompt_lookup_min``)."""
    ngram_max: int = 4
    """Longest suffix n-gram it looks up (vLLM's ``prompt_lookup_max``)."""
    draft_model: str | None = None
    """The draft model (``speculative="draft"``): a smaller Llama of the same tokenizer."""
    adaptive_speculation: bool = True
    """Propose fewer tokens, down to none, where the step's cost model says they would not pay."""
    tensor_parallel_size: int = 1
    """Ranks (processes of this one, ``common.parallel``) the model's heads and MLP are split across."""
    enable_expert_parallel: bool = False
    """A mixture-of-experts model's experts are placed whole across the tensor- or data-parallel
    ranks (``model.expert_parallel``) instead of every expert being split across them."""
    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler, KV cache and CPUs (``parallel.data_parallel``);
    a MoE model's with ``enable_expert_parallel`` run attention apart beside experts placed across them."""
    pipeline_parallel_size: int = 1
    """Stages the layers are cut into, each of ``tensor_parallel_size`` ranks (``parallel.pipeline``)."""
    emulate: str | None = None
    """A ``baton profile`` JSON: an emulated worker (``services/emulated.py``) that runs no model,
    each step's time taken from the profile; its figures are labelled emulated. None: the real model."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        check_quantization(self.quantization)
        cascade_config(self.cascade, self.cascade_min_shared_blocks)  # ValueError for bad options
        check_gpu_memory_utilization(self.gpu_memory_utilization, self.device, self.data_parallel_size)
        for name in ("max_waiting_requests", "max_waiting_tokens", "max_consecutive_failed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.speculative_config()  # raises ValueError for bad speculation options
        if self.emulate is not None and (
            self.speculative or self.tensor_parallel_size * self.pipeline_parallel_size > 1
        ):
            raise ValueError("emulate runs one process and no speculation: leave out speculative and -tp/-pp")

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        return SpeculativeConfig(
            self.speculative,
            self.num_speculative_tokens,
            self.ngram_min,
            self.ngram_max,
            self.draft_model,
            self.adaptive_speculation,
        )
