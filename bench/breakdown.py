"""``baton bench breakdown``: where a served token's time goes.

Starts ``baton up`` (with any flags after ``--``), measures what each of its processes costs while
idle, streams a few requests one at a time (random ``--input-len``-token prompts, ``--output-len``
tokens, greedy, EOS ignored) and splits a served token into:

- the decode worker's engine step (its ``baton:engine_*`` counters: forward pass and sampling,
  detokenization, the rest of the step: scheduling, bookkeeping);
- the decode worker's hand-off from the engine thread to the gRPC stream
  (``baton:stream_handoff_seconds``);
- the gateway's lag behind the engine when a chunk arrives and when its SSE event is written
  (``baton:gateway_chunk_lag_seconds``);
- the CPU that every process (and this client) spends per token, and while idle.

Then, with no cluster running, the same prompt length offline (``LLM``): the prefill time and the
batch-1 decode time per token at that context, and the bars of issue 9: TPOT within 1.1x of
offline, TTFT within 1.2x of the offline prefill plus 20 ms.

    baton bench breakdown --runs 3 --output-json breakdown.json -- --colocated
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baton.bench import proc_stats
from baton.common.launch import python_module
from baton.common.net import free_port

MODEL_HEADER = {"content-type": "application/json"}


@dataclass(frozen=True)
class BreakdownConfig:
    input_len: int = 256
    """Prompt tokens of each request."""
    output_len: int = 128
    """Tokens generated per request."""
    runs: int = 3
    """Requests, one at a time."""
    idle_s: float = 5.0
    """How long the idle cluster is watched."""
    seed: int = 0
    up_args: tuple[str, ...] = ()
    """Flags for ``baton up``."""
    offline: bool = True
    """Also measure the offline reference (needs the cores to itself: runs after the cluster)."""
    ready_timeout_s: float = 600.0


@dataclass
class StreamTiming:
    ttft_s: float
    tpot_s: float
    tokens: int


@dataclass
class Breakdown:
    config: dict
    layout: list[dict] = field(default_factory=list)
    idle: dict[str, dict] = field(default_factory=dict)
    streams: list[dict] = field(default_factory=list)
    per_token_ms: dict[str, float] = field(default_factory=dict)
    first_token_ms: dict[str, float] = field(default_factory=dict)
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)
    offline: dict[str, float] = field(default_factory=dict)
    bars: dict[str, float | bool] = field(default_factory=dict)


# -- the cluster ---------------------------------------------------------------------------------
def _unwind(signum, frame) -> None:
    raise SystemExit(128 + signum)


def start_cluster(up_args: tuple[str, ...], logs: Path, timeout_s: float) -> tuple[subprocess.Popen, int]:
    """``baton up`` on a free port in its own process group; returns once it says it is ready.

    The cluster is in a session of its own, which a signal to this process does not reach; so from
    here SIGTERM unwinds this process like Ctrl-C (where SIGTERM still had its default action),
    and the caller's ``finally: stop_cluster(proc)`` stops the cluster instead of leaving it running."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _unwind)
    port = free_port()
    cmd = [*python_module("baton.cli"), "up", "--port", str(port), "--log-dir", str(logs)]
    proc = subprocess.Popen(
        [*cmd, *up_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    seen = []
    assert proc.stdout is not None
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "Baton is ready" in line:
                return proc, port
    except BaseException:  # a signal or Ctrl-C while it starts: it is in its own session, stop it
        stop_cluster(proc)
        raise
    stop_cluster(proc)
    tails = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))
    raise RuntimeError(f"baton up did not become ready:\n{''.join(seen)}\n{tails}")


