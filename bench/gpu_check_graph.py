"""A batch's decode steps run eagerly (the engine's path: ``ModelRunner.prepare`` then the model) and
replayed from one CUDA graph, over the same paged cache, for ``gpu_check_model.check_cuda_graph_decode``.

The engine has no CUDA-graph mode yet. ``DecodeGraph`` is what one needs: every tensor the decode
forward reads lives in a static buffer (ids, positions, slots, block tables padded to a fixed width,
context lengths), a step copies its inputs into them and replays. The model's decode path makes no
host sync (``num_decode_tokens`` and the padding count are Python ints, the Triton kernel takes its
grid from shapes), which is what lets it be captured at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from baton.common.engine.model_runner import ModelRunner, allocate_kv_cache
from baton.common.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.common.model.attention import AttentionMetadata

BLOCK_SIZE = 16


@dataclass
class DecodeState:
    """A prefilled batch: its cache, block tables, context lengths and last tokens."""

    cache: torch.Tensor  # [num_blocks, layers, 2, KV, bs, D]
    tables: list[tuple[int, ...]]
    lens: list[int]
    """Tokens in each row's cache."""
    tokens: list[int]
    """Each row's next input: the token its prefill sampled."""
    scratch_block: int


@torch.inference_mode()
def prefill_batch(model, prompts: list[list[int]], dtype: torch.dtype, max_len: int) -> DecodeState:
    per_seq = -(-max_len // BLOCK_SIZE)
    num_blocks = len(prompts) * per_seq + 1
    cache = allocate_kv_cache(model, num_blocks, BLOCK_SIZE, dtype, model.embed_tokens.weight.device)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    runner = ModelRunner(model, cache, BLOCK_SIZE, scratch_block=num_blocks - 1)
    sched = SchedulerOutput(
        tuple(ScheduledRequest(str(i), tuple(p), 0, tables[i], True) for i, p in enumerate(prompts))
    )
    inputs = runner.prepare(sched)
    hidden = model(inputs.input_ids, inputs.positions, cache, inputs.meta)
    first = model.greedy_tokens(hidden[inputs.logits_indices]).tolist()
    return DecodeState(cache, tables, [len(p) for p in prompts], first, num_blocks - 1)


@torch.inference_mode()
def eager_decode(model, state: DecodeState, steps: int, hidden: list | None = None) -> list[list[int]]:
    """``steps`` greedy decode steps of the whole batch as the engine runs them (no graph); the
    state's cache is written, its lengths and tokens are not advanced. ``hidden`` collects each
    step's hidden states."""
    runner = ModelRunner(model, state.cache, BLOCK_SIZE, scratch_block=state.scratch_block)
    lens, tokens = list(state.lens), list(state.tokens)
    out: list[list[int]] = [[] for _ in tokens]
    for _ in range(steps):
        sched = SchedulerOutput(
            tuple(
                ScheduledRequest(str(i), (tokens[i],), lens[i], state.tables[i], True)
                for i in range(len(tokens))
            )
        )
        inputs = runner.prepare(sched)
        states = model(inputs.input_ids, inputs.positions, state.cache, inputs.meta)
        if hidden is not None:
            hidden.append(states[: len(tokens)].float().cpu())
        tokens = model.greedy_tokens(states[inputs.logits_indices]).tolist()
        for i, t in enumerate(tokens):
            out[i].append(t)
        lens = [n + 1 for n in lens]
    return out


class DecodeGraph:
    """One CUDA graph of a decode step (forward + greedy head) for this batch size and table width.
    ``capture=False`` runs the same static-buffer step eagerly instead of replaying (on a CPU, where
    it checks the buffers and metadata without a GPU)."""

    def __init__(self, model, state: DecodeState, capture: bool = True):
        self.model, self.state = model, state
        batch, width = len(state.tokens), len(state.tables[0])
        dev = state.cache.device
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slot_blocks = torch.full((batch,), state.scratch_block, dtype=torch.long, device=dev)
        self.slot_offsets = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tables = torch.full((batch, width), state.scratch_block, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(batch, dtype=torch.int32, device=dev)
        self.meta = AttentionMetadata(
            slot_blocks=self.slot_blocks,
            slot_offsets=self.slot_offsets,
            num_decode_tokens=batch,
            decode_block_tables=self.tables,
            decode_context_lens=self.context_lens,
            fresh_runs=(),
            context_prefills=(),
            prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
            prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
        )
        self.graph = torch.cuda.CUDAGraph() if capture else None
        self.out = self._capture() if capture else self.ids

    def _step(self) -> torch.Tensor:
        self.hidden = self.model(self.ids, self.positions, self.state.cache, self.meta)  # [B, hidden]
        return self.model.greedy_tokens(self.hidden)

    @torch.inference_mode()
    def _capture(self) -> torch.Tensor:
        assert self.graph is not None
        # Warm up on a side stream (Triton compiles, the allocator settles) with every row writing
        # to and reading from the scratch block only, so the prefilled cache is left as it was.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
            out = self._step()
        return out

    def _load(self, tokens: list[int], lens: list[int]) -> None:
        bs = BLOCK_SIZE
        host = {
            "ids": torch.tensor(tokens, dtype=torch.long),
            "positions": torch.tensor(lens, dtype=torch.long),
            "slot_blocks": torch.tensor(
                [t[n // bs] for t, n in zip(self.state.tables, lens)], dtype=torch.long
            ),
            "slot_offsets": torch.tensor([n % bs for n in lens], dtype=torch.long),
            "context_lens": torch.tensor([n + 1 for n in lens], dtype=torch.int32),
        }
        for name, value in host.items():
            getattr(self, name).copy_(value, non_blocking=False)
        self.tables.copy_(torch.tensor(self.state.tables, dtype=torch.int32))

    @torch.inference_mode()
    def decode(self, steps: int, hidden: list | None = None) -> list[list[int]]:
        """Like ``eager_decode``, each step a replay."""
        lens, tokens = list(self.state.lens), list(self.state.tokens)
        out: list[list[int]] = [[] for _ in tokens]
        for _ in range(steps):
            self._load(tokens, lens)
            if self.graph is not None:
                self.graph.replay()
            else:
                self.out = self._step()
            if hidden is not None:
                hidden.append(self.hidden.float().cpu())
            tokens = self.out.tolist()
            for i, t in enumerate(tokens):
                out[i].append(t)
            lens = [n + 1 for n in lens]
        return out

    @torch.inference_mode()
    def ms_per_step(self, cache0: torch.Tensor, steps: int = 8) -> float:
        self.state.cache.copy_(cache0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.decode(steps)
        torch.cuda.synchronize()
        return round((time.perf_counter() - t) / steps * 1e3, 3)
