"""Pipeline parallelism for the Llama model: the layers cut into contiguous stages, one per rank
(or per tensor-parallel group of ranks), and a step's batch cut into micro-batches of whole requests
so that the stages work on different micro-batches at once.

A stage keeps only its own layers (``cut_stage``): the embedding lives on the first stage, the final
norm and the LM head on the last, the rotary tables on every one. Between stages the fp32 residual
stream and the last layer's output (``delta``, not yet added into it) travel as they are, so a
stage computes exactly what the same layers compute in one process.

A micro-batch (``split_micro_batches``) is a run of whole requests with attention metadata of its
own, sliced from the step's: its rows, decode rows, prefill chunks and cascade groups, renumbered
from its first row. Every row's arithmetic is the whole batch's, only the GEMMs see fewer rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from baton.common.model.attention import AttentionMetadata, FreshRun
from baton.common.model.llama import LlamaForCausalLM
from baton.kernels.cascade_groups import CascadeGroups


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Each stage's layers ``[start, end)``: an even split, the earlier stages one longer where it
    is uneven (the last stage also runs the LM head, and rank 0's stage sizes the KV budget)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} must be between 1 and the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + base + (s < extra)
        out.append((start, end))
        start = end
    return out


def cut_stage(model: LlamaForCausalLM, stage: int, num_stages: int) -> LlamaForCausalLM:
    """Keep only ``stage``'s part of the loaded (possibly tensor-parallel) ``model``, in place.
    Afterwards ``model.config.num_layers`` is the stage's layer count (its KV cache holds those
    layers only) and ``model.pp_layers`` the model's layers it runs."""
    cfg = model.config
    start, end = stage_layers(cfg.num_layers, num_stages)[stage]
    model.stage_dtype = model.embed_tokens.weight.dtype  # the dtype the final norm rounds to
    model.layers = nn.ModuleList(list(model.layers)[start:end])
    if stage > 0:
        model.embed_tokens = None  # a tied LM head keeps its weight through ``lm_head_weight``
    if stage < num_stages - 1:
        model.norm = None
        model.lm_head_weight = None
        model.lm_head_packed = None
        model.lm_head_quant = None
    if not hasattr(model, "full_config"):  # tensor parallelism has set it
        model.full_config = cfg
    model.config = replace(cfg, num_layers=end - start)
    model.pp_layers = (start, end)
    return model


