"""SmoothQuant calibration for ``--quantization int8``: before the weights are quantized
(``quant.quantize_model``), a per-channel scale is folded between each norm and the q/k/v or gate/up
projection it feeds, set from the activation ranges of one prefill of ``CALIBRATION_TEXT``, so
that the outlier channels that per-token int8 activations lose precision to are flattened. The
product of norm and projection is unchanged (the scales are powers of two)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from baton.common.model.llama import Linear, LlamaForCausalLM, RMSNorm

SMOOTH_ALPHA = 0.5
"""SmoothQuant's migration strength: how much of an input channel's range moves from the
activations into the weights (llm-compressor's default; 0.8 measured worse on SmolLM2)."""

CALIBRATION_TEXT = """\
The river rose slowly through the night, and by morning the lower fields were under water. Farmers
moved their animals to the hills, and the school in the village opened its doors to families who had
nowhere else to go. Nobody could remember a spring so wet.

User: What is the capital of France, and how many people live there?
Assistant: The capital of France is Paris. About two million people live in the city itself, and
more than twelve million in the wider metropolitan area.

def mean(values):
    \"\"\"Return the arithmetic mean of a non-empty list of numbers.\"\"\"
    if not values:
        raise ValueError("mean() needs at least one value")
    return sum(values) / len(values)

In 1905, Albert Einstein published four papers that changed physics: on the photoelectric effect, on
Brownian motion, on special relativity, and on the equivalence of mass and energy, E = mc^2. Prices
rose 3.2% in March; the central bank said it would keep its rate at 4.5% until inflation fell.
"""
"""A small fixed text (prose, a chat turn, code, numbers) whose activations set the smoothing
scales: SmoothQuant needs each channel's activation range, which the weights alone do not tell
(estimating it from the norm weights measured 1.049x bf16's perplexity against 1.024x)."""


def smoothing_scales(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per input channel ``s_j = a_j^alpha / w_j^(1 - alpha)`` (``a_j``: the channel's activation
    range, ``w_j``: its largest weight over the output rows), rounded to a power of two so that
    dividing a bf16 norm weight by it and multiplying a bf16 weight column are exact (a saved
    checkpoint then reloads the same weights)."""
    a = act_amax.float().abs().clamp_min(1e-5)
    w = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return torch.exp2(torch.round(torch.log2(a.pow(alpha) / w.pow(1 - alpha))))


def smoothed_pairs(model: LlamaForCausalLM) -> list[tuple[RMSNorm, Linear]]:
    """(RMSNorm, the projection it alone feeds) of every layer: q/k/v after the input norm and
    gate/up after the post-attention norm (llm-compressor's SmoothQuant mappings for Llama)."""
    from baton.common.model.llama import Linear, RMSNorm

    pairs = []
    for layer in model.layers:
        for norm_name, proj_path in (
            ("input_layernorm", "self_attn.qkv_proj"),
            ("post_attention_layernorm", "mlp.gate_up_proj"),
        ):
            norm = getattr(layer, norm_name, None)
            try:
                proj = layer.get_submodule(proj_path)
            except AttributeError:
                continue  # e.g. a mixture of experts in place of the MLP
            if isinstance(norm, RMSNorm) and isinstance(proj, Linear) and proj.weight is not None:
                pairs.append((norm, proj))
    return pairs


def prefill_inputs(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16) -> tuple:
    """``model.forward``'s arguments for one prefill of ``token_ids`` into a scratch paged cache
    (ids, positions, cache, metadata)."""
    from baton.common.model.attention import AttentionMetadata, FreshRun

    cfg, n = model.config, len(token_ids)
    dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    nb = -(-n // block_size)
    shape = (nb, cfg.num_layers, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
    rows = torch.arange(n, device=dev)
    meta = AttentionMetadata(
        slot_blocks=rows // block_size,
        slot_offsets=rows % block_size,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
        fresh_runs=(FreshRun(0, 1, n),),
        context_prefills=(),
        prefill_block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
        prefill_context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
    )
    ids = torch.tensor(token_ids, device=dev)
    return ids, rows, torch.zeros(shape, dtype=dtype, device=dev), meta


def activation_ranges(model: LlamaForCausalLM, token_ids: list[int]) -> dict:
    """Per-channel max |x| at the input of every smoothed projection (module -> [in]) over one
    prefill of ``token_ids`` through the model."""
    ranges: dict = {}

    def record(module, args):
        ranges[module] = args[0].detach().float().abs().amax(dim=0)

    hooks = [proj.register_forward_pre_hook(record) for _, proj in smoothed_pairs(model)]
    try:
        with torch.inference_mode():
            model(*prefill_inputs(model, token_ids))
    finally:
        for h in hooks:
            h.remove()
    return ranges


def smooth_model(model: LlamaForCausalLM, token_ids: list[int], alpha: float = SMOOTH_ALPHA) -> None:
    """SmoothQuant before int8 quantization: between each norm and the projection it feeds, fold
    a per-channel scale (``smoothing_scales`` of the activation ranges over ``token_ids``): the
    norm's output channel j divided by ``s_j``, the projection's input column j multiplied by it,
    so the product is unchanged and the outlier channels that per-token int8 activations lose
    precision to are flattened. Runs on the whole model, before tensor-parallel sharding."""
    ranges = activation_ranges(model, token_ids)
    with torch.no_grad():
        for norm, proj in smoothed_pairs(model):
            s = smoothing_scales(ranges[proj], proj.weight, alpha)
            norm.weight.data = (norm.weight.float() / s).to(norm.weight.dtype)
            proj.weight.data = (proj.weight.float() * s).to(proj.weight.dtype)


def prepare_quantization(
    model: LlamaForCausalLM, quantization: str | None, source, prequantized: dict
) -> None:
    """What a loaded model (``source``: its ``ModelSource``) needs before sharding and
    ``quantize_model``: int8 quantized here (not read from a checkpoint, whose weights were smoothed
    before they were saved) is smoothed on ``CALIBRATION_TEXT``, tokenized by the model's tokenizer."""
    if quantization == "int8" and not prequantized:
        from baton.common.model.source import load_tokenizer

        ids = load_tokenizer(source).encode(CALIBRATION_TEXT, add_special_tokens=False)
        smooth_model(model, ids)
