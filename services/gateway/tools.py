"""Structured-output fields and tool calls of the OpenAI API.

Structured outputs: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` become one ``StructuredOutputsParams``; a spec that cannot be a grammar is a 400
naming the field the client used, here (``structured_spec.check_spec``: no torch, no xgrammar) or,
when only the compiler can tell, once the worker refuses it (``dispatch.rpc_error``).

Tool calls (``tools``, ``tool_choice``). SmolLM2's chat template has no tool format, so Baton uses
the Hermes format, as vLLM's ``hermes`` parser reads it: the tools are described in the system
message inside ``<tools></tools>``, the model answers each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, an assistant message's ``tool_calls``
go back into the conversation in that form, and a ``tool`` message goes back as a user turn inside
``<tool_response></tool_response>``. ``tool_choice``:

- ``none``: no tools in the prompt, plain text back;
- ``auto`` (the default with tools): the model chooses; ``<tool_call>`` blocks in its output are
  parsed into ``tool_calls`` (finish reason ``tool_calls``), the rest is ``content``;
- ``required``: the output is constrained (structured outputs) to a JSON array of one or more
  ``{"name", "parameters"}`` calls of the given tools, as vLLM does;
- a named function: the output is constrained to that function's parameters schema and is its
  arguments (finish reason ``stop``, as OpenAI's).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.common.engine.sampling_params import StructuredOutputsParams
from baton.common.engine.structured_spec import check_spec as check
from baton.services.gateway.errors import bad_request

Json = dict[str, Any]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # "schema" would shadow a BaseModel method
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs`` request field."""

    json_: dict | str | None = Field(None, alias="json")  # "json" would shadow a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# -- structured outputs ------------------------------------------------------------------------
def structured_spec(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that gave it (None, None: unconstrained).
    More than one constraint is a 400."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    try:
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs a schema", "response_format")
            found.append((StructuredOutputsParams(json=rf.json_schema.schema_), "response_format"))
        so = body.structured_outputs
        if so is not None:
            spec = StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
            )
            found.append((spec, "structured_outputs"))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(body, f"guided_{name}")
            if value is not None:
                found.append((StructuredOutputsParams(**{name: value}), f"guided_{name}"))
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from None
    if len(found) > 1:
        names = ", ".join(n for _, n in found)
        raise bad_request(f"at most one output constraint per request, got {names}", found[1][1])
    return found[0] if found else (None, None)


def check_spec(spec: StructuredOutputsParams, param: str) -> None:
    """A 400 naming ``param`` when ``spec`` cannot be a grammar (see the module doc)."""
    try:
        check(spec)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


# -- tool choice -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolMode:
    """How one chat request uses its tools."""

    tools: tuple[Tool, ...]
    choice: str
    """``auto``, ``required`` or ``named`` (``none`` is no ``ToolMode``)."""
    name: str | None = None
    """The function of a named choice."""

    def spec(self) -> StructuredOutputsParams | None:
        """The output constraint ``required`` and named choices are enforced by."""
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.tools))
        if self.choice == "named":
            return StructuredOutputsParams(json=parameters_schema(self._named()))
        return None

    def _named(self) -> Tool:
        return next(t for t in self.tools if t.function.name == self.name)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.choice == "named" else "tool_calls"


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolMode | None:
    """The request's tool use; None where it has none (no tools, or ``tool_choice`` none)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise bad_request(
                f"tool_choice names '{tool_choice.function.name}', which is not a tool", "tool_choice"
            )
        return ToolMode(tuple(tools), "named", tool_choice.function.name)
    return ToolMode(tuple(tools), tool_choice or "auto")


def parameters_schema(tool: Tool) -> Json:
    return tool.function.parameters or {"type": "object"}


def required_schema(tools: tuple[Tool, ...]) -> Json:
    """One or more calls, each naming a tool and giving its parameters (vLLM's ``required``)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


# -- the prompt --------------------------------------------------------------------------------
def tools_system_prompt(tools: tuple[Tool, ...]) -> str:
    """The Hermes-format description of the tools (NousResearch's Hermes 2 Pro prompt)."""
    specs = "\n".join(
        json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)}) for t in tools
    )
    return (
        "You are a function calling AI model. You are provided with function signatures within "
        "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
        "Don't make assumptions about what values to plug into functions.\n"
        f"<tools>\n{specs}\n</tools>\n"
        "For each function call return a json object with function name and arguments within "
        f"{TOOL_CALL_START}{TOOL_CALL_END} XML tags as follows:\n"
        f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_END}'
    )


