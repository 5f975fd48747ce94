"""Batch-1 decode time per token with and without speculative decoding, on a prompt-grounded
workload (edit a given text: the reply largely copies it, which n-gram prompt lookup exploits)
and on W2-shaped random prompts (where it cannot help, and must not cost).

    .venv/bin/python -m baton.bench.spec --speculative ngram --repeats 3 --output-json spec.json

One model is loaded and shared by the two engines; runs alternate off/on so that a busy
neighbour slows both alike. Per prompt: (time of the whole reply - time of a 1-token reply) /
(reply tokens - 1), with the prompt already in the prefix cache (as ``baton bench latency``).

``--batch N`` adds W1's case, where a step is compute-bound and speculation cannot help (and must
cost at most 3%): N random prompts submitted at once, ``--input-len`` / ``--output-len``, greedy,
EOS ignored, one seed per pair of runs (``--batch-seeds``), the two engines' order alternating.

    .venv/bin/python -m baton.bench.spec --batch 64 --input-len 128 --output-len 128 \
        --num-random 0 --num-grounded 0 --batch-seeds 2,3,4,5,6,7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from baton.bench.offline import make_prompts

TEXTS = [
    "The river town of Calder sits where two valleys meet. Its market opens at dawn on Saturdays, "
    "and farmers bring apples, cheese and wool from the hills. In winter the river freezes along "
    "its edges, and children skate under the old stone bridge while their parents sell hot cider "
    "from wooden stalls. The town hall, built in 1870, still rings its bell every hour.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and "
    "wait until the green light stops blinking. Then open a browser, go to the setup page, and "
    "sign in with the password printed on the label under the router. Choose a new network name "
    "and a strong password, save the settings, and reconnect every device to the new network.",
    "Our team met on Tuesday to plan the spring release. We agreed to finish the search feature "
    "first, because customers ask for it most often. The mobile app will get a new settings page, "
    "and the billing page will show invoices for the last two years. Testing starts on the first "
    "of March, and the release is planned for the twentieth of March if no major bugs are found.",
]

TASKS = [
    "Repeat the following text exactly as it is written, word for word:\n\n{text}",
    "Rewrite the following text, replacing every number with words. Change nothing else:\n\n{text}",
]


def grounded_prompts(tokenizer) -> list[list[int]]:
    """Chat prompts that ask for an edit of a given text, as token ids."""
    out = []
    for task in TASKS:
        for text in TEXTS:
            messages = [{"role": "user", "content": task.format(text=text)}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer.encode(prompt, add_special_tokens=False))
    return out


def _generate(engine, ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[float, list[int]]:
    from baton.common.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    engine.add_request("bench", ids, params)
    t = time.perf_counter()
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].finish_reason == "error":
                raise RuntimeError(f"the engine failed the request: {out.outputs[0].error}")
            tokens = out.outputs[0].token_ids
    return time.perf_counter() - t, tokens


def ms_per_token(engine, ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[float, list[int]]:
    _generate(engine, ids, 2, ignore_eos)  # warm: the prompt joins the prefix cache
    t1, _ = _generate(engine, ids, 1, ignore_eos)
    tn, tokens = _generate(engine, ids, max_tokens, ignore_eos)
    return (tn - t1) / max(len(tokens) - 1, 1) * 1e3, tokens


def _generate_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from baton.common.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"batch-{i}", ids, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].finish_reason == "error":
                raise RuntimeError(f"the engine failed the request: {out.outputs[0].error}")
            tokens[out.request_id] = out.outputs[0].token_ids
    return time.perf_counter() - t, [tokens[f"batch-{i}"] for i in range(len(prompts))]


def run_batch(base, spec, args: argparse.Namespace) -> dict:
    """W1's batch, off and on in turn per seed: seconds each, and on / off per seed."""
    off, on, identical = [], [], []
    verified_before = spec.speculator.stats.num_drafts
    for i, seed in enumerate(int(x) for x in args.batch_seeds.split(",")):
        prompts = make_prompts(args.batch, args.input_len, seed)
        order = [(base, off), (spec, on)] if i % 2 == 0 else [(spec, on), (base, off)]
        outputs = []
        for engine, times in order:
            seconds, tokens = _generate_batch(engine, prompts, args.output_len)
            times.append(seconds)
            outputs.append(tokens)
        same = sum(a == b for a, b in zip(*outputs))
        identical.append(same)
        # In bf16 a row's logits depend on how many rows its GEMM had (oneDNN's blocking), and a
        # verify step has more: near-ties may flip. In fp32 the tokens must be the same.
        if same < len(prompts) and base.config.dtype == "float32":
            raise AssertionError(f"batch seed {seed}: greedy output differs with speculation")
        print(f"batch seed {seed}: off {off[-1]:.2f} s, on {on[-1]:.2f} s", file=sys.stderr, flush=True)
    ratios = [b / a for a, b in zip(off, on)]
    return {
        "requests": args.batch,
        "off_s": off,
        "on_s": on,
        "on_over_off": ratios,
        "mean_on_over_off": statistics.mean(ratios),
        "median_on_over_off": statistics.median(ratios),
        "verified_requests": spec.speculator.stats.num_drafts - verified_before,
        "identical_outputs": identical,
    }


