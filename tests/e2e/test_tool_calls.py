"""Tool calls through the gateway with the official ``openai`` SDK (``max_retries=0``), over real
HTTP, a real Redis and an in-process decode worker running a tiny random Llama: a named and a
``required`` tool_choice are enforced by structured outputs, so even a random model calls the tool
with arguments that validate; the SDK's whole flow (tools -> tool_calls -> a tool message -> the
final answer) runs; ``auto`` parses Hermes ``<tool_call>`` blocks out of the output (the output is
steered into one by a grammar here, since a random model would never write one); and every form is
streamed as OpenAI's deltas."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from baton.common.index.server import EmbeddedRedis
from baton.common.net import free_port
from baton.services.gateway.app import GatewayConfig
from tests.e2e.tiny_gateway import build_tiny_llama, decode_worker, gateway

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    },
]
ARGS = {"get_weather": WEATHER_PARAMS, "get_time": TOOLS[1]["function"]["parameters"]}
USER = {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A Hermes call, written by the model under a grammar: the ``auto`` parser's input.
HERMES = (
    'root ::= "Let me look. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
    '{\\"city\\": \\"" ("Paris" | "Oslo") "\\", \\"days\\": " [1-7] "}}\\n</tool_call>"'
)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    redis = EmbeddedRedis()
    url = redis.start()
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    config = GatewayConfig(
        port=free_port(), model=str(model), served_model_name="m", redis_url=url, log_level="warning"
    )
    try:
        with decode_worker(model, url, 1024), gateway(config) as base:
            with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120) as c:
                yield c
    finally:
        redis.stop()


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, ARGS[call.function.name])
    return args


def test_the_sdk_tool_calling_flow(client):
    """request with tools -> tool_calls -> tool message -> final answer."""
    first = client.chat.completions.create(
        model="m", messages=[USER], tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=1, max_tokens=60
    )
    choice = first.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason for a named tool_choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = _check_call(call)
    tool_result = {"city": args["city"], "forecast": ["sun"] * args["days"]}
    messages = [
        USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(tool_result)},
    ]
    final = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # The tool's result went into the prompt: the same turn without it is a shorter prompt.
    without = client.chat.completions.create(
        model="m", messages=messages[:2], tool_choice="none", tools=TOOLS, max_tokens=1
    )
    assert final.usage.prompt_tokens > without.usage.prompt_tokens


def test_required_calls_one_or_more_tools(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model="m",
            messages=[USER],
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=160,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)


def test_auto_parses_hermes_tool_calls(client):
    r = client.chat.completions.create(
        model="m", messages=[USER], tools=TOOLS, max_tokens=80, extra_body={"guided_grammar": HERMES}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)


def test_without_tools_the_output_is_plain_text(client):
    r = client.chat.completions.create(
        model="m", messages=[USER], max_tokens=80, extra_body={"guided_grammar": HERMES}
    )
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model="m", messages=[USER], tools=TOOLS, stream=True, **kw))
    calls: dict[int, dict] = {}
    content = ""
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert call["id"] is None, "a call's id comes once, in its first delta"
                call["id"] = d.id
            if d.function and d.function.name:
                call["name"] += d.function.name
            if d.function and d.function.arguments:
                call["arguments"] += d.function.arguments
    return content, calls, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize(
    "kw, reason, content",
    [
        ({"tool_choice": NAMED, "temperature": 1.0, "seed": 2, "max_tokens": 60}, "stop", ""),
        ({"tool_choice": "required", "temperature": 1.0, "seed": 2, "max_tokens": 160}, "tool_calls", ""),
        ({"max_tokens": 80, "extra_body": {"guided_grammar": HERMES}}, "tool_calls", "Let me look. "),
    ],
    ids=["named", "required", "auto"],
)
def test_streamed_tool_call_deltas(client, kw, reason, content):
    text, calls, finish = _stream(client, **kw)
    assert finish == reason and text == content and calls
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in ARGS
        jsonschema.validate(json.loads(call["arguments"]), ARGS[call["name"]])
    assert sorted(calls) == list(range(len(calls)))


def test_bad_tool_requests_are_400s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m",
            messages=[USER],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[USER], tool_choice="required")
