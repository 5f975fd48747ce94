"""SamplingParams and TopLogprobs <-> protobuf. SamplingParams validate both ways."""

from __future__ import annotations

from baton.common.engine.outputs import TopLogprobs
from baton.common.engine.sampling_params import SamplingParams, StructuredOutputsParams
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
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(_structured_to_proto(p.structured_outputs))
    return msg


def _structured_to_proto(s: StructuredOutputsParams) -> baton_pb2.StructuredOutputs:
    msg = baton_pb2.StructuredOutputs(json_object=s.json_object, choice=list(s.choice or ()))
    for name in ("json", "regex", "grammar"):
        if getattr(s, name) is not None:
            setattr(msg, name, getattr(s, name))
    return msg


def _structured_from_proto(msg: baton_pb2.StructuredOutputs) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=msg.json if msg.HasField("json") else None,
        json_object=msg.json_object,
        regex=msg.regex if msg.HasField("regex") else None,
        choice=tuple(msg.choice) or None,
        grammar=msg.grammar if msg.HasField("grammar") else None,
    )


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
        structured_outputs=(
            _structured_from_proto(msg.structured_outputs) if msg.HasField("structured_outputs") else None
        ),
    )


def top_logprobs_to_proto(top: TopLogprobs) -> baton_pb2.TopLogprobs:
    return baton_pb2.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def top_logprobs_from_proto(msg: baton_pb2.TopLogprobs) -> TopLogprobs:
    return TopLogprobs(tuple(msg.token_ids), tuple(msg.logprobs))