def run(args: argparse.Namespace) -> dict:
    from baton.common.engine.config import EngineConfig
    from baton.common.engine.llm_engine import LLMEngine
    from baton.common.parallel.engine_factory import create_engine

    base = create_engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_gib=1.0))
    spec_config = EngineConfig(
        model=args.model,
        dtype=base.config.dtype,
        kv_cache_gib=1.0,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        adaptive_speculation=not args.no_adaptive_speculation,
    )
    spec = LLMEngine(spec_config, base.model, base.tokenizer, base.eos_token_ids)
    base.warm_up()
    spec.warm_up()
    workloads = {
        "grounded": (grounded_prompts(base.tokenizer)[: args.num_grounded], False),
        "random": (make_prompts(args.num_random, args.input_len, args.seed), True),
    }
    result: dict = {"speculative": args.speculative, "k": args.num_speculative_tokens, "workloads": {}}
    for name, (prompts, ignore_eos) in workloads.items():
        if not prompts:
            continue
        off, on = [], []
        steps_before, drafted = spec.num_steps_total, spec.speculator.stats.num_draft_tokens
        accepted = spec.speculator.stats.num_accepted_tokens
        for _ in range(args.repeats):
            for ids in prompts:
                a, want = ms_per_token(base, ids, args.output_len, ignore_eos)
                b, got = ms_per_token(spec, ids, args.output_len, ignore_eos)
                if got != want:
                    raise AssertionError(f"{name}: greedy output differs with speculation")
                off.append(a)
                on.append(b)
                print(f"{name}: off {a:.1f} ms/token, on {b:.1f} ms/token", file=sys.stderr, flush=True)
        stats = spec.speculator.stats
        drafted = stats.num_draft_tokens - drafted
        result["workloads"][name] = {
            "prompts": len(prompts),
            "off_ms_per_token": statistics.median(off),
            "on_ms_per_token": statistics.median(on),
            "speedup": statistics.median(off) / statistics.median(on),
            "acceptance_rate": (stats.num_accepted_tokens - accepted) / drafted if drafted else 0.0,
            "spec_steps": spec.num_steps_total - steps_before,
        }
    if args.batch:
        result["workloads"]["batch"] = run_batch(base, spec, args)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--speculative", default="ngram", choices=["ngram"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--no-adaptive-speculation", action="store_true")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--input-len", type=int, default=256, help="of the random (W2-shaped) prompts")
    p.add_argument("--num-random", type=int, default=3)
    p.add_argument("--num-grounded", type=int, default=len(TEXTS) * len(TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="W1's case: this many prompts at once (0: skip)")
    p.add_argument("--batch-seeds", default="2,3,4,5", help="one off/on pair of batch runs per seed")
    p.add_argument("--output-json", default=None)
    a = p.parse_args(argv)
    result = run(a)
    text = json.dumps(result, indent=2)
    print(text)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
