"""Structured outputs through xgrammar: a compiled grammar per spec (cached), a ``GrammarMatcher`` per
request, the token bitmask of the rows that have one, and jump-forward decoding.

A request's matcher has accepted exactly its output tokens so far: ``advance`` feeds it whatever the
step appended (one sampled token, a migrated request's resumed tokens, several accepted at once), so
a resumed request replays its grammar state from the tokens already sent.

Jump-forward: when the grammar allows one continuation only (``find_jump_forward_string``), its
tokens are appended to the output without being sampled. The scheduler gives a running request
``num_tokens - num_computed_tokens`` tokens, so the next step computes them as one chunk (the
prefill-with-context path) and samples after the last: no rollback. Retokenizing at the boundaries
keeps the token sequence what the tokenizer would make of the text (SGLang's lesson: a forced
string cut at a token boundary the model would not choose drifts it out of distribution):

- the front: the forced text is encoded together with the text of the last output token, and the
  jump is taken only when that token survives the encoding unchanged (else the model samples one
  more token and the jump is tried again after it);
- the back: the forced string's last token is left to the model, which may merge it with what
  follows (``": "`` then ``"J`` can be one token ``" "J``... or not); the mask still allows only
  continuations of the grammar.

Forced tokens never take a request's last token slot (``max_tokens``, the context): the request
always ends on a sampled token, so the stop checks of the scheduler see every ending.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from baton.common.engine.request import Request
from baton.common.engine.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_COMPILED_GRAMMARS = 256
"""Compiled grammars kept (least recently used dropped first): a spec seen again compiles once."""
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: (Check failed: .*? is false: )?")


def error_text(e: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, on one line."""
    return _XGR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__


def _choice_ebnf(choices: Sequence[str]) -> str:
    # JSON string literals are valid EBNF string literals in xgrammar's dialect (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Compact separators, no free whitespace: a small model given "any whitespace" can emit newlines
