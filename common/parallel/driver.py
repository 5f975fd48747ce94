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
import os
import select
import subprocess
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from baton.common.launch import python_module
from baton.common.model.tensor_parallel import parallel_greedy, parallel_logits, plan_shard
from baton.common.net import free_port
from baton.common.parallel import messages
from baton.common.parallel.group import GroupConfig, RankGroup
from baton.common.parallel.worker import WorkerSpec


class RankFailedError(RuntimeError):
    """A tensor-parallel rank has died or stopped answering: the model cannot run any more."""

    fatal = True
    """The engine gives up at once (``LLMEngine._after_failed_step``) instead of retrying steps."""


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


def _rank_device(device: str, rank: int) -> str:
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def _cpu_shares(size: int) -> list[tuple[int, ...]]:
    """Each rank's CPUs: this process's cut into runs, or one each in turn where there are fewer
    CPUs than ranks (threads past the cores would only take turns, and a collective waits on the
    slowest rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return [(cpus[r % len(cpus)],) for r in range(size)]
    base, extra = divmod(len(cpus), size)
    out, start = [], 0
    for r in range(size):
        end = start + base + (r < extra)
        out.append(tuple(cpus[start:end]))
        start = end
    return out


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
                _wait(p, 1.0)
            raise self._fail(e) from e

    def _collective(self, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo: connection closed by the peer, or its timeout
            for p in self.workers:
                _wait(p, 1.0)
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
            _close_pipes(p)
        deadline = time.monotonic() + timeout_s
        for p in self.workers:
            if not _wait(p, max(0.0, deadline - time.monotonic())):
                p.kill()
                p.wait(5)
        self.workers = []
        self.group.close()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)


def _wait(p: subprocess.Popen, timeout: float) -> bool:
    try:
        p.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _close_pipes(p: subprocess.Popen) -> None:
    for f in (p.stdin, p.stdout):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def _build_kernels(device: str) -> None:
    """Build (or find built) the CPU kernel extension before any other rank starts: they then import
    it at once, instead of compiling it (or waiting for one of them to) inside their first step's
    collectives, whose timeout a build on a busy machine outlasts."""
    if not device.startswith("cuda"):
        from baton.kernels import cpu_ops

        cpu_ops.load()


def _spawn(spec, module: str = "baton.common.parallel.worker") -> subprocess.Popen:
    # stdin: commands; stdout: the ready line; stderr: the caller's, so a rank's error shows.
    return subprocess.Popen(
        [*python_module(module), spec.to_json()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def _await_ready(workers: list[subprocess.Popen], timeout_s: float, kind: str = "tensor-parallel") -> None:
    """Every other rank's ready line, or ``RankFailedError`` for the first that exits or is late."""
    deadline = time.monotonic() + timeout_s
    for r, p in enumerate(workers, 1):
        assert p.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailedError(f"{kind} rank {r} did not load its shard in {timeout_s:.0f} s")
            readable, _, _ = select.select([p.stdout], [], [], min(left, 0.5))
            if readable:
                line = p.stdout.readline()
                if line.strip() == b"ready":
                    break
                p.wait(5)
                raise RankFailedError(f"{kind} rank {r} exited with code {p.returncode} while loading")


def launch(load, model_name: str | None, dtype: torch.dtype, config: ParallelConfig) -> TensorParallelModel:
    """Start ranks 1..N-1 (the model ``model_name``), load rank 0's shard with ``load(group)``
    (the loader, given the group to shard for), meet them, and return rank 0's model."""
    size = config.tensor_parallel_size
    _build_kernels(config.device)
    host, port = "127.0.0.1", free_port()
    shares = _cpu_shares(size) if config.pin else [()] * size
    workers: list[subprocess.Popen] = []
    try:
        for r in range(1, size):
            spec = WorkerSpec(
                r,
                size,
                host,
                port,
                _rank_device(config.device, r),
                config.timeout_s,
                model_name,
                str(dtype).removeprefix("torch."),
                shares[r],
                expert_parallel=config.expert_parallel,
            )
            workers.append(_spawn(spec))
        saved = None
        if shares[0]:
            saved = torch.get_num_threads()
            torch.set_num_threads(len(shares[0]))
        group = RankGroup(GroupConfig(0, size, host, port, config.device, config.timeout_s))
        model = load(group)
        _await_ready(workers, config.timeout_s)
        group.start()
    except BaseException:
        for p in workers:
            p.kill()
            p.wait(5)
            _close_pipes(p)
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
