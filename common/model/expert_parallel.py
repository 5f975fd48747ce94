"""Mixture-of-experts blocks across ranks: experts TP-sharded, experts placed whole (expert
parallelism), and tokens dispatched to the experts' ranks (expert parallelism beside
data-parallel attention).

* Tensor parallelism (``tensor_parallel.shard_moe``, no EP): every expert's w1|w3 is cut column-wise and its w2
  row-wise, as vLLM does; each rank's output is a partial sum.
* Expert parallelism under TP (``shard_moe`` with EP): rank r keeps experts ``expert_split[r]``
  whole. Attention is tensor-parallel, so every rank already holds every token and routes it the
  same way (same weights, same replicated input): dispatch is a local selection, and the combine
  is the one all-reduce of the ranks' partial sums that TP's MLP block runs anyway. No token
  moves: an all-to-all would only send each rank rows it already has.
* Expert parallelism beside data-parallel attention (``ExpertDispatch``): each rank has its own
  tokens, so they travel. gloo in torch 2.13 implements ``alltoall_base`` with uneven splits, so
  each (token, chosen expert) pair is sent to the rank holding that expert and its output comes
  back the same way: four all-to-alls per block (the counts, the rows, their expert ids, the
  outputs), and a rank receives only the rows its experts compute, not every rank's batch as an
  all-gather would send it. A rank with no tokens takes part with empty sends, which is what a
  data-parallel rank's dummy step does (``data_parallel``).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.common.model.moe import SparseMoE
from baton.common.model.rank_group import RankGroup


def expert_split(num_experts: int, size: int) -> list[tuple[int, int]]:
    """Per rank, the ``[start, end)`` of the experts it holds whole: contiguous, as even as they go."""
    if size > num_experts:
        raise ValueError(
            f"expert parallelism over {size} ranks needs at least {size} experts, the model has {num_experts}"
        )
    base, extra = divmod(num_experts, size)
    runs, start = [], 0
    for r in range(size):
        end = start + base + (r < extra)
        runs.append((start, end))
        start = end
    return runs


def keep_experts(moe: SparseMoE, experts: tuple[int, int]) -> SparseMoE:
    """``moe`` holding only the experts ``[start, end)`` (whole, as loaded), in place."""
    start, end = experts
    kept = list(moe.experts)[start - moe.first_expert : end - moe.first_expert]
    moe.experts = nn.ModuleList(kept)
    moe.first_expert = start
    return moe


class MoEAllReduce(nn.Module):
    """A MoE block whose ranks each compute a partial sum (TP-sharded or EP-placed experts, over
    tokens every rank holds), all-reduced in fp32 and rounded once, as ``RowParallel`` does."""

    def __init__(self, moe: SparseMoE, group: RankGroup):
        super().__init__()
        self.moe = moe
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.moe.gate(x)
        part = self.moe.partial(x, weights, ids)  # [N, hidden] fp32
        return self.group.all_reduce(part).to(x.dtype)


# -- expert parallelism beside data-parallel attention ------------------------------------------
class ExpertDispatch(nn.Module):
    """A MoE block over ranks that each run their own batch: each token's top-k choices go to the
    ranks holding those experts and their outputs come back (all-to-all), weighted and summed at
    home. ``calls`` counts forward passes, so that a data-parallel rank can tell whether a step
    ran its model (or must take part in the collectives with an empty batch)."""

    owner: torch.Tensor
    """[E] the rank holding each expert."""

    def __init__(self, moe: SparseMoE, group: RankGroup):
        super().__init__()
        self.group = group
        split = expert_split(moe.num_experts, group.size)
        self.moe = keep_experts(moe, split[group.rank])
        owner = [r for r, (a, b) in enumerate(split) for _ in range(a, b)]
        owner_t = torch.tensor(owner, dtype=torch.long, device=moe.gate.weight.device)
        self.register_buffer("owner", owner_t, persistent=False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, hidden] in x's dtype; ``n`` may be 0."""
        self.calls += 1
        weights, ids = self.moe.gate(x)  # [n, k]
        k = ids.shape[1]
        dest = self.owner[ids.reshape(-1)]  # [n * k] the rank of each choice
        order = torch.argsort(dest, stable=True)  # choices grouped by destination rank
        send = torch.bincount(dest, minlength=self.group.size).tolist()
        recv = self._exchange_counts(send)
        tokens = order // k
        rows = self._all_to_all(x[tokens], send, recv)  # [Q, hidden] others' rows for my experts
        experts = self._all_to_all(ids.reshape(-1)[order], send, recv)  # [Q]
        done = self.moe.expert_rows(rows, experts) if rows.shape[0] else rows.float()
        back = self._all_to_all(done, recv, send)  # [n * k, hidden] fp32, in ``order``
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, back * weights.reshape(-1)[order].unsqueeze(1))
        return out.to(x.dtype)

    def _exchange_counts(self, send: list[int]) -> list[int]:
        """How many rows each rank will send here, given how many this rank sends each."""
        out = torch.empty(self.group.size, dtype=torch.long, device=self.owner.device)
        inp = torch.tensor(send, dtype=torch.long, device=self.owner.device)
        self.group.pg.alltoall_base(out, inp, [], []).wait()
        return out.tolist()

    def _all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``t`` (grouped by destination, ``send[r]`` for rank r) exchanged: the ``recv[r]``
        rows of each rank r, in rank order. bf16 travels as int16 (gloo has no bf16 sums, and a
        move needs none)."""
        wire = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=wire.dtype, device=t.device)
        self.group.pg.alltoall_base(out, wire.contiguous(), recv, send).wait()
        return out.view(torch.bfloat16) if t.dtype == torch.bfloat16 else out


def dispatch_experts(model, group: RankGroup) -> list[ExpertDispatch]:
    """Put every MoE block of a loaded ``model`` on ``group`` (expert parallelism beside
    data-parallel attention), in place; the blocks, in layer order."""
    blocks = []
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = ExpertDispatch(layer.mlp, group)
            blocks.append(layer.mlp)
    if not blocks:
        raise ValueError("expert parallelism needs a mixture-of-experts model")
    return blocks
