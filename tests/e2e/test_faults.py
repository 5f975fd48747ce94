"""Decode workers that die or hang mid-stream, as real processes behind a real gateway, Redis and a
prefill worker whose KV crosses to them over UCX: the gateway migrates each stream to another
decode worker, which resumes it from the tokens already sent, so every stream completes
token-identical to an unfaulted greedy run, with no gap and no repeat; the only worker left, hung
for a while, resumes its own streams; once it is dead, the client gets an error event and ``[DONE]``
within 5 s. The gateway's migration counter shows
the path was taken."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.serial]

PROGRESS_TIMEOUT_S = 3.0
# Long enough (>= 32 tokens) to be prefilled on the prefill worker.
PROMPTS = [
    "The history of the printing press began in the fifteenth century, when a goldsmith in Mainz "
    "put together movable metal type, oil-based ink and a wooden press. Its history",
    "Here is a recipe for bread that anyone can bake at home with flour, water, salt and yeast, "
    "and a little patience on a quiet Sunday morning. First,",
    "Ten facts about the moon, the only natural satellite of the earth and the fifth largest "
    "moon in the solar system, that every student should know: 1.",
    "A short Python function that sorts a list of integers with the quicksort algorithm, "
    "written clearly and with a docstring and comments:\n\ndef quicksort(xs):",
]
MAX_TOKENS = 40
PREFILL = "prefill-p"


class Cluster:
    """Redis, a gateway and decode workers, each its own process; workers come and go."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.redis = EmbeddedRedis()
        self.redis_url = self.redis.start()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.workers: dict[str, subprocess.Popen] = {}
        self.gateway = self._spawn(
            "gateway",
            [
                "gateway",
                "--port",
                str(self.port),
                "--redis-url",
                self.redis_url,
                "--stream-progress-timeout",
                str(PROGRESS_TIMEOUT_S),
            ],
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child's
        return subprocess.Popen(
            [sys.executable, "-m", "baton.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "REDIS_URL"},
        )

    def start_worker(self, name: str, role: str = "decode") -> None:
        args = [role, "--redis-url", self.redis_url, "--dtype", "float32", "--kv-cache-gib", "1"]
        self.workers[name] = self._spawn(name, [*args, "--worker-id", name])

    def wait_workers(self, names: set[str], timeout: float = 300.0) -> None:
        """Until the gateway's registry lists exactly ``names`` as decode workers, each connected
        to the prefill worker."""
        deadline, seen = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            for name in {*names, PREFILL}:
                code = self.workers[name].poll()
                assert code is None, f"{name} exited with {code}: {self.log(name)}"
            try:
                found = httpx.get(f"{self.base}/workers", timeout=2).json()["workers"]
                decode = [w for w in found if w["role"] == "decode"]
                seen = {w["id"]: w["load"].get("prefill_connected") for w in decode}
                if set(seen) == names and all(seen.values()):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        pytest.fail(f"decode workers {sorted(names)} not registered after {timeout:.0f} s; saw {seen}")

    def signal(self, name: str, sig: int) -> None:
        self.workers[name].send_signal(sig)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def migrations(self) -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("baton:request_migrations_total{")
        )

    def stop(self) -> None:
        procs = [self.gateway, *self.workers.values()]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in procs:
            p.wait(30)
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("faults"))
    try:
        c.start_worker(PREFILL, "prefill")
        c.start_worker("decode-a")
        c.start_worker("decode-b")
        c.wait_workers({"decode-a", "decode-b"})
        yield c
    finally:
        c.stop()


