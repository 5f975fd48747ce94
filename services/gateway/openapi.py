"""What ``/openapi.json`` says the gateway answers: response bodies (for documentation only: the
routes build their JSON themselves), every error status in OpenAI's shape, and the API key.

schemathesis checks the real responses against this (tests/e2e/test_schemathesis.py), so it must
describe them exactly: a field here that a response lacks, or a status a route answers that is not
listed, fails that test.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from baton.services.gateway.auth import is_protected


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: str | int | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: str | int | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    """``/ready``: 200 with ``decode_workers`` and ``prefill_workers``, or 503 with ``reason``."""

    status: Literal["ready", "not ready"]


class WorkerList(BaseModel):
    workers: list[dict[str, Any]]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    what = {
        400: "Invalid request (the parameter is named in error.param)",
        401: "No valid API key (only when the gateway has keys)",
        404: "Unknown model",
        413: "Request body over the gateway's limit",
        429: "Over the gateway's concurrency limit, or a worker's queue is full (see Retry-After)",
        500: "Internal error",
        503: "No worker can take the request now (see Retry-After)",
        504: "The request ran past its deadline on the worker",
    }
    return {s: {"model": ErrorResponse, "description": what[s]} for s in statuses}


SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event (OpenAPI before 3.2: the schema of each event)",
    "properties": {
        "data": {"type": "string", "description": "A chunk as JSON; the last event's is [DONE]"},
        "event": {"type": "string"},
    },
    "required": ["data"],
}


def _sse(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or with ``stream: true`` server-sent events."""
    return {
        200: {
            "model": model,
            "description": "The response; with stream=true, server-sent events of chunks",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        }
    }


def doc(model: type[BaseModel], errors: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses``: ``model`` as its 200, and ``errors``."""
    return {200: {"model": model, "description": "OK"}, **errors}


GENERATION = {**_sse(CompletionResponse), **_errors(400, 401, 404, 413, 429, 500, 503, 504)}
CHAT = {**_sse(ChatCompletionResponse), **_errors(400, 401, 404, 413, 429, 500, 503, 504)}
MODELS = _errors(401, 413)
MODEL = _errors(401, 404, 413)
OPEN = _errors(413)
READY = {
    503: {
        "model": Readiness,
        "description": "No decode worker, fewer prefill workers than expected, or the registry is unreachable",
    }
}
WORKERS = _errors(401, 413, 503)
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}}


def install(app: FastAPI, api_keys: bool) -> None:
    """Make ``app.openapi()`` this gateway's schema: FastAPI's, without the 422 it adds to every
    route with a body (the gateway answers 400, in OpenAI's shape), and with the bearer key on the
    protected paths when the gateway has keys."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _finish(
                get_openapi(title=app.title, version=app.version, routes=app.routes), api_keys
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _finish(schema: dict[str, Any], api_keys: bool) -> dict[str, Any]:
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            if api_keys and is_protected(path):
                operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema
