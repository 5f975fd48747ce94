"""Tensor parallelism for the Llama model: the full weights, loaded as usual, are cut into this
rank's shard (``shard_model``) before they are packed.

Megatron's layout, as vLLM runs it: qkv and gate|up are column-parallel (each rank computes its
heads and its slice of the MLP), o_proj and down_proj row-parallel (each rank's partial sum, one
all-reduce per attention and per MLP block); the embedding and the LM head are split by vocabulary.
The residual stream stays whole and identical on every rank.

Heads are split by KV group so that every rank runs grouped-query attention with the model's
group size (the kernels map query head h to KV head h // group): with N ranks and KV heads,
* N <= KV: the KV heads are cut into N contiguous runs as evenly as they go, each rank taking the
  query heads of its KV heads. SmolLM2 (9 query, 3 KV heads) at N=2 gives 6 + 3 query heads (2 + 1
  KV heads): uneven, but no head is computed twice and no KV is stored twice.
* N > KV and N a multiple of KV (vLLM's case): each KV head is replicated on N / KV ranks, which
  share its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from baton.common.model.config import LlamaConfig
from baton.common.model.expert_parallel import MoEAllReduce, expert_split, keep_experts
from baton.common.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from baton.common.model.moe import SparseMoE
from baton.common.model.rank_group import RankGroup


@dataclass(frozen=True)
class Shard:
    """One rank's slice of the model, in heads and rows."""

    q_heads: tuple[int, int]
    """Query heads ``[start, end)``."""
    kv_heads: tuple[int, int]
    """KV heads ``[start, end)``."""
    intermediate: tuple[int, int]
    """MLP columns ``[start, end)``."""
    vocab: tuple[int, int]
    """Vocabulary rows of the embedding and the LM head ``[start, end)``."""
    max_vocab: int
    """The largest rank's vocabulary slice (gathers pad to it)."""


def _even_runs(total: int, parts: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into ``parts`` contiguous runs, the first ones one longer where uneven."""
    base, extra = divmod(total, parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        runs.append((start, end))
        start = end
    return runs


def head_split(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Per rank: (query heads, KV heads), each ``[start, end)``; see the module's docstring."""
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv = _even_runs(num_kv_heads, size)
        return [((a * group, b * group), (a, b)) for a, b in kv]
    replicas = size // num_kv_heads
    if size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {num_heads} query heads and {num_kv_heads} KV"
            f" heads: it must be at most the KV heads, or a multiple of them that divides each KV"
            f" head's {group} query heads"
        )
    per = group // replicas
    out = []
    for r in range(size):
        head = r // replicas
        q0 = head * group + (r % replicas) * per
        out.append(((q0, q0 + per), (head, head + 1)))
    return out


def plan_shard(cfg: LlamaConfig, rank: int, size: int) -> Shard:
    if size > cfg.intermediate_size or size > cfg.vocab_size:
        raise ValueError(f"tensor_parallel_size={size} is larger than the model's MLP or vocabulary")
    q, kv = head_split(cfg.num_heads, cfg.num_kv_heads, size)[rank]
    vocab = _even_runs(cfg.vocab_size, size)
    return Shard(q, kv, _even_runs(cfg.intermediate_size, size)[rank], vocab[rank], vocab[0][1] - vocab[0][0])


def shard_config(cfg: LlamaConfig, shard: Shard) -> LlamaConfig:
    """The shape this rank computes: its heads and MLP slice; the vocabulary stays whole (the
    gathered logits are)."""
    return replace(
        cfg,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.intermediate[1] - shard.intermediate[0],
    )


