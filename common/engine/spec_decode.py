"""Speculative decoding's pure half: the options, the n-gram proposer, how many tokens to propose
(a cost model of the step), and the acceptance counters. No torch.

A running request whose ``spec_token_ids`` hold k proposals is scheduled a chunk of 1 + k tokens
(its last token and the proposals); the model computes logits at all of them, and the engine keeps
the longest accepted prefix plus one token sampled after it (``rejection``), rolling back
``num_computed_tokens`` and the KV blocks of the rest (``Scheduler.update_from_output``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """``ngram`` (prompt lookup over the request's own tokens) or ``draft`` (a smaller model)."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per request per step (k)."""
    ngram_min: int = 2
    """Shortest suffix n-gram looked up (vLLM's ``prompt_lookup_min``)."""
    ngram_max: int = 4
    """Longest suffix n-gram looked up (vLLM's ``prompt_lookup_max``); the longest match wins."""
    draft_model: str | None = None
    """The draft model's checkpoint (``draft``): a Llama-family model with the target's tokenizer."""
    adaptive: bool = True
    """Propose fewer tokens (down to none) when the step cost model says they would not pay."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative must be one of {list(METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative 'draft' needs a draft_model")


def ngram_propose(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: find the longest suffix of ``tokens`` (``n_max`` down to ``n_min`` tokens)
    that occurred earlier, and propose the (up to) ``k`` tokens that followed its most recent
    earlier occurrence: the most recent copy is the one an edit or a summary is copying now."""
    if k <= 0 or len(tokens) <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [L - n, n]; the suffix excluded
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def proposal_room(num_output: int, max_tokens: int | None, num_tokens: int, max_model_len: int) -> int:
    """How many proposals a request can use: each accepted one and the bonus token are output, so
    ``max_tokens`` and the context leave room for one fewer than they have left."""
    left = max_model_len - num_tokens
    if max_tokens is not None:
        left = min(left, max_tokens - num_output)
    return max(0, left - 1)


class LinearCost:
    """Seconds a forward pass of n tokens takes, fitted as ``a + b * n`` (least squares) over the
    last ``window`` steps measured: the fixed cost is reading the weights, the slope the compute
    per token. Until two token counts have been seen it knows nothing (``fitted`` False)."""

    def __init__(self, window: int = 256):
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._dirty = False

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._obs.append((num_tokens, seconds))
            self._dirty = True

    @property
    def fitted(self) -> bool:
        return self._coefficients() is not None

    def _coefficients(self) -> tuple[float, float] | None:
        if self._dirty:
            self._dirty = False
            n = np.array([o[0] for o in self._obs], dtype=np.float64)
            t = np.array([o[1] for o in self._obs], dtype=np.float64)
            if np.unique(n).size < 2:
                self._fit = None
            else:
                b, a = np.polyfit(n, t, 1)
                self._fit = (max(float(a), 0.0), max(float(b), 0.0))
        return self._fit

    def predict(self, num_tokens: int) -> float:
        fit = self._coefficients()
        if fit is None:
            return 0.0
        return fit[0] + fit[1] * num_tokens


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a request gets from a step that verifies k proposals each accepted with probability
    ``alpha`` (independently): 1 + alpha + ... + alpha^k (the accepted prefix and the bonus)."""
    return float(sum(alpha**i for i in range(k + 1)))


class ThroughputGuard:
    """Output tokens per second measured on decode-only steps, with and without verification, per
    batch size (power-of-two buckets): the check the cost model's extrapolation cannot make. A
    linear fit over every step seen (prefill chunks of 2048 tokens, decodes of 64) puts the cost of
    the few hundred tokens a verification adds where the line says, not where the GEMMs, the LM
    head and attention at that row count put it; on a loaded host its fixed part swells with the
    waiting, and extra tokens look free. Where the measured rate with proposals is below the rate
    without, speculation stops at that batch size; every ``explore_every``-th decode step takes the
    other arm, so both rates stay current (that costs at most 1/``explore_every`` of the steps)."""

    def __init__(self, explore_every: int = 48, decay: float = 0.8):
        self.explore_every = explore_every
        self._decay = decay
        self._rates: dict[tuple[int, bool], float] = {}
        """(batch bucket, verified) -> exponentially weighted output tokens per second."""
        self._steps = 0

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return 1 << max(num_decodes - 1, 0).bit_length()

    def observe(self, num_decodes: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of ``num_decodes`` requests that output ``tokens`` in ``seconds``."""
        if num_decodes <= 0 or seconds <= 0:
            return
        self._steps += 1
        key = (self.bucket(num_decodes), verified)
        rate = tokens / seconds
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else self._decay * old + (1 - self._decay) * rate

    def exploring(self) -> bool:
        return self._steps % self.explore_every == 0

    def _pair(self, num_decodes: int) -> tuple[float | None, float | None]:
        """The measured rates (with proposals, without) at this batch size."""
        b = self.bucket(num_decodes)
        return self._rates.get((b, True)), self._rates.get((b, False))

    def allows(self, num_decodes: int) -> bool:
        """Whether proposals may be verified in the next step at this batch size."""
        spec, plain = self._pair(num_decodes)
        if spec is not None and plain is None:
            return False  # measure the plain rate once before going on
        if spec is None or plain is None:
            return True
        return spec >= plain or self.exploring()

    def forces_plain(self, num_decodes: int) -> bool:
        """Whether the next step runs without proposals, to refresh the plain rate."""
        spec, plain = self._pair(num_decodes)
        return spec is not None and plain is not None and spec >= plain and self.exploring()


@dataclass
class SpecStats:
    """Counters named after vLLM's ``spec_decode`` metrics (exported by ``common.metrics``)."""

    num_drafts: int = 0
    """Requests verified with at least one proposal, summed over steps."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Accepted proposals by their position in the draft (0 = the first proposed token)."""

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecController:
    """Chooses each step's k (0 to ``k_max``) from the measured step cost and the acceptance rate
    seen so far: the k whose expected tokens per second beat not speculating, by a margin. At
    batch 1 a step is bound by reading the weights, so a few more tokens cost almost nothing and
    k stays high; in a large batch every token costs compute, and k falls to 0 (vLLM, which does
    not adapt, measured 1.4-1.8x slow-downs there)."""

    MARGIN = 1.02
    """Speculate only where the model predicts 2% more throughput: the fit is noisy."""

    def __init__(self, k_max: int, adaptive: bool = True, prior_alpha: float = 0.6, decay: float = 0.97):
        self.k_max = k_max
        self.adaptive = adaptive
        self.target = LinearCost()
        self.draft = LinearCost()
        """A draft model's forward pass (one per proposed position); unused for n-grams."""
        self.alpha = prior_alpha
        """Running (exponentially decayed) fraction of proposals accepted."""
        self.guard = ThroughputGuard()
        self._prior = prior_alpha
        self._decay = decay

    def observe_acceptance(self, num_draft: int, num_accepted: int) -> None:
        for i in range(num_draft):
            self.alpha = self._decay * self.alpha + (1 - self._decay) * (i < num_accepted)

    def idle(self) -> None:
        """A step verified nothing: the estimate drifts back toward the prior, so that a low one
        that turned speculation off is tried again once in a while (the workload may have changed)."""
        self.alpha += (self._prior - self.alpha) * 0.01

    def choose_k(self, num_tokens: int, num_decodes: int, num_speculating: int) -> int:
        """The k for a step whose other work is ``num_tokens`` tokens (one per decode, prefill
        chunks) and in which ``num_speculating`` of the ``num_decodes`` decoding requests have
        proposals (draft models: all of them)."""
        if not self.adaptive:
            return self.k_max
        if num_speculating <= 0 or not self.guard.allows(num_decodes) or self.guard.forces_plain(num_decodes):
            return 0
        if not self.target.fitted:
            return self.k_max
        base = num_decodes / max(self.target.predict(num_tokens), 1e-9)
        best_k, best = 0, base * self.MARGIN
        for k in range(1, self.k_max + 1):
            gain = num_decodes - num_speculating + num_speculating * expected_tokens(self.alpha, k)
            cost = self.target.predict(num_tokens + num_speculating * k)
            cost += k * self.draft.predict(num_speculating)
            if gain / max(cost, 1e-9) > best:
                best_k, best = k, gain / max(cost, 1e-9)
        return best_k


def drop_past_stop(req, stop: str, tokenizer, max_drop: int) -> None:
    """Drop the output tokens after the one that completed ``stop``: a step that appended several
    tokens may have run past it, and the output must be what one token a step would have given.
    Only the last step's tokens can be past it, so at most ``max_drop`` go."""
    skip = req.sampling_params.skip_special_tokens
    for _ in range(max_drop):
        if req.num_output_tokens <= 1:
            return
        if stop not in tokenizer.decode(req.output_token_ids[:-1], skip_special_tokens=skip):
            return
        req.drop_output(1)
