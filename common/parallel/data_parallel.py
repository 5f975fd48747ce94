"""Data parallelism: N engine replicas behind one engine front, as vLLM's ``--data-parallel-size``.

Replica 0 is an ``LLMEngine`` in this process; replicas 1..N-1 are processes of it (``python -m
baton.common.parallel.data_parallel '<json ReplicaSpec>'``), each with its own model, scheduler,
KV cache and share of the CPUs, driven down a pipe as the tensor-parallel ranks are. A new request
goes to the replica with the least work (fewest unfinished requests, then fewest of their prompt
tokens); a step steps every replica that has work at once and gathers what finished.

A mixture-of-experts model with expert parallelism runs attention data-parallel beside
expert-parallel MoE blocks (vLLM's and SGLang's DP-attention): each replica keeps its own batch,
attention and KV cache, holds ``num_experts / N`` experts, and its MoE blocks dispatch tokens to the
replicas holding their experts (``expert.ExpertDispatch``). Those blocks are collectives, so every
replica steps every time, and one whose step ran no forward pass takes part with an empty batch.

A replica that has exited fails the engine with ``ReplicaFailedError`` naming it; replicas exit
when the pipe from rank 0 closes.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import EngineFullError, EngineStepError, LLMEngine
from baton.common.launch import python_module
from baton.common.parallel.engine_factory import create_engine
from baton.common.parallel.messages import read_object, send_object
from baton.common.parallel.ranks import build_kernels, close_pipes, cpu_shares, wait_exit

log = logging.getLogger(__name__)


class ReplicaFailedError(EngineStepError):
    """A data-parallel replica has died or failed a step: the engine cannot go on."""

    fatal = True


@dataclass(frozen=True)
class ReplicaSpec:
    rank: int
    """This replica, 0 to ``size - 1``."""
    size: int
    """Replicas in all."""
    engine: dict
    """Its ``EngineConfig`` fields (``data_parallel_size`` 1, dtype resolved)."""
    cpus: tuple[int, ...]
    """CPUs it runs on (empty: the inherited ones); its torch threads match their count."""
    expert_group: tuple[str, int, float] | None = None
    """DP-attention: the (host, port, timeout) where the replicas' expert-parallel group meets."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReplicaSpec:
        d = json.loads(text)
        group = d["expert_group"]
        return cls(**{**d, "cpus": tuple(d["cpus"]), "expert_group": tuple(group) if group else None})


# -- what rank 0 and a replica say to each other (pickles: they never leave the worker) ---------
@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: object  # SamplingParams
    prompt: str | None


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Step:
    pass


@dataclass(frozen=True)
class _ResetPrefixCache:
    pass


@dataclass(frozen=True)
class _Reply:
    outputs: list
    """A step's ``RequestOutput``s (empty for an add)."""
    error: tuple[str, str] | None = None
    """(exception class name, message) of what failed, or None."""


# -- one replica --------------------------------------------------------------------------------
class _Lockstep:
    """Steps an engine whose MoE blocks are collectives over the replicas: a step that ran no
    forward pass (nothing scheduled) runs every block on an empty batch instead, so each replica
    enters each collective exactly once per step."""

    def __init__(self, engine: LLMEngine, blocks: list):
        self.engine = engine
        self.blocks = blocks
        self._hidden = engine.model.config.hidden_size
        self._dtype = engine.model.embed_tokens.weight.dtype

    def step(self) -> list:
        import torch

        calls = self.blocks[0].calls
        outputs = self.engine.step()
        if self.blocks[0].calls == calls:
            with torch.inference_mode():
                empty = torch.empty(0, self._hidden, dtype=self._dtype, device=self.engine.config.device)
                for block in self.blocks:
                    block(empty)
        return outputs