class RowParallel(nn.Module):
    """A block whose output is this rank's partial sum, all-reduced into the whole output. The
    sum runs in fp32 (bf16 partials would round twice) and is rounded once to the block's dtype,
    as the single process rounds its one product."""

    def __init__(self, block: nn.Module, group: RankGroup):
        super().__init__()
        self.block = block
        self.group = group

    @property
    def o_proj(self):  # LlamaDecoderLayer reads the model dtype from its attention's o_proj
        return self.block.o_proj

    def forward(self, *args) -> torch.Tensor:
        part = self.block(*args)  # [N, hidden]
        return self.group.all_reduce(part.float()).to(part.dtype)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids outside them contribute zeros to the all-reduce, so
    the sum is exactly the one row looked up."""

    def __init__(self, weight: torch.Tensor, vocab: tuple[int, int], group: RankGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V_local, hidden]
        self.start, self.end = vocab
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        rows = F.embedding((ids - self.start).clamp_(0, self.end - self.start - 1), self.weight)
        rows = rows.float() * mine.unsqueeze(-1)  # [N, hidden], fp32: the residual's dtype
        return self.group.all_reduce(rows)


def _qkv_rows(cfg: LlamaConfig, shard: Shard) -> torch.Tensor:
    """Row indices of this rank's q, k and v in the fused qkv weight."""
    d = cfg.head_dim
    q = torch.arange(shard.q_heads[0] * d, shard.q_heads[1] * d)
    k = cfg.num_heads * d + torch.arange(shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    v = k + cfg.num_kv_heads * d
    return torch.cat([q, k, v])


def _shard_attention(
    attn: LlamaAttention, cfg: LlamaConfig, shard: Shard, local: LlamaConfig
) -> LlamaAttention:
    d = cfg.head_dim
    out = LlamaAttention(local).to(device=attn.qkv_proj.weight.device, dtype=attn.qkv_proj.weight.dtype)
    out.qkv_proj.weight.data = attn.qkv_proj.weight.data[_qkv_rows(cfg, shard)].contiguous()
    q0, q1 = shard.q_heads
    out.o_proj.weight.data = attn.o_proj.weight.data[:, q0 * d : q1 * d].contiguous()
    return out


def _shard_mlp(mlp: LlamaMLP, cfg: LlamaConfig, shard: Shard, local: LlamaConfig) -> LlamaMLP:
    i0, i1 = shard.intermediate
    out = LlamaMLP(local).to(device=mlp.gate_up_proj.weight.device, dtype=mlp.gate_up_proj.weight.dtype)
    gate_up = mlp.gate_up_proj.weight.data
    inter = cfg.intermediate_size
    out.gate_up_proj.weight.data = torch.cat([gate_up[i0:i1], gate_up[inter + i0 : inter + i1]]).contiguous()
    out.down_proj.weight.data = mlp.down_proj.weight.data[:, i0:i1].contiguous()
    return out


def shard_moe(
    moe: SparseMoE,
    cfg: LlamaConfig,
    shard: Shard,
    local: LlamaConfig,
    group: RankGroup,
    expert_parallel: bool,
) -> MoEAllReduce:
    """``group.rank``'s part of a loaded MoE block (``shard`` and ``local`` are the rank's plan and
    shape): whole experts with ``expert_parallel`` (``expert_parallel.expert_split``), else every
    expert's slice of columns, as Llama's MLP is cut."""
    if expert_parallel:
        keep_experts(moe, expert_split(moe.num_experts, group.size)[group.rank])
    else:
        moe.experts = nn.ModuleList(_shard_mlp(e, cfg, shard, local) for e in moe.experts)
    return MoEAllReduce(moe, group)


def _shard_ffn(
    mlp: nn.Module, cfg, shard: Shard, local, group: RankGroup, expert_parallel: bool
) -> nn.Module:
    """A layer's MLP: Llama's row-parallel, or a mixture of experts' (``shard_moe``)."""
    if isinstance(mlp, SparseMoE):
        return shard_moe(mlp, cfg, shard, local, group, expert_parallel)
    return RowParallel(_shard_mlp(mlp, cfg, shard, local), group)


def shard_model(model: LlamaForCausalLM, group: RankGroup, expert_parallel: bool = False) -> LlamaForCausalLM:
    """Cut the loaded (not yet packed, not quantized) ``model`` into ``group.rank``'s shard, in place.
    Afterwards ``model.config`` is the rank's shape (``shard_config``), so its KV cache holds only
    its KV heads, and ``model.tp_shard`` says what it holds."""
    cfg = model.config
    shard = plan_shard(cfg, group.rank, group.size)
    local = shard_config(cfg, shard)
    with torch.device("cpu"):  # new modules are built small, then get the sliced weights
        for layer in model.layers:
            layer.self_attn = RowParallel(_shard_attention(layer.self_attn, cfg, shard, local), group)
            layer.mlp = _shard_ffn(layer.mlp, cfg, shard, local, group, expert_parallel)
    v0, v1 = shard.vocab
    head = model.lm_head_weight.data[v0:v1].contiguous()
    model.embed_tokens = VocabParallelEmbedding(
        model.embed_tokens.weight.data[v0:v1].contiguous(), shard.vocab, group
    )
    model.lm_head_weight = model.embed_tokens.weight if cfg.tie_word_embeddings else nn.Parameter(head, False)
    model.config = local
    model.full_config = cfg
    model.tp_shard = shard
    model.tp_group = group
    return model


# -- the LM head: each rank's vocabulary slice, gathered -----------------------------------------
def parallel_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """[M, hidden] -> [M, vocab] fp32 on every rank: each computes its slice (``compute_logits``,
    whose bf16 refinement then makes its own best candidates exact), then one all-gather."""
    shard, group = model.tp_shard, model.tp_group
    local = model.compute_logits(hidden)  # [M, V_local]
    padded = F.pad(local, (0, shard.max_vocab - local.shape[1]))
    parts = group.all_gather(padded)
    sizes = [b - a for a, b in _even_runs(model.full_config.vocab_size, group.size)]
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


def parallel_greedy(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """[M, hidden] -> [M] argmax ids: each rank's best (value, id) of its slice, one all-gather of
    those, the best of them; ties go to the lowest id, as argmax over the whole row does."""
    shard, group = model.tp_shard, model.tp_group
    logits = model._lm_head(hidden)  # [M, V_local]
    if logits.dtype == torch.float32:
        value, idx = logits.max(dim=-1)
    else:
        top, exact = model._refine(hidden, logits)
        value, j = exact.max(dim=-1)
        idx = top.gather(1, j.unsqueeze(1)).squeeze(1)
    best = torch.stack([value.float(), (idx + shard.vocab[0]).float()], dim=1)  # [M, 2]
    cands = torch.stack(group.all_gather(best))  # [N, M, 2]
    winner = cands[:, :, 0].argmax(dim=0)  # first (lowest-id) rank among equal values
    return cands[winner, torch.arange(cands.shape[1]), 1].long()
