"""The gateway over a real decode worker, a real Redis and real HTTP, driven by the official
``openai`` client: greedy outputs match the offline engine, usage adds up, streams end well, errors
come back in OpenAI's shape, and a client that leaves mid-stream frees the worker's blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from baton.common.engine.config import EngineConfig
from baton.common.index.server import EmbeddedRedis
from baton.common.llm import SamplingParams
from baton.common.net import free_port
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.gateway.app import GatewayConfig, create_app, make_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three laws of robotics are"
N = 12


def _poll(check, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    return check()


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis()
    url = server.start()
    yield url
    server.stop()


@pytest.fixture(scope="module")
def worker(redis_url):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(dtype="float32", kv_cache_gib=0.3, max_model_len=2048)
    w = DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=redis_url))
    try:
        asyncio.run_coroutine_threadsafe(w.start(), loop).result(timeout=300)
        yield w
    finally:
        asyncio.run_coroutine_threadsafe(w.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def base_url(redis_url, worker):
    port = free_port()
    server = make_server(GatewayConfig(port=port, redis_url=redis_url, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert _poll(ready, 60), "the gateway did not become ready"
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref_chat(llm_fp32):
    return llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=N))[0]


@pytest.fixture(scope="module")
def ref_completion(llm_fp32):
    return llm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N))[0]


def test_chat_matches_the_offline_engine(client, ref_chat):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=N)
    ref = ref_chat.outputs[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref_chat.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The same prompt again is served from the worker's prefix cache (whole blocks of it).
    again = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=N)
    assert again.choices[0].message.content == ref.text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_stream_with_usage(client, ref_chat):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=N,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_chat.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref_chat.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        ref_chat.outputs[0].token_ids
    )
    assert chunks[-1].usage.prompt_tokens == len(ref_chat.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_matches_offline_and_echoes_the_request_id(client, ref_completion):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N, extra_headers={"X-Request-Id": "req-42"}
    )
    assert raw.headers["x-request-id"] == "req-42"
    r = raw.parse()
    assert r.id == "cmpl-req-42" and r.object == "text_completion"
    assert r.choices[0].text == ref_completion.outputs[0].text
    assert r.usage.prompt_tokens == len(ref_completion.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref_completion.outputs[0].token_ids)
    generated = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert len(generated.headers["x-request-id"]) >= 16
    # Clients that reuse an id at once do not collide on the worker.
    with ThreadPoolExecutor(2) as pool:
        same = [
            pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N,
                        extra_headers={"X-Request-Id": "dup"})
            for _ in range(2)
        ]  # fmt: skip
        assert [f.result(timeout=120).choices[0].text for f in same] == [ref_completion.outputs[0].text] * 2


def test_completion_stream_from_token_ids(client, ref_completion):
    ids = ref_completion.prompt_token_ids
    chunks = list(
        client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=N, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == ref_completion.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    single = client.completions.create(model=MODEL, prompt=[PROMPT], temperature=0, max_tokens=N)
    assert single.choices[0].text == ref_completion.outputs[0].text


def test_n_choices_and_stop_strings(client, llm_fp32, ref_completion):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == ref_completion.outputs[0].text for c in r.choices)
    assert r.usage.completion_tokens == 2 * len(ref_completion.outputs[0].token_ids)
    sampled = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=1.0, seed=7, max_tokens=4, n=2, stream=True
    )
    assert {c.choices[0].index for c in sampled if c.choices} == {0, 1}

    stop = ref_completion.outputs[0].text.split()[2]
    ref = llm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, stop=[stop]))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N, stop=stop)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop" == ref.finish_reason


def test_logprobs(client, llm_fp32, ref_completion):
    ref = llm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, logprobs=0))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-3)
    assert "".join(lp.tokens) == ref.text and lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=N, logprobs=True, top_logprobs=1
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(c.logprob <= 0 for c in content)


def test_top_logprobs_in_both_shapes_streamed_and_whole(client, llm_fp32):
    """Completions: per token a {text: logprob} dict of the top ``logprobs`` and the chosen token
    (vLLM's rule); chat: per token a list of exactly ``top_logprobs`` {token, logprob, bytes}.
    Both as the offline engine computes them, and the same streamed as whole."""
    k, decode = 3, llm_fp32.get_tokenizer().decode
    ref = llm_fp32.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, logprobs=k))[0].outputs[0]
    want = [{decode([t]): lp for t, lp in zip(top.token_ids, top.logprobs)} for top in ref.top_logprobs]
    args = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=N, logprobs=k)
    lp = client.completions.create(**args).choices[0].logprobs
    assert len(lp.top_logprobs) == N
    for got, exp, tok, tok_lp in zip(lp.top_logprobs, want, lp.tokens, lp.token_logprobs):
        assert got[tok] == tok_lp and set(got) == set(exp) | {tok}
        assert [got[t] for t in exp] == pytest.approx(list(exp.values()), abs=1e-3)
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True) if c.choices]
    streamed = [d for c in chunks if c for d in c.top_logprobs]
    assert [list(d) for d in streamed] == [list(d) for d in lp.top_logprobs]
    assert [v for d in streamed for v in d.values()] == pytest.approx(
        [v for d in lp.top_logprobs for v in d.values()], abs=1e-4
    )
    zero = client.completions.create(**{**args, "logprobs": 0}).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]

    chat_ref = llm_fp32.chat(CHAT, SamplingParams(temperature=0, max_tokens=N, logprobs=k))[0].outputs[0]
    args = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=N, logprobs=True, top_logprobs=k)
    content = client.chat.completions.create(**args).choices[0].logprobs.content
    assert len(content) == len(chat_ref.token_ids)
    for c, top in zip(content, chat_ref.top_logprobs):
        assert [t.token for t in c.top_logprobs] == [decode([i]) for i in top.token_ids]
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(list(top.logprobs), abs=1e-3)
        assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
    streamed = [
        entry
        for chunk in client.chat.completions.create(**args, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    # Streamed and whole alike (the second run hits the prefix cache: logprobs may differ in the
    # last float bits, the tokens may not).
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content
    ]
    flat = lambda entries: [v for e in entries for v in [e.logprob] + [t.logprob for t in e.top_logprobs]]  # noqa: E731
    assert flat(streamed) == pytest.approx(flat(content), abs=1e-4)


def test_service_endpoints(client, base_url, worker):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    ready = httpx.get(f"{base_url}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["decode_workers"] == 1
    workers = httpx.get(f"{base_url}/workers", timeout=10).json()["workers"]
    assert [(w["id"], w["role"]) for w in workers] == [(worker.worker_id, "decode")]
    assert workers[0]["grpc_address"] == f"127.0.0.1:{worker.grpc_port}"
    assert set(workers[0]) == {"id", "role", "grpc_address", "kv_address", "metrics_url", "load", "settings"}
    assert workers[0]["settings"]["dtype"] == worker.engine.engine.config.dtype
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "baton:time_to_first_token_seconds_bucket" in metrics
    assert 'baton:http_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def test_errors_in_openai_shape(client, base_url):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature" and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="")
    assert "empty" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[100] * 2100, max_tokens=4, stream=True)
    assert "max_model_len" in e.value.message and e.value.param == "prompt"
    for stream in (False, True):  # a prompt that fits, with a completion that cannot: refused up front
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=[100] * 2000, max_tokens=49, stream=stream)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        assert "maximum context length is 2048 tokens" in e.value.message
        assert "2049 tokens (2000 in the prompt, 49 in the completion)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4096)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    bad_json = httpx.post(f"{base_url}/v1/completions", content=b"{nope", timeout=10)
    missing = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL}, timeout=10)
    for r in (bad_json, missing):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert missing.json()["error"]["param"] == "messages"


def test_client_that_leaves_frees_the_blocks(client, base_url, worker):
    engine = worker.engine.engine
    free = engine.pool.num_free_blocks
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    assert _poll(lambda: not engine.has_unfinished_requests(), 20), "the worker did not abort the stream"
    assert _poll(lambda: engine.pool.num_free_blocks == free, 5)
    # A non-streaming client that gives up is noticed too, though no write to it fails.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    assert _poll(lambda: not engine.has_unfinished_requests(), 20), "the worker did not abort the request"
    assert _poll(lambda: engine.pool.num_free_blocks == free, 5)


def test_no_decode_worker_is_503(redis_url):
    # Database 1 of the same Redis holds no workers.
    app = create_app(GatewayConfig(redis_url=redis_url.rsplit("/", 1)[0] + "/1"))
    with TestClient(app) as http:
        assert http.get("/ready").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_decode_worker"
        assert r.headers["retry-after"] == "1"
