"""The gateway's front door over real HTTP, a real Redis and a real decode worker (a tiny random
Llama with SmolLM2's tokenizer): API keys (401s, open probes, no key in the logs), bounded admission
(429 with Retry-After past the cap, slots freed on every exit path), the body limit (413) and the
bounds on every parameter (400s naming it)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.gateway.app import GatewayConfig
from baton.services.procs import ProcessGroup
from baton.services.up import wait_connected
from tests.e2e.tiny_gateway import build_tiny_llama, decode_worker, gateway, wait_for

pytestmark = pytest.mark.serial  # times its 401s and bursts: run alone (make test)

KEY = "sk-limits-test-0123456789"
OTHER_KEY = "sk-second-key-abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 2
BODY_LIMIT = 64 * 1024
MAX_MODEL_LEN = 2048
VOCAB = 49152
HOLD_TOKENS = 1000
"""Tokens a held stream asks for: long enough to hold its slot while others are refused (the tiny
model makes one in 4-15 ms here; the refusals take milliseconds)."""


class Records(logging.Handler):
    """Every log record from the loggers the gateway writes to, formatted."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def logs(base_url):
    """Attached once the server is up: uvicorn's start replaces its loggers' handlers."""
    handler = Records()
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "baton", "httpx"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    yield handler
    for name in names:
        logging.getLogger(name).removeHandler(handler)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    redis = EmbeddedRedis()
    url = redis.start()
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = GatewayConfig(
        port=free_port(),
        model=str(model),
        redis_url=url,
        api_keys=(KEY, OTHER_KEY),
        max_concurrent_requests=CAP,
        max_body_bytes=BODY_LIMIT,
        log_level="info",  # access lines included: the key must not be in them either
    )
    try:
        with decode_worker(model, url, MAX_MODEL_LEN), gateway(config) as base:
            yield base
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def _total(http: httpx.Client, name: str) -> float:
    """``name``'s samples summed over their labels (0 before it has any)."""
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def _admitted(http: httpx.Client) -> float:
    return _metric(http, "baton:gateway_requests_admitted")


def _report(what: str, seconds: list[float]) -> None:
    """Measured latencies, for docs/reliability.md (``pytest -s`` shows them)."""
    ms = sorted(1000 * t for t in seconds)
    print(f"\nfront door: {what}: median {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms over {len(ms)}")