def _build(spec: ReplicaSpec, progress: bool = False):
    """This replica's engine (an ``LLMEngine``, or a ``_Lockstep`` over one for DP-attention) and
    its expert-parallel group (None without), not yet started."""
    config = EngineConfig(**spec.engine)
    if spec.expert_group is None:
        return create_engine(config, progress=progress), None
    from baton.common.engine.llm_engine import parse_dtype
    from baton.common.model.expert_parallel import dispatch_experts
    from baton.common.model.loader import load_model
    from baton.common.model.rank_group import GroupConfig, RankGroup
    from baton.common.model.source import ModelSource, eos_token_ids, load_tokenizer

    host, port, timeout = spec.expert_group
    group = RankGroup(GroupConfig(spec.rank, spec.size, host, port, config.device, timeout, name="dp-ep"))
    source = ModelSource.resolve(config.model)
    model = load_model(
        source, parse_dtype(config.dtype), config.device, progress=progress, quantization=config.quantization
    )
    blocks = dispatch_experts(model, group)
    tokenizer = load_tokenizer(source)
    engine = LLMEngine(config, model, tokenizer, eos_token_ids(source, tokenizer), model_name=source.name)
    return _Lockstep(engine, blocks), group


def _engine_of(replica) -> LLMEngine:
    return replica.engine if isinstance(replica, _Lockstep) else replica


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def serve(spec: ReplicaSpec, commands: int, replies: int) -> None:
    """Build the replica, say ready on ``replies``, then run rank 0's commands until end of file."""
    import torch

    if spec.cpus:
        os.sched_setaffinity(0, set(spec.cpus))
        torch.set_num_threads(len(spec.cpus))
    replica, group = _build(spec)
    if not _engine_of(replica).config.device.startswith("cuda"):  # before any collective waits on it
        from baton.kernels import cpu_ops

        cpu_ops.load()
    send_object(replies, "ready")
    if group is not None:
        group.start()
    engine = _engine_of(replica)
    while True:
        msg = read_object(commands)
        if msg is None:
            return
        if isinstance(msg, _Step):
            try:
                send_object(replies, _Reply(replica.step()))
            except Exception as e:  # noqa: BLE001 - rank 0 reports it; this replica cannot go on
                send_object(replies, _Reply([], _error(e)))
                raise
        elif isinstance(msg, _Add):
            try:
                engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, prompt=msg.prompt)
                send_object(replies, _Reply([]))
            except (ValueError, EngineFullError) as e:
                send_object(replies, _Reply([], _error(e)))
        elif isinstance(msg, _Abort):
            engine.abort_request(list(msg.request_ids))
        elif isinstance(msg, _ResetPrefixCache):
            engine.pool.reset_prefix_cache()


