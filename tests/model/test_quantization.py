"""Quantized weights end to end: SmolLM2's greedy tokens with int8/fp8 weights against bf16 (a
measured bound), the compressed-tensors round trip (quantize -> save -> load -> same tokens) on a
tiny random Llama, the option on every command, and the accuracy bench's pure parts."""

from __future__ import annotations

import json

import pytest

from tests.model.helpers import PLAIN_PROMPTS

GREEDY_TOKENS = 16


def _greedy(llm, prompts) -> list[list[int]]:
    from baton.common.llm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def bf16_tokens(model_path):
    from baton.common.llm import LLM

    return _greedy(LLM(kv_cache_gib=0.25), PLAIN_PROMPTS)


# Greedy tokens diverge for good once one differs, so position-by-position agreement is a harsh
# measure. Measured on these 8 prompts x 16 tokens (2-core Xeon with AMX): int8 W8A8 0.36 (1 of 8
# outputs whole), fp8 weights 0.76 (4 of 8). Random tokens would agree ~0%; the bounds leave a
# margin for another CPU's rounding.
AGREEMENT_BOUNDS = {"int8": 0.25, "fp8": 0.55}


@pytest.mark.slow  # three SmolLM2 engines: ~6-7 min at load 15 on the 2 shared cores
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_smollm2_greedy_tokens_mostly_agree_with_bf16(method, bf16_tokens):
    from baton.bench.accuracy import identical_share, token_agreement
    from baton.common.llm import LLM
    from baton.common.model.quant import QuantLinear

    llm = LLM(kv_cache_gib=0.25, quantization=method)
    model = llm.engine.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.layers[-1].mlp.down_proj, QuantLinear)
    got = _greedy(llm, PLAIN_PROMPTS)
    agreement = token_agreement(bf16_tokens, got)
    print(f"{method}: token agreement {agreement:.3f}, identical {identical_share(bf16_tokens, got):.3f}")
    assert agreement >= AGREEMENT_BOUNDS[method], (agreement, got, bf16_tokens)
    first = sum(t[0] == b[0] for t, b in zip(got, bf16_tokens)) / len(got)
    assert first >= 0.75, (first, got, bf16_tokens)  # the first token of most prompts is the same


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.e2e.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", max_len=512)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_compressed_tensors_round_trip_gives_the_same_tokens(method, tiny_dir, tmp_path):
    import torch
    from safetensors import safe_open

    from baton.common.llm import LLM
    from baton.common.model.quantize import write_checkpoint

    out = tmp_path / f"tiny-{method}"
    write_checkpoint(str(tiny_dir), method, "bfloat16", str(out))

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == {"int8": "int-quantized", "fp8": "float-quantized"}[method]
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale")
        embed = f.get_tensor("model.embed_tokens.weight")
    assert q.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
    assert q.shape == (64, 128) and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert embed.dtype == torch.bfloat16  # the embedding is never quantized
    assert "model.layers.1.mlp.gate_proj.weight_scale" in keys and "lm_head.weight" not in keys  # tied

    prompts = [[100 + i, 200 + 7 * i, 300 + 11 * i, 5] for i in range(4)]
    at_load = _greedy(LLM(model=str(tiny_dir), quantization=method, kv_cache_gib=0.01), prompts)
    loaded = LLM(model=str(out), kv_cache_gib=0.01)  # the checkpoint's own quantization, no flag
    assert loaded.engine.model.layers[0].self_attn.qkv_proj.qweight.dtype == q.dtype
    loaded.engine.warm_up()  # a worker's start: the quantized projections' primitives built too
    assert _greedy(loaded, prompts) == at_load
    other = "fp8" if method == "int8" else "int8"
    with pytest.raises(ValueError, match="quantized as"):
        LLM(model=str(out), quantization=other, kv_cache_gib=0.01)


