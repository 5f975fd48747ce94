"""What can be known of a structured-output spec without compiling it (no torch, no xgrammar).

The gateway checks every request's spec here before routing it; the engine runs the same checks
before it compiles (``structured.StructuredOutputs.compile``). Only the compiler knows whether its
dialect takes a schema's keywords, a regex or an EBNF grammar: a spec that passes here and does not
compile is refused by the worker with ``structured_outputs: ...``, which the gateway answers as a
400 naming the request's field (``services/gateway/dispatch.rpc_error``). xgrammar is not asked
here because importing it imports torch (its matcher and testing modules, as of 0.2.9).
"""

from __future__ import annotations

import json

from baton.common.engine.sampling_params import StructuredOutputsParams

REFUSAL_PREFIX = "structured_outputs: "
"""How the engine's refusal of a spec begins (the gateway recognises it in a worker's error)."""


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` when ``spec`` cannot be a grammar whatever the compiler: text that is
    not valid Unicode (a lone surrogate, which no protobuf string or tokenizer carries), a JSON
    schema that is not JSON, or JSON that is not a schema (an object or a boolean)."""
    for text in (spec.json, spec.regex, spec.grammar, *(spec.choice or ())):
        if isinstance(text, str) and not _is_utf8(text):
            raise ValueError(f"the {spec.kind} is not valid Unicode (a lone surrogate?)")
    if spec.kind == "json":
        try:
            schema = json.loads(spec.json)  # type: ignore[arg-type]
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"the JSON schema must be an object or a boolean, not {type(schema).__name__}")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