# until max_tokens, and fixed separators make the forced strings (jump-forward) longer.
_JSON_OPTIONS = {"any_whitespace": False}


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` unless xgrammar can build the grammar of ``spec``. No tokenizer needed:
    the gateway checks a request with it before sending it on."""
    import xgrammar as xgr

    for text in (spec.json, spec.regex, spec.grammar, *(spec.choice or ())):
        if isinstance(text, str) and not _is_utf8(text):
            raise ValueError(f"the {spec.kind} is not valid Unicode (a lone surrogate?)")
    try:
        kind = spec.kind
        if kind == "json":
            json.loads(spec.json)  # type: ignore[arg-type]
            xgr.Grammar.from_json_schema(spec.json, **_JSON_OPTIONS)  # type: ignore[arg-type]
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)  # type: ignore[arg-type]
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))  # type: ignore[arg-type]
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)  # type: ignore[arg-type]
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every bad spec
        raise ValueError(f"the {spec.kind} cannot be compiled: {error_text(e)}") from None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class GrammarMask:
    """The token bitmask of one step's sampled rows that have a grammar."""

    bitmask: torch.Tensor  # [S, ceil(V / 32)] int32, one row per sampled row
    rows: tuple[int, ...]
    """The sampled rows it applies to (others are left alone)."""
    vocab_size: int
    dead_ends: tuple[int, ...] = ()
    """Rows whose grammar no token of the vocabulary can continue: they may only stop."""
    stop_token_id: int = 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [S, V] fp32 with every token the grammar forbids at -inf, in place."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, self.bitmask, vocab_size=self.vocab_size, indices=list(self.rows)
        )
        for i in self.dead_ends:
            logits[i, self.stop_token_id] = 0.0
        return logits


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    fed: int = 0
    """Output tokens the matcher has accepted."""
    dead: bool = False
    """No token could continue the grammar (see ``mask``): the request was made to stop."""


@dataclass
class StructuredStats:
    """Totals since start, over structured requests (``common/metrics.py``)."""

    sampled_tokens: int = 0
    """Tokens sampled: one per forward step that sampled for a structured request."""
    forced_tokens: int = 0
    """Tokens appended by jump-forward, computed without being sampled."""
    jumps: int = 0
    """Jump-forwards taken."""
    compiled: int = 0
    """Grammars compiled (cache misses)."""

    @property
    def forward_steps_per_output_token(self) -> float:
        total = self.sampled_tokens + self.forced_tokens
        return self.sampled_tokens / total if total else 0.0


@dataclass
class StructuredOutputs:
    """An engine's grammars and matchers. The compiler is built on the first structured request
    (its tokenizer table takes ~0.5 s for a 49k vocabulary)."""

    tokenizer: Any
    vocab_size: int
    """The model's vocabulary (logit columns), at least the tokenizer's."""
    stop_token_ids: Sequence[int]
    max_model_len: int
    """The engine's context: forced tokens leave room for one sampled token within it."""
    jump_forward: bool = True
    """Append forced continuations without sampling them (off: every token is sampled)."""
    stats: StructuredStats = field(default_factory=StructuredStats)

    def __post_init__(self) -> None:
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._states: dict[str, _State] = {}

    # -- grammars ------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec`` (cached); ``ValueError`` when it cannot be compiled."""
        key = spec.key
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            return found
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs: the JSON schema is not valid JSON: {e}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every bad spec
            raise ValueError(
                f"structured_outputs: the {spec.kind} cannot be compiled: {error_text(e)}"
            ) from None
        if not self._can_start(compiled):
            raise ValueError(f"structured_outputs: no token can start an output of this {spec.kind}")
        self.stats.compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _can_start(self, compiled) -> bool:
        """Whether any token begins an output (a grammar whose language is empty allows none)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    @staticmethod
    def _compile(compiler, spec: StructuredOutputsParams):
        kind = spec.kind
        if kind == "json":
            json.loads(spec.json)  # type: ignore[arg-type]
            return compiler.compile_json_schema(spec.json, **_JSON_OPTIONS)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', **_JSON_OPTIONS)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(spec.choice))  # type: ignore[arg-type]
        return compiler.compile_grammar(spec.grammar)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    # -- requests ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Give a structured request its matcher, replaying the output it already has (a migrated
        request's resumed tokens); ``ValueError`` when those do not follow the grammar."""
        spec = req.sampling_params.structured_outputs
        if spec is None:
            return
        import xgrammar as xgr

        state = _State(xgr.GrammarMatcher(self.compile(spec)))
        if not self._feed(state, req):
            raise ValueError("resumed token ids do not follow the request's structured_outputs grammar")
        self._states[req.request_id] = state

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def mask(self, sample_ids: Sequence[str]) -> GrammarMask | None:
        """The bitmask of the step's sampled rows that have a live grammar; None when none has.
        A matcher that has terminated (its stop token accepted, ``ignore_eos`` going on) masks
        nothing. A grammar that no token can continue (a character the vocabulary cannot spell:
        byte-level vocabularies lack some bytes) stops its request there, instead of sampling
        from nothing; that output does not match its grammar, as none could."""
        rows = [
            i
            for i, rid in enumerate(sample_ids)
            if (s := self._states.get(rid)) is not None and not s.dead and not s.matcher.is_terminated()
        ]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(sample_ids), self.vocab_size)
        dead = []
        for i in rows:
            state = self._states[sample_ids[i]]
            state.matcher.fill_next_token_bitmask(bitmask, i)
            if not bool(bitmask[i].any()):
                log.warning("request %s: no token can continue its grammar; it stops", sample_ids[i])
                state.dead = True
                dead.append(i)
        stop = self.stop_token_ids[0] if self.stop_token_ids else 0
        return GrammarMask(bitmask, tuple(rows), self.vocab_size, tuple(dead), stop)

    def advance(self, requests: Sequence[Request]) -> list[str]:
        """After a step: feed each structured request's new output tokens to its matcher, then
        jump forward where the grammar forces a continuation. Returns the ids of requests whose
        new tokens the grammar refused (the engine fails them)."""
        refused = []
        for req in requests:
            state = self._states.get(req.request_id)
            if state is None:
                continue
            self.stats.sampled_tokens += 1
            if not self._feed(state, req):
                refused.append(req.request_id)
            elif not req.is_finished:
                self.jump(req)
        return refused

    def jump(self, req: Request) -> int:
        """Append the grammar's forced continuation to ``req``'s output (see the module doc);
        returns how many tokens were appended."""
        state = self._states.get(req.request_id)
        if not self.jump_forward or state is None or state.matcher.is_terminated():
            return 0
        room = self._room(req)
        if room <= 0:
            return 0
        forced = state.matcher.find_jump_forward_string()
        if not forced:
            return 0
        tokens = self._forced_tokens(req, forced)[: min(room, self.max_model_len - req.num_tokens - 1)]
        taken = 0
        logprob = 0.0 if req.sampling_params.logprobs is not None else None
        params = req.sampling_params
        for t in tokens:
            if t in params.stop_token_ids or t in req.eos_token_ids:
                break
            if not state.matcher.accept_token(t):
                break
            req.append_output(t, logprob)  # forced: probability 1 under the grammar
            state.fed += 1
            taken += 1
        if taken:
            self.stats.forced_tokens += taken
            self.stats.jumps += 1
        return taken

    def _forced_tokens(self, req: Request, forced: str) -> list[int]:
        """The tokens of ``forced`` as they follow the output so far, canonical at both ends, or
        none (see the module doc)."""
        tok = self.tokenizer
        tokens: list[int]
        if req.output_token_ids:
            last = req.output_token_ids[-1]
            head = tok.decode([last])
            both = tok.encode(head + forced, add_special_tokens=False)
            if not both or both[0] != last or tok.decode(both[1:]) != forced:
                return []
            tokens = both[1:]
        else:
            tokens = tok.encode(forced, add_special_tokens=False)
        return tokens[:-1]

    @staticmethod
    def _room(req: Request) -> int:
        """Forced tokens ``req`` can take and still end on a sampled token."""
        params = req.sampling_params
        return 1 << 30 if params.max_tokens is None else params.max_tokens - req.num_output_tokens - 1

    def _feed(self, state: _State, req: Request) -> bool:
        """Feed the output tokens the matcher has not seen; False at the first it refuses."""
        for t in req.output_token_ids[state.fed :]:
            if state.dead or state.matcher.is_terminated():
                state.fed = req.num_output_tokens  # ignore_eos: free text after the grammar ended
                return True
            if not state.matcher.accept_token(t):
                log.warning("request %s: token %d does not follow its grammar", req.request_id, t)
                return False
            state.fed += 1
        return True