def _timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def _completion(max_tokens: int = 4, **extra) -> dict:
    return {"prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0, **extra}


def _assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    assert error["param"] == param
    return error


# -- API keys -------------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/anything", None),
    ("POST", "/v1/completions", _completion()),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/workers", None),
]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_protected_paths_need_a_valid_key(http, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = http.request(method, path, json=body, headers=headers)
        error = _assert_error(r, 401, code="invalid_api_key")
        assert error["type"] == "invalid_request_error"
        assert r.headers["www-authenticate"] == "Bearer"
    for key in (KEY, OTHER_KEY):
        r = http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == (404 if path == "/v1/models/anything" else 200), r.text


def test_a_401_is_fast(http):
    """A request without a key is answered at the door, never reaching a worker: the gateway sends
    no prompt token and streams back none, and each 401 takes less than the same request with the
    key (a generation of a few hundred tokens) would."""
    unauthorized = 'baton:gateway_rejected_requests_total{reason="unauthorized"}'
    body = _completion(HOLD_TOKENS // 4, ignore_eos=True)
    wait_for(lambda: _admitted(http) == 0, 20, "earlier requests to end")
    before = [_metric(http, unauthorized), _total(http, "baton:prompt_tokens_total")]
    before.append(_total(http, "baton:generation_tokens_total"))
    refused = [_timed(lambda: http.post("/v1/completions", json=body)) for _ in range(20)]
    for r, _ in refused:
        _assert_error(r, 401, code="invalid_api_key")
    after = [_metric(http, unauthorized), _total(http, "baton:prompt_tokens_total")]
    after.append(_total(http, "baton:generation_tokens_total"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [20, 0, 0]
    served, served_s = _timed(lambda: http.post("/v1/completions", json=body, headers=AUTH))
    assert served.json()["usage"]["completion_tokens"] == HOLD_TOKENS // 4, served.text
    assert _total(http, "baton:generation_tokens_total") > after[2]  # the counters do count
    times = sorted(took for _, took in refused)
    assert times[-1] < 5.0, f"a 401 took {times[-1]:.1f} s"
    assert times[len(times) // 2] < served_s, f"401s took {times}, a generation {served_s:.2f} s"
    _report("401 without a key", times)


def test_probes_and_docs_stay_open(http):
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert http.get(path).status_code == 200, path
    assert 'baton:gateway_rejected_requests_total{reason="unauthorized"}' in http.get("/metrics").text


def test_openai_client_with_and_without_the_key(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0, timeout=60) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="x", prompt="hi", max_tokens=2)
        assert e.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60) as good:
        model = good.models.list().data[0].id
        r = good.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3


def test_baton_up_readiness_poll_sends_the_key(base_url):
    """``baton up`` waits on /workers before it says ready: with keys set it must send one."""
    wait_connected(base_url, 0, 1, ProcessGroup(), timeout=30, api_key=KEY)
    with pytest.raises(TimeoutError):
        wait_connected(base_url, 0, 1, ProcessGroup(), timeout=1.0)


def test_no_key_in_the_logs(http, logs):
    for key in (KEY, OTHER_KEY, "Bearer wrong-key-in-logs"):
        http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    text = "\n".join(logs.lines)
    assert re.search(r'"GET /v1/models HTTP/1.1" 401', text), "the access log was not captured"
    for secret in (KEY, OTHER_KEY, "wrong-key-in-logs"):
        assert secret not in text


# -- admission --------------------------------------------------------------------------------------
class HeldStream:
    """A streaming completion read on a thread: ``started`` once its first event arrives, then
    read to its end when ``release`` is set."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.status: int | None = None
        self.events: list[dict] = []
        body = _completion(max_tokens, stream=True, ignore_eos=True)
        self._thread = threading.Thread(target=self._run, args=(base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    if not self.started.is_set():
                        self.started.set()
                        self.release.wait(timeout=120)
        self.started.set()

    def finish(self, timeout_s: float) -> None:
        self.release.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "a held stream did not end"


def test_burst_past_the_cap_is_429_at_once_and_slots_come_back(http, base_url):
    rejected_before = _metric(http, 'baton:gateway_rejected_requests_total{reason="concurrency"}')
    held = [HeldStream(base_url, HOLD_TOKENS) for _ in range(CAP)]
    try:
        for stream in held:
            assert stream.started.wait(60), "a stream under the cap did not start"
        assert [s.status for s in held] == [200] * CAP
        assert _admitted(http) == CAP

        def burst(_) -> tuple[httpx.Response, float]:
            return _timed(
                lambda: http.post("/v1/completions", json=_completion(8, stream=True), headers=AUTH)
            )

        with ThreadPoolExecutor(4) as pool:
            refused = list(pool.map(burst, range(4)))
        for r, took in refused:
            error = _assert_error(r, 429, code="too_many_requests")
            assert error["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "1"
            assert took < 5.0, f"a refusal took {took:.1f} s: it waited instead of failing fast"
        assert _admitted(http) == CAP, "a held stream ended before the burst was refused"
        _report("429 past the cap", [took for _, took in refused])
    finally:
        for stream in held:
            stream.finish(120)
    ended = time.perf_counter()
    for stream in held:
        assert stream.events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in stream.events) > 0
    wait_for(lambda: _admitted(http) == 0, 10, "the held streams' slots to come back", every_s=0.005)
    _report("slots back after the held streams' last event was read", [time.perf_counter() - ended])
    rejected = _metric(http, 'baton:gateway_rejected_requests_total{reason="concurrency"}')
    assert rejected - rejected_before == 4
    with ThreadPoolExecutor(CAP) as pool:
        again = list(
            pool.map(lambda _: http.post("/v1/completions", json=_completion(), headers=AUTH), range(CAP))
        )
    assert [r.status_code for r in again] == [200] * CAP


def test_slots_come_back_on_every_exit_path(http, base_url):
    # A streaming client that leaves after the first event.
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=_completion(HOLD_TOKENS, stream=True, ignore_eos=True),
        headers=AUTH, timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        next(r.iter_lines())
    # Each exit path gives its slot back before the next is tried: the gateway hears of a client
    # that left asynchronously, and with both slots still held the errors below would be 429s.
    wait_for(lambda: _admitted(http) == 0, 20, "the streaming client's slot to come back")
    # A non-streaming client that gives up before the answer.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base_url}/v1/completions",
            json=_completion(HOLD_TOKENS, ignore_eos=True),
            headers=AUTH,
            timeout=httpx.Timeout(30, read=0.3),
        )
    wait_for(lambda: _admitted(http) == 0, 30, "the timed-out client's slot to come back")
    # Errors: the worker's (a token id past the vocabulary), the gateway's, and one mid-body.
    _assert_error(http.post("/v1/completions", json={"prompt": [VOCAB]}, headers=AUTH), 400, param="prompt")
    _assert_error(http.post("/v1/completions", json={"prompt": ""}, headers=AUTH), 400, param="prompt")
    _assert_error(http.post("/v1/completions", content=b"x" * (BODY_LIMIT + 1), headers=AUTH), 413)
    wait_for(lambda: _admitted(http) == 0, 20, "every slot to come back")


def test_a_body_still_arriving_holds_its_slot(http, base_url):
    """The slot is taken before the body is read: the cap bounds the memory bodies take."""
    more = threading.Event()

    def slow_body():
        yield b'{"prompt": "hi", '
        more.wait(30)
        yield b'"max_tokens": 2}'

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            f"{base_url}/v1/completions",
            content=slow_body(),
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=60,
        )
        try:
            wait_for(lambda: _admitted(http) == 1, 20, "the slow request to take a slot")
        finally:
            more.set()
        assert pending.result(timeout=60).status_code == 200
    wait_for(lambda: _admitted(http) == 0, 20, "the slow request's slot to come back")


# -- the body limit ---------------------------------------------------------------------------------
def test_bodies_over_the_limit_are_413(http):
    declared = http.post("/v1/completions", content=b" " * (BODY_LIMIT + 1), headers=AUTH)
    error = _assert_error(declared, 413, code="request_too_large")
    assert str(BODY_LIMIT) in error["message"]

    def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b" " * 4096

    chunked = http.post("/v1/completions", content=chunks(), headers=AUTH)
    _assert_error(chunked, 413, code="request_too_large")
    # A client still sending a body far past the limit reads the 413, not a reset connection.
    huge, took = _timed(lambda: http.post("/v1/completions", content=b" " * (8 * 2**20), headers=AUTH))
    _assert_error(huge, 413, code="request_too_large")
    _report("413 for an 8 MiB body (drained, then answered)", [took])
    # Just under the limit: read and parsed (a prompt of token ids, answered by the worker).
    ids = [100] * ((BODY_LIMIT - 100) // 4)
    body = json.dumps({"prompt": ids, "max_tokens": 1}, separators=(",", ":")).encode()
    assert len(body) <= BODY_LIMIT
    r = http.post("/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    _assert_error(r, 400, param="prompt")
    assert "max_model_len" in r.json()["error"]["message"]
    assert _metric(http, 'baton:gateway_rejected_requests_total{reason="body_too_large"}') >= 3


# -- input bounds -----------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]
BAD = [
    ("max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 2**31}),
    ("max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("max_completion_tokens", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2**31}),
    ("min_tokens", "/v1/completions", {"prompt": "hi", "min_tokens": 2**31}),
    ("top_k", "/v1/completions", {"prompt": "hi", "top_k": 2**31}),
    ("n", "/v1/completions", {"prompt": "hi", "n": 2**31}),
    ("n", "/v1/completions", {"prompt": "hi", "n": 10**30}),
    ("n", "/v1/chat/completions", {"messages": CHAT, "n": 1000}),
    ("logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 2**31}),
    ("top_logprobs", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2**31}),
    ("stop_token_ids", "/v1/completions", {"prompt": "hi", "stop_token_ids": [2**31]}),
    ("stop_token_ids", "/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}),
    ("prompt", "/v1/completions", {"prompt": [2**31]}),
    ("prompt", "/v1/completions", {"prompt": [-1]}),
    ("prompt", "/v1/completions", {"prompt": [VOCAB]}),  # past the vocabulary: the worker says so
    ("prompt", "/v1/completions", {"prompt": [[[1]]]}),
    ("prompt", "/v1/completions", {"prompt": []}),
    ("prompt", "/v1/completions", {"prompt": [[]]}),
    ("prompt", "/v1/completions", {"prompt": ""}),
    ("prompt", "/v1/completions", {"prompt": [1, "a"]}),
    ("messages", "/v1/chat/completions", {"messages": []}),
    ("messages", "/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("messages", "/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}),
    ("messages", "/v1/chat/completions", {"messages": [*CHAT, {"role": "wizard", "content": "hi"}]}),
    ("stop", "/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}),
    ("stop", "/v1/completions", {"prompt": "hi", "stop": "s" * 1025}),
    ("stop", "/v1/completions", {"prompt": "hi", "stop": [""]}),
    ("seed", "/v1/completions", {"prompt": "hi", "seed": 2**63}),
    ("temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("temperature", "/v1/completions", {"prompt": "hi", "temperature": 1e39}),
    ("top_p", "/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("top_p", "/v1/completions", {"prompt": "hi", "top_p": 1e-50}),  # 0 as the proto's float32
]


@pytest.mark.parametrize("param,path,body", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_values_are_400_naming_the_param(http, param, path, body):
    r, took = _timed(lambda: http.post(path, json=body, headers=AUTH))
    error = _assert_error(r, 400, param=param)
    assert took < 10.0, f"a 400 took {took:.1f} s"
    assert error["type"] == "invalid_request_error"


RAW = [
    ("temperature", b'{"prompt": "hi", "temperature": 1e999}', "finite"),  # json reads it as inf
    (None, b'{"prompt": "hi", "temperature": NaN}', "not valid JSON"),
    (None, b'{"prompt": "hi", "top_p": Infinity}', "not valid JSON"),
    (None, b'{"prompt": "\\ud800"}', "surrogate"),
    (None, b'{"prompt": "a\\udc00b"}', "surrogate"),
    (None, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "not valid JSON"),
    (None, b'{"prompt": "hi"', "not valid JSON"),
]


@pytest.mark.parametrize("param,raw,says", RAW, ids=[f"raw-{i}" for i in range(len(RAW))])
def test_bad_json_is_400(http, param, raw, says):
    headers = {**AUTH, "Content-Type": "application/json"}
    error = _assert_error(http.post("/v1/completions", content=raw, headers=headers), 400, param=param)
    assert says in error["message"]


def test_a_surrogate_in_chat_content_is_400(http):
    raw = b'{"messages": [{"role": "user", "content": "x\\ud800"}]}'
    r = http.post("/v1/chat/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    _assert_error(r, 400)


def test_a_completion_without_max_tokens_stops_at_16(http):
    """OpenAI's and vLLM's default for /v1/completions (a chat has none: as many as fit)."""
    bare = http.post("/v1/completions", json={"prompt": "0"}, headers=AUTH)
    assert bare.status_code == 200, bare.text
    assert bare.json()["usage"]["completion_tokens"] <= 16  # fewer if the model ends it
    whole = http.post("/v1/completions", json={"prompt": "0", "ignore_eos": True}, headers=AUTH)
    assert whole.json()["usage"]["completion_tokens"] == 16, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "length"


def test_the_limits_leave_good_requests_alone(http):
    r = http.post(
        "/v1/completions",
        json=_completion(5, stop=["zz"] * 16, stop_token_ids=[0, 2**31 - 1], top_k=2**31 - 1, seed=-(2**63)),
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 5
