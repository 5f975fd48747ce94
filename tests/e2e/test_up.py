"""``baton up`` as a user runs it: a whole local cluster in real processes, driven by the official
``openai`` client, then stopped by SIGTERM with nothing left running."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from baton.common.llm import SamplingParams
from baton.services.procs import parse_cpu_list
from tests.e2e.up_process import start_up, stop_up


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``: ``baton up``'s services and Redis, each in its own process
    group (so that a terminal's Ctrl-C reaches only ``baton up``)."""
    out = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit():
            try:
                stat = (proc_dir / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(proc_dir.name))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-logs")
    port, proc = start_up(["--dtype", "float32", "--kv-cache-gib", "1"], logs)
    yield port, proc
    stop_up(proc)


def test_chat_and_completion_through_the_cluster(cluster, llm_fp32):
    import openai

    port, _ = cluster
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
    ref = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    assert chat.choices[0].message.content == ref.outputs[0].text
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    streamed = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ref.outputs[0].text
    plain = client.completions.create(
        model=model, prompt="The three laws of robotics are", temperature=0, max_tokens=12
    )
    stream = client.completions.create(
        model=model, prompt="The three laws of robotics are", temperature=0, max_tokens=12, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    offline = llm_fp32.generate(
        ["The three laws of robotics are"], SamplingParams(temperature=0, max_tokens=12)
    )
    assert text == plain.choices[0].text == offline[0].outputs[0].text


def test_the_layout_it_chose_is_printed_and_is_what_runs(cluster):
    """With no layout flags ``baton up`` decides from the machine; the decision is printed, and
    every worker's ``/workers`` settings say what it runs: the dtype asked for, and torch threads
    as many as its cores."""
    import httpx

    port, proc = cluster
    layout = next(line for line in proc.startup_lines if line.startswith("Layout: "))
    assert "core" in layout and "W2-like request" not in layout  # --dtype given: no dtype was chosen
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()["workers"]
    roles = sorted(w["role"] for w in workers)
    if "colocated" in layout:
        assert roles == ["decode"] and workers[0]["settings"]["colocated"] is True
    else:
        assert roles == ["decode", "prefill"] and "prefill worker" in layout
    for w in workers:
        s = w["settings"]
        assert s["dtype"] == "float32"
        assert s["threads"] == len(parse_cpu_list(s["cpus"])), s
        assert set(parse_cpu_list(s["cpus"])) <= os.sched_getaffinity(0)


def test_sigterm_stops_everything(cluster):
    _, proc = cluster
    children = _children(proc.pid)
    assert len(children) >= 3, children  # Redis, a decode worker and the gateway at least
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30

    def alive() -> bool:
        return _group_alive(proc.pid) or any(Path(f"/proc/{pid}").exists() for pid in children)

    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), "a process of the cluster outlived baton up"
