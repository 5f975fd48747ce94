"""One worker's engine as the simulator sees it: the scheduler's decisions, costed from a profile.

It follows ``common/engine/scheduler.py`` step by step: each step decodes every running sequence
first, then continues prefill chunks, then admits waiting requests first come first served (none in
a step that preempted) while the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and the
KV blocks allow. When a decode cannot get a block, the newest running request not yet given tokens
this step is preempted: its blocks are freed and it is recomputed later from its prompt and the
tokens it produced (the recompute samples its next token, as the real one does). Commands from
outside (a new request, a remote prefill's reservation or resumption, blocks a transfer released)
wait for the next step boundary, as ``AsyncEngine`` drains its command queue between steps.

What makes 1,000 workers x 10 minutes cheap: a step is one event, and a run of steps that only
decode (nothing to admit, nothing prefilling, no block shortage ahead) is one event too. The
decode batch is kept in aggregate: a sequence is stored as the step it joined and its token count
then, so the batch size ``B``, its context ``C`` and the blocks each step needs (sequences whose
token count crosses a block boundary, counted by phase modulo the block size) advance in O(1) per
step; a run of ``k`` steps costs ``k (a + b B + c C) + c B k (k - 1) / 2`` in closed form and is
cut at the step boundary after anything arrives. Only a block shortage walks the batch.

Costs: a decode-only step is ``decode_ms(B, C)``, a prefill-only step ``prefill_ms(pieces)``, and a
mixed step (colocated, or a decode worker prefilling a short prompt or a recompute) is their sum
less the smaller fixed cost ``a`` (one forward pass pays its fixed overhead once), the prefill part
times the profile's ``mixed_prefill_scale`` (a served profile's; 1 in an engine profile). With a
served profile's ``host_ms``, each step (or run) is also slowed by ``Simulator.pace``: the host's
work for the layout's streamed tokens, where no worker's core is idle to take it.

Left out: prefix caching (every prompt is computed whole), the final-block extra token
(``cache_final_block``), speculative decoding, and a budget smaller than the decode batch (every
running sequence decodes each step).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from baton.planner.profile import Profile

WAITING, PREFILL, DECODE, PARKED, DONE = range(5)
MAX_RUN_STEPS = 1 << 20


class Seq:
    """One request on one worker. ``need``/``done``: tokens to compute before its next sample and
    those computed; in the decode batch, ``n0`` tokens at step ``join`` and done at step ``end``."""

    __slots__ = (
        "rid", "arrival", "prompt", "out", "gen", "need", "done", "held", "order",
        "n0", "join", "end", "state", "tx_end", "worker",
    )  # fmt: skip

    def __init__(self, rid: int, arrival: float, prompt: int, out: int) -> None:
        self.rid, self.arrival, self.prompt, self.out = rid, arrival, prompt, out
        self.gen = 0
        self.need = prompt
        self.done = 0
        self.held = 0
        self.order = 0
        self.n0 = self.join = self.end = 0
        self.state = WAITING
        self.tx_end = -1.0
        self.worker = None


class Engine:
    """A worker's scheduler and step clock, driven by ``command`` (at any time) and ``boundary``
    (when the event ``sim.schedule(t, engine, version)`` asked for comes due with the engine's
    current version; older ones are stale). It reports to ``sim``: ``first_token(seq, t)``,
    ``finished(seq, t)``, ``reserved(seq, t, ok)``, and with ``hand_off`` (a prefill worker)
    ``chunk_sent(seq, tokens, t)`` after each chunk and ``prefilled(seq, t)`` after the last; a
    hand-off keeps the prompt's blocks until a ``RELEASE`` command (its transfer landed)."""

    def __init__(self, name: str, profile: Profile, sim, hand_off: bool = False) -> None:
        e = profile.engine
        self.name, self.sim, self.hand_off = name, sim, hand_off
        self.budget, self.max_seqs, self.bs = e.max_num_batched_tokens, e.max_num_seqs, e.block_size
        self.free = e.kv_capacity_tokens // e.block_size
        self.capacity = self.free
        if self.free <= 0:
            raise ValueError(f"worker {name}: a KV capacity of {e.kv_capacity_tokens} tokens holds no block")
        self.dec_a, self.dec_b, self.dec_c = profile.decode.a, profile.decode.b, profile.decode.c
        self.profile = profile
        self.shared_a = min(profile.prefill.a, profile.decode.a)
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.inbox: list[tuple[int, Seq | int]] = []
        self.batch: set[Seq] = set()  # decoding
        self.ends: list[tuple[int, int, Seq]] = []  # (end step, rid, seq): lazily deleted
        self.phase = [0] * self.bs
        self.steps = 0
        self.ctx = 0  # the batch's tokens at step ``steps``
        self.orders = 0
        self.busy = False
        self.version = 0
        self.t0 = self.t_end = 0.0
        self.run_k = 0  # steps in the current run; 0 while idle
        self.pieces: list[tuple[Seq, int]] = []
        self.taken = False  # the step's decode blocks were taken when it started
        self.busy_ms = 0.0
        self.preemptions = 0
        self.slow = 1.0  # the current step's (or run's) time over its profiled time
        self.rate = 0.0  # tokens a ms it streams, as ``Simulator.pace`` last counted it
        self.pacing = False  # in a step, as ``Simulator.pace`` last counted it

    # -- commands (applied at the next step boundary) -----------------------------------------
    ADD, RESERVE, RESUME, RELEASE = range(4)

    def command(self, t: float, kind: int, item) -> None:
        self.inbox.append((kind, item))
        if not self.busy:
            self.boundary(t)
        elif self.run_k > 1:
            self._cut(t)

    def _cut(self, t: float) -> None:
        """End the current run of decode steps at the first step boundary at or after ``t``."""
        n = self._steps_until(t)
        if n < self.run_k:
            self.run_k = n
            self.t_end = self.t0 + self._run_ms(n)
            self.version += 1
            self.sim.schedule(self.t_end, self, self.version)

    def _first_ms(self) -> float:
        """The profiled time of the run's first step."""
        return self.dec_a + self.dec_b * len(self.batch) + self.dec_c * self.ctx

    def _run_ms(self, k: int) -> float:
        first = self._first_ms()
        return max(0.0, k * first + self.dec_c * len(self.batch) * k * (k - 1) / 2) * self.slow

    def _steps_until(self, t: float) -> int:
        """The fewest steps of the run that end at or after ``t`` (at least one)."""
        b, first = len(self.batch), self._first_ms()
        dt, q = (t - self.t0) / self.slow, self.dec_c * b / 2
        if q > 0:  # q k^2 + (first - q) k - dt = 0
            lin = first - q
            n = math.ceil((-lin + math.sqrt(lin * lin + 4 * q * dt)) / (2 * q)) if dt > 0 else 1
        else:
            n = math.ceil(dt / first) if first > 0 else 1
        n = max(1, n)
        while n > 1 and self.t0 + self._run_ms(n - 1) >= t:  # float rounding, either way
            n -= 1
        while n < self.run_k and self.t0 + self._run_ms(n) < t:
            n += 1
        return min(n, self.run_k)

    # -- the step boundary ---------------------------------------------------------------------
    def boundary(self, t: float) -> None:
        """The current step (or run) ended at ``t``: apply it, take the commands, start the next."""
        if self.busy:
            self._apply(t)
        self.busy = False
        inbox, self.inbox = self.inbox, []
        for kind, item in inbox:
            self._take(t, kind, item)
        if self.batch or self.prefilling or self.waiting:
            self._start(t)
        if not self.busy:
            self.slow = self.sim.pace(self, 0, 0.0)

    def _take(self, t: float, kind: int, item) -> None:
        if kind == self.ADD:
            self.waiting.append(item)
        elif kind == self.RELEASE:
            self.free += item
        elif kind == self.RESERVE:
            blocks = -(-item.prompt // self.bs)
            ok = self.free >= blocks
            if ok:
                self.free -= blocks
                item.state, item.held, item.done = PARKED, blocks, item.prompt
            else:
                self.waiting.append(item)
            self.sim.reserved(item, t, ok)
        else:  # RESUME: the prompt's KV landed; decoding starts from the first token
            item.gen = 1
            self.sim.first_token(item, t)
            self._join(item, t)

    def _apply(self, t: float) -> None:
        k = self.run_k
        self.busy_ms += t - self.t0
        if not self.taken:  # a run of decode-only steps: their blocks are taken now
            self.free -= self._blocks_over(k)
        self.taken = False
        self.steps += k
        self.ctx += len(self.batch) * k
        self.run_k = 0
        for seq, num in self.pieces:
            if seq.state == PREFILL:
                self._chunk_done(seq, num, t)
        self.pieces = []
        ends = self.ends
        while ends and ends[0][0] <= self.steps:
            _, _, seq = heapq.heappop(ends)
            if seq.state == DECODE and seq.end == self.steps:
                self._leave(seq)
                self.sim.finished(seq, t)

    def _chunk_done(self, seq: Seq, num: int, t: float) -> None:
        seq.done += num
        if self.hand_off:
            self.sim.chunk_sent(seq, num, t)
        if seq.done < seq.need:
            return
        self.prefilling.remove(seq)
        seq.gen += 1
        if self.hand_off:
            seq.state = DONE
            self.sim.prefilled(seq, t)
        else:
            if seq.gen == 1:
                self.sim.first_token(seq, t)
            self._join(seq, t)

    def _join(self, seq: Seq, t: float) -> None:
        """Into the decode batch with ``seq.held`` blocks for its ``seq.done`` computed tokens."""
        if seq.gen >= seq.out:
            self.free += seq.held
            seq.state = DONE
            self.sim.finished(seq, t)
            return
        seq.state = DECODE
        seq.n0, seq.join, seq.end = seq.done + 1, self.steps, self.steps + seq.out - seq.gen
        self.orders += 1
        seq.order = self.orders
        self.batch.add(seq)
        self.ctx += seq.n0
        self.phase[(seq.n0 - seq.join) % self.bs] += 1
        heapq.heappush(self.ends, (seq.end, seq.rid, seq))

    def _leave(self, seq: Seq) -> None:
        """Out of the decode batch at a boundary, its blocks freed."""
        n = seq.n0 + self.steps - seq.join  # tokens now; ``n - 1`` have KV
        self.batch.remove(seq)
        self.ctx -= n
        self.phase[(seq.n0 - seq.join) % self.bs] -= 1
        self.free += -(-(n - 1) // self.bs)
        seq.gen += self.steps - seq.join
        seq.done, seq.state = n - 1, DONE

    def _blocks_over(self, k: int) -> int:
        """New blocks the decode batch takes over its next ``k`` steps."""
        b, bs = len(self.batch), self.bs
        total = (k // bs) * b
        for j in range(k % bs):
            total += self.phase[(1 - self.steps - j) % bs]
        return total

    def _decode_steps_possible(self, limit: int) -> int:
        """How many of the next ``limit`` decode steps the free blocks cover."""
        b, bs, left = len(self.batch), self.bs, self.free
        if b == 0:
            return limit
        cycles = min(limit // bs, left // b)
        j, left = cycles * bs, left - cycles * b
        while j < limit:
            need = self.phase[(1 - self.steps - j) % bs]
            if need > left:
                break
            left -= need
            j += 1
        return j

    # -- starting a step -----------------------------------------------------------------------
    def _start(self, t: float) -> None:
        self.busy, self.version = True, self.version + 1
        if not self.prefilling and not self._can_admit() and self.batch:
            k = self._run_length()
            if k > 0:
                self.run_k, self.t0 = k, t
                self.slow = self.sim.pace(self, len(self.batch), max(0.0, self._first_ms()))
                self.t_end = t + self._run_ms(k)
                self.sim.schedule(self.t_end, self, self.version)
                return
        self._detailed_step(t)

    def _can_admit(self) -> bool:
        running = len(self.batch) + len(self.prefilling)
        if not self.waiting or running >= self.max_seqs or len(self.batch) >= self.budget:
            return False
        head = self.waiting[0]
        return self.free - self._blocks_over(1) >= -(-min(head.need, self.budget) // self.bs)

    def _run_length(self) -> int:
        ends = self.ends
        while ends and (ends[0][2].state != DECODE or ends[0][2].end != ends[0][0]):
            heapq.heappop(ends)  # finished or preempted since
        limit = min(ends[0][0] - self.steps, MAX_RUN_STEPS) if ends else MAX_RUN_STEPS
        if len(self.batch) > self.budget:
            return 0
        return self._decode_steps_possible(limit)

    def _detailed_step(self, t: float) -> None:
        """One step as ``Scheduler.schedule`` builds it (decodes, chunks, admissions), costed."""
        before = self.preemptions
        if self._blocks_over(1) > self.free:
            self._decode_with_preemption()
        else:
            self.free -= self._blocks_over(1)
        budget = self.budget - len(self.batch)
        pieces: list[tuple[Seq, int]] = []
        served = set(self.batch)
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if seq.state != PREFILL:
                continue  # preempted earlier in this step
            num = min(seq.need - seq.done, budget)
            if self._allocate_or_preempt(seq, num, served):
                pieces.append((seq, num))
                served.add(seq)
                budget -= num
        while self.waiting and budget > 0 and self.preemptions == before:
            if len(self.batch) + len(self.prefilling) >= self.max_seqs:
                break
            seq = self.waiting[0]
            num = min(seq.need - seq.done, budget)
            blocks = -(-(seq.done + num) // self.bs) - seq.held
            if blocks > self.free:
                break
            self.waiting.popleft()
            self.free -= blocks
            seq.held += blocks
            seq.state = PREFILL
            self.prefilling.append(seq)
            pieces.append((seq, num))
            budget -= num
        if not pieces and not self.batch:  # nothing fits until blocks come back: idle till then
            self.busy = False
            return
        self.pieces, self.taken = pieces, True
        self.run_k, self.t0 = 1, t
        ms = self._step_ms(pieces)
        self.slow = self.sim.pace(self, len(self.batch), ms)
        self.t_end = t + ms * self.slow
        self.sim.schedule(self.t_end, self, self.version)

    def _step_ms(self, pieces: list[tuple[Seq, int]]) -> float:
        dec = self.profile.decode_ms(len(self.batch), self.ctx)
        if not pieces:
            return dec
        pre = self.profile.prefill_ms([(num, seq.done) for seq, num in pieces])
        return pre * self.profile.mixed_prefill_scale + dec - self.shared_a if self.batch else pre

    def check_integrity(self) -> None:
        """Raise if the books disagree: every block is free or held by a request here, and the
        batch's context is the sum of its sequences' tokens (tests call it)."""
        held = sum(s.held for s in self.prefilling) + sum(
            -(-(s.n0 + self.steps - s.join - 1) // self.bs) for s in self.batch
        )
        ctx = sum(s.n0 + self.steps - s.join for s in self.batch)
        if self.busy or self.inbox:
            raise AssertionError(f"{self.name}: checked mid-step")
        if self.free + held > self.capacity or self.free < 0 or ctx != self.ctx:
            raise AssertionError(
                f"{self.name}: {self.free} free + {held} held of {self.capacity}, ctx {self.ctx}/{ctx}"
            )

    # -- preemption (the rare path: walks the batch) -------------------------------------------
    def _running(self) -> list[Seq]:
        return [*self.batch, *self.prefilling]

    def _decode_with_preemption(self) -> None:
        """Not every decode gets its block: in running order, one that cannot makes the newest
        running sequence not yet served this step give its blocks back (possibly itself)."""
        served: set[Seq] = set()
        for seq in sorted(self.batch, key=lambda s: s.order):
            if seq.state != DECODE:
                continue  # preempted earlier in this walk
            if (seq.n0 + self.steps - seq.join) % self.bs == 1:
                while self.free < 1:
                    victim = self._victim(served) or seq
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.state != DECODE:
                    continue
                self.free -= 1
            served.add(seq)

    def _allocate_or_preempt(self, seq: Seq, num: int, served: set[Seq]) -> bool:
        """Blocks for ``num`` more tokens of a prefilling ``seq``, preempting as the scheduler does;
        False when ``seq`` itself had to go."""
        blocks = -(-(seq.done + num) // self.bs) - seq.held
        while blocks > self.free:
            victim = self._victim(served) or seq
            self._preempt(victim)
            if victim is seq:
                return False
        self.free -= blocks
        seq.held += blocks
        return True

    def _victim(self, served: set[Seq]) -> Seq | None:
        cands = [s for s in self._running() if s not in served and s.state in (DECODE, PREFILL)]
        return max(cands, key=lambda s: (s.arrival, s.rid)) if cands else None

    def _preempt(self, seq: Seq) -> int:
        """Free ``seq``'s blocks and queue it first, to be computed from its start; the blocks."""
        self.preemptions += 1
        if seq.state == DECODE:
            before = self.free
            self._leave(seq)
            freed = self.free - before
            seq.need = seq.done + 1  # its prompt and outputs, the last sampled one included
        else:
            self.prefilling.remove(seq)
            freed, self.free = seq.held, self.free + seq.held
        seq.done, seq.held, seq.state = 0, 0, WAITING
        self.waiting.appendleft(seq)
        return freed
