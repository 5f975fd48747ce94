"""Runs one scheduled step: builds positions, slot mappings and block tables once, runs the model
over the flat token batch, and samples for the requests that reached their last known token."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from baton.common.engine.cascade_plan import CascadeConfig, plan_cascade
from baton.common.engine.rejection import VerifyGroup, padded_rows, verify
from baton.common.engine.request import Request
from baton.common.engine.sampler import SampleResult, finite_rows, sample
from baton.common.engine.scheduler import SampledToken, SchedulerOutput
from baton.common.engine.step_shapes import padded_num_tokens, token_buckets
from baton.common.engine.structured import StructuredOutputs
from baton.common.model.attention import AttentionMetadata, PrefillSegment, plan_prefills
from baton.common.model.llama import Linear, LlamaForCausalLM
from baton.common.model.quant import QuantLinear
from baton.kernels import kv_quant
from baton.kernels.cascade_groups import CascadeGroups


def _kv_block_shape(model: LlamaForCausalLM, block_size: int, kv_cache_dtype: str) -> tuple[int, ...]:
    cfg = model.config
    row = kv_quant.row_elems(cfg.head_dim, kv_quant.kv_format(kv_cache_dtype))
    return (cfg.num_layers, 2, cfg.num_kv_heads, block_size, row)


def _kv_storage_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    fmt = kv_quant.kv_format(kv_cache_dtype)
    return dtype if fmt is None else fmt.storage


def kv_cache_block_bytes(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one block across every layer, a quantized cache's scales included."""
    elem = torch.empty((), dtype=_kv_storage_dtype(dtype, kv_cache_dtype)).element_size()
    return math.prod(_kv_block_shape(model, block_size, kv_cache_dtype)) * elem


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype, device, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """[num_blocks, num_layers, 2, KV, block_size, D]: a block is contiguous across layers. A
    quantized ``kv_cache_dtype`` stores rows of D 1-byte codes and a 2-byte scale instead
    (``[..., D + 2]`` in the code's dtype, see ``baton.kernels.kv_quant``).

    A CPU cache asks for transparent huge pages before its first touch: moving KV to another
    process over shared memory (UCX's cross-memory attach) pins the source page by page, and with
    2 MB pages a 16k-token SmolLM2 KV moved at ~11 GB/s instead of ~6 GB/s (W5, 2-core host)."""
    shape = (num_blocks, *_kv_block_shape(model, block_size, kv_cache_dtype))
    cache = torch.empty(shape, dtype=_kv_storage_dtype(dtype, kv_cache_dtype), device=device)
    if cache.device.type == "cpu":
        _advise_huge_pages(cache)
    return cache.zero_()


