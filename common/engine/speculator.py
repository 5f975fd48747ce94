"""Speculative decoding's engine side: after each step, propose the running requests' next tokens
(n-gram lookup, or a draft model with its own small paged KV cache kept in step with the
target's), choose how many are worth verifying (``SpecController``), and count what the
verification accepted. The verification itself is ``rejection``; the rollback, the scheduler's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from baton.common.engine.block_pool import BlockPool
from baton.common.engine.hashing import BlockHasher
from baton.common.engine.kv_cache_manager import KVCacheManager
from baton.common.engine.model_runner import ModelRunner, RunnerOutput, allocate_kv_cache
from baton.common.engine.rejection import inverse_cdf
from baton.common.engine.request import Request, RequestStatus
from baton.common.engine.sampler import sampling_probs
from baton.common.engine.sampling_params import SamplingParams
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.common.engine.spec_decode import (
    SpecController,
    SpecStats,
    SpeculativeConfig,
    ngram_propose,
    proposal_room,
)
from baton.common.engine.structured import StructuredOutputs

Proposal = tuple[list[int], torch.Tensor | None]
"""A request's proposed tokens, and the draft's distributions at them ([k, V]; None: greedy)."""


class DraftProposer:
    """A smaller model of the same tokenizer that proposes k tokens by decoding them itself. Its
    paged KV cache holds, per request, the KV of the request's tokens it has already seen: each
    round computes the tokens it has not (the prompt, at first; then the last step's accepted
    tokens), then k - 1 single-token steps. A rejected proposal's KV is dropped by counting it
    uncomputed (``_catch_up``): the next round rewrites its slots."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: str):
        self.model = model
        cache = allocate_kv_cache(model, num_blocks + 1, block_size, dtype, device)
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), BlockHasher(block_size))
        self.runner = ModelRunner(model, cache, block_size, scratch_block=num_blocks)
        self._seqs: dict[str, Request] = {}
        """Per request, a shadow whose ``num_computed_tokens`` counts the draft's KV."""

    def release_except(self, live: set[str]) -> None:
        for rid in [r for r in self._seqs if r not in live]:
            self.kv.free(self._seqs.pop(rid))

    @torch.inference_mode()
    def propose(
        self,
        reqs: Sequence[Request],
        ks: Mapping[str, int],
        generators: Mapping[str, torch.Generator],
        cost=None,
    ) -> dict[str, Proposal]:
        """Up to ``ks[id]`` tokens for each request (none where the draft's pool is full)."""
        chunks = [c for c in (self._catch_up(r, ks[r.request_id]) for r in reqs) if c is not None]
        by_id = {r.request_id: r for r in reqs}
        tokens: dict[str, list[int]] = {c.request_id: [] for c in chunks}
        probs: dict[str, list[torch.Tensor]] = {c.request_id: [] for c in chunks}
        while chunks:
            start = time.perf_counter()
            picked = self._forward(chunks, by_id, generators)
            if cost is not None:
                cost.observe(len(chunks), time.perf_counter() - start)
            nxt = []
            for c in chunks:
                tok, dist = picked[c.request_id]
                tokens[c.request_id].append(tok)
                if dist is not None:
                    probs[c.request_id].append(dist)
                if len(tokens[c.request_id]) < ks[c.request_id]:
                    nxt.append(self._feed(c.request_id, tok))
            chunks = nxt
        return {rid: (t, torch.stack(probs[rid]) if probs[rid] else None) for rid, t in tokens.items()}

    def _catch_up(self, req: Request, k: int) -> ScheduledRequest | None:
        """The chunk of ``req``'s tokens the draft has no KV for, with slots reserved for the
        k - 1 proposals it will feed back; None when the draft's pool cannot hold them."""
        shadow = self._seqs.get(req.request_id)
        if shadow is None:
            shadow = self._seqs[req.request_id] = Request(req.request_id, [], SamplingParams())
        # Positions before the target's last token hold the same tokens the draft saw there;
        # positions after it held proposals, some rejected.
        start = shadow.num_computed_tokens = min(shadow.num_computed_tokens, req.num_tokens - 1)
        if not self.kv.allocate_slots(shadow, req.num_tokens - start + k - 1):
            return None
        shadow.num_computed_tokens = req.num_tokens
        ids = tuple(req.all_token_ids[start:])
        return ScheduledRequest(req.request_id, ids, start, tuple(self.kv.block_ids(req.request_id)), True)

    def _feed(self, request_id: str, token: int) -> ScheduledRequest:
        shadow = self._seqs[request_id]
        pos = shadow.num_computed_tokens
        shadow.num_computed_tokens += 1
        return ScheduledRequest(request_id, (token,), pos, tuple(self.kv.block_ids(request_id)), True)

    def _forward(
        self, chunks: list[ScheduledRequest], reqs: Mapping[str, Request], generators
    ) -> dict[str, tuple[int, torch.Tensor | None]]:
        """Each chunk's next token (and its distribution, for sampled requests)."""
        ordered = sorted(chunks, key=lambda c: c.num_tokens > 1)  # decodes first, as the kernels want
        inputs = self.runner.prepare(SchedulerOutput(tuple(ordered)))
        hidden = self.model(inputs.input_ids, inputs.positions, self.runner.kv_cache, inputs.meta)
        rows = hidden[inputs.logits_indices]
        params = [reqs[rid].sampling_params for rid in inputs.sample_ids]
        if all(p.greedy for p in params):
            return {
                rid: (t, None) for rid, t in zip(inputs.sample_ids, self.model.greedy_tokens(rows).tolist())
            }
        logits = self.model.compute_logits(rows).float().cpu()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        dists = sampling_probs(logits[sampled], [params[i] for i in sampled])  # one softmax for all
        out: dict[str, tuple[int, torch.Tensor | None]] = {}
        for i, rid in enumerate(inputs.sample_ids):
            out[rid] = (int(logits[i].argmax()), None)
        for j, i in enumerate(sampled):
            rid = inputs.sample_ids[i]
            out[rid] = (inverse_cdf(dists[j], generators.get(rid)), dists[j])
        return out


