"""Structured outputs through the gateway (real HTTP, the official ``openai`` client, a real Redis and
an in-process decode worker running a tiny random Llama with SmolLM2's tokenizer): whatever a random
model would say, every output matches its constraint, streamed or not, on both endpoints and every
field that asks for one; a spec xgrammar cannot compile is an OpenAI-shaped 400 naming the field;
jump-forward shows on the worker's /metrics."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.gateway.app import GatewayConfig
from tests.e2e.tiny_gateway import build_tiny_llama, decode_worker, gateway

# Bounded everywhere (enums, maxLength, integer ranges): a random model ends them within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "enum": ["tea", "cake", "soup"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "table": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["items", "table"],
}
CHAT = [{"role": "user", "content": "Describe a user of our system as JSON."}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    redis = EmbeddedRedis()
    url = redis.start()
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = GatewayConfig(
        port=free_port(), model=str(model), served_model_name="m", redis_url=url, log_level="warning"
    )
    try:
        with decode_worker(model, url, 512) as worker, gateway(config) as base:
            yield base, worker
    finally:
        redis.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster[0]}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_chat_json_schema_validates(client, schema):
    for seed in range(3):
        r = client.chat.completions.create(
            model="m",
            messages=CHAT,
            response_format=_schema_format(schema),
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_validates(client):
    stream = client.chat.completions.create(
        model="m",
        messages=CHAT,
        response_format=_schema_format(PERSON),
        temperature=1.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}}, lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
        (
            {"guided_regex": r"(yes|no), because [a-z]{1,6}\."},
            lambda t: re.fullmatch(r"(yes|no), because [a-z]{1,6}\.", t),
        ),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
        ({"guided_json": ORDER}, lambda t: jsonschema.validate(json.loads(t), ORDER) is None),
        (
            {"structured_outputs": {"json": PERSON}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]? "!"'}, lambda t: re.fullmatch(r"x\d\d?!", t)),
    ],
    ids=[
        "so-regex",
        "guided-regex",
        "guided-choice",
        "so-choice",
        "guided-json",
        "so-json",
        "guided-grammar",
    ],
)
def test_completions_constraints(client, extra, check):
    for seed in range(2):
        r = client.completions.create(
            model="m", prompt="Answer:", temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, extra_body=extra
        )
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and check(text), text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"response_format": _schema_format({"type": "objekt"})}, "response_format"),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
        ("completions", {"guided_json": "{not json"}, "guided_json"),
        ("completions", {"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ],
)
def test_a_bad_spec_is_an_openai_400(cluster, path, body, param):
    base = {"messages": CHAT} if path.startswith("chat") else {"prompt": "x"}
    r = httpx.post(f"{cluster[0]}/v1/{path}", json={**base, **body, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=CHAT, response_format=_schema_format({"type": 3}))
    assert e.value.status_code == 400


def _worker_metrics(cluster) -> dict[str, float]:
    metrics = httpx.get(f"http://127.0.0.1:{cluster[1].metrics_port}/metrics", timeout=10).text
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("baton:") and "{" in line
    }


def test_jump_forward_shows_on_the_worker_metrics(client, cluster):
    before = _worker_metrics(cluster)
    done = client.chat.completions.create(
        model="m", messages=CHAT, response_format=_schema_format(ORDER), max_tokens=60
    )
    values = _worker_metrics(cluster)
    assert values["baton:jump_forward_tokens_total"] > before.get("baton:jump_forward_tokens_total", 0)
    assert 0 < values["baton:forward_steps_per_output_token"] < 1
    # Forced tokens are output tokens: the worker counts every token the client was sent.
    generated = values["baton:generation_tokens_total"] - before["baton:generation_tokens_total"]
    assert generated == done.usage.completion_tokens
