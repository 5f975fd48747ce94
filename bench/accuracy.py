"""``baton bench accuracy``: what quantized weights (or a quantized KV cache) cost in accuracy.

Two figures, each against a baseline run (bf16 weights and KV cache, by default) in the same
process:

- **Perplexity** of the model over a fixed English text that ships with every Python: the
  interpreter's own ``LICENSE.txt`` (``<stdlib>/LICENSE.txt``, the PSF license and its history;
  ~3,000 SmolLM2 tokens). The text is tokenized whole, cut into non-overlapping chunks of
  ``--chunk-len`` tokens (a trailing partial chunk is dropped), and each chunk is one prefill
  through the engine's own model and paged KV cache (``ModelRunner``); every token but a chunk's
  first is scored on what precedes it inside its chunk. Same text, same tokens every run.
- **Greedy agreement** over ``--num-prompts`` prompts (windows of ``--prompt-len`` tokens taken at
  evenly spaced offsets of the same text): the share of positions among ``--output-len`` greedy
  tokens where the candidate's token equals the baseline's, and the share of prompts whose whole
  output is identical.

    baton bench accuracy --quantization int8 [--dtype bfloat16] [--kv-cache-dtype int8] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from baton.kernels import kv_cache_dtypes

KV_CACHE_GIB = 0.5
"""Each run's KV cache: the longest sequence here is one chunk."""


@dataclass(frozen=True)
class AccuracyConfig:
    model: str | None = None
    """A .gguf file or a Llama safetensors directory; None: the default SmolLM2."""
    chunk_len: int = 512
    """Tokens per perplexity chunk."""
    num_prompts: int = 64
    """Prompts of the greedy-agreement run."""
    prompt_len: int = 32
    """Tokens per agreement prompt."""
    output_len: int = 32
    """Greedy tokens generated per agreement prompt."""


@dataclass(frozen=True)
class RunResult:
    label: str
    """What ran, e.g. ``bfloat16 int8-weights kv=auto``."""
    perplexity: float
    scored_tokens: int
    outputs: tuple[tuple[int, ...], ...]
    """The greedy tokens of each agreement prompt (not in the JSON)."""


def text_path() -> str:
    """The fixed text: the LICENSE.txt of the standard library this Python runs."""
    return os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")


def read_text() -> str:
    with open(text_path(), encoding="utf-8") as f:
        return f.read()


def chunks(token_ids: Sequence[int], chunk_len: int) -> list[list[int]]:
    """Non-overlapping full chunks of ``chunk_len`` tokens (the partial tail is dropped)."""
    if chunk_len < 2:
        raise ValueError(f"chunk_len must be at least 2, got {chunk_len}")
    n = len(token_ids) // chunk_len
    return [list(token_ids[i * chunk_len : (i + 1) * chunk_len]) for i in range(n)]


