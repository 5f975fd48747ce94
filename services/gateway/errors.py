"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

DEFAULT_RETRY_AFTER_S = 1
"""``Retry-After`` on a 429 or 503 that names none: both are worth retrying, and one second is what
the admission limit's rejections say (a slot frees as soon as any stream ends)."""


class APIError(Exception):
    """An error the client sees, with its HTTP status and any headers it carries."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        retry_after: int | None = None,
    ) -> None:
        """``retry_after`` (seconds) becomes ``Retry-After``; 429s and 503s get one by default."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if retry_after is None and status in (429, 503):
            retry_after = DEFAULT_RETRY_AFTER_S
        if retry_after is not None:
            self.headers.setdefault("Retry-After", str(retry_after))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The JSON response. ASCII-escaped: a message that quotes the client's input (a model name
        with a lone surrogate, say) must still encode, or the error itself would be a 500."""
        content = json.dumps(self.body(), ensure_ascii=True, separators=(",", ":"))
        return Response(content, status_code=self.status, headers=self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")


def unavailable(message: str, code: str | None = None) -> APIError:
    return APIError(503, message, type="server_error", code=code)


def unauthorized() -> APIError:
    """No key, or not one of the gateway's (OpenAI's answer, which names neither)."""
    return APIError(
        401,
        "invalid or missing API key: send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def too_many_requests(limit: int) -> APIError:
    return APIError(
        429,
        f"the gateway is at its limit of {limit} concurrent requests; retry shortly",
        type="rate_limit_error",
        code="too_many_requests",
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large", param=None
    )


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 from FastAPI's ``RequestValidationError.errors()``: the first error, named by the
    top-level field it is about."""
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if loc == ["body"]:
        return bad_request(f"the request body is invalid: {err['msg']}")
    param = loc[1] if len(loc) > 1 and loc[0] == "body" else (loc[-1] if loc else None)
    forms = _union_members(errors, err.get("loc", ()))
    if len(forms) > 1:  # pydantic tries each member of a union: its first error says little
        return bad_request(f"invalid value for '{param}': expected one of {', '.join(forms)}", param=param)
    return bad_request(f"invalid value for '{param}': {err['msg']}", param=param)


def _union_members(errors: list[dict[str, Any]], loc: tuple) -> list[str]:
    """The members of the union at ``loc[:2]`` that the value failed, as pydantic tags them
    (``str``, ``list[int]``...), when the errors are a union's."""
    members = []
    for e in errors:
        where = tuple(e.get("loc", ()))
        if where[:2] == tuple(loc[:2]) and len(where) > 2 and isinstance(where[2], str):
            if where[2] not in members:
                members.append(where[2])
    return members