class Speculator:
    """Proposes after each step; the engine verifies the proposals in the next one. A structured
    request's proposals stop where its grammar refuses one (``StructuredOutputs.trim_proposal``);
    its verified rows are masked (``verify_mask``); jump-forward and speculation take turns: a
    request with forced tokens to compute is not decoding, so it gets no proposals that step."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        drafter: DraftProposer | None = None,
        grammars: StructuredOutputs | None = None,
    ):
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.grammars = grammars
        self.stats = SpecStats()
        self.controller = SpecController(config.num_speculative_tokens, config.adaptive)
        self.draft_probs: dict[str, torch.Tensor] = {}
        """The draft model's distributions at each pending request's proposals (sampled ones)."""
        self._guard_sample: tuple[int, bool, int] | None = None
        """(decodes, verified, tokens) of a decode-only step, for the guard once the step ends."""
        self._propose_seconds = 0.0
        """What the last ``propose`` took: part of the cost of the step it prepared."""

    def observe_step(self, sched: SchedulerOutput, result: RunnerOutput, seconds: float) -> None:
        """Feed the cost model the step's time and count what its verifications accepted."""
        self.controller.target.observe(sched.num_batched_tokens, seconds)
        verified = False
        for r in sched.requests:
            got = result.sampled.get(r.request_id)
            if not r.num_spec or not isinstance(got, tuple):
                continue
            verified = True
            accepted = len(got) - 1
            self.stats.record(r.num_spec, accepted)
            self.controller.observe_acceptance(r.num_spec, accepted)
        if not verified:
            self.controller.idle()
        self._guard_sample = None
        if sched.requests and all(r.sample and r.num_tokens - r.num_spec == 1 for r in sched.requests):
            tokens = sum(len(t) if isinstance(t, tuple) else 1 for t in result.sampled.values())
            self._guard_sample = (len(sched.requests), verified, tokens)
        self.draft_probs = {}

    def finish_step(self, step_seconds: float) -> None:
        """The step's wall time (without the proposing that ends it, for the next step): the
        throughput guard gets it plus the proposing that prepared this step, so that a verifying
        step pays for its n-gram search, its longer sampling and its rollback, not only for its
        forward pass (which alone made verifying look cheaper than it was)."""
        if self._guard_sample is not None:
            num_decodes, verified, tokens = self._guard_sample
            seconds = step_seconds + (self._propose_seconds if verified else 0.0)
            self.controller.guard.observe(num_decodes, verified, tokens, seconds)
        self._guard_sample = None
        self._propose_seconds = 0.0

    def propose(
        self, running: Sequence[Request], budget: int, generators: Mapping[str, torch.Generator]
    ) -> None:
        """Set ``spec_token_ids`` on the running requests that decode next step, as many as the
        controller finds worth it (``budget``: the step's token budget)."""
        start = time.perf_counter()
        try:
            self._propose(running, budget, generators)
        finally:
            self._propose_seconds = time.perf_counter() - start

    def _propose(
        self, running: Sequence[Request], budget: int, generators: Mapping[str, torch.Generator]
    ) -> None:
        decodes = [
            r
            for r in running
            if r.status == RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
        ]
        other = min(budget, sum(r.num_tokens - r.num_computed_tokens for r in running))
        rooms = {r.request_id: self._room(r) for r in decodes}
        candidates = [r for r in decodes if rooms[r.request_id] > 0]
        if self.drafter is not None:
            self.drafter.release_except({r.request_id for r in running})
        # The best case (every decode has proposals) does not pay: skip proposing at all.
        if not candidates or self.controller.choose_k(other, len(decodes), len(candidates)) == 0:
            return
        if self.drafter is None:
            self._propose_ngrams(candidates, rooms, other, len(decodes))
        else:
            self._propose_draft(candidates, rooms, other, len(decodes), generators)

    def _room(self, req: Request) -> int:
        p = req.sampling_params
        room = proposal_room(req.num_output_tokens, p.max_tokens, req.num_tokens, self.max_model_len)
        return min(self.config.num_speculative_tokens, room)

    def _propose_ngrams(
        self, reqs: list[Request], rooms: dict[str, int], other: int, num_decodes: int
    ) -> None:
        cfg = self.config
        found = {
            r.request_id: self._trim(
                r, ngram_propose(r.all_token_ids, cfg.ngram_min, cfg.ngram_max, rooms[r.request_id])
            )
            for r in reqs
        }
        k = self.controller.choose_k(other, num_decodes, sum(1 for p in found.values() if p))
        for r in reqs:
            r.spec_token_ids = found[r.request_id][:k]

    def _propose_draft(
        self, reqs: list[Request], rooms: dict[str, int], other: int, num_decodes: int, generators
    ) -> None:
        k = self.controller.choose_k(other, num_decodes, len(reqs))
        ks = {r.request_id: min(k, rooms[r.request_id]) for r in reqs}
        assert self.drafter is not None
        proposals = self.drafter.propose(reqs, ks, generators, cost=self.controller.draft)
        for r in reqs:
            toks, dists = proposals.get(r.request_id, ([], None))
            r.spec_token_ids = self._trim(r, toks)
            if dists is not None:
                self.draft_probs[r.request_id] = dists[: len(r.spec_token_ids)]

    def _trim(self, req: Request, tokens: list[int]) -> list[int]:
        """A structured request's proposals up to where its grammar refuses one, unless a draft
        model sampled them (``StructuredOutputs.trim_proposal``: verification rejects those)."""
        p = req.sampling_params
        if self.grammars is None or p.structured_outputs is None or (self.drafter and not p.greedy):
            return tokens
        return self.grammars.trim_proposal(req, tokens)


def make_speculator(config: SpeculativeConfig | None, engine, draft_model=None) -> Speculator | None:
    """The speculator of ``engine`` (None when speculation is off). A draft model gets a pool of
    as many blocks as the target's, so that it never runs out before the target does."""
    if config is None:
        return None
    drafter = None
    if config.method == "draft":
        if draft_model is None:
            raise ValueError(
                "speculative 'draft' needs the draft model loaded (parallel.engine_factory.create_engine)"
            )
        vocab, target_vocab = draft_model.config.vocab_size, engine.model.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) is not the target's ({target_vocab}): "
                "it must share the tokenizer"
            )
        cfg = engine.config
        drafter = DraftProposer(draft_model, engine.pool.num_blocks, cfg.block_size, engine.dtype, cfg.device)
    return Speculator(config, engine.max_model_len, drafter, engine.structured)
