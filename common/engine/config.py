"""The engine's options (``EngineConfig``), torch-free: the command line, ``baton up`` and the
planner build and check one without loading torch; ``llm_engine`` runs it.

Every field is checked when the config is built (``__post_init__``: ValueError naming the option),
and ``kv_cache_dtype`` normalised as it is set, so that a config holds only canonical values.

Each field that is a command-line option says how in its ``metadata`` (``Flag``): that is the one
place an engine option is declared; ``config_flags`` builds the flags, the config from parsed flags,
and a child worker's command line from it."""

from __future__ import annotations

from dataclasses import Field, dataclass, field

from baton.common.engine.cascade_plan import cascade_config
from baton.common.engine.kv_budget import check_gpu_memory_utilization
from baton.common.engine.spec_decode import SpeculativeConfig
from baton.common.model.quant_names import check_quantization
from baton.kernels.kv_cache_dtypes import CHOICES as KV_CACHE_DTYPE_CHOICES
from baton.kernels.kv_cache_dtypes import canonical_kv_cache_dtype


@dataclass(frozen=True)
class Flag:
    """How an ``EngineConfig`` field is spelled on the command line."""

    help: str | None = None
    """``--help``'s line; ``{default}`` is replaced by the command's default."""
    name: str | None = None
    """The flag; None: ``--`` and the field's name with dashes."""
    aliases: tuple[str, ...] = ()
    """More spellings of it (``-tp``; vLLM's ``--prompt-lookup-min``)."""
    choices: tuple[str, ...] | None = None
    """The values it takes; None: any of the field's type."""
    negated: bool = False
    """A bool that is on by default: the flag (``--no-...``) turns it off."""
    to_children: bool = True
    """False: ``baton up`` resolves the option itself and hands its workers its own (``dtype``)."""
    path: bool = False
    """A file: made absolute on a child's command line (the child may start elsewhere)."""
    only_with: str | None = None
    """Handed to a child only where this other option is set (a speculation knob, with ``speculative``)."""
    engine_group: bool = True
    """False: not among every engine command's flags; declared apart where it applies (``emulate``)."""
    metavar: str | None = None
    """``--help``'s name for the value; None: argparse's."""

    def flag(self, field_name: str) -> str:
        """The flag of the field ``field_name``."""
        return self.name or "--" + field_name.replace("_", "-")


def flag(**options) -> dict:
    """A field's ``metadata`` declaring it a command-line option (``Flag``'s fields)."""
    return {"flag": Flag(**options)}


def flag_of(f: Field) -> Flag | None:
    """The ``Flag`` of an ``EngineConfig`` field, None when it is no command-line option. The
    ``kv_cache_dtype`` default is a descriptor, which ``field()`` cannot carry: its ``Flag`` rides
    on the descriptor."""
    return f.metadata.get("flag") or getattr(vars(EngineConfig).get(f.name), "flag", None)