# -- rank 0 -------------------------------------------------------------------------------------
class DataParallelEngine:
    """The engine front ``LLM`` drives (``validate_prompt``, ``add_request``, ``step``,
    ``has_unfinished_requests``, ``abort_request``), over ``config.data_parallel_size`` replicas."""

    def __init__(self, config: EngineConfig, local, workers: list[subprocess.Popen], group, threads):
        self.config = config
        self.local = local
        """Replica 0 (an ``LLMEngine``, or ``_Lockstep`` over one)."""
        self.workers = workers
        """Replicas 1..N-1."""
        self.lockstep = isinstance(local, _Lockstep)
        """DP-attention: every replica steps every time."""
        self._group = group
        self._saved_threads = threads
        self._owner: dict[str, int] = {}  # unfinished request -> its replica
        self._tokens: dict[str, int] = {}  # ... and its prompt length
        self.num_requests_per_replica = [0] * (len(workers) + 1)
        """Requests each replica was given since start."""
        self._failed: ReplicaFailedError | None = None

    @property
    def engine0(self) -> LLMEngine:
        return _engine_of(self.local)

    @property
    def tokenizer(self):
        return self.engine0.tokenizer

    @property
    def model(self):
        """Replica 0's model."""
        return self.engine0.model

    @property
    def model_name(self) -> str:
        return self.engine0.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine0.max_model_len

    def validate_prompt(self, prompt_token_ids) -> None:
        self.engine0.validate_prompt(prompt_token_ids)

    def validate_request(self, prompt_token_ids, params, resume_token_ids=()) -> None:
        self.engine0.validate_request(prompt_token_ids, params, resume_token_ids)

    # -- requests ------------------------------------------------------------------------------
    def _pick(self) -> int:
        """The replica with the least work: fewest unfinished requests, then fewest tokens."""
        load = [[0, 0] for _ in range(len(self.workers) + 1)]
        for rid, r in self._owner.items():
            load[r][0] += 1
            load[r][1] += self._tokens[rid]
        return min(range(len(load)), key=lambda r: (load[r][0], load[r][1], r))

    def add_request(self, request_id: str, prompt_token_ids, params, prompt: str | None = None) -> None:
        self._check()
        r = self._pick()
        if r == 0:
            self.engine0.add_request(request_id, prompt_token_ids, params, prompt=prompt)
        else:
            self._tell(r, _Add(request_id, list(prompt_token_ids), params, prompt))
            reply = self._hear(r)
            if reply.error is not None:
                name, message = reply.error
                raise EngineFullError(message) if name == "EngineFullError" else ValueError(message)
        self._owner[request_id] = r
        self._tokens[request_id] = len(prompt_token_ids)
        self.num_requests_per_replica[r] += 1

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._owner:
                by_replica.setdefault(self._owner.pop(rid), []).append(rid)
                self._tokens.pop(rid, None)
        for r, rids in by_replica.items():
            if r == 0:
                self.engine0.abort_request(rids)
            else:
                self._tell(r, _Abort(tuple(rids)))

    @property
    def pool(self) -> _Pools:
        """The replicas' block pools, as far as callers of ``engine.pool`` reset them."""
        return _Pools(self)

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self) -> list:
        """Step every replica with work (every replica, for DP-attention) at once; the outputs of
        the requests that finished."""
        self._check()
        busy = set(self._owner.values())
        remote = [r for r in range(1, len(self.workers) + 1) if self.lockstep or r in busy]
        for r in remote:
            self._tell(r, _Step())
        outputs = []
        if self.lockstep or 0 in busy:
            try:
                outputs += self.local.step()
            except Exception as e:
                for p in self.workers:  # a peer's death is the likelier cause: name it if so
                    wait_exit(p, 1.0)
                raise self._fail(e) from e
        for r in remote:
            reply = self._hear(r)
            if reply.error is not None:
                raise self._fail_with(f"data-parallel replica {r} failed a step: {': '.join(reply.error)}")
            outputs += reply.outputs
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
                self._tokens.pop(out.request_id, None)
        return outputs

    # -- the replicas' pipes -------------------------------------------------------------------
    def dead_replicas(self) -> list[tuple[int, int]]:
        """(replica, exit code) of every replica process that has exited."""
        return [(r, p.returncode) for r, p in enumerate(self.workers, 1) if p.poll() is not None]

    def _fail_with(self, message: str) -> ReplicaFailedError:
        self._failed = ReplicaFailedError(message)
        return self._failed

    def _fail(self, cause: BaseException | None) -> ReplicaFailedError:
        dead = self.dead_replicas()
        if dead:
            names = ", ".join(f"replica {r} (pid {self.workers[r - 1].pid}, exit code {c})" for r, c in dead)
            return self._fail_with(f"data-parallel {names} exited")
        return self._fail_with(f"data-parallel replicas failed: {cause}")

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self.dead_replicas():
            raise self._fail(None)

    def _tell(self, r: int, msg) -> None:
        p = self.workers[r - 1]
        assert p.stdin is not None
        try:
            send_object(p.stdin.fileno(), msg)
        except OSError as e:  # BrokenPipeError: that replica is gone
            wait_exit(p, 1.0)
            raise self._fail(e) from e

    def _hear(self, r: int) -> _Reply:
        p = self.workers[r - 1]
        assert p.stdout is not None
        reply = read_object(p.stdout.fileno())
        if reply is None:
            wait_exit(p, 1.0)
            raise self._fail(EOFError(f"replica {r} closed its pipe"))
        return reply

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the replicas (end of file on their pipes; killed past ``timeout_s``)."""
        if not self.workers:
            return
        for p in self.workers:
            close_pipes(p)
        deadline = time.monotonic() + timeout_s
        for p in self.workers:
            if not wait_exit(p, max(0.0, deadline - time.monotonic())):
                p.kill()
                p.wait(5)
        self.workers = []
        if self._group is not None:
            self._group.close()
        if self._saved_threads is not None:
            import torch

            torch.set_num_threads(self._saved_threads)


@dataclass(frozen=True)
class _Pools:
    front: DataParallelEngine

    def reset_prefix_cache(self) -> None:
        """Forget every replica's cached prefixes (the offline benchmark, between warm-up and run)."""
        self.front._check()
        self.front.engine0.pool.reset_prefix_cache()
        for r in range(1, len(self.front.workers) + 1):
            self.front._tell(r, _ResetPrefixCache())