def agreement_prompts(token_ids: Sequence[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """``num_prompts`` windows of ``prompt_len`` tokens at evenly spaced offsets of the text."""
    span = len(token_ids) - prompt_len
    if span < 0 or num_prompts < 1:
        raise ValueError(f"the text ({len(token_ids)} tokens) is too short for {prompt_len}-token prompts")
    step = span / max(num_prompts - 1, 1)
    return [list(token_ids[round(i * step) : round(i * step) + prompt_len]) for i in range(num_prompts)]


def perplexity(total_nll: float, num_tokens: int) -> float:
    return math.exp(total_nll / num_tokens)


def token_agreement(base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    """Share of positions where the two runs' greedy tokens are equal (position by position)."""
    pairs = [(a, b) for xs, ys in zip(base, other, strict=True) for a, b in zip(xs, ys, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def identical_share(base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    """Share of prompts whose whole output is the same."""
    return sum(list(a) == list(b) for a, b in zip(base, other, strict=True)) / len(base)


def label(engine_kwargs: dict) -> str:
    q = engine_kwargs.get("quantization") or "none"
    return f"{engine_kwargs.get('dtype', 'bfloat16')} weights={q} kv={engine_kwargs.get('kv_cache_dtype', 'auto')}"


# -- runs (torch) ---------------------------------------------------------------------------------
def chunk_nll(engine, token_ids: list[int]) -> float:
    """Summed negative log-likelihood of tokens 1.. of one chunk, given what precedes each, from
    one prefill of the chunk through the engine's model into a scratch paged cache."""
    import torch

    from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
    from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput

    bs = engine.config.block_size
    n_blocks = -(-len(token_ids) // bs)
    cache = allocate_kv_cache(
        engine.model, n_blocks + 1, bs, engine.dtype, engine.config.device, engine.config.kv_cache_dtype
    )
    runner = ModelRunner(engine.model, cache, bs, scratch_block=n_blocks)
    sched = SchedulerOutput((ScheduledRequest("ppl", tuple(token_ids), 0, tuple(range(n_blocks)), True),))
    with torch.inference_mode():
        inputs = runner.prepare(sched)
        hidden = engine.model(inputs.input_ids, inputs.positions, cache, inputs.meta)
        logits = engine.model.compute_logits(hidden[: len(token_ids) - 1])  # [T-1, V] fp32
        targets = torch.tensor(token_ids[1:], dtype=torch.long, device=logits.device)
        return float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))


def run_one(cfg: AccuracyConfig, engine_kwargs: dict, text_ids: list[int]) -> RunResult:
    from baton.common.llm import LLM, SamplingParams

    llm = LLM(model=cfg.model, kv_cache_gib=KV_CACHE_GIB, **engine_kwargs)
    pieces = chunks(text_ids, cfg.chunk_len)
    nll = sum(chunk_nll(llm.engine, c) for c in pieces)
    scored = sum(len(c) - 1 for c in pieces)
    prompts = agreement_prompts(text_ids, cfg.num_prompts, cfg.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return RunResult(
        label(engine_kwargs),
        perplexity(nll, scored),
        scored,
        tuple(tuple(o.outputs[0].token_ids) for o in outs),
    )


def text_token_ids(model: str | None) -> list[int]:
    from baton.common.model.source import ModelSource, load_tokenizer

    return load_tokenizer(ModelSource.resolve(model)).encode(read_text(), add_special_tokens=False)


def run_accuracy(cfg: AccuracyConfig, baseline_kwargs: dict, candidate_kwargs: dict) -> dict:
    """Both runs, one after the other (each engine freed before the next is built)."""
    import gc

    text_ids = text_token_ids(cfg.model)
    base = run_one(cfg, baseline_kwargs, text_ids)
    gc.collect()
    cand = run_one(cfg, candidate_kwargs, text_ids)
    return summarize(cfg, base, cand)


def summarize(cfg: AccuracyConfig, base: RunResult, cand: RunResult) -> dict:
    return {
        "bench": "accuracy",
        "text": "python stdlib LICENSE.txt",
        "config": asdict(cfg),
        "baseline": {"label": base.label, "perplexity": base.perplexity, "scored_tokens": base.scored_tokens},
        "candidate": {
            "label": cand.label,
            "perplexity": cand.perplexity,
            "scored_tokens": cand.scored_tokens,
        },
        "perplexity_ratio": cand.perplexity / base.perplexity,
        "token_agreement": token_agreement(base.outputs, cand.outputs),
        "identical_outputs": identical_share(base.outputs, cand.outputs),
    }


def format_table(result: dict) -> str:
    rows = [
        ("run", "perplexity", "vs baseline", "greedy agreement", "identical outputs"),
        (result["baseline"]["label"], f"{result['baseline']['perplexity']:.3f}", "1.000", "-", "-"),
        (
            result["candidate"]["label"],
            f"{result['candidate']['perplexity']:.3f}",
            f"{result['perplexity_ratio']:.4f}",
            f"{result['token_agreement']:.3f}",
            f"{result['identical_outputs']:.3f}",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


# -- CLI ------------------------------------------------------------------------------------------
def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("accuracy", help="perplexity and greedy agreement of a quantized run vs bf16")
    p.add_argument("--model", default=None, help="a .gguf file or a Llama safetensors directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, choices=["int8", "fp8"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(kv_cache_dtypes.CHOICES))
    p.add_argument("--baseline-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--chunk-len", type=int, default=AccuracyConfig.chunk_len)
    p.add_argument("--num-prompts", type=int, default=AccuracyConfig.num_prompts)
    p.add_argument("--prompt-len", type=int, default=AccuracyConfig.prompt_len)
    p.add_argument("--output-len", type=int, default=AccuracyConfig.output_len)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=cmd_accuracy)


def candidate_kwargs(a: argparse.Namespace) -> dict:
    return {"dtype": a.dtype, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype}


def cmd_accuracy(a: argparse.Namespace) -> int:
    cfg = AccuracyConfig(a.model, a.chunk_len, a.num_prompts, a.prompt_len, a.output_len)
    baseline = {"dtype": a.baseline_dtype, "quantization": None, "kv_cache_dtype": "auto"}
    result = run_accuracy(cfg, baseline, candidate_kwargs(a))
    print(format_table(result))
    line = json.dumps(result)
    print(line)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(line + "\n")
    return 0
