"""`docker compose up` for real: compose.yaml on the distribution's Docker engine with Baton's image.

One project for the module, brought up as compose.yaml says (the images that cannot be pulled here
swapped by compose.override.yaml, each worker's KV cache at 1 GiB so that five fit beside the
suite). Then, through the gateway's port published on 127.0.0.1 and the official `openai` client:
chat, stream and completion with the KV crossing between containers; more prefill and decode
containers that serve; a decode container killed under 8 streams and the streams finished on
another, token for token; `compose stop decode` draining; a Redis restart that costs no request;
and the monitoring profile's Prometheus with every target up and every dashboard query answered.
`make compose-test` runs it after tests/containers/host.sh has made the engine and the images.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import os
import re
import threading
import time
import urllib.parse
import urllib.request

import openai
import pytest

from tests.containers.compose_project import (
    ROOT,
    Project,
    docker,
    engine_or_skip,
    free_port,
    run,
    total,
    wait_for,
)

pytestmark = pytest.mark.containers

PROMPTS = [
    f"Write a short story about a {thing} who learns to cook, in plain words. " * 3
    for thing in ("robot", "cat", "lighthouse keeper", "river", "child", "baker", "mountain", "clock")
]
"""Each over the 32 tokens past which the decode worker asks a prefill worker for its KV."""
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def project():
    engine_or_skip()
    p = Project(f"baton-test-{os.getpid()}", free_port())
    p.env = {
        "BATON_PORT": str(p.port),
        "PROMETHEUS_PORT": str(free_port()),
        "GRAFANA_PORT": str(free_port()),
        "KV_CACHE_GIB": "1",
        # fp32: greedy tokens that do not depend on the batch a request shares, so a stream resumed
        # on another worker, in another batch, can be compared token for token (bf16 cannot).
        "DTYPE": "float32",
    }
    try:
        p.up()
        yield p
    finally:
        p.down()


@pytest.fixture(scope="module")
def client(project) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{project.port}/v1", api_key="none", max_retries=0, timeout=300
    )


def complete(client: openai.OpenAI, prompt: str, on_piece=lambda: None) -> tuple[str, int]:
    """One greedy completion streamed to its end: (text, completion tokens); ``on_piece()`` after
    each piece of text."""
    text, tokens = [], 0
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            on_piece()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens


@pytest.fixture(scope="module")
def unfaulted(client) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy completion on the cluster as it came up, nothing faulted."""
    return {prompt: complete(client, prompt) for prompt in PROMPTS}


def kv_received(project: Project) -> float:
    return sum(
        total(project.metrics(c), "baton:kv_transfer_bytes_total") for c in project.containers("decode")
    )


def test_chat_stream_and_completion_with_the_kv_crossing_between_containers(project, client):
    before = kv_received(project)
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    assert (chat.usage.model_extra or {}).get("kv_transfer_bytes", 0) > 0, (
        "the chat's KV did not come from a prefill worker"
    )
    pieces = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=16,
            stream=True,
        )
    )
    assert len([p for p in pieces if p.choices and p.choices[0].delta.content]) > 1
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    text = (
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[2], max_tokens=8)
        .choices[0]
        .text
    )
    assert text
    assert kv_received(project) > before, "no decode container's metrics saw KV arrive"


def test_more_prefill_and_decode_containers_join_and_serve(project, client):
    before = {
        c: total(project.metrics(c), "baton:kv_transfer_bytes_total") for c in project.containers("decode")
    }
    project.up("--scale", "prefill=2", "--scale", "decode=3")
    prefills, decodes = project.containers("prefill"), project.containers("decode")
    assert (len(prefills), len(decodes)) == (2, 3)
    wait_for("the gateway to list 2 prefill and 3 decode workers", lambda: roles(project) == (2, 3), 120)
    new_decode, new_prefill = decodes[-1], prefills[-1]
    assert new_decode not in before

    def sent(container: str) -> float:
        return total(project.metrics(container), "baton:kv_transfer_bytes_total")

    # Concurrent prompts until each new container has done its part (bounded rounds).
    with futures.ThreadPoolExecutor(8) as pool:
        for _ in range(6):
            list(pool.map(lambda p: complete(client, p), [f"{p} Round {time.monotonic()}." for p in PROMPTS]))
            if sent(new_prefill) > 0 and sent(new_decode) > 0:
                break
    assert sent(new_prefill) > 0, "the new prefill container never sent KV"
    assert sent(new_decode) > 0, "the new decode container never received KV"
    project.up("--scale", "prefill=1", "--scale", "decode=2")  # back to compose.yaml's own counts
    assert (len(project.containers("prefill")), len(project.containers("decode"))) == (1, 2)