class _KVCacheDtype:
    """The ``kv_cache_dtype`` field, with vLLM's aliases resolved as ``__init__`` sets it (``fp8`` ->
    ``fp8_e4m3``), so that the workers' settings and the layout check compare one name. A field
    whose default is a descriptor is the dataclasses way to normalise a frozen field: ``__init__``
    sets it through ``__set__``, a frozen instance refuses any later assignment, and
    ``__get__(None, cls)`` is the default."""

    def __init__(self, spec: Flag) -> None:
        self.flag = spec  # the field's Flag (``flag_of``): field() cannot carry a descriptor default

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_{name}"

    def __get__(self, obj: object, owner: type | None = None) -> str:
        return "auto" if obj is None else obj.__dict__[self._key]

    def __set__(self, obj: object, value: str) -> None:
        obj.__dict__[self._key] = canonical_kv_cache_dtype(value)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(
        default=None, metadata=flag(help="a .gguf file or a Llama safetensors directory")
    )
    """A .gguf file or a Llama safetensors directory; None is the default SmolLM2 GGUF."""
    dtype: str = field(
        default="bfloat16",
        metadata=flag(
            choices=("auto", "bfloat16", "float32"),
            help="compute dtype; auto: bf16 where this CPU multiplies it natively (AVX512-BF16, AMX, Arm BF16) or Baton's GEMM widens it into fp32 FMAs (AVX2), else fp32 (default {default})",
            to_children=False,  # baton up resolves auto once, and gives every worker the answer
        ),
    )
    """bfloat16 or float32, for weights, activations and the KV cache; ``auto`` (resolved by
    ``parallel.engine_factory``): the one this CPU multiplies natively (``gemm_probe``)."""
    device: str = field(
        default="cpu", metadata=flag(help="cpu, or cuda (cuda:N) to run on a GPU (default cpu)")
    )
    """``cpu``, or ``cuda`` (``cuda:N``) for a GPU: Triton decode attention, SDPA prefill."""
    block_size: int = field(default=16, metadata=flag())
    """Tokens per KV block."""
    kv_cache_gib: float = field(default=4.0, metadata=flag(help="KV cache memory budget"))
    """Memory budget for the KV cache; the cache never exceeds it. Unused with
    ``gpu_memory_utilization``."""
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=flag(
            help="on cuda, size the KV cache instead as this fraction (0, 1] of the GPU's memory less what"
            " is in use once the model is loaded, as vLLM does (default: off, --kv-cache-gib)"
        ),
    )
    """On CUDA, the KV cache's size instead (vLLM's option, off by default here): this fraction
    (0, 1] of the GPU's memory less what is in use once the model is loaded (``kv_budget``)."""
    kv_cache_dtype: str = _KVCacheDtype(  # type: ignore[assignment]  # a str, set through __set__
        Flag(
            choices=KV_CACHE_DTYPE_CHOICES,
            help="KV cache storage: auto (the model dtype) or 1-byte codes with a scale per token and head"
            " (fp8: fp8_e4m3, as in vLLM)",
        )
    )
    """KV cache storage (vLLM's names): ``auto`` (the model dtype), ``int8``, ``fp8_e4m3`` or
    ``fp8_e5m2`` (1-byte codes with a scale per token and head; ~2x the tokens per GiB)."""
    quantization: str | None = field(
        default=None,
        metadata=flag(
            choices=("int8", "fp8"),
            help="weights: int8 (W8A8, dynamic per-token activations) or fp8 (e4m3), quantized at load",
        ),
    )
    """Weights: ``int8`` (W8A8, dynamic per-token activations) or ``fp8`` (e4m3), quantized at load;
    None keeps them in ``dtype`` (a compressed-tensors checkpoint is read as it is stored)."""
    max_num_batched_tokens: int = field(default=2048, metadata=flag(help="token budget of one step"))
    """Token budget of one step."""
    max_num_seqs: int = field(default=256, metadata=flag())
    max_model_len: int | None = field(
        default=None,
        metadata=flag(help="context length: prompt + max_tokens beyond it is refused (default: the model's)"),
    )
    """Longest prompt + output; defaults to the model's context length."""
    enable_prefix_caching: bool = field(default=True, metadata=flag(name="--no-prefix-caching", negated=True))
    seed: int = 0
    """Seed of the sampler for requests without their own seed."""
    # The queue caps' defaults bound what a worker holds for queued requests (their token ids, ~10 MB
    # at the token cap) and how long they wait (the token cap is 128 full 2048-token steps), yet sit
    # 16x above W2 all at once (64 prompts of 256 tokens: 64 requests, 16k tokens): load that can be
    # served is never refused; past them a request would wait minutes, so another worker, or the
    # client's retry, serves it sooner.
    max_waiting_requests: int = field(
        default=1024,
        metadata=flag(help="most requests waiting to run; past it a worker refuses new ones (HTTP 429)"),
    )
    """Most requests not yet running (waiting, preempted, parked for a remote prefill); past it a
    new one is refused (``EngineFullError``)."""
    max_waiting_tokens: int = field(
        default=262_144,
        metadata=flag(
            help="most tokens the waiting requests may still have to compute; past it new ones are refused"
        ),
    )
    """Most tokens those requests may still have to compute; past it a new one is refused."""
    max_consecutive_failed_steps: int = 3
    """Steps in a row that may fail (each fails only its own requests) before the engine gives up."""
    cascade: str = field(
        default="auto",
        metadata=flag(
            choices=("auto", "off"),
            help="cascade attention for decode batches sharing a prefix: auto (a cost model decides per"
            " step) or off",
        ),
    )
    """Cascade attention for decode rows sharing prefix blocks: ``auto`` (a cost model decides per
    step, ``cascade_plan``) or ``off``."""
    cascade_min_shared_blocks: int = 4
    """Fewest full blocks a group of decode rows must share for a cascade."""
    jump_forward: bool = field(
        default=True,
        metadata=flag(
            name="--no-jump-forward",
            negated=True,
            help="structured outputs: sample every token, even where the grammar forces the continuation",
        ),
    )
    """Structured outputs append a grammar's forced continuation without sampling it."""
    speculative: str | None = field(
        default=None,
        metadata=flag(
            choices=("ngram", "draft"),
            help="speculative decoding: ngram (prompt lookup) or draft (--draft-model); decode workers only",
        ),
    )
    """Speculative decoding: ``ngram`` (prompt lookup) or ``draft`` (``draft_model``); None: off."""
    num_speculative_tokens: int = field(
        default=4, metadata=flag(only_with="speculative", help="most tokens proposed per step")
    )
    """Most tokens proposed per request per step."""
    ngram_min: int = field(
        default=2, metadata=flag(only_with="speculative", aliases=("--prompt-lookup-min",))
    )
    """Shortest suffix n-gram the n-gram proposer looks up (vLLM's ``prompt_lookup_min``)."""
    ngram_max: int = field(
        default=4, metadata=flag(only_with="speculative", aliases=("--prompt-lookup-max",))
    )
    """Longest suffix n-gram it looks up (vLLM's ``prompt_lookup_max``)."""
    draft_model: str | None = field(
        default=None,
        metadata=flag(path=True, only_with="speculative", help="a smaller Llama, same tokenizer (for draft)"),
    )
    """The draft model (``speculative="draft"``): a smaller Llama of the same tokenizer."""
    adaptive_speculation: bool = field(
        default=True,
        metadata=flag(
            name="--no-adaptive-speculation",
            negated=True,
            only_with="speculative",
            help="always propose --num-speculative-tokens, even where the step cost says it does not pay",
        ),
    )
    """Propose fewer tokens, down to none, where the step's cost model says they would not pay."""
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            aliases=("-tp",),
            help="ranks (processes of this command) the model's heads and MLP are split across (default 1)",
        ),
    )
    """Ranks (processes of this one, ``common.parallel``) the model's heads and MLP are split across."""
    enable_expert_parallel: bool = field(
        default=False,
        metadata=flag(
            help="MoE models: place whole experts across the tensor- or data-parallel ranks instead of"
            " splitting each"
        ),
    )
    """A mixture-of-experts model's experts are placed whole across the tensor- or data-parallel
    ranks (``model.expert_parallel``) instead of every expert being split across them."""
    data_parallel_size: int = field(
        default=1,
        metadata=flag(
            aliases=("-dp",),
            help="engine replicas, each with its own scheduler, KV cache and CPUs (offline commands; default 1)",
        ),
    )
    """Engine replicas, each with its own scheduler, KV cache and CPUs (``parallel.data_parallel``);
    a MoE model's with ``enable_expert_parallel`` run attention apart beside experts placed across them."""
    pipeline_parallel_size: int = field(
        default=1,
        metadata=flag(
            aliases=("-pp",),
            help="stages (of --tensor-parallel-size ranks each) the model's layers are split into (default 1)",
        ),
    )
    """Stages the layers are cut into, each of ``tensor_parallel_size`` ranks (``parallel.pipeline``)."""
    emulate: str | None = field(
        default=None,
        metadata=flag(
            path=True,
            engine_group=False,  # the workers' and baton up's flag; offline commands have none
            metavar="PROFILE",
            help="an emulated worker: no model runs, each step sleeps the time this `baton profile` JSON"
            " predicts (the real services, scheduler, KV books and transfers; its figures are labelled"
            " emulated)",
        ),
    )
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
