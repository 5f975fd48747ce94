"""A step's cascade groups as the kernels take them: which decode rows share how many leading
blocks (``cascade``). Shared by the dispatch and its reference (``cascade``), the Triton kernels
(``triton_cascade``) and the model's attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CascadeGroups:
    """A step's groups as the kernels take them (int32 tensors on the step's device)."""

    rows: torch.Tensor
    """[R] the decode rows of every group, group after group."""
    starts: torch.Tensor
    """[num_groups + 1]: group g owns ``rows[starts[g]:starts[g + 1]]``."""
    shared_blocks: torch.Tensor
    """[num_groups] full blocks group g shares: its first member's first ids."""

    @classmethod
    def build(
        cls, groups: Sequence[tuple[Sequence[int], int]], device: torch.device | str = "cpu"
    ) -> CascadeGroups:
        """From ``(rows, num_shared_blocks)`` pairs."""
        rows = [r for members, _ in groups for r in members]
        starts = [0]
        for members, _ in groups:
            starts.append(starts[-1] + len(members))

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(i32(rows), i32(starts), i32([n for _, n in groups]))

    @property
    def num_groups(self) -> int:
        return self.shared_blocks.numel()

    def as_lists(self) -> list[tuple[list[int], int]]:
        rows, starts, blocks = self.rows.tolist(), self.starts.tolist(), self.shared_blocks.tolist()
        return [(rows[starts[g] : starts[g + 1]], blocks[g]) for g in range(len(blocks))]
