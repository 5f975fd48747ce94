"""What the engine returns, shaped like vLLM's ``RequestOutput``. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    """Log-probability of each chosen token, when requested."""
    finish_reason: str | None = None
    """"stop", "length", "abort" or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion, if one did."""

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
