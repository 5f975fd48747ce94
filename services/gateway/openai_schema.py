"""OpenAI request bodies (pydantic) and their translation into ``SamplingParams``.

Fields the engine does not implement are ignored, as vLLM does; a value the engine rejects becomes a
400 that names the parameter. Every value is checked against what the next hop carries: integers
that travel as int32 on the proto are bounded to it, floats are finite and fit a float32, stop
strings are bounded in number and length.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from baton.common.engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton.services.gateway.errors import bad_request
from baton.services.gateway.tools import (
    ResponseFormat,
    StructuredOutputsBody,
    Tool,
    ToolChoice,
    ToolMode,
    check_spec,
    structured_spec,
    tool_mode,
)

MAX_LOGPROBS = 20
"""Most ``logprobs`` / ``top_logprobs`` a request may ask for (vLLM's default ``max_logprobs``)."""
MAX_STOP_STRINGS = 16
"""Most stop strings per request. OpenAI allows 4 and vLLM any number; every string is matched
against the output's tail at every step, so their number and length are what a step costs."""
MAX_STOP_CHARS = 1024
"""Longest stop string, in characters."""
COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a completion that does not give one: OpenAI's and vLLM's default. A chat
completion has none (as vLLM: as many tokens as the context leaves)."""
Role = Literal["system", "user", "assistant", "tool", "developer", "function"]
"""OpenAI's message roles; any other is a 400 naming ``messages``."""
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
_INT64 = 2**63

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
# Unions are checked by hand (check_prompt_ids, _check_stop), where the message can say what is
# wrong: pydantic reports a union's failure as its first member's ("Input should be a valid
# string"). Their schemas say the same bounds, for clients and for schemathesis.
PromptSchema = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": _TOKEN_ID, "minItems": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1}, "minItems": 1},
        ]
    }
)
StopSchema = WithJsonSchema(
    {"anyOf": [_STOP, {"type": "array", "items": _STOP, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]}
)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Body(BaseModel):
    # NaN and Infinity never parse (body.loads); 1e999 parses as inf, which this refuses.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    """A last chunk with the usage and no choices."""


class _GenerationRequest(_Body):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)
    max_tokens: int | None = Field(
        None, ge=1, le=INT32_MAX, description="At most this many tokens; absent or null, as many as fit"
    )
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: Annotated[str | list[str] | None, StopSchema] = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its ``token_ids`` (the response, its ``prompt_token_ids``)."""
    # Structured outputs (services/gateway/tools.py): OpenAI's, vLLM's, and vLLM's older fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """pydantic's lax mode reads true and false as 1 and 0 for int and float fields: refuse."""
        if isinstance(data, dict):
            for name, info in cls.model_fields.items():
                kinds = set(get_args(info.annotation)) | {info.annotation}
                if kinds & {int, float} and bool not in kinds and isinstance(data.get(name), bool):
                    raise ValueError(f"{name} must be a number, not a boolean")
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> tuple[int | None, str]:
        """The output bound and the name the client gave it. None runs to the model's context."""
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return None

    def _structured(self) -> StructuredOutputsParams | None:
        """The output constraint, checked as far as the gateway can (a 400 naming the field)."""
        spec, param = structured_spec(self)
        if spec is not None:
            check_spec(spec, param or "structured_outputs")
        return spec

    def constraint_field(self) -> str | None:
        """The field that gave the output constraint, for a 400 when the worker cannot compile it."""
        return structured_spec(self)[1]

    def sampling_params(self) -> SamplingParams:
        """Validated parameters; a bad value raises a 400 ``APIError`` naming it."""
        max_tokens, max_name = self._max_tokens()
        structured = self._structured()
        if self.seed is not None and not -_INT64 <= self.seed < _INT64 - max(self.n, 1):
            raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
        _check_stop(self.stop)
        try:
            return SamplingParams(
                n=self.n,
                temperature=_float32(1.0 if self.temperature is None else self.temperature),
                top_p=_float32(1.0 if self.top_p is None else self.top_p),
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=() if self.stop is None else self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=self._logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured,
            )
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e), max_name)) from None


def _float32(value: float) -> float:
    """``value`` as the proto's float32 carries it (the worker checks that value, not ours: a top_p
    of 1e-50 is 0 there). The field bounds keep it finite."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_stop(stop: str | list[str] | None) -> None:
    strings = [stop] if isinstance(stop, str) else (stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}", param="stop")
    for s in strings:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise bad_request(f"stop strings must have 1 to {MAX_STOP_CHARS} characters", param="stop")
        check_text(s, "stop")


def check_text(text: str, param: str) -> None:
    """Text that travels on the proto or into the tokenizer must be valid UTF-8: a lone surrogate
    (JSON's "\\ud800") is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param} is not valid Unicode (a lone surrogate?)", param=param) from None


def _param_of(message: str, max_tokens_name: str) -> str | None:
    """The parameter a ``SamplingParams`` error names (its messages start with it)."""
    word = message.split(" ", 1)[0]
    if word == "max_tokens":
        return max_tokens_name
    known = set(SamplingParams.__dataclass_fields__) | {"stop"}
    return word if word in known else None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], PromptSchema]
    max_tokens: int | None = Field(
        COMPLETION_MAX_TOKENS,
        ge=1,
        le=INT32_MAX,
        description=f"At most this many tokens: {COMPLETION_MAX_TOKENS} if absent; null, as many as fit",
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def _logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: text content only."""
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"content parts of type '{part.type}' are not supported", "messages")
            parts.append(part.text)
        return {"role": self.role, "content": "\n".join(parts)}


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def tool_mode(self) -> ToolMode | None:
        return tool_mode(self.tools, self.tool_choice)

    def _structured(self) -> StructuredOutputsParams | None:
        """``tool_choice`` required or named is enforced by a schema built from the tools."""
        mode = self.tool_mode()
        forced = mode.spec() if mode is not None else None
        if forced is None:
            return super()._structured()
        if structured_spec(self)[0] is not None:
            raise bad_request(
                "a required or named tool_choice cannot be combined with another output constraint",
                "tool_choice",
            )
        check_spec(forced, "tools")
        return forced

    def constraint_field(self) -> str | None:
        mode = self.tool_mode()
        if mode is not None and mode.spec() is not None:
            return "tools"
        return super().constraint_field()

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_prompt_ids(ids: list[int], param: str) -> None:
    """Empty prompts and ids that cannot travel as int32 stop here; the worker checks the rest."""
    if not ids:
        raise bad_request("prompt must not be empty", param=param)
    if any(not 0 <= t <= INT32_MAX for t in ids):
        raise bad_request("prompt token ids must be non-negative 32-bit integers", param=param)
