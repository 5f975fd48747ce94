"""Worker chunks -> OpenAI responses: ``text_completion`` and ``chat.completion`` bodies, their
streamed ``chunk`` forms, ``usage`` and ``logprobs``.

The engine sends each chosen token's log-probability and, when ``logprobs`` (completions) or
``top_logprobs`` (chat) is above 0, that many most likely tokens at each position (``TopLogprobs``,
most likely first). Completions' ``top_logprobs`` are dicts {token text: logprob} of those and of
the chosen token (vLLM's rule: up to ``logprobs`` + 1 entries; with ``logprobs=0``, the chosen one
alone); chat's are lists of exactly ``top_logprobs`` {token, logprob, bytes}, as OpenAI's. A -inf
log-probability is sent as -9999.0, as vLLM and OpenAI do: JSON has no infinity.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.protos import baton_pb2
from baton.services.gateway.dispatch import SubRequest
from baton.services.gateway.tools import ToolMode, ToolStream, merge_deltas, parse_output

Json = dict[str, Any]

_MIN_LOGPROB = -9999.0


def _lp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def sse(obj: Json | str) -> str:
    """One server-sent event."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


class TokenText:
    """The text of single token ids (as OpenAI's logprobs show them), decoded once each."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


@dataclass
class ChoiceState:
    """What one choice has received so far."""

    index: int
    counts_prompt: bool
    """The first choice of its prompt: its cached-token figure goes into ``usage``."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[baton_pb2.TopLogprobs] = field(default_factory=list)
    """One per token when the request asks for alternatives, else empty."""
    finish_reason: str | None = None
    stop_reason: str | None = None
    num_cached_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_bytes_per_token: int = 0
    text_offset: int = 0
    """Characters of the token texts reported so far (completions' ``logprobs.text_offset``)."""

    def add(self, chunk: baton_pb2.GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.top_logprobs.extend(chunk.top_logprobs)
        self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.kv_transfer_bytes:
            self.kv_transfer_bytes = chunk.kv_transfer_bytes
            self.kv_bytes_per_token = chunk.kv_bytes_per_token
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason or None


class ResponseBuilder:
    """One response's state. ``add`` each chunk; then either ``response()`` (non-streaming) or the
    ``*_chunk(s)`` methods as chunks arrive (streaming)."""

    id_prefix = ""
    object_name = ""
    chunk_object = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        subs: Sequence[SubRequest],
        token_text: TokenText,
        logprobs: bool,
        include_usage: bool = False,
        return_token_ids: bool = False,
    ) -> None:
        self.id = f"{self.id_prefix}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = logprobs
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.prompt_ids = {s.prompt_index: list(s.prompt_token_ids) for s in subs}
        self.prompt_of = {s.index: s.prompt_index for s in subs}
        self.prompt_lengths = {s.prompt_index: len(s.prompt_token_ids) for s in subs}
        firsts = {
            s.prompt_index: min(t.index for t in subs if t.prompt_index == s.prompt_index) for s in subs
        }
        self.choices = {s.index: ChoiceState(s.index, firsts[s.prompt_index] == s.index) for s in subs}

    def add(self, index: int, chunk: baton_pb2.GenerateChunk) -> ChoiceState:
        choice = self.choices[index]
        choice.add(chunk)
        return choice

    def usage(self) -> Json:
        prompt = sum(self.prompt_lengths.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(c.num_cached_tokens for c in self.choices.values() if c.counts_prompt)
        usage: Json = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        moved = sum(c.kv_transfer_bytes for c in self.choices.values())
        if moved:  # Baton's extension: KV that prefill workers sent for these prompts
            usage["kv_transfer_bytes"] = moved
            usage["kv_bytes_per_token"] = max(c.kv_bytes_per_token for c in self.choices.values())
        return usage

    def _with_ids(self, choice: Json, index: int, token_ids: Sequence[int], first: bool = False) -> Json:
        """``choice`` with vLLM's ``token_ids`` (and, on a choice's first form, ``prompt_token_ids``)."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                choice["prompt_token_ids"] = self.prompt_ids[self.prompt_of[index]]
        return choice

    def _envelope(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(self) -> Json:
        choices = [self._final_choice(self.choices[i]) for i in sorted(self.choices)]
        return {**self._envelope(self.object_name, choices), "usage": self.usage()}

    def chunk(self, choices: list[Json]) -> Json:
        body = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> Json:
        return {**self._envelope(self.chunk_object, []), "usage": self.usage()}

    def start_chunks(self) -> list[Json]:
        return []

    def delta_chunk(self, choice: ChoiceState, chunk: baton_pb2.GenerateChunk) -> Json | None:
        raise NotImplementedError

    def _final_choice(self, choice: ChoiceState) -> Json:
        raise NotImplementedError


class CompletionBuilder(ResponseBuilder):
    id_prefix = "cmpl"
    object_name = chunk_object = "text_completion"

    def _logprobs(
        self,
        choice: ChoiceState,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        tops: Sequence[baton_pb2.TopLogprobs],
    ) -> Json | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [_lp(lp) for lp in logprobs],
            "top_logprobs": [
                self._top(tok, lp, tops[i] if i < len(tops) else None)
                for i, (tok, lp) in enumerate(zip(tokens, logprobs))
            ],
            "text_offset": offsets,
        }

    def _top(self, token: str, logprob: float, top: baton_pb2.TopLogprobs | None) -> dict[str, float]:
        """The chosen token first, then the most likely ones (vLLM's order)."""
        out = {token: _lp(logprob)}
        if top is not None:
            for t, lp in zip(top.token_ids, top.logprobs):
                out.setdefault(self.token_text(t), _lp(lp))
        return out

    def _final_choice(self, choice: ChoiceState) -> Json:
        body = {
            "index": choice.index,
            "text": "".join(choice.text),
            "logprobs": self._logprobs(choice, choice.token_ids, choice.logprobs, choice.top_logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        return self._with_ids(body, choice.index, choice.token_ids, first=True)

    def delta_chunk(self, choice: ChoiceState, chunk: baton_pb2.GenerateChunk) -> Json | None:
        wants_ids = (self.want_logprobs or self.return_token_ids) and chunk.token_ids
        if not (chunk.text or chunk.finish_reason or wants_ids):
            return None
        body = {
            "index": choice.index,
            "text": chunk.text,
            "logprobs": self._logprobs(choice, chunk.token_ids, chunk.logprobs, chunk.top_logprobs),
            "finish_reason": chunk.finish_reason or None,
            "stop_reason": (chunk.stop_reason or None) if chunk.finish_reason else None,
        }
        first = len(choice.token_ids) == len(chunk.token_ids)
        return self.chunk([self._with_ids(body, choice.index, chunk.token_ids, first)])


class ChatBuilder(ResponseBuilder):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: ToolMode | None = None, **kwargs) -> None:
        """``tools``: the request's tool use; its calls are parsed out of the text (``tools.py``)."""
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[baton_pb2.TopLogprobs]
    ) -> Json | None:
        if not self.want_logprobs:
            return None
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            entry = self._entry(t, lp)
            top = tops[i] if i < len(tops) else None
            entry["top_logprobs"] = [] if top is None else list(map(self._entry, top.token_ids, top.logprobs))
            content.append(entry)
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> Json:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    def _final_choice(self, choice: ChoiceState) -> Json:
        message: Json = {"role": "assistant", "content": "".join(choice.text)}
        finish = choice.finish_reason
        if self.tools is not None:
            message["content"], calls = parse_output(self.tools, message["content"])
            if calls:
                message["tool_calls"] = calls
                finish = self.tools.finish_reason if finish == "stop" else finish
        body = {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs, choice.top_logprobs),
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
        }
        return self._with_ids(body, choice.index, choice.token_ids)

    def start_chunks(self) -> list[Json]:
        """The first chunk of every choice names the role, as OpenAI's do."""
        return [
            self.chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in sorted(self.choices)
        ]

    def delta_chunk(self, choice: ChoiceState, chunk: baton_pb2.GenerateChunk) -> Json | None:
        wants_ids = (self.want_logprobs or self.return_token_ids) and chunk.token_ids
        delta, finish = self._delta(choice, chunk)
        if not (delta or finish or wants_ids):
            return None
        body = {
            "index": choice.index,
            "delta": delta,
            "logprobs": self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs),
            "finish_reason": finish,
        }
        return self.chunk([self._with_ids(body, choice.index, chunk.token_ids)])

    def _delta(self, choice: ChoiceState, chunk: baton_pb2.GenerateChunk) -> tuple[Json, str | None]:
        """The chunk's ``delta`` and finish reason: its text, or, with tools, its content and calls."""
        finish = chunk.finish_reason or None
        if self.tools is None:
            return ({"content": chunk.text} if chunk.text else {}), finish
        stream = self._tool_streams.setdefault(choice.index, ToolStream(self.tools))
        delta = merge_deltas(stream.feed(chunk.text, final=finish is not None))
        if finish == "stop" and stream.calls:
            finish = self.tools.finish_reason
        return delta, finish
