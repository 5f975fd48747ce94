"""Rank 0 of a tensor-parallel model: the engine's model object, which runs its own shard and
has the other ranks run theirs.

``launch`` starts ranks 1..N-1 as processes of the caller (``worker``), loads rank 0's shard here
and meets them. Each forward pass, and each LM-head call, is first sent down a pipe to every other
rank (``messages``), then run here; the collectives inside keep the ranks in step. The scheduler,
block tables and sampler are rank 0's alone.

A rank that has died fails the call that finds it with ``RankFailedError`` naming it (a broken
pipe, a collective whose peer is gone, or one past its timeout); every later call fails at once.
"""

from __future__ import annotations

import atexit
import subprocess
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from baton.common.model.rank_group import GroupConfig, RankGroup
from baton.common.model.tensor_parallel import parallel_greedy, parallel_logits, plan_shard
from baton.common.net import free_port
from baton.common.parallel import messages
from baton.common.parallel.ranks import (
    RankFailedError,
    await_ready,
    build_kernels,
    close_pipes,
    cpu_shares,
    rank_device,
    spawn,
    wait_exit,
)
from baton.common.parallel.worker import WorkerSpec


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    """Ranks the model's layers are split across."""
    device: str = "cpu"
    """Rank 0's device; on CUDA rank r runs on the r-th device after it."""
    timeout_s: float = 120.0
    """Longest a collective waits for a peer, and the ranks to load and meet."""
    pin: bool = True
    """Split this process's CPUs among the ranks: the others are pinned to their share, and every
    rank's torch threads match its share (rank 0's restored by ``close``)."""
    expert_parallel: bool = False
    """A MoE model's experts are placed whole across the ranks instead of each being sliced."""


class TensorParallelModel(nn.Module):
    """The model as the engine sees it (``forward``, ``compute_logits``, ``greedy_tokens``,
    ``config``: this rank's shape with the whole vocabulary), over ranks that compute together."""

    def __init__(
        self, model: nn.Module, group: RankGroup, workers: list[subprocess.Popen], threads: int | None
    ):
        super().__init__()
        self.model = model
        self.group = group
        self.workers = workers
        self._saved_threads = threads
        self._failed: RankFailedError | None = None
        self._send_lock = threading.Lock()  # the KV transport's commands come from other threads

    @property
    def config(self):
        return self.model.config

    @property
    def full_config(self):
        return self.model.full_config

    @property
    def embed_tokens(self):
        return self.model.embed_tokens

    @property
    def lm_head_packed(self):
        return self.model.lm_head_packed

    @property
    def lm_head_quant(self):  # the runner's warm-up asks (None: no quantized LM head)
        return getattr(self.model, "lm_head_quant", None)

    def forward(self, input_ids, positions, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        self._send(messages.Forward(input_ids, positions, meta, tuple(kv_cache.shape), kv_cache.dtype))
        return self._collective(lambda: self.model(input_ids, positions, kv_cache, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send(messages.Logits(hidden, greedy=False))
        return self._collective(lambda: parallel_logits(self.model, hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send(messages.Logits(hidden, greedy=True))
        return self._collective(lambda: parallel_greedy(self.model, hidden))

    # -- failures ----------------------------------------------------------------------------
    kind = "tensor-parallel"
    """How errors name the ranks."""

    def _describe(self, rank: int, code: int) -> str:
        return f"rank {rank} (pid {self.workers[rank - 1].pid}, exit code {code})"

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every other rank that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.workers, 1) if p.poll() is not None]

    def _fail(self, cause: BaseException | None) -> RankFailedError:
        dead = self.dead_ranks()
        if dead:
            names = ", ".join(self._describe(r, c) for r, c in dead)
            err = RankFailedError(f"{self.kind} {names} exited")
        else:
            err = RankFailedError(f"{self.kind} collective failed: {cause}")
        self._failed = err
        return err

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self.dead_ranks():
            raise self._fail(None)

    def tell(self, message) -> None:
        """Send ``message`` to every other rank, after everything sent before it (the KV
        transport's commands, ``kv_ranks``); ``RankFailedError`` if a rank is gone."""
        self._send(message)

    def _send(self, message) -> None:
        self._check()
        data = messages.encode(message)
        try:
            with self._send_lock:
                for p in self.workers:
                    assert p.stdin is not None
                    messages.write(p.stdin.fileno(), data)
        except OSError as e:  # BrokenPipeError: that rank is gone
            for p in self.workers:  # reap it, so that dead_ranks sees it
                wait_exit(p, 1.0)
            raise self._fail(e) from e

    def _collective(self, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo: connection closed by the peer, or its timeout
            for p in self.workers:
                wait_exit(p, 1.0)
            raise self._fail(e) from e

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other ranks (``Stop``, then end of file; killed past ``timeout_s``)."""
        if not self.workers:
            return
        if self._failed is None and not self.dead_ranks():
            try:
                self._send(messages.Stop())
            except RankFailedError:
                pass
        for p in self.workers:
            close_pipes(p)
        deadline = time.monotonic() + timeout_s
        for p in self.workers:
            if not wait_exit(p, max(0.0, deadline - time.monotonic())):
                p.kill()
                p.wait(5)
        self.workers = []
        self.group.close()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)


def launch(load, model_name: str | None, dtype: torch.dtype, config: ParallelConfig) -> TensorParallelModel:
    """Start ranks 1..N-1 (the model ``model_name``), load rank 0's shard with ``load(group)``
    (the loader, given the group to shard for), meet them, and return rank 0's model."""
    size = config.tensor_parallel_size
    build_kernels(config.device)
    host, port = "127.0.0.1", free_port()
    shares = cpu_shares(size) if config.pin else [()] * size
    workers: list[subprocess.Popen] = []
    try:
        for r in range(1, size):
            spec = WorkerSpec(
                r,
                size,
                host,
                port,
                rank_device(config.device, r),
                config.timeout_s,
                model_name,
                str(dtype).removeprefix("torch."),
                shares[r],
                expert_parallel=config.expert_parallel,
            )
            workers.append(spawn(spec))
        saved = None
        if shares[0]:
            saved = torch.get_num_threads()
            torch.set_num_threads(len(shares[0]))
        group = RankGroup(GroupConfig(0, size, host, port, config.device, config.timeout_s))
        model = load(group)
        await_ready(workers, config.timeout_s)
        group.start()
    except BaseException:
        for p in workers:
            p.kill()
            p.wait(5)
            close_pipes(p)
        raise
    driver = TensorParallelModel(model, group, workers, saved)
    atexit.register(driver.close)
    return driver


def load_tensor_parallel(engine_config, dtype: torch.dtype, progress: bool = False) -> TensorParallelModel:
    """The engine's model at ``engine_config.tensor_parallel_size`` ranks (an ``EngineConfig``)."""
    from baton.common.model.loader import load_model, read_config
    from baton.common.model.source import ModelSource

    if engine_config.quantization is not None:
        raise ValueError("--quantization is not supported with --tensor-parallel-size > 1 yet")
    source = ModelSource.resolve(engine_config.model)
    plan_shard(read_config(source), 0, engine_config.tensor_parallel_size)  # ValueError before any spawn
    ep = engine_config.enable_expert_parallel
    config = ParallelConfig(engine_config.tensor_parallel_size, engine_config.device, expert_parallel=ep)

    def load(group: RankGroup):
        return load_model(
            source, dtype, engine_config.device, progress=progress, tensor_parallel=group, expert_parallel=ep
        )

    return launch(load, engine_config.model, dtype, config)
