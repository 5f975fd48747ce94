"""W1 of BENCHMARKS.md: random prompts submitted at once, fixed output length, EOS ignored."""

from __future__ import annotations

import random
import time


def make_prompts(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from [100, 40000), the same draw as the vLLM peer script."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(num_prompts)]


def run_offline_bench(
    num_prompts: int, input_len: int, output_len: int, seed: int, engine_kwargs: dict
) -> dict:
    from baton.common.llm import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    prompts = make_prompts(num_prompts, input_len, seed)
    # Warm up (kernel build, allocator) on a different draw so that no prefix is cached.
    llm.generate(
        make_prompts(2, input_len, seed + 1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    llm.engine.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {
        "engine": "baton",
        "elapsed_s": elapsed,
        "num_requests": len(outs),
        "output_token_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
    }


def run_latency_bench(input_len: int, output_len: int, seed: int, engine_kwargs: dict) -> dict:
    """Batch-1 decode time per output token, measured like the vLLM peer script: one prompt,
    (elapsed of an N-token generate - elapsed of a 1-token generate) / (N - 1), so that the
    prefill and per-request overhead cancel."""
    from baton.common.llm import LLM, SamplingParams

    if output_len < 2:
        raise ValueError(f"output_len must be at least 2, got {output_len}")
    llm = LLM(**engine_kwargs)
    prompt = make_prompts(1, input_len, seed)

    def timed(n: int) -> float:
        t = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        dt = time.perf_counter() - t
        assert len(out[0].outputs[0].token_ids) == n
        return dt

    timed(4)  # warm-up; also puts the prompt in the prefix cache for both timed runs
    t1 = timed(1)
    tn = timed(output_len)
    return {
        "engine": "baton",
        "ms_per_token": (tn - t1) / (output_len - 1) * 1e3,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_1_s": t1,
        "elapsed_n_s": tn,
    }
