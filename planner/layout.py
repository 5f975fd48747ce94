"""Worker layouts the simulator and planner speak of: ``colocated`` (``colocated:N``: N workers that
each prefill and decode) or ``<N>p<M>d`` (N prefill workers and M decode workers)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_DISAGG = re.compile(r"(\d+)p(\d+)d")
_COLOCATED = re.compile(r"colocated(?::(\d+))?")


@dataclass(frozen=True)
class Layout:
    prefill: int
    """Prefill-only workers (0 when colocated)."""
    decode: int
    """Decode workers; when colocated, the workers that do both."""
    colocated: bool

    def __str__(self) -> str:
        return f"colocated:{self.decode}" if self.colocated else f"{self.prefill}p{self.decode}d"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def parse_layout(text: str) -> Layout:
    """``colocated`` (one worker), ``colocated:N`` or ``<N>p<M>d`` with N, M >= 1."""
    s = text.strip().lower()
    if m := _COLOCATED.fullmatch(s):
        n = int(m.group(1) or 1)
        if n < 1:
            raise ValueError(f"layout {text!r}: colocated needs at least one worker")
        return Layout(0, n, True)
    if m := _DISAGG.fullmatch(s):
        p, d = int(m.group(1)), int(m.group(2))
        if p < 1 or d < 1:
            raise ValueError(
                f"layout {text!r}: a disaggregated layout needs at least 1 prefill and 1 decode worker"
            )
        return Layout(p, d, False)
    raise ValueError(f"layout {text!r}: expected 'colocated', 'colocated:N' or '<N>p<M>d' (e.g. 2p4d)")
