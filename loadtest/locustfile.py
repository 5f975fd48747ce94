"""Locust users that chat with Baton through its OpenAI API, streaming, and report TTFT and TPOT.

Each user asks a short question with ``POST /v1/chat/completions`` (``stream: true``,
``stream_options: {"include_usage": true}``), reads the server-sent events up to ``[DONE]``, waits
0.5-2 s and asks again. Three entries go to locust's stats (the table and ``--csv``), in ms:

- ``POST /v1/chat/completions``: the whole request, end to end. A failure for an answer other than
  200, a broken or unparsable stream, an error event, or a stream with no ``[DONE]`` or no usage.
- ``TTFT chat``: time to the first chunk that carries content.
- ``TPOT chat``: (end to end - TTFT) / (usage.completion_tokens - 1), for answers of 2+ tokens.

Against a ``baton up --port 8000``, for a minute, headless::

    locust -f loadtest/locustfile.py --headless -u 4 -r 2 --run-time 60s --stop-timeout 60s \\
        --host http://127.0.0.1:8000 --csv /tmp/baton --exit-code-on-error 1

Options, each also an environment variable: ``--model`` (``BATON_LOADTEST_MODEL``; default the
first of ``GET /v1/models``), ``--max-tokens`` (``BATON_LOADTEST_MAX_TOKENS``, default 32),
``--prompts-file`` (``BATON_LOADTEST_PROMPTS``: one prompt a line; default a built-in list of short
questions), ``--request-timeout`` (``BATON_LOADTEST_TIMEOUT``, seconds, default 120).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from locust import User, between, events, task  # first: it makes sockets cooperative (gevent)
from requests import RequestException, Session

CHAT = "/v1/chat/completions"
PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What does a compiler do?",
    "How many legs does a spider have?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is photosynthesis, in one sentence?",
    "Suggest a name for a pet turtle.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Tell me a fun fact about the ocean.",
)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument(
        "--model", default="", env_var="BATON_LOADTEST_MODEL", help="model to ask (default: the first served)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        env_var="BATON_LOADTEST_MAX_TOKENS",
        help="max_tokens of each chat",
    )
    parser.add_argument(
        "--prompts-file",
        default="",
        env_var="BATON_LOADTEST_PROMPTS",
        help="one prompt a line (default: built in)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, env_var="BATON_LOADTEST_TIMEOUT", help="seconds"
    )


class StreamError(Exception):
    """A stream that began with 200 but did not end as the OpenAI API says it must."""


@dataclass(frozen=True)
class StreamResult:
    ttft_s: float | None
    """Seconds to the first chunk with content; None if no chunk had any."""
    e2e_s: float
    completion_tokens: int
    num_bytes: int


def read_stream(lines: Iterable[bytes], start: float) -> StreamResult:
    """Read an OpenAI chat stream to its end; ``start`` is the ``perf_counter`` of the request.

    The stream is read past ``[DONE]`` (as the ``openai`` client does), so that the connection
    goes back to the pool, and anything but blank lines after it is an error."""
    ttft = usage = done = None
    num_bytes = 0
    for line in lines:
        num_bytes += len(line) + 1
        if done is not None:
            if line.strip():
                raise StreamError(f"data after [DONE]: {line[:200]!r}")
        elif line.startswith(b"data:"):  # else the blank line between events, or an SSE comment
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = time.perf_counter() - start
                continue
            event = _parse_event(payload)
            if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    if done is None:
        raise StreamError(f"stream ended without [DONE] after {num_bytes} bytes")
    return _finish(ttft, usage, done, num_bytes)


def _parse_event(payload: bytes) -> dict:
    try:
        event = json.loads(payload)
    except ValueError:
        raise StreamError(f"not JSON: {payload[:200]!r}") from None
    if not isinstance(event, dict):
        raise StreamError(f"not a JSON object: {payload[:200]!r}")
    if "error" in event:
        raise StreamError(f"error event: {event['error']}")
    return event


def _finish(ttft: float | None, usage: dict | None, e2e: float, num_bytes: int) -> StreamResult:
    if not usage or "completion_tokens" not in usage:
        raise StreamError("no usage chunk, though stream_options.include_usage was set")
    return StreamResult(ttft, e2e, int(usage["completion_tokens"]), num_bytes)


def load_prompts(path: str) -> list[str]:
    if not path:
        return list(PROMPTS)
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


class ChatUser(User):
    """One chat client: a short question, a streamed answer, a short pause."""

    wait_time = between(0.5, 2)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.max_tokens = opts.max_tokens
        self.timeout = opts.request_timeout
        self.prompts = load_prompts(opts.prompts_file)
        self.model = opts.model or None
        self.base = self.host.rstrip("/")
        self.session = Session()

    def on_stop(self) -> None:
        self.session.close()

    @task
    def chat(self) -> None:
        self.model = self.model or self.discover_model()
        if self.model is None:
            return  # the failed discovery is in the stats; try again next time
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": random.choice(self.prompts)}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        try:
            with self.session.post(self.base + CHAT, json=body, stream=True, timeout=self.timeout) as r:
                if r.status_code != 200:
                    raise StreamError(f"HTTP {r.status_code}: {r.text[:300]}")
                result = read_stream(r.iter_lines(chunk_size=None), start)  # None: each chunk as it comes
        except (StreamError, RequestException) as e:
            self.report("POST", CHAT, time.perf_counter() - start, 0, e)
            return
        self.report("POST", CHAT, result.e2e_s, result.num_bytes)
        self.report_latencies(result)

    def report_latencies(self, result: StreamResult) -> None:
        if result.ttft_s is None:
            return  # an answer with no text (e.g. end of sequence first) has no first token to time
        self.report("TTFT", "chat", result.ttft_s, result.completion_tokens)
        if result.completion_tokens >= 2:
            tpot = (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)
            self.report("TPOT", "chat", tpot, result.completion_tokens)

    def discover_model(self) -> str | None:
        """The first model of ``GET /v1/models``, or None (reported as a failure)."""
        start = time.perf_counter()
        try:
            r = self.session.get(self.base + "/v1/models", timeout=self.timeout)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (RequestException, ValueError, KeyError, IndexError) as e:
            self.report("GET", "/v1/models", time.perf_counter() - start, 0, e)
            return None
        self.report("GET", "/v1/models", time.perf_counter() - start, len(r.content))
        return model

    def report(self, kind: str, name: str, seconds: float, length: int, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=name,
            response_time=seconds * 1000,
            response_length=length,
            exception=exc,
            context={},
        )