def roles(project: Project) -> tuple[int, int]:
    """(prefill, decode) workers the gateway's router lists."""
    found = [w["role"] for w in project.gateway("/workers")["workers"]]
    return found.count("prefill"), found.count("decode")


def busiest_decode(project: Project) -> tuple[str, float]:
    loads = {c: total(project.metrics(c), "baton:num_requests_running") for c in project.containers("decode")}
    return max(loads.items(), key=lambda kv: kv[1])


def stream_all(client, prompts, started: threading.Event | None = None, after: int = 4):
    """Stream every prompt at once; set ``started`` once each has ``after`` pieces."""
    counts = {p: 0 for p in prompts}
    lock = threading.Lock()

    def counted(prompt: str) -> None:
        with lock:
            counts[prompt] += 1
            if started and all(n >= after for n in counts.values()):
                started.set()

    def one(prompt: str) -> tuple[str, int]:
        return complete(client, prompt, lambda: counted(prompt))

    pool = futures.ThreadPoolExecutor(len(prompts))
    return pool, {p: pool.submit(one, p) for p in prompts}


def test_a_killed_decode_container_loses_no_stream(project, client, unfaulted):
    started = threading.Event()
    pool, jobs = stream_all(client, PROMPTS, started)
    try:
        assert started.wait(300), "the 8 streams did not all start"
        victim, running = busiest_decode(project)
        assert running > 0, "no decode container held a stream when it was to be killed"
        run([docker(), "kill", victim], 60)
        got = {p: j.result(timeout=600) for p, j in jobs.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert got == unfaulted, "a stream resumed on another decode container differs from the unfaulted run"
    project.up()  # the killed container back (restart: unless-stopped, or up again)


def test_compose_stop_decode_drains_what_it_holds(project, client, unfaulted):
    started = threading.Event()
    prompts = PROMPTS[:2]  # one a worker: done well within the drain timeout on two busy cores
    pool, jobs = stream_all(client, prompts, started, after=2)
    try:
        assert started.wait(300), "the streams did not all start"
        began = time.monotonic()
        project.compose("stop", "--timeout", "40", "decode", timeout=120)
        try:
            got = {p: j.result(timeout=120) for p, j in jobs.items()}
        except openai.APIError as e:
            raise AssertionError(
                f"a stream failed {time.monotonic() - began:.1f} s into the stop: {e}\n{project.logs(80)}"
            ) from e
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert got == {p: unfaulted[p] for p in prompts}, "a draining decode container cut a stream short"
    project.up()


def test_a_redis_restart_costs_no_request(project, client, unfaulted):
    results: dict[str, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def traffic() -> None:
        for prompt in PROMPTS:
            try:
                results[prompt] = complete(client, prompt)
            except BaseException as e:  # noqa: BLE001 - counted and asserted below
                errors.append(e)

    worker = threading.Thread(target=traffic)
    worker.start()
    project.compose("restart", "redis", timeout=120)
    worker.join(600)
    assert not worker.is_alive(), "requests still running 10 minutes after Redis restarted"
    assert not errors, errors
    assert results == unfaulted
    wait_for(
        "every worker registered again in the restarted Redis",
        lambda: roles(project) == (1, 2),
        60,
    )


def test_monitoring_profile_scrapes_every_target_and_answers_every_dashboard_query(project, client):
    project.up("prometheus", "redis-exporter", "--no-deps")
    prom = f"http://127.0.0.1:{project.env['PROMETHEUS_PORT']}"

    def get(path: str) -> dict:
        with urllib.request.urlopen(prom + path, timeout=10) as r:
            return json.loads(r.read())

    def targets_up():
        active = get("/api/v1/targets")["data"]["activeTargets"]
        jobs = {t["labels"]["job"] for t in active}
        down = [(t["labels"]["job"], t["health"], t.get("lastError")) for t in active if t["health"] != "up"]
        return not down and {"gateway", "prefill", "decode", "redis", "prometheus"} <= jobs and active

    wait_for("Prometheus to see every target up", targets_up, 180, 2)
    # Traffic for the rate() panels, then each query as Grafana would send it.
    for prompt in PROMPTS[:4]:
        complete(client, prompt)
    dashboard = json.loads((ROOT / "deploy/monitoring/grafana/dashboards/baton.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries = [re.sub(r"\$__(rate_interval|interval|range)", "2m", q) for q in queries]
    assert queries

    def answered(q: str) -> list:
        return get("/api/v1/query?query=" + urllib.parse.quote(q))["data"]["result"]

    def all_answered() -> bool:
        missing = [q for q in queries if not answered(q)]
        if missing:
            raise AssertionError(f"no data for {missing}")
        return True

    wait_for("every dashboard query to return data", all_answered, 120, 5)
