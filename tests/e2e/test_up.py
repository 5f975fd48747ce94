"""``baton up`` as a user runs it: a whole local cluster in real processes, driven by the official
``openai`` client, then stopped by SIGTERM with nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from baton.common.index.server import free_port
from baton.common.llm import SamplingParams


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("up-logs")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.services.cli", "up", "--port", str(port), "--dtype", "float32",
         "--kv-cache-gib", "1", "--log-dir", str(logs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: we can check that nothing outlives it
    )  # fmt: skip
    deadline = time.monotonic() + 300
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Baton is ready" in line:
            break
    if not any("Baton is ready" in line for line in lines):
        proc.kill()
        logs_text = "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
        pytest.fail(f"baton up did not become ready:\n{''.join(lines)}\n{logs_text}")
    yield port, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_chat_and_completion_through_the_cluster(cluster, llm_fp32):
    import openai

    port, _ = cluster
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
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


def test_sigterm_stops_everything(cluster):
    _, proc = cluster
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a process of the cluster outlived baton up"
