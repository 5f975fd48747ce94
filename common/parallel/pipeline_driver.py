"""Rank 0 of a pipeline-parallel model (stage 0, tensor-parallel rank 0): the engine's model object.

``launch_pipeline`` starts ranks 1..tp*pp-1 as processes of the caller (``pipeline_worker``),
loads rank 0's stage here and meets them. Each forward pass is cut into micro-batches of whole
requests (``pipeline_parallel.split_micro_batches``), sent down a pipe to every other rank
(``messages.StageForward``), then run through stage 0 here, which hands each micro-batch on as
soon as it is done; the last stage sends the final hidden states back. LM-head calls go to the
last stage, which computes them and sends the logits (or greedy ids) back. The scheduler, block
tables and sampler are rank 0's alone.

A worker's ranks move their own stage's KV as tensor-parallel ranks move their heads
(``kv_ranks``, told through ``tell``). Failures are the tensor-parallel driver's
(``driver.TensorParallelModel``): a rank that has died fails the call that finds it with
``RankFailedError`` naming it and its stage.
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import time

import torch

from baton.common.model.pipeline_parallel import split_micro_batches, stage_layers
from baton.common.net import free_port
from baton.common.parallel import messages
from baton.common.parallel.driver import TensorParallelModel
from baton.common.parallel.pipeline import Layout, Stage, StageSpec
from baton.common.parallel.ranks import (
    RankFailedError,
    await_ready,
    build_kernels,
    close_pipes,
    cpu_shares,
    rank_device,
    spawn,
)

WORKER = "baton.common.parallel.pipeline_worker"


class PipelineParallelModel(TensorParallelModel):
    """The model as the engine sees it (``forward``, ``compute_logits``, ``greedy_tokens``,
    ``config``: stage 0's layers and rank 0's heads, the whole vocabulary), over the stages."""

    kind = "pipeline-parallel"

    def __init__(
        self, stage: Stage, workers: list[subprocess.Popen], threads: int | None, num_micro_batches: int
    ):
        super().__init__(stage.model, stage, workers, threads)  # type: ignore[arg-type]
        self.stage = stage
        self.layout = stage.spec.layout
        self.num_micro_batches = num_micro_batches
        """Most micro-batches a step is cut into (1: the whole batch goes through stage after stage)."""

    def _describe(self, rank: int, code: int) -> str:
        pid = self.workers[rank - 1].pid
        return f"rank {rank} (stage {self.layout.stage(rank)}, pid {pid}, exit code {code})"

    def forward(self, input_ids, positions, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        batches = split_micro_batches(input_ids, positions, meta, self.num_micro_batches)
        self._send(messages.StageForward(batches, tuple(kv_cache.shape), kv_cache.dtype))
        hidden = self._collective(lambda: self.stage.forward(batches, kv_cache))
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)  # [N, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send(messages.Logits(hidden, greedy=False))
        return self._collective(lambda: self.stage.receive_lm_head(hidden.shape[0], greedy=False))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send(messages.Logits(hidden, greedy=True))
        return self._collective(lambda: self.stage.receive_lm_head(hidden.shape[0], greedy=True))

    def busy_intervals(self, timeout_s: float = 30.0) -> dict[int, list[tuple[float, float]]]:
        """Every rank's recent (start, end) micro-batch intervals, ``time.monotonic``: which shows
        whether the stages ran at the same time."""
        self._send(messages.BusyIntervals())
        out = {0: list(self.stage.busy)}
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(self.workers, 1):
            assert p.stdout is not None
            left = deadline - time.monotonic()
            readable, _, _ = select.select([p.stdout], [], [], max(0.0, left))
            if not readable:
                raise RankFailedError(f"{self.kind} rank {r} sent no busy intervals in {timeout_s:.0f} s")
            line = p.stdout.readline()
            if not line:
                raise self._fail(None)
            out[r] = [tuple(x) for x in json.loads(line)]
        return out


def _free_ports(n: int) -> tuple[int, ...]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return tuple(ports)


def launch_pipeline(
    model_name: str | None,
    dtype: torch.dtype,
    device: str,
    layout: Layout,
    timeout_s: float = 120.0,
    progress: bool = False,
    num_micro_batches: int | None = None,
) -> PipelineParallelModel:
    """Start ranks 1..world-1 (each loading ``model_name``'s stage and shard), load rank 0's here,
    meet them, and return rank 0's model. ``num_micro_batches`` defaults to the stages' count.
    This process's CPUs are shared among the ranks as tensor parallelism shares them."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    world = layout.world_size
    ports = _free_ports((pp if tp > 1 else 0) + tp)
    tp_ports, pp_ports = ports[: len(ports) - tp], ports[len(ports) - tp :]
    shares = cpu_shares(world)
    build_kernels(device)

    def spec(rank: int) -> StageSpec:
        return StageSpec(
            rank, tp, pp, "127.0.0.1", tp_ports, pp_ports, rank_device(device, rank), timeout_s,
            model_name, str(dtype).removeprefix("torch."), shares[rank],
        )  # fmt: skip

    workers: list[subprocess.Popen] = []
    try:
        for r in range(1, world):
            workers.append(spawn(spec(r), WORKER))
        saved = torch.get_num_threads()
        torch.set_num_threads(len(shares[0]))
        stage = Stage(spec(0))
        stage.load(progress)
        await_ready(workers, timeout_s, PipelineParallelModel.kind)
        stage.start()
    except BaseException:
        for p in workers:
            p.kill()
            p.wait(5)
            close_pipes(p)
        raise
    driver = PipelineParallelModel(stage, workers, saved, num_micro_batches or pp)
    atexit.register(driver.close)
    return driver


def load_pipeline_parallel(
    engine_config, dtype: torch.dtype, progress: bool = False
) -> PipelineParallelModel:
    """The engine's model at ``engine_config.pipeline_parallel_size`` stages of
    ``tensor_parallel_size`` ranks each (an ``EngineConfig``)."""
    from baton.common.model.loader import read_config
    from baton.common.model.source import ModelSource
    from baton.common.model.tensor_parallel import plan_shard

    tp, pp = engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size
    if engine_config.quantization is not None:
        raise ValueError("--quantization is not supported with --pipeline-parallel-size > 1 yet")
    cfg = read_config(ModelSource.resolve(engine_config.model))
    stage_layers(cfg.num_layers, pp)  # ValueError before any spawn
    if tp > 1:
        plan_shard(cfg, 0, tp)
    layout = Layout(tp, pp)
    return launch_pipeline(engine_config.model, dtype, engine_config.device, layout, progress=progress)
