"""The engine's front: validates requests and queues them, parks the ones another worker prefills
and resumes them, warms the engine up. The step loop is ``EngineCore``'s (``engine_core``), the
parts it runs are built by ``engine_build``, and the text out is ``OutputProcessor``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baton.common.engine.engine_build import parse_dtype
from baton.common.engine.engine_core import EngineCore, EngineStepError
from baton.common.engine.outputs import RequestOutput
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import SampledToken
from baton.common.engine.spec_decode import SpecStats

__all__ = [
    "EngineFullError",
    "EngineStepError",
    "LandedPrefix",
    "LLMEngine",
    "Quarantine",
    "parse_dtype",
]


class EngineFullError(Exception):
    """The engine's waiting queue is full: try again later or elsewhere (gRPC RESOURCE_EXHAUSTED,
    HTTP 429). Deliberately not a ``ValueError``, which means the client's request is bad."""


@dataclass(frozen=True)
class Quarantine:
    """Blocks that a receive the transport could not cancel may still write (a remote prefill given
    up mid-message): out of use, and out of the pool until ``settled()``."""

    block_ids: tuple[int, ...]
    settled: Callable[[], bool]
    """Thread-safe; True once nothing can write the blocks any more."""
    on_settled: Callable[[Callable[[], None]], None] | None = None
    """Registers a callback (run on any thread, at once if already settled) for when it is: the
    owner of the engine thread asks for the release then (``AsyncEngine``); without it the next
    step does."""


@dataclass(frozen=True)
class LandedPrefix:
    """What a remote prefill that failed part-way leaves: the KV of the prompt's first
    ``num_tokens`` tokens landed in the request's blocks (whole blocks from the start of its
    reserved range), so only the rest is computed here (``resume_remote``); and the request's
    blocks that are quarantined, which it swaps for fresh ones."""

    num_tokens: int
    quarantine: Quarantine | None = None


