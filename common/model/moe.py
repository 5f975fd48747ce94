"""Mixtral's sparse mixture-of-experts block: a router picks each token's top-k experts, each expert
is a SwiGLU MLP (Llama's, its gate|up fused from Mixtral's w1|w3, its down projection w2), and the
token's output is the experts' outputs weighted by their renormalised router probabilities.

Routing follows transformers' ``MixtralTopKRouter``: router logits in the model dtype, softmax in
fp32, top-k of the probabilities, the k weights divided by their sum. Experts' contributions are
summed in fp32 and rounded once to the model dtype.

A block may hold only some experts (``first_expert`` onwards, expert parallelism): it then returns
its experts' share of the sum, and the ranks' shares add up to the whole (``partial``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.common.model.config import LlamaConfig
from baton.common.model.llama import LlamaMLP


class Router(nn.Module):
    """The gate: [N, hidden] -> top-k (weights, expert ids). A plain projection, never packed or
    quantized (``quant`` swaps ``llama.Linear`` only): a rounded router would change which experts
    a token goes to, not just how precisely they compute."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [N, k] fp32 (each row sums to 1) and expert ids [N, k] int64."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)  # [N, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class SparseMoE(nn.Module):
    """The MLP of a Mixtral decoder layer (a drop-in for ``LlamaMLP``)."""

    def __init__(
        self, cfg: LlamaConfig, num_experts: int, top_k: int, experts: tuple[int, int] | None = None
    ):
        """``experts``: the ``[start, end)`` of the experts this block holds (default: all)."""
        super().__init__()
        self.num_experts = num_experts
        self.first_expert, last = experts or (0, num_experts)
        self.gate = Router(cfg.hidden_size, num_experts, top_k)
        self.experts = nn.ModuleList(LlamaMLP(cfg) for _ in range(last - self.first_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, hidden] in x's dtype."""
        weights, ids = self.gate(x)
        return self.partial(x, weights, ids).to(x.dtype)

    def partial(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[N, hidden] fp32: the sum over each token's chosen experts that this block holds of
        ``weight * expert(x)``; zeros for tokens none of whose experts are here."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for local, (tokens, slots) in self._routes(ids).items():
            y = self.experts[local](x[tokens])  # [T, hidden]
            out.index_add_(0, tokens, y.float() * weights[tokens, slots].unsqueeze(1))
        return out

    def expert_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[Q, hidden] fp32: row q through expert ``ids[q]`` (one of this block's), unweighted: the
        rows other ranks dispatched here (``expert_parallel.ExpertDispatch``)."""
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for local, (rows, _) in self._routes(ids.unsqueeze(1)).items():
            out[rows] = self.experts[local](x[rows]).float()
        return out

    def _routes(self, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Local expert -> (token rows, top-k slots) routed to it, from one sort of the choices
        (not one comparison pass per expert)."""
        flat = ids.reshape(-1) - self.first_expert  # [N * k], local expert ids
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat.clamp(-1, len(self.experts)) + 1, minlength=len(self.experts) + 2)
        k = ids.shape[1]
        routes, start = {}, int(counts[0])  # choices of experts below this block's come first
        for local in range(len(self.experts)):
            n = int(counts[local + 1])
            if n:
                pick = order[start : start + n]
                routes[local] = (pick // k, pick % k)
            start += n
        return routes
