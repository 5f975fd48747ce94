"""Structured outputs across a cluster (issue 13, part 6): a real Redis, a gateway, a prefill worker
and two decode workers as real processes (UCX between them), a tiny random Llama. A structured
request's first token comes from the prefill worker, masked there by the grammar, with its KV
crossed to the decode worker; a structured stream whose decode worker is killed (-9) mid-stream is
migrated to the other, which replays the grammar from the tokens already sent: the stream goes on
token-identical to the unfaulted run and its text still matches the grammar.

The grammar is a regex of 50 groups of three digits joined by ``-``: a random model's unmasked
first token is almost never a digit, a stream is ~200 tokens long (long enough to be killed in the
middle), and a grammar restarted from scratch after the migration would not match the whole."""

from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.gateway.app import GatewayConfig

from .fault_cluster import GatewayThread, WorkerProcess, metric, tiny_model, wait_for

pytestmark = pytest.mark.slow

REGEX = r"([0-9]{3}-){49}[0-9]{3}"
MAX_TOKENS = 240
# Each prompt is over 32 tokens (the decode workers' remote prefill threshold) and unlike the others.
PROMPTS = [
    f"Order {i}: write the tracking number of parcel {i} of the spring shipment, in groups of three "
    f"digits joined by dashes, as printed on the label of box {i} in the warehouse at dock {i}:"
    for i in range(4)
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_model()
    logs = tmp_path_factory.mktemp("structured-cluster")
    redis = EmbeddedRedis()
    url = redis.start()
    procs: dict[str, WorkerProcess] = {}
    gateway = None
    try:
        # All at once: a decode worker connects to a prefill worker once it is registered.
        procs["prefill"] = WorkerProcess("prefill", model, url, logs)
        for name in ("decode-a", "decode-b"):
            procs[name] = WorkerProcess("decode", model, url, logs, "--worker-id", name)
        for p in procs.values():
            p.wait_ready()
        config = GatewayConfig(
            port=free_port(),
            model=str(model),
            redis_url=url,
            log_level="warning",
            stream_progress_timeout_s=3.0,
        )
        gateway = GatewayThread(config)
        wait_for(lambda: _decode_workers_connected(gateway.url) == 2, 120, "two decode workers, connected")
        yield {"gateway": gateway, "procs": procs}
    finally:
        if gateway is not None:
            gateway.stop()
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.terminate()  # all at once, then each waited for
        for p in procs.values():
            p.stop()
        redis.stop()


def _decode_workers_connected(base: str) -> int:
    try:
        found = httpx.get(f"{base}/workers", timeout=2).json()["workers"]
    except (httpx.HTTPError, KeyError, ValueError):
        return 0
    return sum(1 for w in found if w["role"] == "decode" and w["load"].get("prefill_connected"))


def _body(prompt: str, stream: bool) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "guided_regex": REGEX,
        "stream": stream,
        "return_token_ids": True,
    }


@pytest.fixture(scope="module")
def reference(cluster):
    """The unfaulted run of each prompt: token ids, text and usage (the first run of each prompt,
    so none is in a decode worker's prefix cache and every one is prefilled remotely)."""
    base = cluster["gateway"].url

    def run(prompt: str) -> tuple:
        r = httpx.post(f"{base}/v1/completions", json=_body(prompt, False), timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"], r.json()["usage"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(run, PROMPTS))


def test_a_structured_first_token_from_the_prefill_worker_follows_the_grammar(cluster, reference):
    prefill = cluster["procs"]["prefill"]
    for ids, text, finish, usage in reference:
        assert usage.get("kv_transfer_bytes", 0) > 0, usage  # prefilled there, its KV came over UCX
        assert re.fullmatch(REGEX, text), text
        assert finish == "stop" and len(ids) < MAX_TOKENS
    # The prefill worker sampled each first token under the grammar (a digit, not the model's pick).
    assert metric(prefill.metrics_url, "baton:structured_output_sampled_tokens_total") >= len(PROMPTS)
    assert metric(prefill.metrics_url, "baton:kv_transfer_bytes_total") > 0


class Stream:
    """One streamed completion, read on its own thread."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.error: dict | None = None
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
                    self.error = event["error"]
                    continue
                choice = event["choices"][0]
                self.token_ids += choice.get("token_ids") or []
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        return self


def _migrations(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton:request_migrations_total{")
    )


def test_a_structured_stream_survives_its_decode_worker_killed_mid_stream(cluster, reference):
    base, procs = cluster["gateway"].url, cluster["procs"]
    before = _migrations(base)
    streams = [Stream() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(s.run, base, p) for s, p in zip(streams, PROMPTS)]
        deadline = time.monotonic() + 120
        while not all(len(s.token_ids) >= 5 for s in streams):
            assert time.monotonic() < deadline, (
                f"streams did not start: {[len(s.token_ids) for s in streams]}"
            )
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            time.sleep(0.01)
        sent = [len(s.token_ids) for s in streams]
        # The router spreads streams by load and cached prefixes: kill a decode worker that holds one.
        victim = max(
            (procs["decode-a"], procs["decode-b"]),
            key=lambda p: metric(p.metrics_url, "baton:num_requests_running"),
        )
        victim.signal(signal.SIGKILL)
        for f in futures:
            f.result(timeout=120)
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert _migrations(base) - before >= 1, "no stream was on the killed worker"
    assert all(n < len(ids) for n, (ids, *_) in zip(sent, reference)), "a stream ended before the kill"
    for s, (ids, text, finish, _) in zip(streams, reference):
        assert s.error is None and s.done, s.error
        assert s.token_ids == ids  # nothing lost or repeated; resumed under the replayed grammar
        assert s.text == text and re.fullmatch(REGEX, s.text), s.text
        assert s.finish_reason == finish == "stop"
