"""The engine loop: validates requests, schedules a step, runs it, detokenizes finished output."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.cascade_plan import cascade_config
from baton.common.engine.config import EngineConfig
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_budget import gpu_kv_cache_bytes
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache, kv_cache_block_bytes
from baton.common.engine.outputs import CompletionOutput, RequestOutput
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from baton.common.engine.spec_decode import SpecStats, drop_past_stop
from baton.common.engine.speculator import make_speculator
from baton.common.engine.structured import StructuredOutputs

log = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _gpu_memory(device: str) -> tuple[int, int]:
    """``device``'s total memory and what is in use on it now, every process counted (the CUDA
    context, this one's tensors); blocks torch's allocator caches but no tensor holds are freed first."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total, total - free


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


class EngineStepError(RuntimeError):
    """The engine cannot go on: its block pool's books no longer balance after a failed step, or
    ``max_consecutive_failed_steps`` steps in a row failed."""


class LLMEngine:
    """One engine over one model. Not thread-safe: one loop drives ``step()``."""

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
        mcfg = model.config
        self.dtype = parse_dtype(config.dtype)
        self.max_model_len = min(
            config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        num_blocks = self._num_kv_blocks(draft_model)
        self.kv_cache = allocate_kv_cache(
            model, num_blocks + 1, config.block_size, self.dtype, config.device, config.kv_cache_dtype
        )
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, BlockHasher(config.block_size))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len), self.kv
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            config.block_size,
            scratch_block=num_blocks,
            cascade=cascade_config(
                config.cascade, config.cascade_min_shared_blocks, str(self.dtype).removeprefix("torch.")
            ),
        )
        self.structured = StructuredOutputs(
            tokenizer, mcfg.vocab_size, sorted(eos_token_ids), self.max_model_len, config.jump_forward
        )
        self.runner.grammars = self.structured
        self.speculator = make_speculator(config.speculative_config(), self, draft_model)
        self._generators: dict[str, torch.Generator] = {}
        self._prompts: dict[str, str | None] = {}
        self._texts: dict[str, _IncrementalText] = {}
        # Output text grows one token at a time (tokenizers' DecodeStream) instead of the whole
        # output being decoded again at every step; a finished output is decoded once, whole, so
        # its text is exactly ``tokenizer.decode``'s. Tokenizers that clean up spaces after
        # decoding are decoded whole every time.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self._counter = itertools.count()
        # Called on the engine thread after each forward step, before any request of the step is
        # finished or freed: the step's scheduled requests still own their (now computed) blocks.
        # The prefill worker pushes finished KV blocks from here.
        self.on_step_computed: Callable[[SchedulerOutput], None] | None = None
        # Totals since start, for tests and metrics.
        self.num_computed_tokens_total = 0
        self.num_prompt_tokens_computed_total = 0
        self.num_generated_tokens_total = 0
        self.num_steps_with_prefill = 0
        self.num_preemptions_total = 0
        self.num_remote_prefills_total = 0
        self.num_remote_tokens_kept_total = 0
        """Prompt tokens whose KV landed before their remote prefill failed, kept, not recomputed."""
        # Where a step's time goes (``baton bench breakdown``): the whole step, the model's forward
        # pass and sampling, and detokenizing output.
        self.num_steps_total = 0
        self.step_seconds_total = 0.0
        self.forward_seconds_total = 0.0
        self.detokenize_seconds_total = 0.0
        self._remote: dict[str, Request] = {}  # parked while another worker prefills them
        # Failures (``_fail_step``): every failed step and request, and failed steps since the last
        # good one (the engine gives up at ``max_consecutive_failed_steps``).
        self.num_failed_steps_total = 0
        self.num_failed_requests_total = 0
        self._failed_steps_in_a_row = 0
        self.num_refused_requests_total = 0  # the waiting queue was full (``check_queue_room``)

    def _num_kv_blocks(self, draft_model) -> int:
        """Blocks in the pool: what the budget (``kv_cache_gib``, or ``gpu_memory_utilization`` of
        this device measured now, the model loaded and no cache yet) holds. Tensor- and pipeline-
        parallel ranks allocate as many blocks of their own shape: rank 0 sizes the cache for all,
        its stage holding the most layers (``stage_layers``)."""
        config = self.config
        block_bytes = kv_cache_block_bytes(self.model, config.block_size, self.dtype, config.kv_cache_dtype)
        if config.gpu_memory_utilization is None:
            budget, what = int(config.kv_cache_gib * 2**30), f"kv_cache_gib={config.kv_cache_gib}"
        else:
            budget = gpu_kv_cache_bytes(config.gpu_memory_utilization, *_gpu_memory(config.device))
            what = f"gpu_memory_utilization={config.gpu_memory_utilization} ({budget / 2**30:.2f} GiB)"
            if draft_model is not None:  # its cache has as many blocks, out of the same memory
                block_bytes += kv_cache_block_bytes(draft_model, config.block_size, self.dtype)
        # One block of the budget is the scratch block where a step's padding rows store their KV
        # (ModelRunner.prepare); the pool never hands it out.
        num_blocks = budget // block_bytes - 1
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"{what} holds {max(num_blocks, 0) * config.block_size} tokens, "
                f"less than max_model_len={self.max_model_len}"
            )
        return num_blocks

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
            arrival_time=next(self._counter),
        )
        for t in resume_token_ids:  # their log-probabilities were sent already: placeholders
            req.append_output(t, 0.0 if params.logprobs is not None else None)
        self.structured.add(req)  # replays the resumed tokens; a forced start joins the prefill
        self.structured.jump(req)
        self.scheduler.add_request(req)
        self._prompts[request_id] = prompt
        if params.seed is not None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            if resume_token_ids and not params.greedy:
                torch.rand(len(resume_token_ids), dtype=torch.float64, generator=gen)

    def check_queue_room(self, num_tokens: int) -> None:
        """Raise ``EngineFullError`` unless one more request of ``num_tokens`` tokens fits under the
        caps on requests not yet running (``max_waiting_requests``, ``max_waiting_tokens``)."""
        full = self._queue_full(num_tokens)
        if full is not None:
            self.num_refused_requests_total += 1
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
            arrival_time=next(self._counter),
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
            self.num_remote_prefills_total += 1
        self.scheduler.admit_running(req, first_token)
        if first_token is None:
            return None
        if not req.is_finished and self._advance_grammars([req]):
            return self._fail_requests([request_id], "the first token does not follow the grammar")[0]
        if not req.is_finished and req.sampling_params.stop:
            self._check_stop_strings(req)
        out = self._make_output(req)
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
        self.num_remote_tokens_kept_total += n - req.num_computed_tokens
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

    # -- the step ------------------------------------------------------------------------------
    def step(self, include_unfinished: bool = False) -> list[RequestOutput]:
        """Run one step; return outputs of the requests that finished in it and, with
        ``include_unfinished``, cumulative outputs of every request that received a token."""
        start = time.perf_counter()
        self.kv.release_settled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.num_computed_tokens_total += sched.num_batched_tokens
        for r in sched.requests:
            req = self.scheduler.requests.get(r.request_id)
            if req is None:  # a finished request's final block (see Scheduler.completing)
                continue
            prompt_len = req.num_prompt_tokens
            self.num_prompt_tokens_computed_total += max(
                0, min(r.start_pos + r.num_tokens, prompt_len) - r.start_pos
            )
        self.num_steps_with_prefill += any(r.num_tokens - r.num_spec > 1 for r in sched.requests)
        self.num_preemptions_total += len(sched.preempted)
        requests = self.scheduler.requests
        gens = _DefaultingMap(self._generators, self._default_generator)
        forward = time.perf_counter()
        spec = self.speculator
        try:
            result = self.runner.execute(sched, requests, gens, spec.draft_probs if spec else None)
        except Exception as e:  # noqa: BLE001 - a fault in the step fails its requests, not the engine
            self.forward_seconds_total += time.perf_counter() - forward
            return self._fail_step(sched, e)
        forward_seconds = time.perf_counter() - forward
        self.forward_seconds_total += forward_seconds
        try:  # the step's hooks fail like the step: its requests, not the engine thread
            if spec is not None:
                spec.observe_step(sched, result, forward_seconds)
            if self.on_step_computed is not None:
                self.on_step_computed(sched)
        except Exception as e:  # noqa: BLE001
            return self._fail_step(sched, e)
        progressed = self.scheduler.update_from_output(sched, result.sampled)
        self.num_generated_tokens_total += self.scheduler.num_new_tokens
        refused = self._advance_grammars(progressed)
        outputs = []
        for req in progressed:
            if not req.is_finished and req.sampling_params.stop:
                self._check_stop_strings(req)
            if req.is_finished:
                outputs.append(self._make_output(req))
                self._forget(req.request_id)
            elif include_unfinished:
                outputs.append(self._make_output(req))
        if result.failed:
            outputs += self._fail_requests(result.failed, "the model's logits were not finite", whole=True)
        if refused:
            outputs += self._fail_requests(refused, "an output token does not follow the request's grammar")
        if spec is not None:
            spec.finish_step(time.perf_counter() - start)
            spec.propose(self.scheduler.running, self.config.max_num_batched_tokens, gens)
        self.num_steps_total += 1
        self.step_seconds_total += time.perf_counter() - start
        if result.failed and not progressed:  # nothing in the step came out right: a failed step
            self._after_failed_step(RuntimeError("every sampled row of the step was not finite"))
        else:
            self._failed_steps_in_a_row = 0
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
            outputs.append(self._make_output(req))
            self._forget(req.request_id)
        self.num_failed_requests_total += len(outputs)
        log.warning("failed %d request(s): %s", len(outputs), why)
        return outputs

    def _after_failed_step(self, error: Exception) -> None:
        """Raise ``EngineStepError`` (fatal: the worker must restart) if the block pool's books do
        not balance, or if too many steps in a row failed; else count the failure and go on."""
        self.num_failed_steps_total += 1
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

    def _check_stop_strings(self, req: Request) -> None:
        text = self._detokenize(req)
        for s in req.sampling_params.stop:
            # Only the tail can hold a new match: the previous step found none.
            if s in text:
                req.stop_reason = s
                if self.speculator is not None:  # a step of several tokens may run past the stop
                    drop_past_stop(req, s, self.tokenizer, self.config.num_speculative_tokens)
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                return

    def _detokenize(self, req: Request) -> str:
        start = time.perf_counter()
        skip = req.sampling_params.skip_special_tokens
        if req.is_finished or self._backend is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=skip)
        else:
            inc = self._texts.get(req.request_id)
            if inc is None:
                inc = self._texts[req.request_id] = _IncrementalText(skip)
            text = inc.extend(self._backend, req.output_token_ids)
        self.detokenize_seconds_total += time.perf_counter() - start
        return text

    def _make_output(self, req: Request) -> RequestOutput:
        text = self._detokenize(req)
        if isinstance(req.stop_reason, str):
            text = text[: text.find(req.stop_reason)]
        params = req.sampling_params
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            logprobs=list(req.output_logprobs) if params.logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            top_logprobs=list(req.output_top_logprobs) if params.logprobs else None,
            error=req.error,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=self._prompts.get(req.request_id),
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=req.is_finished,
            num_cached_tokens=min(max(req.num_cached_tokens, 0), req.num_prompt_tokens),
        )

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._texts.pop(request_id, None)
        self.structured.remove(request_id)

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": self.pool.usage,
            "num_free_blocks": self.pool.num_free_blocks,
        }


def _written_block_ids(sched: SchedulerOutput, block_size: int) -> set[int]:
    """The blocks a step writes KV into: those holding positions ``start_pos ..`` of each request."""
    out: set[int] = set()
    for r in sched.requests:
        first, last = r.start_pos // block_size, (r.start_pos + r.num_tokens - 1) // block_size
        out.update(r.block_ids[first : last + 1])
    return out


class _IncrementalText:
    """A request's output text so far, extended by the tokens it has not seen yet."""

    def __init__(self, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fed = 0
        self._text = ""

    def extend(self, backend, token_ids: Sequence[int]) -> str:
        for t in token_ids[self._fed :]:
            chunk = self._stream.step(backend, t)  # None while a UTF-8 sequence is incomplete
            if chunk:
                self._text += chunk
        self._fed = len(token_ids)
        return self._text


class _DefaultingMap(dict):
    """Per-request generators, falling back to the engine's own for unseeded requests."""

    def __init__(self, gens: dict, default: torch.Generator):
        super().__init__(gens)
        self._default = default

    def get(self, key, default=None):
        return super().get(key, self._default)
