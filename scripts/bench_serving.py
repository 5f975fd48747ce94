"""The serving figures of docs/bench/journal.md's W2-W5 sections (summarised in docs/benchmarks.md's
"W2 across layouts" and "W3, W4, W5"), in one run: W2 at several rates against Baton
disaggregated (1 prefill + 1 decode worker, one core each), Baton colocated (one worker, both cores)
and vLLM (when ``--vllm-serve`` is given), all measured by ``baton bench serve``; then W3 with two
prefill workers and W4, and a plot per rate.

    .venv/bin/python scripts/bench_serving.py --out docs/bench --rates 0.75,1,1.5 \\
        --vllm-serve PEER/vllm_serve.sh --vllm-bench PEER/venv/bin/vllm

``--vllm-serve`` is a command that starts ``vllm serve`` on the port given as its first argument
(the peer, as docs/benchmarks.md starts it); ``--vllm-bench`` runs ``vllm bench serve`` against it
at the middle rate, to check that both clients agree. Each server is started, measured and stopped in turn, so that
nothing else runs on the cores while one is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from baton.services.procs import ProcessGroup, wait_http_ok

SLO = ["ttft:1500", "tpot:60"]
BATON = [sys.executable, "-m", "baton.cli"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, ready_path: str, port: int, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}{ready_path}", ProcessGroup([(cmd[0], proc)]), timeout)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def bench(port: int, out: Path, label: str, workload: str, extra: list[str]) -> dict:
    cmd = [*BATON, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--workload", workload,
           "--label", label, "--output-json", str(out), "--disable-tqdm", *extra]  # fmt: skip
    print("$", " ".join(cmd[2:]), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True)
    print(run.stdout, run.stderr[-2000:], flush=True)
    return json.loads(out.read_text())


W2_SYSTEMS = ("disaggregated", "colocated", "vllm")


def w2_file(out: Path, system: str, rate: str, repeat: int = 0) -> Path:
    return out / (f"w2-{system}-{rate}.json" if repeat == 0 else f"w2-{system}-{rate}-r{repeat}.json")


def w2_runs(system: str, port: int, rates: list[str], out: Path, num_prompts: int, repeats: int) -> None:
    # Each run gets its own prompts and arrivals (seed i + 10 r for rate i, repeat r; the same for
    # every system), because a server keeps the previous run's prompts in its prefix cache: with one
    # seed for all rates, every rate after the first measured cache hits, 240 of 256 prompt tokens.
    for r in range(repeats):
        for i, rate in enumerate(rates, start=1):
            bench(port, w2_file(out, system, rate, r), system, "w2",
                  ["--request-rate", rate, "--num-prompts", str(num_prompts), "--goodput", *SLO,
                   "--seed", str(i + 10 * r)])  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--rates", default="0.75,1,1.5")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="W2 runs per rate, each with other seeds")
    ap.add_argument("--systems", default="disaggregated,colocated,vllm,w3,w4")
    ap.add_argument("--vllm-serve", default=None, help="command that starts vllm serve on port $1")
    ap.add_argument("--vllm-bench", default=None, help="the vllm executable, for vllm bench serve")
    ap.add_argument(
        "--vllm-tokenizer", default=None, help="the HF directory of ../shared/peers/make_hf_dir.py"
    )
    a = ap.parse_args()
    if a.vllm_bench and not a.vllm_tokenizer:
        ap.error("--vllm-bench needs --vllm-tokenizer")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = a.rates.split(",")
    systems = a.systems.split(",")
    up = {
        "disaggregated": ["--prefill", "1", "--decode", "1", "--cpus", "auto"],
        "colocated": ["--colocated", "--decode", "1", "--cpus", "auto"],
    }
    for system in ("disaggregated", "colocated"):
        if system not in systems:
            continue
        port = free_port()
        proc = start([*BATON, "up", "--port", str(port), *up[system]], out / f"{system}.log", "/ready", port)
        try:
            w2_runs(system, port, rates, out, a.num_prompts, a.repeats)
            if system == "disaggregated" and "w4" in systems:
                bench(port, out / "w4-disaggregated.json", "disaggregated", "w4", ["--request-rate", "1"])
        finally:
            stop(proc)
    if "w3" in systems:
        port = free_port()
        args = [*BATON, "up", "--port", str(port), "--prefill", "2", "--decode", "1", "--cpus", "auto"]
        proc = start(args, out / "w3.log", "/ready", port)
        try:
            bench(port, out / "w3-2prefill.json", "2 prefill + 1 decode", "w3", ["--max-concurrency", "1"])
        finally:
            stop(proc)
    if "vllm" in systems and a.vllm_serve:
        port = free_port()
        proc = start([a.vllm_serve, str(port)], out / "vllm.log", "/v1/models", port, timeout=900)
        try:
            w2_runs("vllm", port, rates, out, a.num_prompts, a.repeats)
            if a.vllm_bench:
                mid = rates[len(rates) // 2]
                cmd = [a.vllm_bench, "bench", "serve", "--backend", "vllm", "--base-url",
                       f"http://127.0.0.1:{port}", "--model", "SmolLM2-135M-Instruct", "--tokenizer",
                       a.vllm_tokenizer, "--dataset-name", "random", "--random-input-len", "256",
                       "--random-output-len", "256", "--num-prompts", str(a.num_prompts), "--request-rate", mid,
                       "--ignore-eos", "--goodput", *SLO, "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "50,90,99", "--seed", "100", "--save-result",
                       "--result-dir", str(out), "--result-filename", f"vllm-bench-serve-{mid}.json"]  # fmt: skip
                print("$", " ".join(cmd), flush=True)
                env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
                run = subprocess.run(cmd, capture_output=True, text=True, env=env)
                (out / f"vllm-bench-serve-{mid}.log").write_text(run.stdout + run.stderr)
                print(run.stdout[-3000:], flush=True)
        finally:
            stop(proc)
    for rate in rates:
        files = [w2_file(out, s, rate) for s in W2_SYSTEMS]
        files = [str(f) for f in files if f.exists()]
        if files:
            subprocess.run(
                [*BATON, "bench", "plot", *files, "--output", str(out / f"w2-{rate}.png")], check=True
            )
    print(summary(out, rates))
    if a.repeats > 1:
        print(goodput_by_seed(out, rates, a.repeats))
    return 0


def summary(out: Path, rates: list[str]) -> str:
    """The W2 table of docs/bench/journal.md ("W2: goodput under load")."""
    lines = [
        "| rate (req/s) | system | goodput (req/s) | throughput (req/s) | p50/p99 TTFT (ms) | p50/p99 TPOT (ms) | p99 ITL (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for system in W2_SYSTEMS:
            f = w2_file(out, system, rate)
            if not f.exists():
                continue
            s = json.loads(f.read_text())
            lines.append(
                f"| {rate} | {system} | {s['request_goodput']:.2f} | {s['request_throughput']:.2f} | "
                f"{s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | {s['median_tpot_ms']:.1f} / "
                f"{s['p99_tpot_ms']:.1f} | {s['p99_itl_ms']:.0f} |"
            )
    return "\n".join(lines)


def goodput_by_seed(out: Path, rates: list[str], repeats: int) -> str:
    """W2 goodput of every repeat (seed) and their mean: the arrivals' bursts move it a lot."""
    head = " | ".join(f"repeat {r}" for r in range(repeats))
    lines = [f"| rate (req/s) | system | goodput: {head} | mean |", "|---|---|" + "---|" * (repeats + 1)]
    for rate in rates:
        for system in W2_SYSTEMS:
            files = [w2_file(out, system, rate, r) for r in range(repeats)]
            if not all(f.exists() for f in files):
                continue
            g = [json.loads(f.read_text())["request_goodput"] for f in files]
            lines.append(
                f"| {rate} | {system} | " + " | ".join(f"{x:.2f}" for x in g) + f" | {sum(g) / len(g):.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
