"""The engine's running part: the parts ``engine_build`` made, and the step loop over them:
schedule, run the model, advance the grammars, check stop strings, return outputs; and what a
failed step does (its requests fail, the engine goes on while its books balance).

``LLMEngine`` (``llm_engine``) adds the requests' way in on top.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from baton.common.engine.config import EngineConfig
from baton.common.engine.engine_build import build_parts
from baton.common.engine.engine_stats import EngineStats, StatsField
from baton.common.engine.output_processor import OutputProcessor
from baton.common.engine.outputs import RequestOutput
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.scheduler import SchedulerOutput
from baton.common.engine.spec_decode import drop_past_stop
from baton.common.engine.speculator import make_speculator

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine cannot go on: its block pool's books no longer balance after a failed step, or
    ``max_consecutive_failed_steps`` steps in a row failed."""


class EngineCore:
    """One engine's parts over one model, and its step loop. Not thread-safe: one loop drives
    ``step()``."""

    # The totals in ``counters``, each also an attribute of the engine (metrics and tests read them).
    num_computed_tokens_total = StatsField()
    num_prompt_tokens_computed_total = StatsField()
    num_generated_tokens_total = StatsField()
    num_steps_with_prefill = StatsField()
    num_preemptions_total = StatsField()
    num_remote_prefills_total = StatsField()
    num_remote_tokens_kept_total = StatsField()
    num_steps_total = StatsField()
    step_seconds_total = StatsField()
    forward_seconds_total = StatsField()
    detokenize_seconds_total = StatsField()
    num_failed_steps_total = StatsField()
    num_failed_requests_total = StatsField()
    num_refused_requests_total = StatsField()

    def __init__(
        self,
        config: EngineConfig,
        model,
        tokenizer,
        eos_token_ids: frozenset[int],
        model_name: str = "model",
        draft_model=None,
    ):
        """``draft_model``: the loaded draft model, for ``speculative="draft"``."""
        self.config = config
        self.model_name = model_name
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        parts = build_parts(config, model, tokenizer, eos_token_ids, draft_model)
        self.dtype, self.max_model_len = parts.dtype, parts.max_model_len
        self.kv_cache, self.pool, self.kv = parts.kv_cache, parts.pool, parts.kv
        self.scheduler, self.runner, self.structured = parts.scheduler, parts.runner, parts.structured
        self.speculator = make_speculator(config.speculative_config(), self, draft_model)
        self.counters = EngineStats()
        self.output_processor = OutputProcessor(tokenizer, self.counters)
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(config.seed)
        # Called on the engine thread after each forward step, before any request of the step is
        # finished or freed: the step's scheduled requests still own their (now computed) blocks.
        # The prefill worker pushes finished KV blocks from here.
        self.on_step_computed: Callable[[SchedulerOutput], None] | None = None
        # Failed steps since the last good one (``_fail_step``): the engine gives up at
        # ``max_consecutive_failed_steps``.
        self._failed_steps_in_a_row = 0
        self._arrivals = itertools.count()  # the order requests came in (``Request.arrival_time``)
        self._remote: dict[str, Request] = {}  # parked while another worker prefills them

    # -- the step ------------------------------------------------------------------------------
    def step(self, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one step; return outputs of the requests that finished in it and, with
        ``include_unfinished``, cumulative outputs of every request that received a token."""
        start = time.perf_counter()
        self.kv.release_settled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self._count_scheduled(sched)
        counters, requests = self.counters, self.scheduler.requests
        gens = _DefaultingMap(self._generators, self._default_generator)
        forward = time.perf_counter()
        spec = self.speculator
        try:
            result = self.runner.execute(sched, requests, gens, spec.draft_probs if spec else None)
        except Exception as e:  # noqa: BLE001 - a fault in the step fails its requests, not the engine
            counters.forward_seconds_total += time.perf_counter() - forward
            return self._fail_step(sched, e)
        forward_seconds = time.perf_counter() - forward
        counters.forward_seconds_total += forward_seconds
        try:  # the step's hooks fail like the step: its requests, not the engine thread
            if spec is not None:
                spec.observe_step(sched, result, forward_seconds)
            if self.on_step_computed is not None:
                self.on_step_computed(sched)
        except Exception as e:  # noqa: BLE001
            return self._fail_step(sched, e)
        progressed = self.scheduler.update_from_output(sched, result.sampled)
        counters.num_generated_tokens_total += self.scheduler.num_new_tokens
        refused = self._advance_grammars(progressed)
        outputs = self._outputs_of(progressed, include_unfinished)
        if result.failed:
            outputs += self._fail_requests(result.failed, "the model's logits were not finite", whole=True)
        if refused:
            outputs += self._fail_requests(refused, "an output token does not follow the request's grammar")
        if spec is not None:
            spec.finish_step(time.perf_counter() - start)
            spec.propose(self.scheduler.running, self.config.max_num_batched_tokens, gens)
        counters.num_steps_total += 1
        counters.step_seconds_total += time.perf_counter() - start
        if result.failed and not progressed:  # nothing in the step came out right: a failed step
            self._after_failed_step(RuntimeError("every sampled row of the step was not finite"))
        else:
            self._failed_steps_in_a_row = 0
        return outputs

    def _count_scheduled(self, sched: SchedulerOutput) -> None:
        """Count what the step computes: its tokens, those of prompts among them, whether it
        prefills, and the requests preempted to make room for it."""
        counters = self.counters
        counters.num_computed_tokens_total += sched.num_batched_tokens
        for r in sched.requests:
            req = self.scheduler.requests.get(r.request_id)
            if req is None:  # a finished request's final block (see Scheduler.completing)
                continue
            prompt_len = req.num_prompt_tokens
            counters.num_prompt_tokens_computed_total += max(
                0, min(r.start_pos + r.num_tokens, prompt_len) - r.start_pos
            )
        counters.num_steps_with_prefill += any(r.num_tokens - r.num_spec > 1 for r in sched.requests)
        counters.num_preemptions_total += len(sched.preempted)

    def _outputs_of(self, progressed: list[Request], include_unfinished: bool) -> list[RequestOutput]:
        """Stop the requests whose text now holds a stop string; the outputs of those that
        finished (forgotten here) and, with ``include_unfinished``, of the others."""
        outputs = []
        for req in progressed:
            if not req.is_finished and req.sampling_params.stop:
                self._check_stop_strings(req)
            if req.is_finished:
                outputs.append(self.output_processor.make_output(req))
                self._forget(req.request_id)
            elif include_unfinished:
                outputs.append(self.output_processor.make_output(req))
        return outputs

    def _advance_grammars(self, progressed: list[Request]) -> list[str]:
        """Feed the step's tokens to the requests' grammars (and jump forward where one forces the
        continuation); stop those whose grammar ended before ``min_tokens`` (``ended_early``).
        Returns the requests whose tokens a grammar refused."""
        refused = self.structured.advance(progressed)
        max_drop = self.config.num_speculative_tokens if self.speculator is not None else 0
        ended = self.structured.ended_early(progressed, max_drop)
        self.scheduler.finish_requests(ended, RequestStatus.FINISHED_STOPPED, keep_final_block=True)
        return refused

    def _check_stop_strings(self, req: Request) -> None:
        """Finish ``req`` (``FINISHED_STOPPED``) if its text holds one of its stop strings."""
        stop = self.output_processor.find_stop_string(req)
        if stop is None:
            return
        req.stop_reason = stop
        if self.speculator is not None:  # a step of several tokens may run past the stop
            drop_past_stop(req, stop, self.tokenizer, self.config.num_speculative_tokens)
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.output_processor.forget(request_id)
        self.structured.remove(request_id)

    # -- failures ------------------------------------------------------------------------------
    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A step that raised: its requests finish with ``FINISHED_ERROR`` (outputs returned, so
        their streams end), the blocks it was writing leave the prefix cache, and the engine goes on
        unless ``_after_failed_step`` finds it cannot."""
        log.error("engine step failed: %s: %s", type(error).__name__, error, exc_info=error)
        self.pool.uncache_blocks(_written_block_ids(sched, self.config.block_size))
        self.scheduler.update_from_output(sched, {})  # frees the final blocks it was computing
        ids = [r.request_id for r in sched.requests if r.request_id in self.scheduler.requests]
        outputs = self._fail_requests(ids, f"the engine step failed: {type(error).__name__}: {error}")
        self._after_failed_step(error)
        return outputs

    def _fail_requests(
        self, request_ids: Sequence[str], why: str, whole: bool = False
    ) -> list[RequestOutput]:
        """Finish requests with ``FINISHED_ERROR``; with ``whole``, none of their blocks stays in
        the prefix cache (where a NaN came from is unknown)."""
        if whole:
            for rid in request_ids:
                self.pool.uncache_blocks(self.kv.block_ids(rid))
        outputs = []
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR):
            req.error = why
            outputs.append(self.output_processor.make_output(req))
            self._forget(req.request_id)
        self.counters.num_failed_requests_total += len(outputs)
        log.warning("failed %d request(s): %s", len(outputs), why)
        return outputs

    def _after_failed_step(self, error: Exception) -> None:
        """Raise ``EngineStepError`` (fatal: the worker must restart) if the block pool's books do
        not balance, or if too many steps in a row failed; else count the failure and go on."""
        self.counters.num_failed_steps_total += 1
        self._failed_steps_in_a_row += 1
        try:
            self.pool.check_integrity()
        except AssertionError as e:
            raise EngineStepError(f"the block pool is inconsistent after a failed step: {e}") from error
        if getattr(error, "fatal", False):  # no later step can run (a tensor-parallel rank has died)
            raise EngineStepError(f"the engine cannot go on: {error}") from error
        limit = self.config.max_consecutive_failed_steps
        if self._failed_steps_in_a_row >= limit:
            raise EngineStepError(f"{self._failed_steps_in_a_row} engine steps in a row failed") from error


def _written_block_ids(sched: SchedulerOutput, block_size: int) -> set[int]:
    """The blocks a step writes KV into: those holding positions ``start_pos ..`` of each request."""
    out: set[int] = set()
    for r in sched.requests:
        first, last = r.start_pos // block_size, (r.start_pos + r.num_tokens - 1) // block_size
        out.update(r.block_ids[first : last + 1])
    return out


class _DefaultingMap(dict):
    """Per-request generators, falling back to the engine's own for unseeded requests."""

    def __init__(self, gens: dict, default: torch.Generator):
        super().__init__(gens)
        self._default = default

    def get(self, key, default=None):
        return super().get(key, self._default)
