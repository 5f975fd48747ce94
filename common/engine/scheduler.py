"""Continuous batching under a per-step token budget, with chunked prefill. No torch.

Each step the scheduler hands every running request the tokens it still has to compute, decodes
first, then continuing prefill chunks, then new requests (after a prefix-cache lookup), until the
token budget is spent. When the pool runs out of blocks the newest running request is preempted:
its blocks are freed (their cached prefixes stay in the pool) and it is recomputed later.

A request's last sampled token has no KV yet. When that token completes a block, the finished
request keeps its blocks one step longer and that one token is computed (nothing sampled), so the
whole block joins the prefix cache: the next turn of a conversation, which repeats the reply, then
hits all of it instead of all but its last block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.outputs import TopLogprobs
from baton.common.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks and decodes together)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) a request may reach."""
    cache_final_block: bool = True
    """Compute a finished request's last token when it completes a block, to cache that block."""


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]
    """The tokens computed this step: positions ``start_pos .. start_pos + len - 1``."""
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    """True when this step reaches the request's last known token, so a token is sampled."""
    num_spec: int = 0
    """Proposed tokens at the end of ``token_ids`` (speculative decoding): all of them verified."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    """Decodes first, then prefill chunks."""
    preempted: tuple[str, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    """The most likely alternatives, when the request asks for ``logprobs`` > 0."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.completing: list[Request] = []
        """Finished requests whose last token completes a block: computed next step, then freed."""
        self._completed: list[Request] = []
        self.num_new_tokens = 0
        """Tokens the last ``update_from_output`` appended (several per verified request)."""

    # -- bookkeeping ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.release_completing(req.request_id)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.completing)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, keep_final_block: bool = False
    ) -> list[Request]:
        """End requests (abort, stop string) wherever they are; unknown ids are ignored. With
        ``keep_final_block``, a request whose last token completes a block keeps its blocks until
        the next step has computed that token (see ``cache_final_block``)."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            if keep_final_block and self._completes_a_block(req):
                self.completing.append(req)
            else:
                self.kv.free(req)
            done.append(req)
        return done

    def release_completing(self, request_id: str) -> None:
        """Free at once a finished request's blocks still held for its final block: its id is
        being reused, and blocks are tracked by request id."""
        for req in [r for r in self.completing if r.request_id == request_id]:
            self.completing.remove(req)
            self.kv.free(req)

    def _completes_a_block(self, req: Request) -> bool:
        return (
            self.config.cache_final_block
            and self.kv.pool.enable_caching
            and req.num_computed_tokens == req.num_tokens - 1
            and req.num_tokens % self.kv.block_size == 0
        )

    def admit_running(self, req: Request, token: SampledToken | None = None) -> None:
        """Put a request whose blocks are already reserved straight into the running batch: after
        a remote prefill (``token`` is the first token it sampled), or to compute the rest of its
        prompt here when the remote prefill failed (``token`` None). A token that ends the request
        finishes it at once."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.release_completing(req.request_id)
        self.requests[req.request_id] = req
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if token is not None:
            req.append_output(token.token_id, token.logprob, token.top_logprobs)
            reason = self._check_stop(req)
            if reason is not None:
                self.finish_requests([req.request_id], reason)

    def readmit(self, req: Request) -> None:
        """Queue first a request that holds no blocks and is computed from its start, as a
        preempted one is: a remote prefill given up with no room to replace its quarantined blocks."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.release_completing(req.request_id)
        self.requests[req.request_id] = req
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # Decodes before prefill chunks: a decode holds a user's stream, a chunk can wait a step.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        done: set[str] = set()
        # Finished requests' final blocks: one token each, nothing sampled, freed after the step.
        for req in self.completing:
            if budget <= 0 or not self.kv.allocate_slots(req, 1):
                self.kv.free(req)  # not worth a preemption: the block is just not cached
                continue
            start = req.num_computed_tokens
            req.num_computed_tokens += 1
            scheduled.append(
                ScheduledRequest(
                    request_id=req.request_id,
                    token_ids=(req.all_token_ids[start],),
                    start_pos=start,
                    block_ids=tuple(self.kv.block_ids(req.request_id)),
                    sample=False,
                )
            )
            self._completed.append(req)
            budget -= 1
        self.completing = []
        for req in order:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_spec = self._reserve_spec(req, num_new, budget)
            while not num_spec and not self.kv.allocate_slots(req, num_new):
                victim = self._pick_victim(exclude=done) or req
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(self._commit(req, num_new + num_spec, num_spec))
            done.add(req.request_id)
            budget -= num_new + num_spec

        # New and resumed requests, first come first served, unless this step preempted.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, num_new, hit_blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._commit(req, num_new))
            budget -= num_new

        scheduled.sort(key=lambda s: s.num_tokens > 1)
        return SchedulerOutput(requests=tuple(scheduled), preempted=tuple(preempted))

    def _reserve_spec(self, req: Request, num_new: int, budget: int) -> int:
        """Reserve slots for a decoding request's last token and its proposals, as many as the
        budget and the pool allow; returns how many proposals (0: none, nothing reserved). The
        proposals' blocks stay out of the prefix cache until their tokens are accepted."""
        num_spec = min(len(req.spec_token_ids), budget - 1) if num_new == 1 else 0
        if num_spec <= 0 or not self.kv.allocate_slots(req, 1 + num_spec, cache=False):
            return 0
        self.kv.cache_computed(req, req.num_computed_tokens + 1)
        return num_spec

    def _commit(self, req: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = tuple(req.all_token_ids[start : start + num_new - num_spec])
        req.num_computed_tokens += num_new
        spec = tuple(req.spec_token_ids[:num_spec])
        req.spec_token_ids = []
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=known + spec,
            start_pos=start,
            block_ids=tuple(self.kv.block_ids(req.request_id)),
            sample=req.num_computed_tokens - num_spec == req.num_tokens,
            num_spec=num_spec,
        )

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        # The newest arrival loses: it has the least work to redo and waited the least. Requests
        # already given tokens this step keep their blocks.
        candidates = [r for r in self.running if r.request_id not in exclude]
        return max(candidates, key=lambda r: r.arrival_time) if candidates else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.spec_token_ids = []
        self.waiting.appendleft(req)

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, SampledToken | tuple[SampledToken, ...]]
    ) -> list[Request]:
        """Append sampled tokens and finish requests that hit EOS, a stop token or a length
        limit. Returns the requests that received a token (finished ones included). A verified
        request gets a tuple (accepted proposals, then the bonus token): appended until one ends
        it, and its computed tokens and blocks are rolled back to the tokens it kept."""
        progressed = []
        finished_stopped, finished_length = [], []
        self.num_new_tokens = 0
        for sched in output.requests:
            tok = sampled.get(sched.request_id)
            req = self.requests.get(sched.request_id)
            if tok is None or req is None:
                continue
            reason = self._append(req, tok if isinstance(tok, tuple) else (tok,))
            if sched.num_spec:
                self._roll_back(req)
            progressed.append(req)
            if reason == RequestStatus.FINISHED_STOPPED:
                finished_stopped.append(req.request_id)
            elif reason == RequestStatus.FINISHED_LENGTH:
                finished_length.append(req.request_id)
        for req in self._completed:
            self.kv.free(req)
        self._completed = []
        self.finish_requests(finished_stopped, RequestStatus.FINISHED_STOPPED, keep_final_block=True)
        self.finish_requests(finished_length, RequestStatus.FINISHED_LENGTH, keep_final_block=True)
        return progressed

    def _append(self, req: Request, tokens: tuple[SampledToken, ...]) -> RequestStatus | None:
        """Append tokens until one ends the request; returns why it ended, if one did."""
        reason = None
        for tok in tokens:
            req.append_output(tok.token_id, tok.logprob, tok.top_logprobs)
            self.num_new_tokens += 1
            reason = self._check_stop(req)
            if reason is not None:
                break
        return reason

    def _roll_back(self, req: Request) -> None:
        """After a verification: the KV of the step's rows up to the last token kept is right (the
        last token itself has none yet); the rejected proposals' slots are given back."""
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.trim(req, req.num_tokens)
        self.kv.cache_computed(req, req.num_computed_tokens)

    def _check_stop(self, req: Request) -> RequestStatus | None:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