class LLMEngine(EngineCore):
    """One engine over one model: ``EngineCore``'s parts and step loop, and the requests' way in.
    Not thread-safe: one loop drives ``step()``."""

    # -- requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens, longer than the model's context "
                f"(max_model_len={self.max_model_len}) leaves room for"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")

    def validate_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, resume_token_ids: Sequence[int] = ()
    ) -> None:
        """What a server checks before it accepts a request: the prompt (``validate_prompt``), and
        that the prompt and ``max_tokens`` fit in the context together (vLLM's message), so that a
        request that can never complete is refused instead of cut short. ``resume_token_ids``
        (a migrated request's output so far) must leave room for at least one more token. A
        structured request's grammar must compile."""
        self.validate_prompt(prompt_token_ids)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)
        n, limit = len(prompt_token_ids), self.max_model_len
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        if resume_token_ids:
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in resume_token_ids):
                raise ValueError(f"resumed token ids must be in [0, {vocab})")
            done = len(resume_token_ids)
            if n + done >= limit or (params.max_tokens is not None and done >= params.max_tokens):
                raise ValueError(f"resumed output of {done} tokens leaves nothing to generate")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request. ``resume_token_ids`` continues one that another worker started (request
        migration): they become its output so far, recomputed with the prompt like a preempted
        request's, and count against ``max_tokens``; a seeded request's generator skips the draws
        they took, so that sampling goes on where it stopped (greedy output is token-identical)."""
        self.validate_prompt(prompt_token_ids)
        self.check_queue_room(len(prompt_token_ids) + len(resume_token_ids))
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=next(self._arrivals),
        )
        for t in resume_token_ids:  # their log-probabilities were sent already: placeholders
            req.append_output(t, 0.0 if params.logprobs is not None else None)
        self.structured.add(req)  # replays the resumed tokens; a forced start joins the prefill
        self.structured.jump(req)
        self.scheduler.add_request(req)
        self.output_processor.add(request_id, prompt)
        if params.seed is not None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            if resume_token_ids and not params.greedy:
                torch.rand(len(resume_token_ids), dtype=torch.float64, generator=gen)

    def check_queue_room(self, num_tokens: int) -> None:
        """Raise ``EngineFullError`` unless one more request of ``num_tokens`` tokens fits under the
        caps on requests not yet running (``max_waiting_requests``, ``max_waiting_tokens``)."""
        full = self._queue_full(num_tokens)
        if full is not None:
            self.counters.num_refused_requests_total += 1
            raise EngineFullError(full)

    def _queue_full(self, num_tokens: int) -> str | None:
        """Why the waiting queue has no room for ``num_tokens`` more tokens, or None. Counted
        afresh each time (at most ``max_waiting_requests`` terms): no counter to keep in step with
        every path in and out of the queue."""
        cfg = self.config
        waiting = list(self.scheduler.waiting) + list(self._remote.values())
        if len(waiting) >= cfg.max_waiting_requests:
            return f"{len(waiting)} requests are waiting (max_waiting_requests={cfg.max_waiting_requests})"
        queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        if waiting and queued + num_tokens > cfg.max_waiting_tokens:  # one alone always fits
            return (
                f"{queued} tokens are waiting and this request brings {num_tokens} "
                f"(max_waiting_tokens={cfg.max_waiting_tokens})"
            )
        return None

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parked = self._remote.pop(rid, None)
            if parked is not None:
                parked.status = RequestStatus.FINISHED_ABORTED
                self.kv.free(parked)
                self._forget(rid)
        for req in self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
            self._forget(req.request_id)

    # -- remote prefill ------------------------------------------------------------------------
    def reserve_remote(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> tuple[list[int], int] | None:
        """Reserve blocks for a prompt that another worker will prefill: returns the request's
        block ids and how many leading prompt tokens this worker already caches, or None when the
        pool cannot hold the prompt now (prefill it here instead). The request is parked, outside
        the schedule, until ``resume_remote``."""
        self.validate_prompt(prompt_token_ids)
        self.check_queue_room(len(prompt_token_ids))
        if request_id in self.scheduler.requests or request_id in self._remote:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.scheduler.release_completing(request_id)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=next(self._arrivals),
        )
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        if not self.kv.allocate_slots(req, req.num_tokens - num_hit, hit_blocks, cache=False):
            return None
        req.num_computed_tokens = req.num_cached_tokens = num_hit
        self.structured.add(req)
        self._remote[request_id] = req
        if params.seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return self.kv.block_ids(request_id), num_hit

    def resume_remote(
        self, request_id: str, first_token: SampledToken | LandedPrefix | None
    ) -> RequestOutput | None:
        """Start decoding a parked request whose prompt KV has landed in its blocks, with the
        first token the prefill worker sampled; or, with None (the remote prefill failed or was
        not worth it), compute the rest of its prompt here; or, with a ``LandedPrefix`` (it failed
        part-way), keep the KV that landed and compute only the rest, in fresh blocks where its own
        are quarantined (with no room for those now, it starts over from the head of the queue).
        Returns the output when the first token already ends the request or streams it."""
        if isinstance(first_token, LandedPrefix) and first_token.quarantine is not None:
            self.quarantine_blocks(first_token.quarantine)
        req = self._remote.pop(request_id, None)
        if req is None:
            return None  # aborted meanwhile
        if isinstance(first_token, LandedPrefix):
            self._keep_landed(req, first_token.num_tokens)
            first_token = None
            if not self.kv.swap_quarantined(req):  # no room for fresh blocks now: start over later
                self.kv.free(req)
                self.scheduler.readmit(req)
                return None
        if first_token is not None:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.cache_computed(req, req.num_prompt_tokens)
            self.counters.num_remote_prefills_total += 1
        self.scheduler.admit_running(req, first_token)
        if first_token is None:
            return None
        if not req.is_finished and self._advance_grammars([req]):
            return self._fail_requests([request_id], "the first token does not follow the grammar")[0]
        if not req.is_finished and req.sampling_params.stop:
            self._check_stop_strings(req)
        out = self.output_processor.make_output(req)
        if req.is_finished:
            self._forget(request_id)
        return out

    def quarantine_blocks(self, quarantine: Quarantine) -> None:
        """Keep ``quarantine``'s blocks out of use and out of the pool until it is settled
        (``release_quarantined``); a request holding them gets fresh ones at ``resume_remote``."""
        self.kv.quarantine(quarantine.block_ids, quarantine.settled)

    def release_quarantined(self) -> int:
        """Return the quarantined blocks nothing can write any more to the pool; how many."""
        return self.kv.release_settled()

    def _keep_landed(self, req: Request, num_tokens: int) -> None:
        """Count a parked request's first ``num_tokens`` prompt tokens as computed (their KV
        landed); at least its last prompt token is left to compute, for the logits of its first
        token. Their full blocks join the prefix cache, as computed blocks do."""
        n = max(req.num_computed_tokens, min(num_tokens, req.num_prompt_tokens - 1))
        self.counters.num_remote_tokens_kept_total += n - req.num_computed_tokens
        req.num_computed_tokens = n
        self.kv.cache_computed(req, n)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    _COUNTERS = (
        "num_computed_tokens_total",
        "num_prompt_tokens_computed_total",
        "num_generated_tokens_total",
        "num_steps_with_prefill",
        "num_preemptions_total",
    )

    def warm_up(self, prompt_len: int = 96, decode_steps: int = 4) -> None:
        """Build the GEMM primitives of every padded step shape (``ModelRunner.warm_up``), then
        serve two prompts, one greedy and one sampled with top-p, top-k, a seed and logprobs (a
        prefill step, a mixed step, decode steps) before the first real
        request, so that the kernels are loaded and the allocator and oneDNN's primitives are warm:
        a worker that says it is ready serves its first request at full speed. Leaves no trace: no
        cached prefix, no cache events, counters as they were. Only on a fresh, idle engine (it
        forgets every cached prefix)."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up needs an idle engine")
        saved = {name: getattr(self, name) for name in self._COUNTERS}
        queries, hits = self.kv.prefix_cache_queries, self.kv.prefix_cache_hits
        n = max(1, min(prompt_len, self.max_model_len - decode_steps - 1))
        vocab = self.model.config.vocab_size
        cfg = self.config
        # A verification's LM head runs 1 + k rows a request (``rejection.padded_rows``).
        per_request = 1 + (cfg.num_speculative_tokens if self.speculator is not None else 0)
        lm_rows = min(cfg.max_num_batched_tokens, min(64, cfg.max_num_seqs) * per_request)
        self.runner.warm_up(cfg.max_num_batched_tokens, lm_rows)
        # One greedy request and one sampled as chat clients ask (temperature, top-p, top-k, a seed,
        # logprobs): every sampler path has run once before the first real request needs it.
        greedy = SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True)
        sampled = SamplingParams(
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            seed=0,
            logprobs=2,
            max_tokens=decode_steps,
            ignore_eos=True,
        )
        for i, params in enumerate((greedy, sampled)):
            ids = [(7 + 31 * j + i) % vocab for j in range(n - 8 * i)]
            self.add_request(f"__warm_up-{i}", ids, params)
            self.step()
        while self.has_unfinished_requests():
            self.step()
        self.pool.reset_prefix_cache()
        self.pool.take_events()
        for name, value in saved.items():
            setattr(self, name, value)
        if self.speculator is not None:  # its cost model keeps the warm-up's steps
            self.speculator.stats = SpecStats()
        self.kv.prefix_cache_queries, self.kv.prefix_cache_hits = queries, hits

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.pool.usage,
            "num_free_blocks": self.pool.num_free_blocks,
        }
