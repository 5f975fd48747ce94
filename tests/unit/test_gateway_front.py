"""The gateway's front door as pure logic: bearer tokens and key checks, the admission counter,
strict JSON, union errors, request defaults and roles, and the CLI's front-door settings (flags and
``BATON_API_KEY``)."""

from __future__ import annotations

import json
from typing import get_args

import pytest
from pydantic import ValidationError

from baton.cli.main import build_parser
from baton.services.cli_args import front_door
from baton.services.gateway.admission import Admission
from baton.services.gateway.auth import KeyCheck, bearer_token, is_protected
from baton.services.gateway.body import loads
from baton.services.gateway.errors import APIError, validation_error
from baton.services.gateway.openai_schema import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    Role,
)


@pytest.mark.parametrize(
    "headers,token",
    [
        ([(b"authorization", b"Bearer abc")], b"abc"),
        ([(b"authorization", b"bearer   abc ")], b"abc"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([(b"x-other", b"Bearer abc")], None),
        ([], None),
    ],
)
def test_bearer_token(headers, token):
    assert bearer_token(headers) == token


def test_key_check_knows_every_key_and_nothing_else():
    check = KeyCheck(["k1", "k2"])
    assert check.allows(b"k1") and check.allows(b"k2")
    assert not check.allows(b"k3") and not check.allows(b"k") and not check.allows(b"k1k2")
    assert not check.allows(None)
    with pytest.raises(ValueError):
        KeyCheck([])
    with pytest.raises(ValueError):
        KeyCheck(["ok", ""])


def test_protected_paths():
    assert all(is_protected(p) for p in ["/v1", "/v1/models", "/v1/chat/completions", "/workers"])
    assert not any(is_protected(p) for p in ["/health", "/ready", "/metrics", "/openapi.json", "/v10"])


def test_admission_counts_to_its_limit_and_back():
    seen: list[int] = []
    a = Admission(2, on_change=seen.append)
    assert a.try_enter() and a.try_enter()
    assert not a.try_enter()
    a.leave()
    assert a.try_enter()
    a.leave()
    a.leave()
    assert a.in_flight == 0 and seen == [1, 2, 1, 2, 1, 0]
    with pytest.raises(ValueError):
        Admission(0)


def test_429_and_503_say_when_to_retry():
    assert APIError(429, "busy").headers == {"Retry-After": "1"}
    assert APIError(503, "down", retry_after=5).headers == {"Retry-After": "5"}
    assert APIError(400, "bad").headers == {}
    body = json.loads(APIError(404, "no model 'x\ud800'").response().body)
    assert body["error"]["message"] == "no model 'x\ud800'"  # escaped, so it encodes


@pytest.mark.parametrize(
    "raw", [b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": "\\ud800"}', b"[" * 1000 + b"]" * 1000, b"{", b"\xff"]
)
def test_strict_json_refuses(raw):
    with pytest.raises(json.JSONDecodeError):
        loads(raw)


def test_strict_json_reads_json():
    assert loads(b'{"prompt": [1, 2], "s": "\\ud83d\\ude00", "t": 0.5}') == {
        "prompt": [1, 2],
        "s": "\U0001f600",
        "t": 0.5,
    }


def test_a_union_failure_names_the_forms():
    errors = [
        {"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "Input should be a valid string"},
        {"type": "int_type", "loc": ("body", "prompt", "list[int]", 0), "msg": "..."},
        {"type": "list_type", "loc": ("body", "prompt", "list[list[int]]", 0), "msg": "..."},
    ]
    e = validation_error(errors)
    assert e.param == "prompt" and e.message.endswith("expected one of str, list[int], list[list[int]]")
    single = validation_error(
        [{"type": "x", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}]
    )
    assert single.param == "messages" and single.message == "invalid value for 'messages': Field required"


def test_a_completion_without_max_tokens_makes_16_and_a_chat_as_many_as_fit():
    def max_tokens(request_type, **body) -> int | None:
        return request_type.model_validate(body).sampling_params().max_tokens

    assert COMPLETION_MAX_TOKENS == 16  # OpenAI's and vLLM's default for /v1/completions
    assert max_tokens(CompletionRequest, prompt="0") == 16
    assert max_tokens(CompletionRequest, prompt="0", max_tokens=1000) == 1000
    assert max_tokens(CompletionRequest, prompt="0", max_tokens=None) is None  # asked for: to the context
    chat = [{"role": "user", "content": "hi"}]
    assert max_tokens(ChatCompletionRequest, messages=chat) is None  # vLLM's chat default
    assert max_tokens(ChatCompletionRequest, messages=chat, max_completion_tokens=5) == 5


def _chat_error(messages: list[dict]) -> APIError:
    """The gateway's 400 for a chat body pydantic refuses (FastAPI puts "body" before each loc)."""
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": messages})
    return validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()])


@pytest.mark.parametrize("role", ["", "User", "bot", "ipython", None, 1])
def test_a_role_outside_openais_is_a_400_naming_messages(role):
    error = _chat_error([{"role": "user", "content": "hi"}, {"role": role, "content": "hi"}])
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", "messages")
    assert all(f"'{name}'" in error.message for name in get_args(Role)), error.message


def test_every_openai_role_is_accepted():
    roles = ["system", "user", "assistant", "tool", "developer", "function"]
    assert sorted(get_args(Role)) == sorted(roles)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": r, "content": "x"} for r in roles]})
    assert [m.for_template()["role"] for m in body.messages] == roles


def _gateway_args(*extra: str):
    return build_parser().parse_args(["gateway", "--redis-url", "redis://x", *extra])


def test_front_door_from_flags_and_the_environment(monkeypatch):
    monkeypatch.setenv("BATON_API_KEY", "env-1, env-2,,")
    a = _gateway_args("--api-key", "flag-1", "--api-key", "env-1", "--max-concurrent-requests", "3")
    assert front_door(a) == {
        "api_keys": ("flag-1", "env-1", "env-2"),
        "max_concurrent_requests": 3,
        "max_body_bytes": 4 * 2**20,
    }
    monkeypatch.delenv("BATON_API_KEY")
    assert front_door(_gateway_args())["api_keys"] == ()
    up = build_parser().parse_args(["up", "--api-key", "k", "--max-body-bytes", "100"])
    assert front_door(up) == {"api_keys": ("k",), "max_concurrent_requests": 512, "max_body_bytes": 100}


@pytest.mark.parametrize("flags", [["--api-key", "has,comma"], ["--api-key", "has space"], ["--api-key", ""]])
def test_unusable_keys_are_refused_without_printing_them(flags, capsys, monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    assert front_door(_gateway_args(*flags)) is None
    err = capsys.readouterr().err
    assert "API key" in err and (not flags[1] or flags[1] not in err)


def test_limits_below_one_are_refused(monkeypatch):
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    assert front_door(_gateway_args("--max-concurrent-requests", "0")) is None
    assert front_door(_gateway_args("--max-body-bytes", "0")) is None


def test_an_unhandled_error_is_an_openai_500_with_the_request_id_and_counted():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from baton.services.gateway.app import REQUEST_ID_HEADER, RequestIdMiddleware
    from baton.services.gateway.metrics import GatewayMetrics

    app = FastAPI()
    metrics = GatewayMetrics("m")

    @app.get("/v1/models")
    async def broken():
        raise RuntimeError("a bug, not the client's doing")

    app.add_middleware(RequestIdMiddleware, metrics=metrics)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/v1/models", headers={REQUEST_ID_HEADER: "req-42"})
    assert r.status_code == 500
    assert r.headers[REQUEST_ID_HEADER] == "req-42"
    assert r.json()["error"]["type"] == "server_error" and "a bug" not in r.text
    counted = metrics.registry.get_sample_value(
        "baton:http_requests_total", {"endpoint": "/v1/models", "status": "500"}
    )
    assert counted == 1
