"""The gRPC ``Prefill`` service of a prefill worker: what a call must satisfy, the job it opens on
the worker, and the status code each way it can fail ends with.

A Prefill call is checked (INVALID_ARGUMENT), its decode worker's cache layout compared
(FAILED_PRECONDITION) and its KV receiver connected (UNAVAILABLE); then the prompt runs for one
token while the worker pushes its KV (``PrefillWorker._on_step_computed``), and the call answers
once every block has landed (DATA_LOSS if some did not). The engine's refusals keep their meaning:
a full queue is RESOURCE_EXHAUSTED and a dead engine UNAVAILABLE, for the decode worker to prefill
the prompt itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from baton.common.api.convert import params_from_proto, top_logprobs_to_proto
from baton.common.engine.async_engine import AsyncEngine, EngineDeadError, EngineFullError, StreamDelta
from baton.common.engine.llm_engine import LLMEngine
from baton.common.engine.sampling_params import SamplingParams
from baton.common.transfer import KVSender, TransferDescriptor, TransferHandle
from baton.common.transfer.base import BACKENDS
from baton.common.transfer.reshard import Shard
from baton.protos import baton_pb2, baton_pb2_grpc
from baton.services import tp_transfer


@dataclass
class PrefillJob:
    """One Prefill RPC in flight. Created on the event loop (``PrefillServicer``); advanced on the
    engine thread (``PrefillWorker``)."""

    request_id: str
    prompt_len: int
    skip_blocks: int
    dst_block_ids: list[int]
    sender: KVSender
    sender_key: str
    computed: int = 0
    """Prompt tokens computed, the prefix cache's hit counted from the start."""
    next_block: int = 0
    """Index of the first prompt block not yet sent (starts at ``skip_blocks``)."""
    started: float = 0.0
    bytes_sent: int = 0
    done: bool = False
    error: str | None = None
    finished: TransferHandle | None = None
    """Every send of the prompt (``KVSender.finish``), once its last block was queued."""
    sends: list[TransferHandle] = field(default_factory=list)


class PrefillBackend(Protocol):
    """What the service asks of its worker (``PrefillWorker``), once the worker has started."""

    engine: AsyncEngine | None
    jobs: dict[str, PrefillJob]
    """The calls in flight by request id, read by the engine thread."""
    kv_layout: str
    rank_shards: list[Shard]
    whole_kv: Shard
    transfer_failures_total: int

    async def sender_for(self, dest: tp_transfer.Destination, routes: list) -> tuple[str, KVSender]:
        """The connected sender for ``dest`` (raises if it cannot be reached)."""
        ...

    async def sent(self, job: PrefillJob) -> str | None:
        """Wait until every send of a finished job completed; None, or what failed."""
        ...


# -- the checks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillCall:
    """A Prefill request that passed ``check_prefill``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    """The request's, for one token (``max_tokens=1``)."""
    skip_blocks: int
    """Leading prompt blocks the decode worker holds already: not sent."""
    dst_block_ids: list[int]


