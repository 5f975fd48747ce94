"""``baton up --autoscale`` with real workers: load makes it start a second decode worker (1 -> 2),
which registers and serves; when the load stops it retires one, which drains. Every stream in flight
across both steps completes with the tokens an unfaulted run gives (greedy).

The profile is written for the test: one worker serves ~0.5 req/s within its SLO, so any real load
asks for the most (2); with no arrivals the fewest (1) is enough. A tiny random Llama in float32,
one torch thread a process, a colocated layout (decode workers that prefill)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from baton.planner.profile import Linear
from tests.e2e.fault_cluster import wait_for
from tests.e2e.tiny_llama import write_tiny_llama
from tests.e2e.up_process import start_up, stop_up
from tests.planner_profiles import synthetic_profile

pytestmark = [pytest.mark.slow]

PROMPTS = [[11, 200, 3000, 45, 9], [700, 701, 702, 703, 704, 705], list(range(100, 140))]
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-gib", "0.05", "--max-num-batched-tokens", "256"]
ENGINE_FLAGS += ["--max-num-seqs", "8"]
SHORT, PACE = 24, 256
LONG_S, LONG_MIN, LONG_MAX = 30.0, 1000, 4000
"""The long streams' length: ``LONG_S`` seconds of this host's pace (a ``PACE``-token stream alone,
timed), so that they outlast the scale-down's 3 quiet intervals (1 s each) and the cooldown's
10 s left on a fast host (2,500 tokens ended within them on a 2-core Xeon with AMX) without taking
minutes on a slow one (4,000 tokens, the tiny Llama's 4,096 positions less the prompt, ran ~200 s
on a busy 2-core Zen 3); the streams still in flight when the retirement starts are asserted."""


def _slow_profile(path: Path) -> str:
    """~0.5 req/s a worker at 24 output tokens within a 600 ms TPOT: 500 ms decode steps."""
    synthetic_profile(
        Linear(5.0, 0.01),
        Linear(500.0, 1.0),
        model="tiny",
        dtype="float32",
        max_num_batched_tokens=256,
        max_num_seqs=8,
        kv_capacity_tokens=50_000,
    ).save(path)
    return str(path)


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def _complete(base: str, body: dict) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _stream(base: str, body: dict) -> list[int]:
    """A streamed completion's token ids; an error event or a short stream fails it."""
    ids: list[int] = []
    with httpx.Client(timeout=300) as client:
        with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    ids += chunk["choices"][0].get("token_ids") or []
    return ids


def _workers(base: str) -> list[dict]:
    return httpx.get(f"{base}/workers", timeout=5).json()["workers"]


def _counter(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _generated(metrics_url: str) -> float:
    return _counter(metrics_url, "baton:generation_tokens_total")


class _Drain(threading.Thread):
    """Reads ``baton up``'s output so that its pipe never fills; the lines are kept."""

    def __init__(self, proc) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines = proc, list(proc.startup_lines)

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)


class _Load:
    """Clients streaming short greedy completions back to back until ``stop``; each result kept."""

    def __init__(self, base: str, model: str, clients: int, prompts: list[list[int]] = PROMPTS) -> None:
        self.base, self.model, self.stop, self.prompts = base, model, threading.Event(), prompts
        self.results: list[tuple[int, list[int]]] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            p = n % len(self.prompts)
            try:
                self.results.append((p, _stream(self.base, _body(self.model, self.prompts[p], SHORT))))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
                return
            n += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in self.threads), "a load client did not finish"


