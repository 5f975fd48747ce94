"""A tensor-parallel rank other than 0: loads its shard, then runs what rank 0 sends it.

Started by ``driver.launch`` as ``python -m baton.common.parallel.worker '<json WorkerSpec>'``,
its stdin a pipe from rank 0 (the commands; end of file: rank 0 has gone, so the rank exits) and
its stdout a pipe back (one ``ready`` line once the weights are loaded).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    """This rank (1 to size - 1)."""
    size: int
    """Ranks in the group."""
    host: str
    """Rank 0's rendezvous store."""
    port: int
    """Its port."""
    device: str
    """This rank's device (``cpu``, ``cuda:N``)."""
    timeout_s: float
    """Collective and rendezvous timeout."""
    model: str | None
    """The model (``ModelSource.resolve``)."""
    dtype: str
    """Weights' dtype, a torch name (``bfloat16``, ``float32``)."""
    cpus: tuple[int, ...]
    """CPUs to run on (empty: the inherited affinity); torch's threads match their count."""
    expert_parallel: bool = False
    """A MoE model's experts are placed whole across the ranks (``load_model``'s flag)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        return cls(**{**d, "cpus": tuple(d["cpus"])})


def serve(spec: WorkerSpec, commands: int, ready: int) -> None:
    """Load the shard, report ready on fd ``ready``, meet the group, then run commands from fd
    ``commands`` until a ``Stop`` or end of file."""
    import torch

    from baton.common.model.loader import load_model
    from baton.common.model.rank_group import GroupConfig, RankGroup
    from baton.common.model.source import ModelSource
    from baton.common.model.tensor_parallel import parallel_greedy, parallel_logits
    from baton.common.parallel import kv_ranks, messages
    from baton.common.parallel.ranks import pin_cpus

    pin_cpus(spec.cpus)
    group = RankGroup(GroupConfig(spec.rank, spec.size, spec.host, spec.port, spec.device, spec.timeout_s))
    model = load_model(
        ModelSource.resolve(spec.model),
        getattr(torch, spec.dtype),
        spec.device,
        tensor_parallel=group,
        expert_parallel=spec.expert_parallel,
    )
    os.write(ready, b"ready\n")
    group.start()
    cache: torch.Tensor | None = None
    kv = kv_ranks.RankKV(spec.rank, ready)  # this rank's part of the worker's KV transport
    cache_for = functools.partial(_cache_for, num_kv_heads=model.config.num_kv_heads, device=spec.device)
    with torch.inference_mode(), contextlib.closing(kv):
        while True:
            msg = messages.read(commands, spec.device)
            if msg is None or isinstance(msg, messages.Stop):
                return
            if isinstance(msg, messages.Forward):
                cache = cache_for(cache, msg)
                model(msg.input_ids, msg.positions, cache, msg.meta)
            elif isinstance(msg, kv_ranks.Command):
                cache = kv.handle(msg, cache, cache_for)
            elif msg.greedy:
                parallel_greedy(model, msg.hidden)
            else:
                parallel_logits(model, msg.hidden)


def _cache_for(cache, msg, num_kv_heads: int, device: str):
    """This rank's KV cache: rank 0's shape with this rank's KV heads (allocated once)."""
    import torch

    shape = list(msg.cache_shape)
    shape[3] = num_kv_heads  # [num_blocks, layers, 2, KV, block_size, row]
    if cache is None or list(cache.shape) != shape or cache.dtype != msg.cache_dtype:
        cache = torch.zeros(shape, dtype=msg.cache_dtype, device=device)
    return cache


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = WorkerSpec.from_json(sys.argv[1])
    try:
        serve(spec, sys.stdin.fileno(), sys.stdout.fileno())
    except Exception:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
