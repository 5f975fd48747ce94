"""Emulated workers (issue 30 part 5): the real gateway, Redis, and 16 workers as real processes
(4 prefill, 12 decode), each running no model but the real services and engine books, its steps
timed from a profile. Completions go through the gateway with the OpenAI client; the KV of every
long prompt crosses from a prefill worker to a decode worker over UCX (small blocks); the requests
spread over the decode workers; a decode-only request lasts what the profile says; every worker
says it is emulated."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.planner.profile import EngineShape, Linear, Machine, Profile
from tests.procs import die_with_parent

MODEL = "SmolLM2-135M-Instruct"
NUM_PREFILL, NUM_DECODE = 4, 12
PROFILE = Profile(
    machine=Machine(cpu="emulated test machine", isa="avx2", cores=1),
    engine=EngineShape(
        model=MODEL,
        dtype="bfloat16",
        quantization=None,
        kv_cache_dtype="auto",
        tensor_parallel_size=1,
        block_size=16,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        kv_capacity_tokens=8192,
    ),
    # Steps long enough that the modelled time, not 16 processes' bookkeeping on 2 cores, sets the pace.
    prefill=Linear(20.0, 0.05, 0.0),
    decode=Linear(40.0, 0.5, 0.0001),
    transfer={"ucx": Linear(5.0, 0.01)},
    gateway_ms=1.0,
    taken_at="2026-01-01T00:00:00Z",
)


def _metrics(url: str) -> dict[str, float]:
    """A worker's Prometheus samples by name (labels dropped; one series per name here)."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_:]+)(?:\{[^}]*\})? (\S+)$", body, re.M)}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


class EmulatedCluster:
    """Redis in this process's child, the gateway and the workers each a ``baton`` process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.profile = folder / "profile.json"
        PROFILE.save(self.profile)
        self.redis = EmbeddedRedis()
        self.redis_url = self.redis.start()
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics: dict[str, str] = {}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def spawn(self, name: str, args: list[str]) -> None:
        with open(self.folder / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "baton.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in os.environ.items() if k != "REDIS_URL"},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def start(self) -> None:
        for role, count in (("prefill", NUM_PREFILL), ("decode", NUM_DECODE)):
            for i in range(count):
                name = f"{role}-{i}"  # metrics and gRPC on ports of the kernel's pick (0)
                args = [role, "--emulate", str(self.profile), "--redis-url", self.redis_url]
                self.spawn(name, [*args, "--worker-id", name])
        gateway = ["gateway", "--port", str(self.port), "--redis-url", self.redis_url]
        self.spawn("gateway", [*gateway, "--expect-prefill", str(NUM_PREFILL)])

    def wait_connected(self, timeout_s: float = 400.0) -> list[dict]:
        """Until the gateway lists every worker and each decode worker is connected to every
        prefill worker; returns the gateway's ``/workers``."""
        deadline, seen = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"exited: {dead}\n{self.log(next(iter(dead)))}"
            try:
                seen = httpx.get(f"{self.base}/workers", timeout=5).json()["workers"]
            except (httpx.HTTPError, KeyError, ValueError):
                seen = []
            decode = [w for w in seen if w["role"] == "decode"]
            if len(seen) == NUM_PREFILL + NUM_DECODE and all(
                w["load"].get("prefill_connected", 0) >= NUM_PREFILL for w in decode
            ):
                self.metrics = {w["id"]: w["metrics_url"] for w in seen}  # as each registered
                return seen
            time.sleep(0.5)
        pytest.fail(
            f"the emulated cluster was not connected after {timeout_s:.0f} s; saw {len(seen)} workers"
        )

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM to all (workers drain), SIGKILL whatever is left after 30 s; then Redis."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EmulatedCluster(tmp_path_factory.mktemp("emulated"))
    started = time.monotonic()
    try:
        c.start()
        c.workers = c.wait_connected()
        c.start_s = time.monotonic() - started
        yield c
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.procs.values())


def _client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt(i: int) -> str:
    """~200 tokens, its own from the first word: past the remote-prefill threshold, no shared prefix."""
    return f"Request {i} of the emulated burst. " + " ".join(f"word{i}x{j}" for j in range(60))