def stop_cluster(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- metrics -------------------------------------------------------------------------------------
def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> ``{sample name{labels}: value}``, summed over the ``worker`` and
    ``model_name`` labels (one figure per metric and remaining labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rest = {k: v for k, v in s.labels.items() if k not in ("worker", "model_name")}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(rest.items())) + "}" if rest else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _mean_ms(d: dict[str, float], name: str, labels: str = "") -> float:
    """The mean of a summary, in ms; ``labels`` as ``scrape`` writes them (``{stage=received}``)."""
    count = d.get(f"{name}_count{labels}", 0.0)
    return 1e3 * d.get(f"{name}_sum{labels}", 0.0) / count if count else float("nan")


def per_token_figures(decode: dict[str, float], gateway: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step or per chunk from the metric deltas of one measured window."""
    steps = decode.get("baton:engine_steps_total", 0.0)

    def per_step(name: str) -> float:
        return 1e3 * decode.get(name, 0.0) / steps if steps else float("nan")

    step = per_step("baton:engine_step_seconds_total")
    forward = per_step("baton:engine_forward_seconds_total")
    detok = per_step("baton:engine_detokenize_seconds_total")
    return {
        "engine_step": step,
        "engine_forward_and_sampling": forward,
        "engine_detokenize": detok,
        "engine_rest_of_step": step - forward - detok,
        "worker_handoff_lag": _mean_ms(decode, "baton:stream_handoff_seconds"),
        "gateway_received_lag": _mean_ms(gateway, "baton:gateway_chunk_lag_seconds", "{stage=received}"),
        "gateway_written_lag": _mean_ms(gateway, "baton:gateway_chunk_lag_seconds", "{stage=written}"),
    }


def first_token_figures(
    prefill: dict[str, float], decode: dict[str, float], gateway: dict[str, float], requests: int
) -> dict[str, float]:
    """Milliseconds per request of what comes before the first token, outermost first: the
    gateway's TTFT (arrival to first token), the decode worker's (its ``Generate`` call to first
    token), and, when a prefill worker did the prompt, its engine steps, their forward passes, and
    the KV transfer."""
    ttft = "baton:time_to_first_token_seconds"
    return {
        "gateway_ttft": _mean_ms(gateway, ttft),
        "decode_worker_ttft": _mean_ms(decode, ttft),
        "prefill_worker_steps": 1e3 * prefill.get("baton:engine_step_seconds_total", 0.0) / requests,
        "prefill_worker_forward": 1e3 * prefill.get("baton:engine_forward_seconds_total", 0.0) / requests,
        "kv_transfer": _mean_ms(prefill, "baton:kv_transfer_seconds"),
    }


def _get(url: str, timeout: float = 10.0) -> str:
    import httpx

    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    return r.text


# -- the client ----------------------------------------------------------------------------------
def stream_one(client, base: str, model: str, prompt: list[int], output_len: int) -> StreamTiming:
    """One streamed completion on ``client`` (an ``httpx.Client``, made once: building one loads
    CA certificates, ~30 ms that no served token pays); TTFT and TPOT as ``vllm bench serve``
    defines them."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    start = time.perf_counter()
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the stream carried no tokens")
    tpot = (times[-1] - times[0]) / (output_len - 1) if output_len > 1 else 0.0
    return StreamTiming(times[0] - start, tpot, output_len)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


# -- the offline reference -----------------------------------------------------------------------
def offline_reference(input_len: int, output_len: int, runs: int, seed: int) -> dict[str, float]:
    """The engine alone: prefill of a fresh ``input_len``-token prompt (median), and batch-1 decode
    ms/token at that context, as ``baton bench latency`` measures it."""
    from baton.bench.offline import make_prompts
    from baton.common.llm import LLM, SamplingParams

    llm = LLM()
    llm.engine.warm_up()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill = []
    for prompt in make_prompts(runs, input_len, seed + 1000):
        t = time.perf_counter()
        llm.generate([prompt], one)
        prefill.append(time.perf_counter() - t)
    prompt = make_prompts(1, input_len, seed + 2000)

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    timed(4)  # caches the prompt: both timed runs below decode only
    t1, tn = timed(1), timed(output_len)
    return {
        "prefill_ms": 1e3 * statistics.median(prefill),
        "decode_ms_per_token": 1e3 * (tn - t1) / (output_len - 1),
    }


# -- the run -------------------------------------------------------------------------------------
def run(cfg: BreakdownConfig) -> Breakdown:
    out = Breakdown(config=asdict(cfg))
    rng = random.Random(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="baton-breakdown-") as logs:
        proc, port = start_cluster(cfg.up_args, Path(logs), cfg.ready_timeout_s)
        try:
            base = f"http://127.0.0.1:{port}"
            _measure(cfg, out, proc.pid, base, rng)
        finally:
            stop_cluster(proc)
    if cfg.offline:
        out.offline = offline_reference(cfg.input_len, cfg.output_len, cfg.runs, cfg.seed)
        out.bars = bars(out)
    return out


def _measure(cfg: BreakdownConfig, out: Breakdown, up_pid: int, base: str, rng: random.Random) -> None:
    import httpx

    with httpx.Client(timeout=600) as client:
        _measure_with(client, cfg, out, up_pid, base, rng)


def _measure_with(
    client, cfg: BreakdownConfig, out: Breakdown, up_pid: int, base: str, rng: random.Random
) -> None:
    pids = proc_stats.cluster_pids(up_pid)
    model = json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
    out.layout = json.loads(_get(f"{base}/workers"))["workers"]
    first = stream_one(client, base, model, _prompt(rng, cfg.input_len), 4)  # the first after ready
    time.sleep(1.0)  # let the warm-up request's tail (publishing, heartbeats) pass before idling
    a = {n: proc_stats.sample(p) for n, p in pids.items()}
    time.sleep(cfg.idle_s)
    out.idle = proc_stats.usage(a, {n: proc_stats.sample(p) for n, p in pids.items()}, cfg.idle_s)

    def metrics() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        workers = json.loads(_get(f"{base}/workers"))["workers"]
        by_role: dict[str, dict[str, float]] = {"decode": {}, "prefill": {}}
        for w in workers:
            into = by_role[w["role"]]
            for k, v in scrape(_get(w["metrics_url"])).items():
                into[k] = into.get(k, 0.0) + v
        return by_role["decode"], by_role["prefill"], scrape(_get(f"{base}/metrics"))

    dec0, pre0, gw0 = metrics()
    cpu0 = {n: proc_stats.sample(p) for n, p in pids.items()}
    client0, wall0 = time.process_time(), time.perf_counter()
    timings = [
        stream_one(client, base, model, _prompt(rng, cfg.input_len), cfg.output_len) for _ in range(cfg.runs)
    ]
    client1, wall1 = time.process_time(), time.perf_counter()
    cpu1 = {n: proc_stats.sample(p) for n, p in pids.items()}
    dec1, pre1, gw1 = metrics()

    tokens = sum(t.tokens for t in timings)
    out.streams = [asdict(t) for t in timings]
    out.per_token_ms = {
        "client_tpot": 1e3 * statistics.median(t.tpot_s for t in timings),
        "client_ttft": 1e3 * statistics.median(t.ttft_s for t in timings),
        "client_ttft_first_request": 1e3 * first.ttft_s,
        **per_token_figures(delta(dec0, dec1), delta(gw0, gw1)),
    }
    out.first_token_ms = first_token_figures(
        delta(pre0, pre1), delta(dec0, dec1), delta(gw0, gw1), len(timings)
    )
    busy = proc_stats.usage(cpu0, cpu1, wall1 - wall0)
    out.cpu_ms_per_token = {n: 1e3 * u["cpu_s"] / tokens for n, u in busy.items()}
    out.cpu_ms_per_token["client"] = 1e3 * (client1 - client0) / tokens


def bars(b: Breakdown) -> dict[str, float | bool]:
    """Issue 9's bars: served TPOT within 1.1x offline decode, TTFT within 1.2x offline prefill
    plus 20 ms."""
    tpot, ttft = b.per_token_ms["client_tpot"], b.per_token_ms["client_ttft"]
    decode, prefill = b.offline["decode_ms_per_token"], b.offline["prefill_ms"]
    return {
        "tpot_over_offline": tpot / decode,
        "tpot_bar_met": tpot <= 1.1 * decode,
        "ttft_bar_ms": 1.2 * prefill + 20.0,
        "ttft_bar_met": ttft <= 1.2 * prefill + 20.0,
    }


def format_table(b: Breakdown) -> str:
    lines = ["Layout: " + "; ".join(_describe(w) for w in b.layout)]
    lines.append(f"{'per served token (ms)':<36}{'':>10}")
    for name, value in b.per_token_ms.items():
        lines.append(f"  {name:<34}{value:>10.2f}")
    lines.append("per request, before the first token (ms)")
    for name, value in b.first_token_ms.items():
        lines.append(f"  {name:<34}{value:>10.2f}")
    lines.append(f"{'CPU per token (ms) / idle':<36}{'busy':>10}{'idle %':>10}{'wakeups/s':>11}")
    for name, value in b.cpu_ms_per_token.items():
        idle = b.idle.get(name, {})
        lines.append(
            f"  {name:<34}{value:>10.2f}{idle.get('cpu_percent', float('nan')):>10.1f}"
            f"{idle.get('wakeups_per_s', float('nan')):>11.0f}"
        )
    if b.offline:
        lines.append(
            f"offline: prefill {b.offline['prefill_ms']:.0f} ms, decode "
            f"{b.offline['decode_ms_per_token']:.2f} ms/token"
        )
        r = b.bars
        lines.append(
            f"bars: TPOT {r['tpot_over_offline']:.2f}x offline (<= 1.1: {'pass' if r['tpot_bar_met'] else 'FAIL'}), "
            f"TTFT {b.per_token_ms['client_ttft']:.0f} ms (<= {r['ttft_bar_ms']:.0f}: "
            f"{'pass' if r['ttft_bar_met'] else 'FAIL'})"
        )
    return "\n".join(lines)


def _describe(worker: dict) -> str:
    settings = worker.get("settings") or {}
    extra = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    return f"{worker['role']} {worker['id']}" + (f" ({extra})" if extra else "")


# -- the command ---------------------------------------------------------------------------------
def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("breakdown", help="where a served token's time goes (starts baton up)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="requests, one at a time")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds the idle cluster is watched")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-offline", action="store_true", help="skip the offline reference")
    p.add_argument("--output-json", default=None)
    p.add_argument("up_args", nargs=argparse.REMAINDER, help="-- then flags for baton up")
    p.set_defaults(func=cmd_breakdown)


def cmd_breakdown(a: argparse.Namespace) -> int:
    up_args = tuple(x for x in a.up_args if x != "--")
    if a.runs < 1 or a.output_len < 2 or a.input_len < 1:
        print("error: --runs, --input-len must be >= 1 and --output-len >= 2", file=sys.stderr)
        return 2
    cfg = BreakdownConfig(a.input_len, a.output_len, a.runs, a.idle_s, a.seed, up_args, not a.no_offline)
    try:
        result = run(cfg)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0