def template_messages(messages: list[dict], extras: list[dict], mode: ToolMode | None) -> list[dict]:
    """Messages for a chat template without a tool format: the tools in the system message,
    assistant ``tool_calls`` as ``<tool_call>`` blocks, ``tool`` results as user turns.
    ``extras``: each message's fields beyond role and content."""
    out = []
    for msg, extra in zip(messages, extras):
        role, content = msg["role"], msg["content"]
        if role == "assistant" and extra.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_block(c) for c in extra["tool_calls"]])
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if mode is not None:
        prompt = tools_system_prompt(mode.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_block(call: Any) -> str:
    try:
        fn = call["function"]
        args = fn.get("arguments") or "{}"
        arguments = json.loads(args) if isinstance(args, str) else args
        body = json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False)
    except (TypeError, KeyError, ValueError, AttributeError):
        raise bad_request(
            "an assistant message's tool_calls must be function calls with JSON arguments", "messages"
        ) from None
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


# -- the output --------------------------------------------------------------------------------
def new_call(name: str, arguments: str) -> Json:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _as_call(obj: Any, args_key: str) -> Json | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    return new_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str, list[Json]]:
    """``<tool_call>`` blocks out of ``text``: (the rest, stripped; the calls). A block that is not
    a JSON call stays in the text."""
    content, calls, pos = [], [], 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        end = text.find(TOOL_CALL_END, start)
        stop = len(text) if end < 0 else end
        try:
            call = _as_call(json.loads(text[start + len(TOOL_CALL_START) : stop]), "arguments")
        except ValueError:
            call = None
        if call is None:
            content.append(text[pos : stop + len(TOOL_CALL_END) * (end >= 0)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = len(text) if end < 0 else end + len(TOOL_CALL_END)
    content.append(text[pos:])
    return "".join(content).strip(), calls


def parse_output(mode: ToolMode, text: str) -> tuple[str | None, list[Json]]:
    """(content, tool_calls) of a whole output."""
    if mode.choice == "named":
        return None, [new_call(mode.name or "", text)]
    if mode.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in (_as_call(i, "parameters") for i in items) if c is not None]
        return (None, calls) if calls else (text, [])
    content, calls = parse_hermes(text)
    return (content or None) if calls else text, calls


@dataclass
class ToolStream:
    """Turns one choice's streamed text into ``delta``s: content as it comes, a named call's
    arguments as they come, other calls whole as each completes (Hermes blocks) or at the end."""

    mode: ToolMode
    buffer: str = ""
    calls: list[Json] = field(default_factory=list)
    started: bool = False

    def feed(self, text: str, final: bool) -> list[Json]:
        if self.mode.choice == "named":
            return self._named(text)
        self.buffer += text
        if self.mode.choice == "required":
            return self._flush_required() if final else []
        return self._auto(final)

    def _named(self, text: str) -> list[Json]:
        if not self.started:
            self.started = True
            call = new_call(self.mode.name or "", text)
            self.calls.append(call)
            return [{"tool_calls": [{"index": 0, **call}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _flush_required(self) -> list[Json]:
        content, calls = parse_output(self.mode, self.buffer)
        self.buffer = ""
        return self._emit(calls) if calls else ([{"content": content}] if content else [])

    def _emit(self, calls: list[Json]) -> list[Json]:
        deltas = [{"tool_calls": [{"index": len(self.calls) + i, **c}]} for i, c in enumerate(calls)]
        self.calls.extend(calls)
        return deltas

    def _auto(self, final: bool) -> list[Json]:
        deltas: list[Json] = []
        while True:
            start = self.buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.buffer, TOOL_CALL_START)
                text, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                if text and not (self.calls and not text.strip()):
                    deltas.append({"content": text})
                return deltas
            if start:
                deltas.append({"content": self.buffer[:start]})
                self.buffer = self.buffer[start:]
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0 and not final:
                return deltas
            block = self.buffer if end < 0 else self.buffer[: end + len(TOOL_CALL_END)]
            self.buffer = "" if end < 0 else self.buffer[end + len(TOOL_CALL_END) :]
            content, calls = parse_hermes(block)
            deltas += self._emit(calls) if calls else [{"content": block}]
            if not self.buffer:
                return deltas


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: it may be a call)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def merge_deltas(deltas: list[Json]) -> Json:
    """One ``delta`` of several: their content joined, their tool calls in order."""
    out: Json = {}
    content = "".join(d["content"] for d in deltas if d.get("content"))
    if content:
        out["content"] = content
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    if calls:
        out["tool_calls"] = calls
    return out
