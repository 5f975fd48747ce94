"""SamplingParams and TopLogprobs <-> protobuf. SamplingParams validate both ways."""

from __future__ import annotations

from baton.common.engine.outputs import TopLogprobs
from baton.common.engine.sampling_params import SamplingParams
from baton.protos import baton_pb2


def params_to_proto(p: SamplingParams) -> baton_pb2.SamplingParams:
    msg = baton_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        max_tokens=p.max_tokens or 0,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_proto(msg: baton_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the parameter) on invalid values."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens or None,
        min_tokens=msg.min_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=msg.skip_special_tokens,
    )


def top_logprobs_to_proto(top: TopLogprobs) -> baton_pb2.TopLogprobs:
    return baton_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_logprobs_from_proto(msg: baton_pb2.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(tuple(msg.token_ids), tuple(msg.logprobs))
