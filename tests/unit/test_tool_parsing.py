"""Tool calls' pure parts (services/gateway/tools.py): Hermes blocks out of text, whole and
streamed in arbitrary pieces; the schemas ``required`` and named choices are enforced by; the
conversation rendered for a template without a tool format; the structured-output fields."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from baton.common.engine.structured_spec import REFUSAL_PREFIX
from baton.services.gateway.dispatch import rpc_error
from baton.services.gateway.errors import APIError
from baton.services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from baton.services.gateway.tools import (
    Tool,
    ToolMode,
    ToolStream,
    merge_deltas,
    parse_hermes,
    parse_output,
    required_schema,
    template_messages,
    tool_mode,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
)
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TOOLS = (WEATHER, TIME)

TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_parse_hermes_takes_every_call_out_of_the_text():
    content, calls = parse_hermes(TEXT)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_a_block_that_is_not_a_call_stays_text():
    text = "a <tool_call>not json</tool_call> b"
    assert parse_hermes(text) == (text, [])
    content, calls = parse_output(ToolMode(TOOLS, "auto"), "no calls here")
    assert (content, calls) == ("no calls here", [])


def _streamed(mode: ToolMode, text: str, size: int) -> list[dict]:
    stream = ToolStream(mode)
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, final=i == len(pieces) - 1)
    return deltas


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_parse(size):
    deltas = _streamed(ToolMode(TOOLS, "auto"), TEXT, size)
    merged = merge_deltas(deltas)
    content, calls = parse_hermes(TEXT)
    assert merged["content"].strip() == content  # no piece of a block leaks into the content
    assert "<tool_call" not in merged["content"]
    got = [
        (c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in merged["tool_calls"]
    ]
    assert got == [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]


def test_a_partial_marker_is_held_back_then_released_as_content():
    stream = ToolStream(ToolMode(TOOLS, "auto"))
    assert stream.feed("x <tool", final=False) == [{"content": "x "}]
    assert stream.feed("box", final=True) == [{"content": "<toolbox"}]


def test_named_choice_streams_arguments_as_they_come():
    mode = ToolMode(TOOLS, "named", "get_weather")
    deltas = _streamed(mode, '{"city": "Oslo"}', 4)
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["id"].startswith("call_")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"city": "Oslo"}
    assert mode.finish_reason == "stop"


def test_required_output_is_an_array_of_calls():
    schema = required_schema(TOOLS)
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"unit": "C"}}], schema)
    content, calls = parse_output(ToolMode(TOOLS, "required"), json.dumps(good))
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


def test_tool_choice_rules():
    assert tool_mode(list(TOOLS), None).choice == "auto"
    assert tool_mode(list(TOOLS), "none") is None
    assert tool_mode(None, None) is None
    with pytest.raises(APIError) as e:
        tool_mode(None, "required")
    assert e.value.param == "tool_choice"
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER.model_dump()],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        }
    )
    with pytest.raises(APIError) as e:
        body.sampling_params()
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_required_and_named_choices_constrain_the_output():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER.model_dump()],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    spec = body.sampling_params().structured_outputs
    assert spec is not None and json.loads(spec.json) == WEATHER.function.parameters


def test_the_conversation_goes_back_in_hermes_form():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    extras = [
        {},
        {
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ]
        },
        {"tool_call_id": "c1"},
    ]
    out = template_messages(messages, extras, ToolMode(TOOLS, "auto"))
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"] and "get_time" in out[0]["content"]
    assert (
        out[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert template_messages(messages[:1], extras[:1], None) == messages[:1]


@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}},
                }
            },
            "json",
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex"),
        ({"structured_outputs": {"json": {"type": "integer"}}}, "json"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar"),
        ({"guided_json": '{"type": "boolean"}'}, "json"),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_every_structured_field_becomes_one_spec(fields, kind):
    params = CompletionRequest.model_validate({"prompt": "x", **fields}).sampling_params()
    assert (params.structured_outputs.kind if params.structured_outputs else None) == kind


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[]"}, "guided_json"),
        ({"structured_outputs": {"json": "3"}}, "structured_outputs"),
        ({"guided_regex": "a\ud800"}, "guided_regex"),
        ({"guided_choice": ["yes", "\udc00"]}, "guided_choice"),
    ],
)
def test_a_spec_that_cannot_be_a_grammar_is_a_400_at_the_gateway(fields, param):
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate({"prompt": "x", **fields}).sampling_params()
    assert e.value.status == 400 and e.value.param == param, e.value.message


# Only the compiler (xgrammar, which imports torch) can refuse these: the gateway passes them on and
# names the field when the worker refuses them (the engine's message, as in tests/model/test_structured.py;
# end to end in tests/e2e/test_structured_api.py).
COMPILED_BY_THE_WORKER = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        "response_format",
        "json",
    ),
    ({"guided_regex": "(("}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs", "grammar"),
]


def _worker_refusal(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )


@pytest.mark.parametrize("fields, param, kind", COMPILED_BY_THE_WORKER)
def test_a_spec_only_the_compiler_refuses_is_a_400_naming_its_field(fields, param, kind):
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    assert body.sampling_params().structured_outputs.kind == kind
    refusal = f"{REFUSAL_PREFIX}the {kind} cannot be compiled: bad"
    err = rpc_error(_worker_refusal(refusal), "prompt", body.constraint_field())
    assert (err.status, err.param, err.message) == (
        400,
        param,
        f"{param}: the {kind} cannot be compiled: bad",
    )


def test_a_forced_tool_call_refused_by_the_worker_names_tools():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER.model_dump()],
            "tool_choice": "required",
        }
    )
    assert body.constraint_field() == "tools"
    err = rpc_error(
        _worker_refusal(f"{REFUSAL_PREFIX}no token can start an output of this json"), "messages", "tools"
    )
    assert (err.status, err.param) == (400, "tools")
    plain = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert plain.constraint_field() is None
    # Without a constraint the refusal is passed on unnamed, as any other worker refusal.
    assert rpc_error(_worker_refusal(f"{REFUSAL_PREFIX}x"), "messages", None).param is None
