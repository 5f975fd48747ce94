"""What the engine returns, shaped like vLLM's ``RequestOutput``. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely tokens at one output position, most likely first (OpenAI's ``top_logprobs``):
    the model's log-probabilities before temperature, top-k and top-p, like the chosen token's."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


NO_TOP_LOGPROBS = TopLogprobs()
"""The placeholder of a position whose alternatives are unknown (a migrated request's resumed tokens)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    """Log-probability of each chosen token, when requested."""
    finish_reason: str | None = None
    """"stop", "length", "abort", "error" (the engine failed this request) or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion, if one did."""
    top_logprobs: list[TopLogprobs] | None = None
    """The ``logprobs`` most likely tokens at each position, when ``logprobs`` > 0."""
    error: str | None = None
    """Why the engine failed the request, when ``finish_reason`` is "error"."""

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