def test_unknown_quantization_is_refused():
    from baton.common.engine.config import EngineConfig
    from baton.common.model.quant_checkpoint import checkpoint_quantization

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    assert checkpoint_quantization({}) is None
    with pytest.raises(ValueError, match="not supported"):
        checkpoint_quantization({"quantization_config": {"quant_method": "gptq"}})


def test_quantization_flag_reaches_every_command_and_baton_up_workers():
    from baton.cli.main import build_parser
    from baton.common.engine.config_flags import engine_flags, engine_kwargs

    parser = build_parser()
    for cmd in (
        ["generate", "--prompt", "hi"],
        ["bench", "offline"],
        ["bench", "latency"],
        ["prefill"],
        ["decode"],
    ):
        assert engine_kwargs(parser.parse_args([*cmd, "--quantization", "int8"]))["quantization"] == "int8"
        assert engine_kwargs(parser.parse_args(cmd))["quantization"] is None
    flags = engine_flags(parser.parse_args(["up", "--quantization", "fp8"]))
    assert flags[flags.index("--quantization") + 1] == "fp8"
    assert engine_kwargs(parser.parse_args(["decode", *flags]))["quantization"] == "fp8"
    assert "--quantization" not in engine_flags(parser.parse_args(["up"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["decode", "--quantization", "int4"])
    qz = parser.parse_args(["quantize", "--quantization", "int8", "/tmp/out"])
    assert (qz.out_dir, qz.quantization, qz.dtype) == ("/tmp/out", "int8", "bfloat16")
    acc = parser.parse_args(["bench", "accuracy", "--quantization", "int8", "--kv-cache-dtype", "int8"])
    from baton.bench.accuracy import candidate_kwargs

    assert candidate_kwargs(acc) == {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"}


def test_accuracy_bench_text_and_measures_are_fixed():
    from baton.bench import accuracy

    text = accuracy.read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in text
    ids = list(range(1000))
    parts = accuracy.chunks(ids, 300)
    assert [len(p) for p in parts] == [300, 300, 300] and parts[1][0] == 300  # the tail is dropped
    prompts = accuracy.agreement_prompts(ids, 5, 10)
    assert [p[0] for p in prompts] == [0, 248, 495, 742, 990] and all(len(p) == 10 for p in prompts)
    assert accuracy.token_agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.75
    assert accuracy.identical_share([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.5
    assert accuracy.perplexity(0.0, 10) == 1.0
    with pytest.raises(ValueError):
        accuracy.agreement_prompts(ids[:5], 3, 10)


def test_smoothing_folds_exactly_and_rescales_the_outlier_channels(tiny_dir):
    """SmoothQuant's power-of-two scales fold between each norm and its projection without a
    rounding: the smoothed fp32 model's hidden states are bit for bit the unsmoothed one's, while
    the norm weights of outlier channels (made 30x the rest here) shrink and their weight columns grow."""
    import torch

    from baton.common.model import quant_calibration
    from baton.common.model.llama import LlamaForCausalLM
    from baton.common.model.loader import config_from_hf

    cfg = config_from_hf(json.loads((tiny_dir / "config.json").read_text()))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    torch.nn.init.normal_(model.embed_tokens.weight)  # the model leaves it empty for the loader
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = torch.rand(cfg.hidden_size) + 0.5
            norm.weight.data[:4] *= 30  # outlier channels
    ids = [100 + 37 * i % 900 for i in range(40)]
    with torch.inference_mode():
        before = model(*quant_calibration.prefill_inputs(model, ids))
    norm0 = model.layers[0].input_layernorm.weight.clone()
    quant_calibration.smooth_model(model, ids)
    with torch.inference_mode():
        after = model(*quant_calibration.prefill_inputs(model, ids))
    assert torch.equal(before, after)
    ratio = model.layers[0].input_layernorm.weight / norm0  # 1 / s: powers of two
    assert torch.equal(ratio, torch.exp2(torch.round(torch.log2(ratio))))
    assert ratio[:4].max() < ratio[4:].min(), "the outlier channels are scaled down the most"
    assert len(quant_calibration.smoothed_pairs(model)) == 2 * cfg.num_layers
