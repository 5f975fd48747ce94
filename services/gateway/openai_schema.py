"""OpenAI request bodies (pydantic) and their translation into ``SamplingParams``.

Fields the engine does not implement are ignored, as vLLM does; a value the engine rejects becomes a
400 that names the parameter.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from baton.common.engine.sampling_params import SamplingParams
from baton.services.gateway.errors import bad_request

MAX_LOGPROBS = 20
"""Most ``logprobs`` / ``top_logprobs`` a request may ask for (vLLM's default ``max_logprobs``)."""
_INT64 = 2**63


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    """A last chunk with the usage and no choices."""


class _GenerationRequest(_Body):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    """vLLM's extension: each choice carries its ``token_ids`` (the response, its ``prompt_token_ids``)."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> tuple[int | None, str]:
        """The output bound and the name the client gave it. None runs to the model's context."""
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return None

    def sampling_params(self) -> SamplingParams:
        """Validated parameters; a bad value raises a 400 ``APIError`` naming it."""
        max_tokens, max_name = self._max_tokens()
        if self.seed is not None and not -_INT64 <= self.seed < _INT64 - max(self.n, 1):
            raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
        if self.stop_token_ids and any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            raise bad_request("stop_token_ids must be non-negative 32-bit integers", param="stop_token_ids")
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=() if self.stop is None else self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=self._logprobs(),
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e), max_name)) from None


def _param_of(message: str, max_tokens_name: str) -> str | None:
    """The parameter a ``SamplingParams`` error names (its messages start with it)."""
    word = message.split(" ", 1)[0]
    if word == "max_tokens":
        return max_tokens_name
    known = set(SamplingParams.__dataclass_fields__) | {"stop"}
    return word if word in known else None


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def _logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
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

    role: str
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
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_prompt_ids(ids: list[int], param: str) -> None:
    """Empty prompts and ids that cannot travel as int32 stop here; the worker checks the rest."""
    if not ids:
        raise bad_request("prompt must not be empty", param=param)
    if any(not 0 <= t < 2**31 for t in ids):
        raise bad_request("prompt token ids must be non-negative 32-bit integers", param=param)
