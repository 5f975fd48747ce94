"""``baton gateway`` serves without torch (issue 29). Started as its own process with torch made
unimportable, it answers ``/health``, tokenizes a chat, checks its output constraint (a spec that
cannot be a grammar is a 400 naming its field; a good one reaches routing: a 503, as no decode worker
is up) and shuts down cleanly. An import check alone (``tests/unit/test_pure_imports.py``) would not
see the paths a request takes: the tokenizer, the structured-output check.

With torch installed, whether the process imports it is what the gateway's memory pays for (about
200 MB): it does not (``common/model/source.load_tokenizer`` reads the cached tokenizer as the fast
tokenizer it is; ``AutoTokenizer`` would import torch to resolve its class)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.model.source import ModelSource, load_tokenizer
from baton.common.net import free_port
from tests.e2e.fault_cluster import wait_for

# The child reports at exit whether torch was imported (for the run where it is not blocked).
CHILD = """
import atexit, sys
if sys.argv.pop(1) == "blocked":
    sys.modules["torch"] = None  # every import of torch raises ImportError
atexit.register(lambda: print("torch imported:", sys.modules.get("torch") is not None, flush=True))
from baton.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
CHAT = [{"role": "user", "content": "Describe a user as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def redis_url():
    # The tokenizer is built from the GGUF once and cached; that build goes through transformers'
    # GGUF reader, which needs torch, so it happens here, before the gateway reads the cache.
    load_tokenizer(ModelSource.resolve(None))
    redis = EmbeddedRedis()
    try:
        yield redis.start()
    finally:
        redis.stop()


def _run_gateway(redis_url: str, mode: str) -> tuple[dict[str, httpx.Response], str]:
    """Start ``baton gateway`` (torch ``blocked`` or ``installed``), make the requests, stop it with
    SIGTERM; the answers by name and the process's output."""
    port = free_port()
    cmd = [sys.executable, "-c", CHILD, mode, "gateway", "--port", str(port), "--redis-url", redis_url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{url}/health") or proc.poll() is not None, 120, "the gateway")
        assert proc.poll() is None, proc.communicate()[0]
        answers = _requests(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return answers, out


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _requests(url: str) -> dict[str, httpx.Response]:
    def chat(**extra) -> httpx.Response:
        body = {"messages": CHAT, "max_tokens": 8, **extra}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)

    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    return {
        "health": httpx.get(f"{url}/health", timeout=10),
        "metrics": httpx.get(f"{url}/metrics", timeout=10),
        "good spec": chat(response_format=schema),
        "good regex": chat(guided_regex="[a-z]{3}"),
        "schema not json": chat(guided_json="{not json"),
        "not a schema": chat(guided_json="[1]"),
    }


def test_the_gateway_serves_with_torch_unimportable(redis_url):
    answers, out = _run_gateway(redis_url, "blocked")
    assert answers["health"].json() == {"status": "ok"}
    assert answers["metrics"].status_code == 200
    for name in ("good spec", "good regex"):  # checked, tokenized, then no worker to route to
        r = answers[name]
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_worker", (name, r.text)
    for name in ("schema not json", "not a schema"):
        r = answers[name]
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", (name, r.text)
    assert "Traceback" not in out, out


def test_the_gateway_does_not_import_torch_when_it_is_installed(redis_url):
    answers, out = _run_gateway(redis_url, "installed")
    assert answers["health"].status_code == 200 and answers["good spec"].status_code == 503
    assert "torch imported: False" in out, out
