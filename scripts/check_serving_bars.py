"""Issue 3's bars, measured once on this machine:
  1. `baton up` -> its first chat completion (run with empty BATON_KERNEL_CACHE and BATON_CACHE_DIR
     folders to include building the kernels and the tokenizer, as on a fresh clone);
  2. time to first token of a 512-token prompt through the gateway (prefill worker -> KV over UCX ->
     decode worker -> gateway), against the offline engine's prefill of the same length.

Usage: .venv/bin/python scripts/check_serving_bars.py [--port 8123]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time

MODEL = "SmolLM2-135M-Instruct"


def main() -> int:
    import openai

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    t0 = time.perf_counter()
    up = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "up", "--port", str(a.port)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        for line in up.stdout:
            if "Baton is ready" in line:
                break
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{a.port}/v1", api_key="x", timeout=120)
        msg = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=MODEL, messages=msg, max_tokens=16, temperature=0)
        print(
            f"baton up -> first chat completion: {time.perf_counter() - t0:.1f} s ({r.choices[0].message.content!r})"
        )
        rng = random.Random(0)
        ttft = []
        for _ in range(a.runs):
            prompt = [rng.randrange(100, 40000) for _ in range(512)]
            t = time.perf_counter()
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True
            )
            for chunk in stream:
                if chunk.choices and len(ttft) < a.runs and t:
                    ttft.append(time.perf_counter() - t)
                    t = 0.0
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    from baton.common.llm import LLM, SamplingParams

    llm = LLM(kv_cache_gib=1)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([[5] * 512], one)
    offline = []
    for _ in range(a.runs):
        prompt = [rng.randrange(100, 40000) for _ in range(512)]
        t = time.perf_counter()
        llm.generate([prompt], one)
        offline.append(time.perf_counter() - t)
    mid = a.runs // 2
    g, o = sorted(ttft)[mid], sorted(offline)[mid]
    print(
        f"TTFT, 512-token prompt, through the gateway: {g * 1e3:.0f} ms; offline prefill: {o * 1e3:.0f} ms; ratio {g / o:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
