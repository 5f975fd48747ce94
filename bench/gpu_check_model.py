"""The engine's checks of ``make gpu-check`` (``bench/gpu_check.py`` runs each in its own process):
a model of SmolLM2-135M's shape with seeded random weights, the engine against transformers on it,
a decode step replayed from a CUDA graph against the same step run eagerly, and W1 on the GPU.

Nothing here downloads anything: the weights come from ``LlamaForCausalLM(config)`` under a fixed
seed, the tokenizer is a word-level one over the ids (``<0>`` .. ``<49151>``; prompts are token ids).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

# SmolLM2-135M's shape (docs: FIELD-NOTES.md, "The model").
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
# Sharpening of the random init (std 0.02 everywhere): projections x2 so that every layer and its
# attention move the residual stream (at x1.5 the next token hardly depends on anything but the last
# one; at x4 the 30 layers turn bf16 rounding into a different token within a few), the tied
# embedding x30 so that logits spread and greedy choices are rarely near-ties (less with fewer
# layers, whose smaller share of the residual stream would leave the model a bigram table).
PROJECTION_GAIN, EMBEDDING_GAIN = 2.0, 30.0
# A divergence from the fp32 reference counts as a near-tie (not a bug) when the reference's own
# logit of the token taken is within this of its best: fp32 kernels differ by ~1e-5, bf16 by ~0.1-1.
TIE_TOLERANCE = {"float32": 1e-2, "bfloat16": 1.5}


def write_seeded_model(path: Path, seed: int = 0, num_layers: int | None = None) -> dict:
    """Save a seeded random Llama of SmolLM2's shape (safetensors, config, tokenizer) into ``path``;
    returns figures (parameters, seconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = time.perf_counter()
    shape = dict(SMOLLM2_SHAPE)
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.mul_(EMBEDDING_GAIN * (shape["num_hidden_layers"] / 30) ** 0.5)
            elif p.dim() == 2:
                p.mul_(PROJECTION_GAIN)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_id_tokenizer(path, shape["vocab_size"])
    params = sum(p.numel() for p in model.parameters())
    sensitivity = context_sensitivity(model)
    if sensitivity < 0.5:
        raise ValueError(
            f"the next token follows the context in only {sensitivity:.0%} of pairs: a weak test"
        )
    return {
        "parameters": params,
        "context_sensitivity": sensitivity,
        "num_layers": shape["num_hidden_layers"],
        "build_s": round(time.perf_counter() - t, 2),
    }


@torch.no_grad()
def context_sensitivity(model, pairs: int = 8) -> float:
    """How often two prompts that end in the same token but differ before it get different next
    tokens: near 0 the model is a bigram table, and a broken KV cache or attention would pass."""
    firsts, seconds = make_prompts([24] * pairs, seed=5), make_prompts([24] * pairs, seed=6)
    differ = 0
    for a, b in zip(firsts, seconds):
        b = b[:-1] + a[-1:]
        logits = model(torch.tensor([a, b])).logits[:, -1]
        differ += int(logits[0].argmax() != logits[1].argmax())
    return differ / pairs


def write_id_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose token i is ``<i>``: the engine needs one to detokenize, and the
    real one is not at hand (no network)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<1>", eos_token="<2>")
    fast.save_pretrained(path)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token ids uniform in [100, 40000), as BENCHMARKS.md's workloads draw them."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


PROMPT_LENGTHS = [5, 17, 33, 64]


def hf_reference(
    model_dir: str, prompts: list[list[int]], max_tokens: int, device: str, dtype: torch.dtype = torch.float32
) -> list[dict]:
    """transformers' greedy continuation of each prompt, with each step's logits (for telling a
    near-tie from a bug)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            steps = [logits[0].float().cpu() for logits in gen.logits]
            out.append({"tokens": gen.sequences[0, len(prompt) :].tolist(), "logits": steps})
    del hf
    return out


def engine_tokens(
    model_dir: str, prompts, max_tokens: int, dtype: str, device: str, **engine
) -> list[list[int]]:
    """Baton's greedy tokens for all prompts, submitted together (one batch of mixed lengths)."""
    from baton.common.llm import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device, kv_cache_gib=0.25, max_model_len=512, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def compare(reference: list[dict], got: list[list[int]], tolerance: float) -> dict:
    """Token for token; where a sequence first differs, the reference's logit of the token taken must
    be within ``tolerance`` of its best (a near-tie). After that the two continue from different
    prefixes and are not compared."""
    matched, ties, errors = [], [], []
    for i, (ref, tokens) in enumerate(zip(reference, got, strict=True)):
        want = ref["tokens"]
        n = next((j for j, (a, b) in enumerate(zip(want, tokens)) if a != b), min(len(want), len(tokens)))
        matched.append(n)
        if len(tokens) != len(want):
            errors.append(f"prompt {i}: {len(tokens)} tokens, reference {len(want)}")
        if n == len(want) or n == len(tokens):
            continue
        logits = ref["logits"][n]
        gap = float(logits.max() - logits[tokens[n]])
        ties.append(round(gap, 6))
        if gap > tolerance:
            errors.append(
                f"prompt {i} step {n}: took {tokens[n]}, reference {want[n]} by {gap:.4f} > {tolerance}"
            )
    total = sum(len(r["tokens"]) for r in reference)
    figures = {
        "tokens_matched": sum(matched),
        "tokens": total,
        "matched_per_prompt": matched,
        "gaps_at_divergence": ties,
        "tie_tolerance": tolerance,
    }
    return figures | ({"error": "; ".join(errors)} if errors else {})


def check_engine_vs_transformers(model_dir: str, device: str, dtype: str, max_tokens: int = 24) -> dict:
    """Greedy tokens against transformers' fp32 ones. In fp32 they must agree token for token (a
    divergence only at a near-tie). In bf16 a random 30-layer model's rounding noise soon turns a
    greedy choice (transformers' own bf16 follows its fp32 for a few tokens), so the tokens are
    figures and the verdict is ``bf16_logits``: teacher-forced, ours must be as close to fp32 as
    transformers' bf16 is."""
    prompts = make_prompts(PROMPT_LENGTHS)
    ref = hf_reference(model_dir, prompts, max_tokens, device)
    got = engine_tokens(model_dir, prompts, max_tokens, dtype, device)
    figures = compare(ref, got, TIE_TOLERANCE[dtype])
    if dtype == "float32":
        if figures["tokens_matched"] < figures["tokens"] // 2:
            figures.setdefault(
                "error", f"only {figures['tokens_matched']} of {figures['tokens']} tokens agree"
            )
        return {"device": device, "dtype": dtype, **figures}
    hf16 = hf_reference(model_dir, prompts, max_tokens, device, torch.bfloat16)
    figures["transformers_bf16_tokens_matched"] = compare(ref, [r["tokens"] for r in hf16], 0.0)[
        "tokens_matched"
    ]
    token_error = figures.pop("error", None)
    if token_error:
        figures["token_divergences"] = token_error
    seqs = [p + r["tokens"] for p, r in zip(prompts, ref)]
    logits = bf16_logits(model_dir, seqs, device)
    return {"device": device, "dtype": dtype, **figures, "bf16_logits": logits} | (
        {"error": logits["error"]} if "error" in logits else {}
    )


def bf16_logits(model_dir: str, seqs: list[list[int]], device: str) -> dict:
    """Every position's logits of ``seqs`` in one forward each (teacher-forced: no divergence to
    compound): the engine's bf16 and transformers' bf16 against transformers' fp32, as
    tests/model/test_reference.py compares them on the real model."""
    from transformers import LlamaForCausalLM

    ours = engine_logits(model_dir, seqs, torch.bfloat16, device)
    ref32, ref16 = [], []
    for dtype, into in ((torch.float32, ref32), (torch.bfloat16, ref16)):
        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        with torch.no_grad():
            into += [hf(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]
        del hf
    ours_t, r32, r16 = torch.cat(ours), torch.cat(ref32), torch.cat(ref16)
    ours_err, hf_err = (ours_t - r32).abs().mean().item(), (r16 - r32).abs().mean().item()
    best = r32.argmax(-1)
    figures = {
        "positions": int(r32.shape[0]),
        "mean_abs_err_vs_fp32": round(ours_err, 5),
        "transformers_bf16_mean_abs_err_vs_fp32": round(hf_err, 5),
        "argmax_agreement": round((ours_t.argmax(-1) == best).float().mean().item(), 4),
        "transformers_bf16_argmax_agreement": round((r16.argmax(-1) == best).float().mean().item(), 4),
    }
    if ours_err > 1.5 * hf_err + 1e-3:
        figures["error"] = f"bf16 logits {ours_err:.4f} from fp32 on average, transformers' bf16 {hf_err:.4f}"
    elif figures["argmax_agreement"] < figures["transformers_bf16_argmax_agreement"] - 0.05:
        figures["error"] = "bf16 argmax agrees with fp32 less often than transformers' bf16 does"
    return figures


@torch.inference_mode()
def engine_logits(
    model_dir: str, seqs: list[list[int]], dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    """The engine's model over each whole sequence as one prefill: fp32 logits [T, V] on the CPU."""
    from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
    from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
    from baton.common.model.loader import load_model
    from baton.common.model.source import ModelSource

    model = load_model(ModelSource.resolve(model_dir), dtype, device)
    out = []
    for ids in seqs:
        n_blocks = -(-len(ids) // 16)
        cache = allocate_kv_cache(model, n_blocks + 1, 16, dtype, device)  # + the padding rows' block
        runner = ModelRunner(model, cache, 16, scratch_block=n_blocks)
        step = ScheduledRequest("x", tuple(ids), 0, tuple(range(n_blocks)), True)
        inputs = runner.prepare(SchedulerOutput((step,)))
        hidden = model(inputs.input_ids, inputs.positions, cache, inputs.meta)
        out.append(model.compute_logits(hidden[: len(ids)]).float().cpu())
    return out


# --- CUDA graphs -----------------------------------------------------------------------------------


@torch.inference_mode()
def check_cuda_graph_decode(model_dir: str, dtype: str = "bfloat16", steps: int = 16) -> dict:
    """The engine has no CUDA-graph mode yet; this shows its decode step can have one. The model's
    decode forward and greedy head are captured once into a CUDA graph over static buffers, then
    ``steps`` decode steps of a batch are run from the same prefilled cache twice: eagerly (the
    engine's path) and by copying the inputs into the buffers and replaying. Tokens must be equal."""
    from baton.bench.gpu_check_graph import DecodeGraph, eager_decode, prefill_batch
    from baton.common.engine.llm_engine import parse_dtype
    from baton.common.model.loader import load_model
    from baton.common.model.source import ModelSource

    torch_dtype = parse_dtype(dtype)
    model = load_model(ModelSource.resolve(model_dir), torch_dtype, "cuda")
    prompts = make_prompts([9, 16, 31, 40, 64, 3, 100, 17], seed=1)
    state = prefill_batch(model, prompts, torch_dtype, max_len=len(max(prompts, key=len)) + steps + 1)
    cache0 = state.cache.clone()
    eager_hidden: list[torch.Tensor] = []
    graph_hidden: list[torch.Tensor] = []
    eager = eager_decode(model, state, steps, eager_hidden)
    state.cache.copy_(cache0)
    t = time.perf_counter()
    graph = DecodeGraph(model, state)
    capture_s = time.perf_counter() - t
    replayed = graph.decode(steps, graph_hidden)
    same = eager == replayed
    diffs = [(a - b).abs().max().item() for a, b in zip(eager_hidden, graph_hidden)]
    figures = {"dtype": dtype, "batch": len(prompts), "steps": steps, "capture_s": round(capture_s, 3)}
    figures["hidden_max_abs_diff_per_step"] = [float(f"{d:.3g}") for d in diffs]  # 0 if bitwise equal
    figures |= {
        "identical": same,
        "eager_ms_per_step": eager_ms(model, state, cache0),
        "graph_ms_per_step": graph.ms_per_step(cache0),
    }
    if not same:
        diff = [i for i, (a, b) in enumerate(zip(eager, replayed)) if a != b]
        figures["error"] = f"tokens differ between eager and graph replay in rows {diff}"
    return figures


@torch.inference_mode()
def eager_ms(model, state, cache0) -> float:
    from baton.bench.gpu_check_graph import eager_decode

    state.cache.copy_(cache0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    eager_decode(model, state, 8)
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / 8 * 1e3, 3)


# --- W1 on the GPU ---------------------------------------------------------------------------------


def check_w1(model_dir: str, num_prompts: int = 64, input_len: int = 256, output_len: int = 128) -> dict:
    """BENCHMARKS.md's W1 through ``bench/offline.py`` on the GPU, bf16 (the seeded model: its
    tokens are not the real model's, its cost is)."""
    from baton.bench.offline import run_offline_bench

    engine = dict(model=model_dir, dtype="bfloat16", device="cuda", kv_cache_gib=4.0, max_model_len=1024)
    result = run_offline_bench(num_prompts, input_len, output_len, seed=0, engine_kwargs=engine)
    result["workload"] = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len}
    return result
