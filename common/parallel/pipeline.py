"""One rank of a pipeline-parallel model: its stage's layers, and the hand-offs between stages.

Ranks are laid out stage after stage, the tensor-parallel index innermost (vLLM's order): rank
``r`` is stage ``r // tp``, tensor-parallel rank ``r % tp``. Each rank is in two groups:
* its stage's tensor-parallel group (the layers' all-reduces; none at ``tp == 1``);
* the pipeline group of its tensor-parallel index, one rank per stage: rank ``(s, t)`` hands its
  activations to ``(s + 1, t)`` with a point-to-point send (every tensor-parallel rank holds the
  whole residual stream, so no gather is needed). The last stage's rank ``(S - 1, 0)`` sends the
  final hidden states, and the LM head's output, back to rank 0 in group ``0``.

A stage runs the micro-batches of a step one after another and hands each on as soon as it is
done, so while stage 1 runs micro-batch 0, stage 0 already runs micro-batch 1. Each rank records
when it was busy (``Stage.busy``), to show that the stages overlap.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from baton.common.model.rank_group import GroupConfig, RankGroup

_ACTIVATIONS, _HIDDEN, _LM_HEAD = 0, 1, 2  # point-to-point tags


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int
    """Ranks per stage."""
    pipeline_parallel_size: int
    """Stages."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size