@pytest.mark.slow
def test_emulated_workers_serve_through_the_real_gateway(cluster):
    print(f"\n{NUM_PREFILL + NUM_DECODE} emulated workers connected in {cluster.start_s:.1f} s")
    rss = {name: _rss_mib(p.pid) for name, p in cluster.procs.items() if name != "gateway"}
    print(f"worker RSS MiB: min {min(rss.values()):.0f}, max {max(rss.values()):.0f}")
    assert max(rss.values()) < 1024, rss

    # Labelled: the registry records (through the gateway) and every worker's metrics.
    assert all(w["settings"].get("emulated") == str(cluster.profile) for w in cluster.workers)
    before = {name: _metrics(url) for name, url in cluster.metrics.items()}
    assert all(m["baton:emulated"] == 1.0 for m in before.values())
    assert all(m["baton:num_blocks"] == 8192 // 16 for m in before.values())

    client = _client(cluster.base)
    max_tokens = 12
    with ThreadPoolExecutor(24) as pool:
        done = list(
            pool.map(
                lambda i: client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=max_tokens),
                range(48),
            )
        )
    assert all(r.usage.completion_tokens == max_tokens for r in done)
    assert all(r.choices[0].finish_reason == "length" and r.choices[0].text for r in done)

    after = {name: _metrics(url) for name, url in cluster.metrics.items()}

    def rose(name: str, metric: str) -> float:
        return after[name].get(metric, 0.0) - before[name].get(metric, 0.0)

    decode = [f"decode-{i}" for i in range(NUM_DECODE)]
    prefill = [f"prefill-{i}" for i in range(NUM_PREFILL)]
    # KV crossed: prefill workers computed the prompts and sent their blocks; decode workers received.
    assert sum(rose(n, "baton:prompt_tokens_computed_total") for n in prefill) >= 48 * 150
    assert all(rose(n, "baton:kv_transfer_bytes_total") > 0 for n in prefill)
    assert sum(rose(n, "baton:kv_transfer_bytes_total") for n in decode) > 0
    served = [n for n in decode if rose(n, "baton:generation_tokens_total") > 0]
    assert len(served) >= NUM_DECODE // 2, f"48 requests reached only {served}"


@pytest.mark.slow
def test_a_decode_only_request_takes_the_profiles_time(cluster):
    """A prompt under the remote-prefill threshold, prefilled where it decodes: one prefill step,
    then a decode step per token after the first, each ~``decode_ms(1, context)``."""
    client = _client(cluster.base)
    k = 30
    start = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="Count slowly.", max_tokens=k)
    took_ms = (time.monotonic() - start) * 1000
    n = r.usage.prompt_tokens
    assert r.usage.completion_tokens == k and n < 32
    predicted = PROFILE.prefill_ms([(n, 0)]) + sum(PROFILE.decode_ms(1, n + i) for i in range(1, k))
    print(f"\ndecode-only request: {took_ms:.0f} ms, the profile predicts {predicted:.0f} ms")
    assert 0.8 * predicted <= took_ms <= 3 * predicted


def test_the_emulated_engine_keeps_the_profiles_shape_and_real_books(tmp_path):
    """In this process: the profile's block count, chunk and batch; outputs of exactly max_tokens
    stand-in tokens; a prompt sharing a prefix hits the real prefix cache; a profile of another
    model is refused, and so is the offline engine factory."""
    from dataclasses import replace

    from baton.common.engine.config import EngineConfig
    from baton.common.engine.sampling_params import SamplingParams
    from baton.common.parallel.engine_factory import create_engine
    from baton.services.emulated import create_emulated_engine, emulated_config

    path = tmp_path / "profile.json"
    PROFILE.save(path)
    config = emulated_config(EngineConfig(emulate=str(path), max_num_seqs=8))
    assert (config.block_size, config.max_num_batched_tokens, config.max_num_seqs) == (16, 512, 8)
    engine = create_emulated_engine(config)
    assert engine.pool.num_blocks == 8192 // 16 and engine.kv_cache.shape[0] == 8192 // 16 + 1
    prompt = list(range(1000, 1064))
    outputs = []
    for rid, tail in (("a", [7, 8]), ("b", [9])):
        engine.add_request(rid, prompt + tail, SamplingParams(max_tokens=5, temperature=0))
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
    assert outputs[1].num_cached_tokens == 64  # the 4 blocks the first prompt cached
    engine.pool.check_integrity()
    assert engine.runner.modelled_seconds_total > 0

    other = replace(PROFILE, engine=replace(PROFILE.engine, model="another-model"))
    other.save(path)
    with pytest.raises(ValueError, match="another-model"):
        create_emulated_engine(config)
    with pytest.raises(ValueError, match="emulate"):
        create_engine(config)


def test_baton_up_emulate_needs_the_layout_given(tmp_path, capsys):
    """The machine's probe says nothing of emulated workers: without --layout, --plan, --prefill or
    --colocated ``baton up --emulate`` stops before starting anything, saying why."""
    from baton.cli.main import main

    path = tmp_path / "profile.json"
    PROFILE.save(path)
    assert main(["up", "--emulate", str(path), "--decode", "2"]) == 2
    assert "--emulate needs the workers given" in capsys.readouterr().err


def test_an_emulated_transfer_lasts_the_profiles_time_from_its_first_send():
    """``hold_transfer`` waits what the profile's transfer model leaves after the real (tiny) sends:
    all of it for a transfer that just started, nothing for one already longer than the model."""
    import asyncio

    from baton.services.emulated import hold_transfer

    model = PROFILE.transfer["ucx"]  # 5 + 0.01 ms a token: 205 ms for 20,000 tokens

    def held(started_ago_s: float, transfer=model) -> float:
        start = time.monotonic()
        asyncio.run(hold_transfer(transfer, 20_000, start - started_ago_s))
        return time.monotonic() - start

    assert held(0.0) >= 0.2
    assert held(10.0) < 0.2
    assert held(0.0, transfer=None) < 0.2  # a real worker: no model, no wait
