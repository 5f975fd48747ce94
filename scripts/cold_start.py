"""Cold start as on a fresh clone: ``baton up`` with empty kernel and tokenizer caches, then ten
streamed chats; prints the time to "Baton is ready", to the first token, and each request's TTFT
(the first against the tenth is what "/ready means full speed" is about). The chats share no
prefix-cache block, so each computes its whole prompt the same way.

    .venv/bin/python scripts/cold_start.py --port 8321 -- --kv-cache-gib 1 [--prefill 1]

Arguments after ``--`` go to ``baton up``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import openai


def _messages(i: int) -> list[dict]:
    """The i-th chat, sharing no cached block with the others: without a system message SmolLM2's
    template inserts the same default one (two 16-token blocks), so every request after the first
    would hit the prefix cache, compute less, and (with ``--prefill``) stay below the remote-prefill
    threshold: first against tenth would then compare a full prefill with a cache hit."""
    return [
        {"role": "system", "content": f"Session {i} {'xyzw'[i % 4] * (i + 1)}: you answer in one word."},
        {"role": "user", "content": "What is the capital of France? Please answer it in a single word."},
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("up_args", nargs="*", help="flags for baton up (after --)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="baton-cold-")
    env = {**os.environ, "BATON_KERNEL_CACHE": f"{tmp}/kernels", "BATON_CACHE_DIR": f"{tmp}/cache"}
    t0 = time.perf_counter()
    up = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "up", "--port", str(a.port), *a.up_args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:
            print("up:", line.rstrip(), flush=True)
            if "Baton is ready" in line:
                break
        else:
            print("baton up exited before it was ready", file=sys.stderr)
            return 1
        ready = time.perf_counter() - t0
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{a.port}/v1", api_key="none", timeout=300, max_retries=0
        )
        model = client.models.list().data[0].id
        ttfts, first_token = [], float("nan")
        for i in range(a.requests):
            start = time.perf_counter()
            stream = client.chat.completions.create(
                model=model,
                stream=True,
                max_tokens=16,
                messages=_messages(i),
            )
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            ttfts.append((first - start) * 1000 if first else float("nan"))
            if i == 0 and first:
                first_token = first - t0
        print(f"ready after {ready:.1f} s; first token {first_token:.1f} s after baton up started")
        print("TTFT ms:", [round(t) for t in ttfts])
        return 0
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