def test_load_adds_a_decode_worker_and_its_end_retires_one_by_draining(tmp_path, monkeypatch):
    model = write_tiny_llama(tmp_path / "tiny")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--model", str(model), "--colocated", *ENGINE_FLAGS, "--drain-timeout", "120"]
    args += [
        "--autoscale",
        "--profile",
        _slow_profile(tmp_path / "profile.json"),
        "--slo",
        "ttft:2000",
        "tpot:600",
    ]
    args += ["--autoscale-interval", "1", "--autoscale-cold-start", "10", "--autoscale-cooldown", "10"]
    args += ["--autoscale-min-colocated", "1", "--autoscale-max-colocated", "2"]
    port, proc = start_up(args, tmp_path / "logs")
    out = _Drain(proc)
    out.start()
    base, name = f"http://127.0.0.1:{port}", model.name
    try:
        assert len(_workers(base)) == 1
        reference = {i: _complete(base, _body(name, p, SHORT)) for i, p in enumerate(PROMPTS)}
        began = time.monotonic()
        assert len(_stream(base, _body(name, PROMPTS[0], PACE))) == PACE
        tokens_per_s = PACE / (time.monotonic() - began)
        long = min(LONG_MAX, max(LONG_MIN, round(LONG_S * tokens_per_s)))
        print(f"long streams: {long} tokens ({tokens_per_s:.0f} tokens/s alone)")
        # 1 -> 2 under load: streams run through the start and registration of the second worker.
        with _Load(base, name, clients=3) as load:
            two = wait_for(lambda: len(w := _workers(base)) == 2 and w, 180, "a second decode worker")
            wait_for(lambda: all(_generated(w["metrics_url"]) > 0 for w in two), 120, "both workers serving")
            served = len(load.results)
            wait_for(lambda: len(load.results) >= served + 6, 120, "streams after the step")
        assert not load.errors, load.errors
        assert all(tokens == reference[p] for p, tokens in load.results), "a stream's tokens differ"
        assert "autoscale: started decode-1" in out.text()
        # 2 -> 1 when arrivals stop: long streams on both workers are in flight through the retirement.
        long_results: dict[int, list[int]] = {}
        streams = [
            threading.Thread(
                target=lambda i=i: long_results.__setitem__(
                    i, _stream(base, _body(name, PROMPTS[i % 3], long))
                )
            )
            for i in range(4)
        ]
        for t in streams:
            t.start()
        wait_for(lambda: "autoscale: retiring decode-" in out.text(), 120, "a scale-down", every_s=0.2)
        assert any(t.is_alive() for t in streams), (
            "the streams ended before the scale-down: nothing was drained"
        )
        for t in streams:
            t.join(timeout=300)
        assert len(long_results) == 4 and all(len(v) == long for v in long_results.values())
        wait_for(lambda: len(_workers(base)) == 1, 60, "one worker left")
        wait_for(
            lambda: "retired: exited with code 0" in out.text(), 180, "the retired worker's exit", every_s=0.2
        )
        # the unfaulted run: one worker, the three prompts at once (greedy tokens do not depend on
        # the batch, which the load's streams above checked against references taken alone)
        with ThreadPoolExecutor(3) as pool:
            unfaulted = dict(enumerate(pool.map(lambda p: _complete(base, _body(name, p, long)), PROMPTS)))
        for i, tokens in long_results.items():
            assert tokens == unfaulted[i % 3], f"long stream {i} differs"
    finally:
        stop_up(proc)
        out.join(timeout=30)
        print("".join(line for line in out.lines if "autoscale" in line or "->" in line or "retire" in line))


PD_PROMPTS = [list(range(100 + 7 * i, 148 + 7 * i)) for i in range(3)]
"""48 tokens each: past the remote-prefill threshold, so the prefill worker computes every one."""


def test_load_adds_a_decode_worker_beside_the_prefill_pool_and_the_kv_crosses_into_it(tmp_path, monkeypatch):
    """``--layout 1p1d --autoscale``: the decode pool grows 1 -> 2 under load (the prefill pool held
    at 1); the new decode worker receives prompts' KV from the prefill worker, and every stream
    across the step has a single engine's tokens."""
    model = write_tiny_llama(tmp_path / "tiny")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--model", str(model), "--layout", "1p1d", *ENGINE_FLAGS, "--drain-timeout", "120"]
    args += ["--autoscale", "--profile", _slow_profile(tmp_path / "profile.json")]
    args += ["--slo", "ttft:2000", "tpot:600", "--autoscale-interval", "2", "--autoscale-cold-start", "10"]
    args += ["--autoscale-cooldown", "600", "--autoscale-min-prefill", "1", "--autoscale-max-prefill", "1"]
    args += ["--autoscale-min-decode", "1", "--autoscale-max-decode", "2"]
    port, proc = start_up(args, tmp_path / "logs")
    out = _Drain(proc)
    out.start()
    base, name = f"http://127.0.0.1:{port}", model.name
    kv = "baton:kv_transfer_bytes_total"
    try:
        assert sorted(w["role"] for w in _workers(base)) == ["decode", "prefill"]
        reference = {i: _complete(base, _body(name, p, SHORT)) for i, p in enumerate(PD_PROMPTS)}
        with _Load(base, name, clients=3, prompts=PD_PROMPTS) as load:
            two = wait_for(
                lambda: len(d := [w for w in _workers(base) if w["role"] == "decode"]) == 2 and d,
                180,
                "a second decode worker",
            )
            wait_for(
                lambda: all(_counter(w["metrics_url"], kv) > 0 for w in two),
                120,
                "KV into both decode workers",
            )
            served = len(load.results)
            wait_for(lambda: len(load.results) >= served + 6, 120, "streams after the step")
        assert not load.errors, load.errors
        assert all(tokens == reference[p] for p, tokens in load.results), "a stream's tokens differ"
        assert "autoscale: started decode-1" in out.text()
        assert [w["role"] for w in _workers(base)].count("prefill") == 1
    finally:
        stop_up(proc)
        out.join(timeout=30)
        print("".join(line for line in out.lines if "autoscale" in line or "->" in line))