# -- a stage's part of the forward pass (``LlamaForCausalLM.forward`` in three pieces) -----------
def embed(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """[N] ids -> [N, hidden] fp32 residual stream (the first stage)."""
    return model.embed_tokens(input_ids).float()


def run_layers(
    model: LlamaForCausalLM,
    residual: torch.Tensor,  # [N, hidden] fp32, updated in place
    delta: torch.Tensor | None,  # [N, hidden] the previous layer's output, model dtype
    positions: torch.Tensor,  # [N]
    kv_cache: torch.Tensor,  # [num_blocks, stage layers, 2, KV, bs, D]
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The stage's layers; returns the last one's output (still to be added into ``residual``)."""
    for i, layer in enumerate(model.layers):
        delta = layer(residual, delta, positions, model.rotary, kv_cache[:, i], meta)
    assert delta is not None  # a stage has at least one layer
    return delta


def final_norm(model: LlamaForCausalLM, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Hidden states after the final norm, [N, hidden] in the model dtype (the last stage)."""
    return model.norm(residual, delta, model.stage_dtype)


# -- micro-batches ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroBatch:
    """Rows ``[start, start + len(input_ids))`` of a step: whole requests, with their own metadata."""

    start: int
    input_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    meta: AttentionMetadata


def request_starts(meta: AttentionMetadata) -> list[int]:
    """The row each request of the step starts at, then the end of the last (padding excluded):
    decode rows one each, then one entry per prefill chunk."""
    decodes = list(range(meta.num_decode_tokens))
    if meta.prefill_context_lens.numel() == 0:
        return decodes + [meta.num_decode_tokens]
    return decodes + meta.prefill_query_start_loc.tolist()


def split_points(starts: list[int], parts: int) -> list[int]:
    """Cuts ``[0, c1, ..., total]`` into at most ``parts`` non-empty runs of whole requests: at
    each even share of the rows, the request boundary nearest to it (the lower one on a tie)."""
    total = starts[-1]
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        nearest = min(starts, key=lambda b: (abs(b - target), b))
        if cuts[-1] < nearest < total:
            cuts.append(nearest)
    return cuts + [total]


def split_micro_batches(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, parts: int
) -> tuple[MicroBatch, ...]:
    """The step as up to ``parts`` micro-batches of whole requests, about equal in rows; the
    step's padding rows go with the last one. One part (or one request) is the step itself."""
    cuts = split_points(request_starts(meta), parts)
    if len(cuts) == 2:
        return (MicroBatch(0, input_ids, positions, meta),)
    out = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        last = i == len(cuts) - 2
        end = input_ids.shape[0] if last else b
        out.append(MicroBatch(a, input_ids[a:end], positions[a:end], slice_metadata(meta, a, b, last)))
    return tuple(out)


def slice_metadata(meta: AttentionMetadata, a: int, b: int, last: bool) -> AttentionMetadata:
    """The metadata of rows ``[a, b)`` (whole requests), renumbered from ``a``; ``last`` takes the
    step's padding rows after ``b`` too."""
    nd = meta.num_decode_tokens
    d0, d1 = min(a, nd), min(b, nd)
    num_prefills = meta.prefill_context_lens.numel()
    loc = meta.prefill_query_start_loc.tolist()
    k0 = sum(1 for s in loc[:num_prefills] if s < a)
    k1 = sum(1 for s in loc[:num_prefills] if s < b)
    sub_loc = [x - a for x in loc[k0 : k1 + 1]] if k1 > k0 else [0]
    end = b + meta.num_padding_tokens if last else b
    return replace(
        meta,
        slot_blocks=meta.slot_blocks[a:end],
        slot_offsets=meta.slot_offsets[a:end],
        num_decode_tokens=d1 - d0,
        decode_block_tables=meta.decode_block_tables[d0:d1],
        decode_context_lens=meta.decode_context_lens[d0:d1],
        fresh_runs=_slice_runs(meta.fresh_runs, a, b),
        context_prefills=tuple(
            replace(s, start=s.start - a, end=s.end - a) for s in meta.context_prefills if a <= s.start < b
        ),
        prefill_block_tables=meta.prefill_block_tables[k0:k1],
        prefill_context_lens=meta.prefill_context_lens[k0:k1],
        prefill_query_start_loc=torch.tensor(
            sub_loc, dtype=torch.int32, device=meta.prefill_query_start_loc.device
        ),
        num_padding_tokens=meta.num_padding_tokens if last else 0,
        cascade=_slice_cascade(meta.cascade, d0, d1),
    )


def _slice_runs(runs: tuple[FreshRun, ...], a: int, b: int) -> tuple[FreshRun, ...]:
    """The chunks of each batched run that lie in ``[a, b)``, renumbered from ``a``."""
    out = []
    for run in runs:
        first = max(0, -((run.start - a) // run.length))  # ceil((a - start) / length)
        last = min(run.count, (b - run.start) // run.length)
        if last > first:
            out.append(FreshRun(run.start + first * run.length - a, last - first, run.length))
    return tuple(out)


def _slice_cascade(cascade: CascadeGroups | None, d0: int, d1: int) -> CascadeGroups | None:
    """The groups' decode rows in ``[d0, d1)``, renumbered; a group left with one row attends
    alone (the plain path), as rows in no group do."""
    if cascade is None:
        return None
    groups = []
    for members, shared in cascade.as_lists():
        kept = [r - d0 for r in members if d0 <= r < d1]
        if len(kept) >= 2:
            groups.append((kept, shared))
    return CascadeGroups.build(groups, cascade.rows.device) if groups else None
