"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client sees, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")


def unavailable(message: str, code: str | None = None) -> APIError:
    return APIError(503, message, type="server_error", code=code)


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
    return bad_request(f"invalid value for '{param}': {err['msg']}", param=param)
