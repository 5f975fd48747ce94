"""The engine's totals since start, for tests, metrics (``common.metrics``) and ``baton bench
breakdown``. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters that only grow (``LLMEngine.warm_up`` puts some back as they were)."""

    num_computed_tokens_total: int = 0
    """Tokens scheduled into steps: prompt chunks, decodes, verified proposals."""
    num_prompt_tokens_computed_total: int = 0
    """Prompt tokens computed here (a prefix-cache hit or KV that landed from elsewhere is not)."""
    num_generated_tokens_total: int = 0
    """Output tokens the steps appended (a grammar's forced ones: ``StructuredOutputs.stats``)."""
    num_steps_with_prefill: int = 0
    """Steps that gave a request more than one token besides its proposals (a prompt chunk)."""
    num_preemptions_total: int = 0
    """Requests preempted for blocks."""
    num_remote_prefills_total: int = 0
    """Requests whose prompt another worker prefilled (``resume_remote`` with a first token)."""
    num_remote_tokens_kept_total: int = 0
    """Prompt tokens whose KV landed before their remote prefill failed, kept, not recomputed."""
    num_steps_total: int = 0
    """Steps that ran to their end (not one that raised; an empty schedule is no step)."""
    step_seconds_total: float = 0.0
    """The steps' whole time: where a step's time goes (``baton bench breakdown``) ..."""
    forward_seconds_total: float = 0.0
    """... the model's forward pass and sampling ..."""
    detokenize_seconds_total: float = 0.0
    """... and detokenizing output."""
    num_failed_steps_total: int = 0
    """Steps that raised, or whose every sampled row was not finite."""
    num_failed_requests_total: int = 0
    """Requests finished with ``FINISHED_ERROR``."""
    num_refused_requests_total: int = 0
    """Requests refused because the waiting queue was full (``check_queue_room``)."""


class StatsField:
    """An engine attribute that is one field of its ``counters`` (an ``EngineStats``): metrics and
    tests read ``engine.num_steps_total`` as they always have, and assigning it (a warm-up putting
    a counter back) writes the field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner=None):
        if engine is None:
            return self
        return getattr(engine.counters, self.name)

    def __set__(self, engine, value) -> None:
        setattr(engine.counters, self.name, value)
