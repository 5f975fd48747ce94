"""A request's state inside the engine. No torch.

``num_computed_tokens`` catches up with ``num_tokens``: a prefill chunk, a prefix-cache hit and a
decode step all advance it; a token is sampled whenever it reaches the end of the known tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.common.engine.hashing import BlockHash
from baton.common.engine.outputs import NO_TOP_LOGPROBS, TopLogprobs
from baton.common.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    """The engine failed the request (its step raised, or its logits were not finite)."""

    @property
    def finished(self) -> bool:
        return self in (
            self.FINISHED_STOPPED,
            self.FINISHED_LENGTH,
            self.FINISHED_ABORTED,
            self.FINISHED_ERROR,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens found in the prefix cache when first scheduled (-1: not yet scheduled)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """One entry per output token when ``sampling_params.logprobs`` > 0, else empty."""
    error: str | None = None
    """Why the engine failed the request (``FINISHED_ERROR``)."""
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of the request's full blocks computed so far (a growing chain)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed next tokens (speculative decoding), verified by the next step that schedules it."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(
        self, token_id: int, logprob: float | None = None, top_logprobs: TopLogprobs | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.sampling_params.logprobs:
            # A placeholder where the alternatives are unknown keeps the list aligned with the tokens.
            self.output_top_logprobs.append(top_logprobs or NO_TOP_LOGPROBS)

    def drop_output(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` output tokens (a stop string completed before them, in a
        step that appended several); only for a request about to finish (their KV is not undone)."""
        keep = self.num_output_tokens - num_tokens
        del self.output_token_ids[keep:]
        del self.all_token_ids[self.num_prompt_tokens + keep :]
        del self.output_logprobs[keep:]
        del self.output_top_logprobs[keep:]