def kv_cache_layout(cache: torch.Tensor) -> str:
    """A cache's dtype and block shape, e.g. ``bfloat16 30x2x3x16x64``: two workers can move
    blocks between their caches only if theirs are equal."""
    return f"{str(cache.dtype).removeprefix('torch.')} {'x'.join(map(str, cache.shape[1:]))}"


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over the whole 2 MB pages inside ``tensor``; a no-op where the kernel
    or libc says no (THP disabled, not Linux)."""
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start:
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(start, end - start, _MADV_HUGEPAGE)


def _pad_tables(tables: list[tuple[int, ...]]) -> np.ndarray:
    """Block tables as one zero-padded [len(tables), longest] int32 array."""
    out = np.zeros((len(tables), max((len(t) for t in tables), default=1)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S], the rows whose logits are sampled
    sample_ids: tuple[str, ...]  # request id of each sampled row
    verify: tuple[VerifyGroup, ...] = ()  # requests whose proposals are verified (all their rows)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        scratch_block: int,
        cascade: CascadeConfig | None = None,
    ):
        """``scratch_block``: a cache block that no request owns, where padding rows store their K/V.
        ``cascade``: when decode rows sharing prefix blocks use cascade attention (None: never)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = kv_cache.device
        self.cascade = cascade
        # Steps that used cascade attention, their groups and the decode rows in them (metrics).
        self.num_cascade_steps = 0
        self.num_cascade_groups = 0
        self.num_cascade_queries = 0
        self.grammars: StructuredOutputs | None = None
        """The engine's structured outputs: the rows of requests with a grammar, or short of
        ``min_tokens``, are masked."""

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        decode_tables: list[tuple[int, ...]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        verify_groups: list[VerifyGroup] = []
        for r in sched.requests:
            start_row = len(ids)
            n = r.num_tokens
            ids.extend(r.token_ids)
            p = range(r.start_pos, r.start_pos + n)
            pos.extend(p)
            table = r.block_ids
            blocks.extend(table[i // bs] for i in p)
            offsets.extend(i % bs for i in p)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(r.start_pos + 1)
            else:
                prefills.append(
                    PrefillSegment(
                        start=start_row,
                        end=start_row + n,
                        context_len=r.start_pos + n,
                        block_table=table,
                    )
                )
            if r.num_spec:
                draft = r.token_ids[-r.num_spec :]
                verify_groups.append(VerifyGroup(r.request_id, len(ids) - 1 - r.num_spec, draft))
            elif r.sample:
                logits_rows.append(len(ids) - 1)
                sample_ids.append(r.request_id)
        padding = padded_num_tokens(len(ids)) - len(ids)
        ids.extend([0] * padding)
        pos.extend([0] * padding)
        blocks.extend([self.scratch_block] * padding)
        offsets.extend([0] * padding)
        nd = len(decode_lens)
        table_np = _pad_tables(decode_tables)
        dev = self.device
        fresh_runs, context_prefills = plan_prefills(tuple(prefills))
        ptables = _pad_tables([p.block_table for p in prefills])
        qsl = [p.start for p in prefills] + [prefills[-1].end] if prefills else [0]
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(offsets, dtype=torch.long, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=torch.from_numpy(table_np).to(dev),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            fresh_runs=fresh_runs,
            context_prefills=context_prefills,
            prefill_block_tables=torch.from_numpy(ptables).to(dev),
            prefill_context_lens=torch.tensor(
                [p.context_len for p in prefills], dtype=torch.int32, device=dev
            ),
            prefill_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            num_padding_tokens=padding,
            cascade=self._cascade_groups(decode_tables, decode_lens),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            meta=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sample_ids=tuple(sample_ids),
            verify=tuple(verify_groups),
        )

    def _cascade_groups(self, tables: list[tuple[int, ...]], lens: list[int]) -> CascadeGroups | None:
        """The decode rows that attend to shared prefix blocks once per group this step, or None
        (the plain kernel). A quantized cache (1-byte codes) is never planned: the cascade kernels
        read floating-point K/V only."""
        kv = self.kv_cache.dtype
        if self.cascade is None or len(tables) < 2 or not kv.is_floating_point or kv.itemsize < 2:
            return None
        plan = plan_cascade(tables, lens, self.block_size, self.cascade)
        if plan is None:
            return None
        self.num_cascade_steps += 1
        self.num_cascade_groups += len(plan.groups)
        self.num_cascade_queries += plan.num_queries
        return CascadeGroups.build([(g.rows, g.num_shared_blocks) for g in plan.groups], self.device)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, max_sampled: int) -> None:
        """Build the oneDNN primitives of every projection at every row count a step of up to
        ``max_tokens`` tokens is padded to, and of the LM head at 1 to ``max_sampled`` rows, so
        that none is built while serving (see ``padded_num_tokens``). Projections on other paths
        (fp32 runs MKL's GEMM, which builds nothing per shape) are left alone."""
        shapes = {
            (type(m), m.in_features, m.out_features): m
            for name, m in self.model.named_modules()
            if (isinstance(m, Linear) and m.packed is not None)
            or (isinstance(m, QuantLinear) and name != "lm_head_quant")  # oneDNN's int8 primitives too
        }
        dtype = self.model.embed_tokens.weight.dtype
        for n in token_buckets(max_tokens) if shapes else ():
            for (_, k, _), linear in shapes.items():
                linear(torch.zeros(n, k, dtype=dtype, device=self.device))
        if self.model.lm_head_packed is None and self.model.lm_head_quant is None:
            return
        hidden = self.model.config.hidden_size
        for n in token_buckets(max_sampled):  # the row counts ``padded_rows`` gives
            self.model.greedy_tokens(torch.zeros(n, hidden, dtype=dtype, device=self.device))

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        requests: Mapping[str, Request],
        generators: Mapping[str, torch.Generator],
        draft_probs: Mapping[str, torch.Tensor] | None = None,
    ) -> RunnerOutput:
        """Run the step's forward pass and sample. An exception here fails the step's requests
        (``LLMEngine.step``); a row whose numbers are not finite fails only its own request.
        Requests with proposals get their accepted ones and a bonus token (``rejection``), judged
        against ``draft_probs`` (a draft model's, per request; none: n-gram proposals)."""
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        out = self._sample(inputs, hidden, requests, generators)
        if not inputs.verify:
            return out
        mask = self.grammars.verify_mask(inputs.verify, requests) if self.grammars is not None else None
        verified, failed = verify(self.model, hidden, inputs.verify, requests, generators, draft_probs, mask)
        return RunnerOutput({**out.sampled, **verified}, out.failed + failed)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor, requests, generators) -> RunnerOutput:
        if not inputs.sample_ids:
            return RunnerOutput({})
        rows = hidden[inputs.logits_indices]
        params = [requests[rid].sampling_params for rid in inputs.sample_ids]
        grammar = self.grammars.mask(inputs.sample_ids, requests) if self.grammars is not None else None
        if grammar is None and all(p.greedy and p.logprobs is None for p in params):
            # No fp32 logits here: the hidden rows are checked instead ([S, hidden], a few us).
            # Finite hidden states and finite weights give finite logits.
            tokens = self.model.greedy_tokens(padded_rows(rows))[: len(rows)].tolist()
            result = SampleResult(tokens, bad_rows=_non_finite_rows(rows))
        else:
            logits = self.model.compute_logits(padded_rows(rows))[: len(rows)]
            gens = [generators.get(rid) for rid in inputs.sample_ids]
            result = sample(logits.cpu(), params, gens, grammar)
        return _runner_output(inputs.sample_ids, result)


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced: a token for each request that sampled (a tuple for a verified one),
    and the ones that failed."""

    sampled: dict[str, SampledToken | tuple[SampledToken, ...]]
    failed: tuple[str, ...] = ()
    """Requests whose logits (or hidden state) were not finite: no token; the engine fails them."""


def _non_finite_rows(rows: torch.Tensor) -> tuple[int, ...]:
    finite = finite_rows(rows)
    return () if bool(finite.all()) else tuple(torch.nonzero(~finite).view(-1).tolist())


def _runner_output(sample_ids: tuple[str, ...], result: SampleResult) -> RunnerOutput:
    lps, tops, bad = result.logprobs, result.top_logprobs, set(result.bad_rows)
    sampled = {
        rid: SampledToken(tok, None if lps is None else lps[i], None if tops is None else tops[i])
        for i, (rid, tok) in enumerate(zip(sample_ids, result.token_ids))
        if i not in bad
    }
    return RunnerOutput(sampled, tuple(sample_ids[i] for i in result.bad_rows))
