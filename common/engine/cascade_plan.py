"""Cascade attention planning: which decode requests share a prefix of KV blocks, and whether
attending to that prefix once for the whole group is worth it this step. Pure: no torch.

With prefix caching, requests that share a prompt prefix hold the same physical block ids at the
start of their block tables. A cascade step attends every query of such a group to the shared
blocks in one pass (the shared K/V read once, a GEMM-shaped problem), each request to its own
remaining blocks separately, and merges the two partial softmaxes exactly by log-sum-exp.

Cost model (per KV head; constants in ``CascadeCostModel``, calibrated by ``baton.bench.cascade``):

    plain   = per_token * sum_b len_b
    cascade = sum_g (shared_per_query * M_g * S_g + shared_per_token * S_g + per_group)
              + per_token * sum_b (len_b - S_g(b)) + per_merged_row * sum_g M_g

for groups g of M_g requests sharing S_g tokens. The suffixes cost the same on both sides, so a
group pays for itself exactly when its own saving is positive; each group is kept or dropped on
that test (``group_saving``), and a step runs the cascade kernel when any group is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CASCADE_MODES = ("auto", "off")


@dataclass(frozen=True)
class CascadeCostModel:
    """Nanoseconds per unit of work of each kernel pass, per KV head. The defaults are the bf16
    fit (``COST_MODELS``); ``python -m baton.bench.cascade --calibrate --dtype D`` refits them."""

    per_token: float = 29.8
    """Plain paged decode: one request's G query heads against one cached token."""
    shared_per_query: float = 2.32
    """Shared pass: one request's G query heads against one shared token (the GEMM part)."""
    shared_per_token: float = 37.3
    """Shared pass: packing one shared token of K and V (once per group)."""
    per_group: float = 12825.0
    """Shared pass: fixed cost of a group (set-up, thread split, the first tile's latency)."""
    per_merged_row: float = 0.0
    """Carrying one request's partial softmax from the shared pass into its own pass."""


# Fitted on the 2-core Intel Xeon (AMX, AVX512-BF16) by ``python -m baton.bench.cascade
# --calibrate --dtype D --iters 10`` (one thread, load ~6: the absolute figures are inflated by the
# load, their ratios are what a decision uses). bf16's shared pass runs on AMX tiles, fp32's on
# AVX-512 FMAs: ~13x and ~8x less work per query row and shared token than the plain kernel.
COST_MODELS = {
    "bfloat16": CascadeCostModel(),
    "float32": CascadeCostModel(
        per_token=48.8, shared_per_query=6.37, shared_per_token=90.2, per_group=13750.0, per_merged_row=125.0
    ),
}


@dataclass(frozen=True)
class CascadeConfig:
    """When a decode step uses cascade attention."""

    min_shared_blocks: int = 4
    """Fewest full blocks a group must share (4 blocks of 16 = 64 tokens)."""
    min_group_size: int = 2
    """Fewest requests in a group."""
    cost: CascadeCostModel = CascadeCostModel()
    """Decides, group by group, whether the cascade beats the plain kernel (``COST_MODELS``)."""

    def __post_init__(self) -> None:
        if self.min_shared_blocks < 1 or self.min_group_size < 2:
            raise ValueError(
                f"min_shared_blocks must be >= 1 and min_group_size >= 2, got "
                f"{self.min_shared_blocks} and {self.min_group_size}"
            )


@dataclass(frozen=True)
class CascadeGroup:
    rows: tuple[int, ...]
    """Rows of the step's decode batch in the group, ascending."""
    num_shared_blocks: int
    """Full blocks every member holds at the start of its block table (the same ids)."""


@dataclass(frozen=True)
class CascadePlan:
    """The groups one decode step attends in cascade; rows in no group run the plain way."""

    groups: tuple[CascadeGroup, ...]
    block_size: int

    @property
    def num_queries(self) -> int:
        """Decode rows served by a shared pass."""
        return sum(len(g.rows) for g in self.groups)

    def shared_blocks(self, tables: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """Each group's shared block ids, read from its first member's table."""
        return tuple(tuple(tables[g.rows[0]][: g.num_shared_blocks]) for g in self.groups)


def _common_blocks(tables: Sequence[Sequence[int]], rows: Sequence[int], limit: int) -> int:
    """Length of the block-id prefix that every row's table shares, at most ``limit``."""
    first = tables[rows[0]]
    n = 0
    while n < limit and all(tables[r][n] == first[n] for r in rows):
        n += 1
    return n


def find_groups(
    tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int, min_shared_blocks: int
) -> tuple[CascadeGroup, ...]:
    """Groups of >= 2 decode rows whose tables start with the same ``min_shared_blocks`` block ids,
    each with the longest prefix of full blocks all its members share.

    A shared block must be full for every member: block ``j`` is shared only if ``(j + 1) *
    block_size <= len`` for each (the block holding a request's newest tokens is its own)."""
    by_key: dict[tuple[int, ...], list[int]] = {}
    for row, (table, n) in enumerate(zip(tables, lens)):
        if n // block_size >= min_shared_blocks:
            by_key.setdefault(tuple(table[:min_shared_blocks]), []).append(row)
    groups = []
    for rows in by_key.values():
        if len(rows) < 2:
            continue
        full = min(lens[r] for r in rows) // block_size
        groups.append(CascadeGroup(tuple(rows), _common_blocks(tables, rows, full)))
    return tuple(sorted(groups, key=lambda g: g.rows[0]))


def group_saving(group: CascadeGroup, block_size: int, cost: CascadeCostModel) -> float:
    """Nanoseconds per KV head the cascade saves on this group over the plain kernel (negative:
    it costs more). The suffixes cost the same either way and cancel."""
    m, s = len(group.rows), group.num_shared_blocks * block_size
    plain = cost.per_token * m * s
    cascade = cost.shared_per_query * m * s + cost.shared_per_token * s + cost.per_group
    return plain - cascade - cost.per_merged_row * m


def step_costs(plan: CascadePlan, lens: Sequence[int], cost: CascadeCostModel) -> tuple[float, float]:
    """The model's (plain, cascade) nanoseconds per KV head for a step run with ``plan``."""
    plain = cost.per_token * sum(lens)
    saved = sum(group_saving(g, plan.block_size, cost) for g in plan.groups)
    return plain, plain - saved


def plan_cascade(
    tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int, config: CascadeConfig
) -> CascadePlan | None:
    """The step's cascade plan, or None when no group of decode rows is worth a shared pass.

    ``tables[i]`` is decode row i's block table and ``lens[i]`` its context length (the new token
    included)."""
    groups = find_groups(tables, lens, block_size, config.min_shared_blocks)
    kept = tuple(
        g
        for g in groups
        if len(g.rows) >= config.min_group_size and group_saving(g, block_size, config.cost) > 0
    )
    return CascadePlan(kept, block_size) if kept else None


def cascade_config(mode: str, min_shared_blocks: int = 4, dtype: str = "bfloat16") -> CascadeConfig | None:
    """The config of ``--cascade`` for a model computing in ``dtype`` (``auto``: the cost model of
    that dtype decides per step; ``off``: never, None). ValueError for another mode or a bad block
    count."""
    if mode not in CASCADE_MODES:
        raise ValueError(f"cascade must be one of {list(CASCADE_MODES)}, got {mode!r}")
    cost = COST_MODELS.get(dtype, COST_MODELS["bfloat16"])
    config = CascadeConfig(min_shared_blocks=min_shared_blocks, cost=cost)
    return config if mode == "auto" else None
