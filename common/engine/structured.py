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

Speculation: a verified request's rows are masked too, row j by the grammar's bitmask after the
output and the first j proposals (``verify_mask``: the matcher accepts them, fills each row, and
rolls back), so a proposal the grammar forbids is rejected and the bonus token is drawn under the
mask, as plain sampling would draw it. Proposals are cut where the grammar refuses one and before
any stop token (``trim_proposal``): a verified row never follows the grammar's end.

``min_tokens``: every request's EOS and stop token ids are masked while it has fewer output tokens
(vLLM's ``MinTokensLogitsProcessor``), on top of its grammar. Where the grammar allows only an
ending (a short schema completed early), the ending stays allowed and the request stops there,
short of ``min_tokens``: the grammar wins, as in vLLM (PR #54218) since that conflict emptied the
mask and failed the request (HTTP 500, vLLM issue #53665).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from baton.common.engine.request import Request
from baton.common.engine.sampling_params import StructuredOutputsParams
from baton.common.engine.structured_spec import REFUSAL_PREFIX, check_spec

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


@dataclass(frozen=True)
class GrammarMask:
    """What one step's rows may sample: their grammars' token bitmask and the stop tokens that
    ``min_tokens`` holds back. Rows are those of the logits it is applied to."""

    bitmask: torch.Tensor | None  # [S, ceil(V / 32)] int32, one row per logits row; None: no grammar
    rows: tuple[int, ...]
    """The rows the bitmask applies to (others are left alone)."""
    vocab_size: int
    dead_ends: tuple[int, ...] = ()
    """Rows whose grammar no token of the vocabulary can continue: they may only stop."""
    stop_token_id: int = 0
    banned: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(row, token ids): stop tokens masked until the row's request has ``min_tokens`` tokens."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [S, V] fp32 with every token the grammar forbids at -inf, in place."""
        if self.bitmask is not None and self.rows:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(
                logits, self.bitmask, vocab_size=self.vocab_size, indices=list(self.rows)
            )
        for i in self.dead_ends:
            logits[i, self.stop_token_id] = 0.0
        for i, ids in self.banned:
            _ban_unless_only(logits[i], list(ids))
        return logits


def _ban_unless_only(row: torch.Tensor, ids: list[int]) -> None:
    """Mask ``ids`` in ``row`` [V], unless nothing else is allowed (see the module doc)."""
    saved = row[ids].clone()
    row[ids] = float("-inf")
    if not bool(torch.isfinite(row).any()):
        row[ids] = saved


def min_tokens_ban(req: Request, ahead: int = 0) -> tuple[int, ...]:
    """The token ids ``req`` may not sample ``ahead`` tokens after its output so far: its stop
    tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) while it is short of ``min_tokens``."""
    params = req.sampling_params
    if req.num_output_tokens + ahead >= params.min_tokens:
        return ()
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= req.eos_token_ids
    return tuple(sorted(ids))


@dataclass
class _State:
    matcher: Any  # xgrammar.GrammarMatcher
    fed: int = 0
    """Output tokens the matcher has accepted."""
    dead: bool = False
    """No token could continue the grammar (see ``mask``): the request was made to stop."""
    ended_at: int | None = None
    """The output index of the stop token the grammar ended on."""


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
        try:
            check_spec(spec)
        except ValueError as e:
            raise ValueError(f"{REFUSAL_PREFIX}{e}") from None
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every bad spec
            raise ValueError(f"{REFUSAL_PREFIX}the {spec.kind} cannot be compiled: {error_text(e)}") from None
        if not self._can_start(compiled):
            raise ValueError(f"{REFUSAL_PREFIX}no token can start an output of this {spec.kind}")
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

        state = _State(xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=self._stops(req)))
        if not self._feed(state, req):
            raise ValueError("resumed token ids do not follow the request's structured_outputs grammar")
        self._states[req.request_id] = state

    def _stops(self, req: Request) -> list[int] | None:
        """The tokens that may end ``req``'s grammar: the engine's, and the request's own
        ``stop_token_ids`` (vLLM's ``override_stop_tokens``); None keeps the compiled grammar's."""
        own = req.sampling_params.stop_token_ids
        return sorted(set(self.stop_token_ids) | set(own)) if own else None

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def _live(self, request_id: str) -> _State | None:
        s = self._states.get(request_id)
        return s if s is not None and not s.dead and not s.matcher.is_terminated() else None

    def mask(
        self, sample_ids: Sequence[str], requests: Mapping[str, Request] | None = None
    ) -> GrammarMask | None:
        """The mask of the step's sampled rows: the bitmask of those with a live grammar, and the
        stop tokens of those short of ``min_tokens`` (with ``requests``); None when no row has
        either. A matcher that has terminated (its stop token accepted, ``ignore_eos`` going on)
        masks nothing. A grammar that no token can continue (a character the vocabulary cannot
        spell: byte-level vocabularies lack some bytes) stops its request there, instead of
        sampling from nothing; that output does not match its grammar, as none could."""
        rows = [i for i, rid in enumerate(sample_ids) if self._live(rid) is not None]
        banned = _bans((requests[rid], i, 0) for i, rid in enumerate(sample_ids)) if requests else ()
        if not rows:
            return GrammarMask(None, (), self.vocab_size, banned=banned) if banned else None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(sample_ids), self.vocab_size)
        dead = []
        for i in rows:
            state = self._states[sample_ids[i]]
            if not self._fill(state, bitmask, i):
                log.warning("request %s: no token can continue its grammar; it stops", sample_ids[i])
                state.dead = True
                dead.append(i)
        return GrammarMask(bitmask, tuple(rows), self.vocab_size, tuple(dead), self._stop_token, banned)

    @property
    def _stop_token(self) -> int:
        return self.stop_token_ids[0] if self.stop_token_ids else 0

    @staticmethod
    def _fill(state: _State, bitmask: torch.Tensor, row: int) -> bool:
        """Fill ``bitmask[row]`` from the matcher; False when it allows no token (a dead end)."""
        state.matcher.fill_next_token_bitmask(bitmask, row)
        return bool(bitmask[row].any())

    def verify_mask(self, groups: Sequence, requests: Mapping[str, Request]) -> GrammarMask | None:
        """The mask of a step's verified rows, laid out as ``rejection.verify`` gathers them (each
        group's 1 + k rows in turn): row j of a request with a grammar is its bitmask after the
        output and the first j proposals; a proposal the grammar refuses ends the masked rows
        (the rows after it are never kept). Stop tokens are held back per row for ``min_tokens``.
        None when no row needs a mask."""
        import xgrammar as xgr

        total = sum(len(g.draft) + 1 for g in groups)
        bitmask: torch.Tensor | None = None
        rows: list[int] = []
        dead: list[int] = []
        bans: list[tuple[Request, int, int]] = []
        base = 0
        for g in groups:
            req = requests[g.request_id]
            bans += [(req, base + j, j) for j in range(len(g.draft) + 1)]
            state = self._live(g.request_id)
            if state is not None:
                if bitmask is None:
                    bitmask = xgr.allocate_token_bitmask(total, self.vocab_size)
                self._fill_draft(state, g.draft, bitmask, base, rows, dead)
            base += len(g.draft) + 1
        banned = _bans(bans)
        if bitmask is None and not banned:
            return None
        return GrammarMask(bitmask, tuple(rows), self.vocab_size, tuple(dead), self._stop_token, banned)

    def _fill_draft(self, state: _State, draft, bitmask, base: int, rows: list, dead: list) -> None:
        """Fill rows ``base ..`` for the matcher after each prefix of ``draft``, then roll it back."""
        accepted = 0
        for j in range(len(draft) + 1):
            rows.append(base + j)
            if not self._fill(state, bitmask, base + j):
                dead.append(base + j)  # only a stop: ``_feed`` takes it as the dead end it is
                break
            if j == len(draft) or not state.matcher.accept_token(draft[j]):
                break
            accepted += 1
            if state.matcher.is_terminated():  # a stop token: the rows after it are free text
                break
        if accepted:
            state.matcher.rollback(accepted)

    def trim_proposal(self, req: Request, tokens: Sequence[int]) -> list[int]:
        """``tokens`` (proposed after ``req``'s output) up to the first that its grammar refuses or
        that would stop it (see the module doc); all of them for a request without a live one.
        Only for proposals that do not depend on a draw (n-grams, a greedy draft): cutting a
        sampled draft where it leaves the grammar would bias the rejection sampling."""
        state = self._live(req.request_id)
        if state is None or not tokens:
            return list(tokens)
        stops = set(req.sampling_params.stop_token_ids) | req.eos_token_ids | set(self.stop_token_ids)
        kept = 0
        for t in tokens:
            if t in stops or not state.matcher.accept_token(t):
                break
            kept += 1
        if kept:
            state.matcher.rollback(kept)
        return list(tokens[:kept])

    def ended_early(self, requests: Sequence[Request], max_drop: int) -> list[str]:
        """Requests still running whose grammar has ended on a stop token before ``min_tokens``
        (the only token it allowed, see the module doc): the engine stops them there. Tokens a
        multi-token step appended after that stop (at most ``max_drop``) are dropped."""
        out = []
        for req in requests:
            state = self._states.get(req.request_id)
            if state is None or req.is_finished or state.ended_at is None:
                continue
            if state.ended_at >= req.num_output_tokens:  # dropped since (a stop string)
                continue
            params, last = req.sampling_params, req.output_token_ids[state.ended_at]
            if params.ignore_eos or last not in req.eos_token_ids:
                continue
            past = req.num_output_tokens - 1 - state.ended_at
            if past > max_drop:
                continue  # not this step's: free text after the grammar (ignore_eos), as it was
            req.drop_output(past)
            req.stop_reason = None
            out.append(req.request_id)
        return out

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
            if not state.matcher.accept_token(t) and not self._dead_end_stop(state, t):
                log.warning("request %s: token %d does not follow its grammar", req.request_id, t)
                return False
            if state.matcher.is_terminated():
                state.ended_at = state.fed
            state.fed += 1
        return True

    def _dead_end_stop(self, state: _State, token: int) -> bool:
        """Whether ``token`` is the stop a dead end forced (a verified row found it, ``mask`` did
        not see it); the grammar is then dead (see ``mask``)."""
        if token != self._stop_token:
            return False
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        state.dead = not self._fill(state, bitmask, 0)
        return state.dead


def _bans(rows) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """((row, stop tokens held back), ...) of ``(request, row, tokens ahead)`` triples."""
    return tuple((i, ids) for req, i, ahead in rows if (ids := min_tokens_ban(req, ahead)))