def _await_ready(workers: list[subprocess.Popen], timeout_s: float) -> None:
    """Each replica's ready message, or ``ReplicaFailedError`` for the first that exits or is late."""
    deadline = time.monotonic() + timeout_s
    for r, p in enumerate(workers, 1):
        assert p.stdout is not None
        left = deadline - time.monotonic()
        readable, _, _ = select.select([p.stdout], [], [], max(left, 0.0))
        if not readable:
            raise ReplicaFailedError(f"data-parallel replica {r} did not load in {timeout_s:.0f} s")
        if read_object(p.stdout.fileno()) != "ready":
            p.wait(5)
            raise ReplicaFailedError(
                f"data-parallel replica {r} exited with code {p.returncode} while loading"
            )


def _resolved(config: EngineConfig) -> EngineConfig:
    """``config`` for one replica: one of them, its dtype decided once for all (``auto``)."""
    config = replace(config, data_parallel_size=1)
    if config.dtype != "auto":
        return config
    import torch

    from baton.common.model.gemm_probe import cached_probe
    from baton.common.model.source import ModelSource

    on_gpu = config.device != "cpu"
    source = ModelSource.resolve(config.model)
    return replace(
        config, dtype="bfloat16" if on_gpu else cached_probe(source.path, torch.get_num_threads()).dtype
    )


def _is_moe(config: EngineConfig) -> bool:
    from baton.common.model.loader import read_config
    from baton.common.model.mixtral import MixtralConfig
    from baton.common.model.source import ModelSource

    return isinstance(read_config(ModelSource.resolve(config.model)), MixtralConfig)


def launch(config: EngineConfig, progress: bool = False, timeout_s: float = 300.0) -> DataParallelEngine:
    """Start replicas 1..N-1, build replica 0 here, and return the front over them."""
    import torch

    from baton.common.net import free_port

    size = config.data_parallel_size
    if config.tensor_parallel_size > 1 or getattr(config, "pipeline_parallel_size", 1) > 1:
        raise ValueError(
            "--data-parallel-size > 1 with --tensor-parallel-size or --pipeline-parallel-size > 1 is not"
            " supported yet"
        )
    dp_attention = config.enable_expert_parallel and _is_moe(config)
    if dp_attention and config.speculative is not None:
        raise ValueError("speculative decoding is not supported with expert-parallel data-parallel attention")
    one = asdict(_resolved(config))
    group = ("127.0.0.1", free_port(), 120.0) if dp_attention else None
    build_kernels(config.device)  # the replicas then import it, not build it inside a collective
    shares = cpu_shares(size)
    specs = [ReplicaSpec(r, size, one, shares[r], group) for r in range(size)]
    workers: list[subprocess.Popen] = []
    saved = torch.get_num_threads()
    try:
        for spec in specs[1:]:
            # stdin: commands; stdout: replies; stderr: the caller's, so a replica's error shows.
            cmd = [*python_module("baton.common.parallel.data_parallel"), spec.to_json()]
            workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        torch.set_num_threads(len(shares[0]))
        local, expert_group = _build(specs[0], progress)
        _await_ready(workers, timeout_s)
        if expert_group is not None:
            expert_group.start()
    except BaseException:
        for p in workers:
            p.kill()
            p.wait(5)
            close_pipes(p)
        torch.set_num_threads(saved)
        raise
    front = DataParallelEngine(config, local, workers, expert_group, saved)
    atexit.register(front.close)
    return front


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    spec = ReplicaSpec.from_json(sys.argv[1])
    # The replies keep the pipe that was stdout; anything printed goes to stderr, not into them.
    replies = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve(spec, sys.stdin.fileno(), replies)
    except Exception:
        log.exception("data-parallel replica %d failed", spec.rank)
        sys.exit(1)


if __name__ == "__main__":
    # Run the imported module's ``main``, not this ``__main__`` copy's: the messages' classes must
    # be the ones rank 0 pickles (``baton.common.parallel.data_parallel._Step``, not ``__main__._Step``).
    from baton.common.parallel import data_parallel

    data_parallel.main()