@dataclass(frozen=True)
class StageSpec:
    """Everything a rank needs to load its stage and meet the others (JSON on its command line)."""

    rank: int
    """This rank, 0 to ``tp * pp - 1``."""
    tensor_parallel_size: int
    """Ranks per stage."""
    pipeline_parallel_size: int
    """Stages."""
    host: str
    """Where the groups' rendezvous stores listen."""
    tp_ports: tuple[int, ...]
    """Each stage's tensor-parallel store (hosted by the stage's first rank); empty at ``tp == 1``."""
    pp_ports: tuple[int, ...]
    """Each tensor-parallel index's pipeline store (hosted by its stage-0 rank)."""
    device: str
    """This rank's device (``cpu``, ``cuda:N``)."""
    timeout_s: float
    """Longest a collective, a hand-off or the rendezvous waits for a peer."""
    model: str | None
    """The model (``ModelSource.resolve``)."""
    dtype: str
    """Weights' dtype, a torch name (``bfloat16``, ``float32``)."""
    cpus: tuple[int, ...] = ()
    """CPUs to run on (empty: the inherited affinity); torch's threads match their count."""

    @property
    def layout(self) -> Layout:
        return Layout(self.tensor_parallel_size, self.pipeline_parallel_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StageSpec:
        d = json.loads(text)
        return cls(**{**d, **{k: tuple(d[k]) for k in ("tp_ports", "pp_ports", "cpus")}})


class Stage:
    """This rank's layers and its two groups; built without side effects, then ``load`` and
    ``start`` (which meets the other ranks)."""

    def __init__(self, spec: StageSpec):
        layout = spec.layout
        self.spec = spec
        self.index = layout.stage(spec.rank)
        self.tp_rank = layout.tp_rank(spec.rank)
        self.first = self.index == 0
        self.last = self.index == layout.pipeline_parallel_size - 1
        tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
        self.tp_group = None
        if tp > 1:
            self.tp_group = RankGroup(
                GroupConfig(
                    self.tp_rank, tp, spec.host, spec.tp_ports[self.index], spec.device, spec.timeout_s,
                    name=f"tp{self.index}",
                )
            )  # fmt: skip
        self.pp_group = RankGroup(
            GroupConfig(
                self.index, pp, spec.host, spec.pp_ports[self.tp_rank], spec.device, spec.timeout_s,
                name=f"pp{self.tp_rank}",
            )
        )  # fmt: skip
        self.model: Any = None  # LlamaForCausalLM, cut to the stage (``load``)
        self.busy: deque[tuple[float, float]] = deque(maxlen=256)
        """(start, end) of this rank's recent micro-batches, ``time.monotonic`` (one clock for every
        process of the machine)."""

    def load(self, progress: bool = False):
        """Load the model, keep this rank's tensor-parallel shard and this stage's layers."""
        from baton.common.model.loader import load_model
        from baton.common.model.pipeline_parallel import cut_stage
        from baton.common.model.source import ModelSource

        dtype = getattr(torch, self.spec.dtype)
        source = ModelSource.resolve(self.spec.model)
        model = load_model(source, dtype, self.spec.device, progress=progress, tensor_parallel=self.tp_group)
        self.model = cut_stage(model, self.index, self.spec.pipeline_parallel_size)
        return self.model

    def start(self) -> Stage:
        """Meet the other ranks: every rank starts its tensor-parallel group, then its pipeline one."""
        if self.tp_group is not None:
            self.tp_group.start()
        self.pp_group.start()
        return self

    def close(self) -> None:
        if self.tp_group is not None:
            self.tp_group.close()
        self.pp_group.close()

    # -- a step ------------------------------------------------------------------------------
    def forward(self, batches: Sequence, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """Run this stage's layers over each micro-batch (``pipeline_parallel.MicroBatch``) in turn,
        handing each on as soon as it is done. Rank 0 returns every micro-batch's final hidden
        states ([n, hidden] in the model dtype, from the last stage); the other ranks nothing."""
        from baton.common.model.pipeline_parallel import embed, final_norm, run_layers

        model = self.model
        sending: list[tuple[Any, torch.Tensor]] = []  # the work and the tensor it must outlive
        for mb in batches:
            if self.first:
                start = time.monotonic()
                residual, delta = embed(model, mb.input_ids), None
            else:
                residual, delta = self._receive_activations(mb.positions.shape[0])
                start = time.monotonic()
            delta = run_layers(model, residual, delta, mb.positions, kv_cache, mb.meta)
            if self.last:
                out = final_norm(model, residual, delta).float().contiguous()
                dst, tag = 0, _HIDDEN
            else:
                out = torch.stack([residual, delta.float()])  # [2, n, hidden]: both exact in fp32
                dst, tag = self.index + 1, _ACTIVATIONS
            self.busy.append((start, time.monotonic()))
            if not self.last or self.tp_rank == 0:
                sending.append((self.pp_group.send(out, dst, tag), out))
        hidden = self._receive_hidden(batches) if self.spec.rank == 0 else []
        for work, _ in sending:
            work.wait()
        return hidden

    def _receive_activations(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty(2, n, self.model.config.hidden_size, device=self.spec.device)
        self.pp_group.recv(buf, self.index - 1, _ACTIVATIONS).wait()
        return buf[0], buf[1].to(self.model.stage_dtype)

    def _receive_hidden(self, batches: Sequence) -> list[torch.Tensor]:
        """On rank 0: the last stage's output for each micro-batch (all receives posted at once)."""
        hidden = self.model.config.hidden_size
        bufs = [torch.empty(mb.positions.shape[0], hidden, device=self.spec.device) for mb in batches]
        last = self.spec.pipeline_parallel_size - 1
        works = [self.pp_group.recv(b, last, _HIDDEN) for b in bufs]
        for w in works:
            w.wait()
        return [b.to(self.model.stage_dtype) for b in bufs]

    # -- the LM head (the last stage computes it, rank 0 receives it) ---------------------------
    def lm_head(self, hidden: torch.Tensor, greedy: bool) -> None:
        """On the last stage: argmax ids ([M] int64) or fp32 logits ([M, vocab]) of ``hidden``,
        sent to rank 0 by the stage's first rank."""
        from baton.common.model.tensor_parallel import parallel_greedy, parallel_logits

        if hidden.shape[0] == 0:
            return
        model = self.model
        if self.tp_group is not None:
            out = parallel_greedy(model, hidden) if greedy else parallel_logits(model, hidden)
        else:
            out = model.greedy_tokens(hidden) if greedy else model.compute_logits(hidden)
        if self.tp_rank == 0:
            out = out.contiguous()
            self.pp_group.send(out, 0, _LM_HEAD).wait()

    def receive_lm_head(self, rows: int, greedy: bool) -> torch.Tensor:
        """On rank 0: what the last stage's ``lm_head`` sends for ``rows`` rows."""
        dev = self.spec.device
        if greedy:
            out = torch.empty(rows, dtype=torch.long, device=dev)
        else:
            out = torch.empty(rows, self.model.full_config.vocab_size, device=dev)
        if rows:
            self.pp_group.recv(out, self.spec.pipeline_parallel_size - 1, _LM_HEAD).wait()
        return out


def stage_cache(cache: torch.Tensor | None, shape: Sequence[int], dtype, config, device: str) -> torch.Tensor:
    """This rank's KV cache: rank 0's ``shape`` with this stage's layers and this rank's KV heads
    (``[num_blocks, layers, 2, KV, block_size, row]``), allocated once."""
    want = list(shape)
    want[1], want[3] = config.num_layers, config.num_kv_heads
    if cache is None or list(cache.shape) != want or cache.dtype != dtype:
        cache = torch.zeros(want, dtype=dtype, device=device)
    return cache
