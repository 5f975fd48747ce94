"""From a request's tokens to what its caller sees: the text so far (detokenized a token at a time),
the stop string it holds, and the ``RequestOutput``. No torch; the scheduler is the engine's."""

from __future__ import annotations

import time
from collections.abc import Sequence

from baton.common.engine.engine_stats import EngineStats
from baton.common.engine.outputs import CompletionOutput, RequestOutput
from baton.common.engine.request import Request


class IncrementalText:
    """A request's output text so far, extended by the tokens it has not seen yet."""

    def __init__(self, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fed = 0
        self._text = ""

    def extend(self, backend, token_ids: Sequence[int]) -> str:
        for t in token_ids[self._fed :]:
            chunk = self._stream.step(backend, t)  # None while a UTF-8 sequence is incomplete
            if chunk:
                self._text += chunk
        self._fed = len(token_ids)
        return self._text


class OutputProcessor:
    """The text side of the engine's requests: each one's prompt text (``add``, until ``forget``)
    and its output text, which grows as the steps append tokens."""

    def __init__(self, tokenizer, stats: EngineStats):
        """``stats``: the engine's counters; detokenizing adds its time to them."""
        self.tokenizer = tokenizer
        self.stats = stats
        self._prompts: dict[str, str | None] = {}
        self._texts: dict[str, IncrementalText] = {}
        # Output text grows one token at a time (tokenizers' DecodeStream) instead of the whole
        # output being decoded again at every step; a finished output is decoded once, whole, so
        # its text is exactly ``tokenizer.decode``'s. Tokenizers that clean up spaces after
        # decoding are decoded whole every time.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None

    def add(self, request_id: str, prompt: str | None) -> None:
        self._prompts[request_id] = prompt

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)
        self._texts.pop(request_id, None)

    def find_stop_string(self, req: Request) -> str | None:
        """The first of the request's stop strings (in its order) that its text holds, or None."""
        text = self.detokenize(req)
        for s in req.sampling_params.stop:
            # Only the tail can hold a new match: the previous step found none.
            if s in text:
                return s
        return None

    def detokenize(self, req: Request) -> str:
        start = time.perf_counter()
        skip = req.sampling_params.skip_special_tokens
        if req.is_finished or self._backend is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=skip)
        else:
            inc = self._texts.get(req.request_id)
            if inc is None:
                inc = self._texts[req.request_id] = IncrementalText(skip)
            text = inc.extend(self._backend, req.output_token_ids)
        self.stats.detokenize_seconds_total += time.perf_counter() - start
        return text

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output so far (cumulative), its text cut before the stop string that
        ended it."""
        text = self.detokenize(req)
        if isinstance(req.stop_reason, str):
            text = text[: text.find(req.stop_reason)]
        params = req.sampling_params
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(req.output_token_ids),
            logprobs=list(req.output_logprobs) if params.logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            top_logprobs=list(req.output_top_logprobs) if params.logprobs else None,
            error=req.error,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=self._prompts.get(req.request_id),
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=req.is_finished,
            num_cached_tokens=min(max(req.num_cached_tokens, 0), req.num_prompt_tokens),
        )