def check_prefill(request: baton_pb2.PrefillRequest, llm: LLMEngine, in_use: Container[str]) -> PrefillCall:
    """``request`` checked against the engine and the request ids ``in_use``; ValueError says what
    is wrong (the call ends INVALID_ARGUMENT)."""
    rid = request.request_id
    ids = list(request.prompt_token_ids)
    if not rid:
        raise ValueError("request_id must not be empty")
    params = params_from_proto(request.params)  # one token here; min_tokens masks its stops too
    params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    llm.validate_prompt(ids)
    bs = llm.config.block_size
    skip = request.num_skip_tokens
    if skip < 0 or skip % bs or skip > len(ids):
        raise ValueError(
            f"num_skip_tokens must be a multiple of the block size {bs} in [0, {len(ids)}], got {skip}"
        )
    n_blocks = -(-len(ids) // bs)
    want = n_blocks - skip // bs
    if len(request.dst_block_ids) != want:
        raise ValueError(
            f"expected {want} dst_block_ids for a {len(ids)}-token prompt skipping {skip} tokens, "
            f"got {len(request.dst_block_ids)}"
        )
    parse_descriptor(request.destination)
    if rid in in_use:
        raise ValueError(f"request_id {rid!r} is already in use")
    return PrefillCall(rid, ids, params, skip // bs, list(request.dst_block_ids))


def parse_descriptor(msg: baton_pb2.TransferDescriptor) -> TransferDescriptor:
    """A destination's transport descriptor; ValueError if malformed or of an unknown backend."""
    try:
        if msg.extra_json:
            d = TransferDescriptor.from_dict(json.loads(msg.extra_json))
        else:
            d = TransferDescriptor(msg.backend, host=msg.host, port=msg.port)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"bad destination descriptor: {e}") from e
    if d.backend not in BACKENDS:
        raise ValueError(f"destination backend must be one of {BACKENDS}, got {d.backend!r}")
    return d


def layout_mismatch(requested: str, own: str) -> str | None:
    """Why a destination whose cache blocks are laid out as ``requested`` cannot take this worker's
    (``own``); None if it can (or did not say)."""
    if not requested or requested == own:
        return None
    return (
        f"KV layout mismatch: the decode worker's cache is {requested}, this prefill worker's is "
        f"{own} (start both with the same --dtype, --kv-cache-dtype, --block-size and model)"
    )


ENGINE_ERRORS = (
    # refused at admission
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    # the waiting queue is full: the decode worker prefills it itself
    (EngineFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # leaving service: the decode worker prefills it itself
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    # the engine failed this request
    (RuntimeError, grpc.StatusCode.INTERNAL),
)
"""The status a Prefill call ends with when the engine raises: the first match, in this order."""


def engine_error_status(error: Exception) -> grpc.StatusCode:
    """The status of ``error``, one of ``ENGINE_ERRORS``' kinds."""
    return next(code for kind, code in ENGINE_ERRORS if isinstance(error, kind))


def unanswered(job: PrefillJob, first: StreamDelta | None) -> tuple[grpc.StatusCode, str] | None:
    """Why a prompt that ran cannot be answered (the status and message), or None if it can: its
    KV failed (DATA_LOSS), it ended without a token, or its KV was never all queued."""
    rid = job.request_id
    if job.error is not None:
        return grpc.StatusCode.DATA_LOSS, job.error
    if first is None or not first.token_ids:
        reason = first.finish_reason if first is not None else "no output"
        code = grpc.StatusCode.CANCELLED if reason == "abort" else grpc.StatusCode.INTERNAL
        return code, f"prefill of {rid!r} ended without a token ({reason})"
    if not job.done:  # cannot happen unless the engine skipped the hook
        return grpc.StatusCode.INTERNAL, f"KV of {rid!r} was not sent"
    return None


# -- the service -----------------------------------------------------------------------------------
class PrefillServicer(baton_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillBackend):
        self.worker = worker

    async def Prefill(self, request, context):
        w = self.worker
        assert w.engine is not None
        try:
            call = check_prefill(request, w.engine.engine, w.jobs)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        key, sender = await self._connect(request, context, count_failure=True)
        job = PrefillJob(
            call.request_id,
            len(call.prompt_token_ids),
            call.skip_blocks,
            call.dst_block_ids,
            sender,
            key,
            next_block=call.skip_blocks,
            # What the prefix cache holds counts as computed from the start: the worker's published
            # queue is the tokens it has to compute, as the gateway's router estimates them.
            computed=w.engine.engine.kv.cached_prefix_tokens(call.prompt_token_ids),
        )
        w.jobs[call.request_id] = job
        first = await self._first_token(call, job, context)
        refusal = unanswered(job, first)
        if refusal is not None:
            await context.abort(*refusal)
        assert first is not None
        error = await w.sent(job)
        if error is not None:
            # DATA_LOSS, not UNAVAILABLE: this worker is alive and says the KV did not all arrive
            # (and may have let go of blocks the receiver was still reading): recompute it all.
            await context.abort(grpc.StatusCode.DATA_LOSS, error)
        cached = first.num_cached_tokens
        return baton_pb2.PrefillResponse(
            request_id=call.request_id,
            first_token_id=first.token_ids[0],
            first_logprob=first.logprobs[0] if first.logprobs else 0.0,
            first_top_logprobs=top_logprobs_to_proto(first.top_logprobs[0]) if first.top_logprobs else None,
            num_computed_tokens=len(call.prompt_token_ids) - cached,
            num_cached_tokens=cached,
            bytes_sent=job.bytes_sent,
        )

    async def _first_token(self, call: PrefillCall, job: PrefillJob, context) -> StreamDelta | None:
        """Run the prompt for its one token; the delta that carried it (else the last one). The job
        leaves the worker's ``jobs`` on the way out."""
        w = self.worker
        assert w.engine is not None
        rid = call.request_id
        first = None
        try:
            async for d in w.engine.generate(rid, call.prompt_token_ids, call.params):
                if d.token_ids and first is None:
                    first = d
                if d.finished:
                    if first is None:
                        first = d
                    break
        except (ValueError, EngineFullError, RuntimeError) as e:
            await context.abort(engine_error_status(e), str(e))
        finally:
            w.jobs.pop(rid, None)
            if not job.done:  # aborted: its sends are not waited for (their blocks are still held)
                job.sender.finish(rid)
        return first

    async def _connect(self, request, context, count_failure: bool = False) -> tuple[str, KVSender]:
        """The sender to the decode worker of a Prefill or Connect request: its layout checked
        (FAILED_PRECONDITION), its destination parsed (INVALID_ARGUMENT) and reached (UNAVAILABLE;
        a transfer failure when ``count_failure``)."""
        w = self.worker
        mismatch = layout_mismatch(request.kv_layout, w.kv_layout)
        if mismatch is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        dest, routes = await self._destination(request, context)
        try:
            return await w.sender_for(dest, routes)
        except Exception as e:  # noqa: BLE001 - unreachable or bogus destination
            if count_failure:
                w.transfer_failures_total += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV receiver: {e}")
            raise  # abort raises; for the type checker

    async def _destination(self, request, context) -> tuple[tp_transfer.Destination, list]:
        """The decode worker's ranks and which of this worker's ranks feeds which (re-sharded
        when the two run at different tensor- or pipeline-parallel degrees)."""
        w = self.worker
        try:
            dest = tp_transfer.destination(request, parse_descriptor, w.whole_kv)
            return dest, tp_transfer.routes(w.rank_shards, dest, w.whole_kv)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # abort raises; for the type checker

    async def Connect(self, request, context):
        """Connect the KV transport to a decode worker ahead of its first prompt."""
        try:
            parse_descriptor(request.destination)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._connect(request, context)
        return baton_pb2.ConnectResponse()

    async def Abort(self, request, context):
        w = self.worker
        assert w.engine is not None
        for rid in request.request_ids:
            w.engine.abort(rid)
            w.jobs.pop(rid, None)
        return baton_pb2.AbortResponse(num_aborted=len(request.request_ids))
