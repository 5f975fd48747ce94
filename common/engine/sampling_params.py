"""Sampling parameters, shaped like vLLM's ``SamplingParams``. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: the smallest temperature that is sampled rather than greedy."""


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of the fields.
    Enforced by ``common/engine/structured.py`` (xgrammar); this module only checks the shape.
    Its values are normalised when it is made (a dict schema to its JSON text, a choice list to a
    tuple) and not changed after."""

    json: str | dict | None = None
    """A JSON schema (a dict or its JSON text); kept as JSON text, key order preserved."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's GBNF dialect, ``root ::= ...``)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)
        if self.choice is not None:
            self.choice = tuple(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            kinds = "json, json_object, regex, choice, grammar"
            raise ValueError(f"structured_outputs must set exactly one of {kinds}; got {given or 'none'}")

    @property
    def kind(self) -> str:
        """Which field is set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar (the compiled-grammar cache's key)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            value = json.dumps(list(value), ensure_ascii=False)
        return self.kind, "" if value is True else str(value)


@dataclass
class SamplingParams:
    """How to sample one completion. Invalid values raise ``ValueError`` naming the parameter.
    Normalised when made (``stop`` and ``stop_token_ids`` to tuples), as vLLM's; a variant is made
    with ``dataclasses.replace``, never by assigning a field of one in use."""

    n: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """0 (or anything below ``SAMPLING_EPS``) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop token ids may end the request."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion; not included in the text."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (besides EOS)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    logprobs: int | None = None
    """Return the log-probability of each chosen token when set (0 or more)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (structured outputs)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Unvalidated pass-through for callers (request metadata)."""

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        self._validate()

    def _validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``SAMPLING_EPS`` are greedy (vLLM's rule): dividing logits by a tiny
        temperature would overflow to inf, and the argmax is what such a temperature means."""
        return self.temperature < SAMPLING_EPS