def _body(prompt: str, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


def _reference(cluster: Cluster, crossed: bool = False) -> list[tuple[list[int], str]]:
    """The unfaulted run of PROMPTS: token ids and text. With ``crossed``, check that every prompt
    was prefilled on the prefill worker (later runs may hit a decode worker's prefix cache)."""
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{cluster.base}/v1/completions", json=_body(prompt, False), timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if crossed:
            assert r.json()["usage"].get("kv_transfer_bytes", 0) > 0  # its KV came over UCX
        out.append((choice["token_ids"], choice["text"]))
    return out


class Stream:
    """One streamed completion, read on its own thread: token ids, text, when each token came,
    an error event if one came, and whether ``[DONE]`` ended it."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.times: list[float] = []
        self.text = ""
        self.error: dict | None = None
        self.error_at: float | None = None
        self.done = False
        self.finish_reason: str | None = None

    def run(self, base: str, prompt: str) -> Stream:
        with httpx.stream("POST", f"{base}/v1/completions", json=_body(prompt, True), timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    self.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error, self.error_at = event["error"], time.monotonic()
                    continue
                choice = event["choices"][0]
                self.token_ids += choice.get("token_ids") or []
                self.times += [time.monotonic()] * len(choice.get("token_ids") or [])
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        return self


def _streams_until(cluster: Cluster, fault, min_tokens: int = 5) -> list[Stream]:
    """Stream PROMPTS at once; once every stream has ``min_tokens`` tokens, call ``fault()``."""
    streams = [Stream() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(s.run, cluster.base, p) for s, p in zip(streams, PROMPTS)]
        deadline = time.monotonic() + 120
        while not all(len(s.token_ids) >= min_tokens for s in streams):
            assert time.monotonic() < deadline, (
                f"streams did not start: {[len(s.token_ids) for s in streams]}"
            )
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            time.sleep(0.02)
        fault()
        for f in futures:
            f.result(timeout=120)
    return streams


def _assert_complete_and_identical(streams: list[Stream], reference) -> None:
    for s, (ids, text) in zip(streams, reference):
        assert s.error is None, s.error
        assert s.done and s.finish_reason == "length"
        assert s.token_ids == ids  # nothing lost, nothing repeated, the same greedy tokens
        assert s.text == text


def _report(fault: str, streams: list[Stream], at: float) -> None:
    """What docs/reliability.md quotes (``pytest -s``): the longest silence a stream saw, from the
    fault to its next token."""
    waits = [next((t - at for t in s.times if t > at), float("nan")) for s in streams]
    print(f"\n{fault}: first token after the fault within {max(waits):.2f} s (streams: {len(streams)})")


def test_a_killed_decode_worker_loses_no_stream(cluster):
    reference = _reference(cluster, crossed=True)
    before = cluster.migrations()
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        cluster.signal("decode-a", signal.SIGKILL)

    streams = _streams_until(cluster, kill)
    _assert_complete_and_identical(streams, reference)
    assert cluster.migrations() - before >= 1  # the streams on decode-a moved to decode-b
    _report("kill -9 of a decode worker", streams, killed[0])
    assert cluster.workers["decode-a"].wait(10) == -signal.SIGKILL


def test_a_hung_decode_worker_is_migrated_within_the_progress_deadline(cluster):
    cluster.start_worker("decode-c")
    cluster.wait_workers({"decode-b", "decode-c"})  # decode-a's key has expired too
    reference = _reference(cluster)
    before = cluster.migrations()
    stopped: list[float] = []

    def hang() -> None:
        stopped.append(time.monotonic())
        cluster.signal("decode-b", signal.SIGSTOP)

    streams = _streams_until(cluster, hang)
    _assert_complete_and_identical(streams, reference)
    assert cluster.migrations() - before >= 1
    # The longest silence any stream saw: the progress deadline (or keepalive), plus the resume.
    gaps = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    assert max(gaps) < PROGRESS_TIMEOUT_S + 5.0, max(gaps)
    _report(f"SIGSTOP of a decode worker (progress deadline {PROGRESS_TIMEOUT_S} s)", streams, stopped[0])
    cluster.signal("decode-b", signal.SIGKILL)
    cluster.workers["decode-b"].wait(10)


def test_a_lone_decode_worker_that_hangs_and_comes_back_loses_no_stream(cluster):
    """The only decode worker stops answering past the progress deadline (a host starved of CPU, a
    keepalive answered late): each stream fails there, has no other worker to move to, and resumes
    on the same one once it answers again. CI's locust run lost chats this way."""
    cluster.wait_workers({"decode-c"})  # decode-b's key has expired
    reference = _reference(cluster)
    before = cluster.migrations()
    stopped: list[float] = []

    def hang_until_noticed() -> None:
        stopped.append(time.monotonic())
        cluster.signal("decode-c", signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while cluster.migrations() == before:  # the gateway saw a stream fail
                assert time.monotonic() < deadline, "no stream failed within 30 s of SIGSTOP"
                time.sleep(0.05)
        finally:
            cluster.signal("decode-c", signal.SIGCONT)

    streams = _streams_until(cluster, hang_until_noticed)
    _assert_complete_and_identical(streams, reference)
    assert cluster.migrations() - before >= 1
    _report("SIGSTOP of the only decode worker until a stream failed there", streams, stopped[0])


def test_without_another_worker_the_client_gets_an_error_event_within_5_s(cluster):
    cluster.wait_workers({"decode-c"})
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        cluster.signal("decode-c", signal.SIGKILL)

    streams = _streams_until(cluster, kill)
    for s in streams:
        assert s.done  # the stream ends: an error event, then [DONE]
        assert s.error is not None and s.error["code"] == "no_decode_worker", s.error
        assert s.error_at - killed[0] < 5.0
        assert len(s.token_ids) < MAX_TOKENS
    slowest = max(s.error_at - killed[0] for s in streams if s.error_at is not None)
    print(f"\nkill -9 of the last decode worker: error event within {slowest:.2f} s")
    r = httpx.post(f"{cluster.base}/v1/completions", json=_body(PROMPTS[0], False), timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_worker"
