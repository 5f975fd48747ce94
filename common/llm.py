"""The offline interface, shaped like vLLM's ``LLM``:

from baton.common.llm import LLM, SamplingParams
llm = LLM()                                   # the default SmolLM2 GGUF, bf16, CPU
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING

from baton.common.engine.config import EngineConfig
from baton.common.engine.llm_engine import LLMEngine
from baton.common.engine.outputs import RequestOutput
from baton.common.engine.sampling_params import SamplingParams
from baton.common.parallel.engine_factory import create_engine

if TYPE_CHECKING:
    from baton.common.parallel.data_parallel import DataParallelEngine

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

PromptType = str | Sequence[int] | dict


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "bfloat16", progress: bool = False, **kwargs):
        """``kwargs`` are ``EngineConfig`` fields (``kv_cache_gib``, ``max_num_batched_tokens``, ...)."""
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.config = EngineConfig(model=model, dtype=dtype, **kwargs)
        self.engine: LLMEngine | DataParallelEngine
        if self.config.data_parallel_size > 1:
            from baton.common.parallel.data_parallel import launch

            self.engine = launch(self.config, progress=progress)
        else:
            self.engine = create_engine(self.config, progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _to_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            return self._to_ids(prompt["prompt"])
        return [int(t) for t in prompt], None

    @staticmethod
    def _as_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt of token ids
        return list(prompts)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": ...}``); outputs
        come back in the prompts' order. Bad prompts raise ``ValueError`` before any work."""
        items = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
        encoded = [self._to_ids(p) for p in items]
        for ids, _ in encoded:
            self.engine.validate_prompt(ids)
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt, tokenize=False)
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, encoded, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        # n > 1 becomes n engine requests (seeds seed, seed+1, ...), merged back per prompt.
        owners: dict[str, tuple[int, int]] = {}
        for i, ((ids, text), p) in enumerate(zip(encoded, params)):
            for j in range(p.n):
                sub = p if p.n == 1 else _with(p, n=1, seed=None if p.seed is None else p.seed + j)
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, sub, prompt=text)
                owners[rid] = (i, j)
        results: list[RequestOutput | None] = [None] * len(encoded)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(owners), desc="Processed prompts", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                i, j = owners[out.request_id]
                out.outputs[0].index = j
                merged = results[i]
                if merged is None:
                    out.request_id = str(i)
                    results[i] = out
                else:
                    merged.outputs.append(out.outputs[0])
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        for r in results:
            if r is not None:
                r.outputs.sort(key=lambda c: c.index)
        return [r for r in results if r is not None]


def _with(p: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(p, **changes)
