"""An emulated model runner: a step takes the time a profile predicts for it, and its tokens are
deterministic stand-ins. Everything around it is the real engine (scheduler, block pool with prefix
caching and preemption, request lifecycle, outputs and counters), so an emulated worker keeps the
real books at a fraction of the cost, and dozens fit on one machine (issue 30 part 5).

A step is costed as ``planner/sim_engine.py`` costs it: its decode rows (one token each, as
``ModelRunner.prepare`` tells them apart) are a decode step over ``(batch, context)``, its longer
pieces a prefill step over ``(new, prior)`` tokens, and a step holding both pays the smaller fixed
cost once (one forward pass). The runner sleeps what the step's own bookkeeping has not already
taken of that time.

A sampled token is a hash of the request id and the token's position into the ordinary ids of the
vocabulary, never an end-of-sequence or stop token: a request ends at ``max_tokens`` (or a stop
string, or the context), so the output lengths are those the client asked for.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from baton.common.engine.model_runner import RunnerOutput
from baton.common.engine.outputs import TopLogprobs
from baton.common.engine.request import Request
from baton.common.engine.scheduler import SampledToken, SchedulerOutput


@dataclass(frozen=True)
class StepCosts:
    """What an emulated step costs, in ms (a ``planner.profile.Profile``'s predictors)."""

    prefill_ms: Callable[[Sequence[tuple[int, int]]], float]
    """One prefill step over ``(new_tokens, prior_tokens)`` pieces."""
    decode_ms: Callable[[int, int], float]
    """One decode step over ``(batch, context_tokens)``."""
    shared_ms: float
    """The fixed cost a mixed step pays once instead of twice (the smaller of the two fixed costs)."""


def step_ms(sched: SchedulerOutput, costs: StepCosts) -> float:
    """The modelled time of one scheduled step."""
    pieces, batch, context = [], 0, 0
    for r in sched.requests:
        if r.num_tokens == 1:  # a decode row, as ModelRunner.prepare runs it
            batch += 1
            context += r.start_pos + 1
        else:
            pieces.append((r.num_tokens, r.start_pos))
    if not pieces:
        return costs.decode_ms(batch, context)
    prefill = costs.prefill_ms(pieces)
    return prefill + costs.decode_ms(batch, context) - costs.shared_ms if batch else prefill


@dataclass(frozen=True)
class FakeVocab:
    """The ids fake tokens are drawn from: ``[first, end)`` less ``avoid`` (end-of-sequence ids)."""

    first: int
    end: int
    avoid: frozenset[int] = frozenset()

    def token(self, request_id: str, position: int, also_avoid: Sequence[int] = ()) -> int:
        """The token at ``position`` of ``request_id``'s sequence: the same on every worker and run."""
        digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
        span = self.end - self.first
        tok = self.first + int.from_bytes(digest, "little") % span
        for _ in range(span):
            if tok not in self.avoid and tok not in also_avoid:
                return tok
            tok = self.first + (tok - self.first + 1) % span
        raise ValueError("every id of the fake vocabulary is avoided")


class EmulatedModelRunner:
    """``ModelRunner``'s interface to ``LLMEngine`` (``execute``, ``warm_up``, ``grammars``) with
    no model: each step sleeps its modelled time (``step_ms``) and samples ``FakeVocab`` tokens."""

    def __init__(
        self,
        costs: StepCosts,
        vocab: FakeVocab,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.costs = costs
        self.vocab = vocab
        self._sleep = sleep
        self._clock = clock
        self.grammars = None  # set by LLMEngine; a grammar would refuse the fake tokens
        self.modelled_seconds_total = 0.0
        """The steps' modelled time, summed (what the worker would have computed)."""
        # ModelRunner's cascade counters, read by the metrics: never a cascade here.
        self.num_cascade_steps = self.num_cascade_groups = self.num_cascade_queries = 0

    def warm_up(self, max_tokens: int, max_sampled: int) -> None:
        """Nothing to build."""

    def execute(
        self,
        sched: SchedulerOutput,
        requests: Mapping[str, Request],
        generators: Mapping,
        draft_probs: Mapping | None = None,
    ) -> RunnerOutput:
        start = self._clock()
        seconds = step_ms(sched, self.costs) / 1000.0
        sampled = {
            r.request_id: self._sample(requests[r.request_id], r.start_pos + r.num_tokens)
            for r in sched.requests
            if r.sample and r.request_id in requests
        }
        self.modelled_seconds_total += seconds
        left = seconds - (self._clock() - start)
        if left > 0:
            self._sleep(left)
        return RunnerOutput(sampled)

    def _sample(self, req: Request, position: int) -> SampledToken:
        params = req.sampling_params
        tok = self.vocab.token(req.request_id, position, params.stop_token_ids)
        if params.logprobs is None:
            return SampledToken(tok)
        top = TopLogprobs((tok,), (0.0,)) if params.logprobs else None
        return SampledToken(tok, 0.0, top)
