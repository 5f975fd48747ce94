"""``baton plan``: the layout that serves a workload within its SLOs with the fewest workers (pure).

Every candidate is judged by the simulator (``simulate.py``) on the same requests (one seed): a
layout *meets* the workload when its predicted SLO attainment reaches the target (0.9: P90, as
DistServe). The search, per chunk size:

- ``colocated:N``: attainment grows with N, so the fewest is a binary search over 1..budget;
- ``<P>p<D>d``: attainment grows with P at a fixed D and with D at a fixed P, so the layouts that
  meet it with the fewest decode workers for each P form a staircase (``D_min(P)`` falls as P
  rises); walking it visits O(budget) layouts instead of budget^2, and every layout of the fewest
  workers is on it.

The choice is the meeting layout of the fewest workers; ties go to the higher goodput per worker.
When nothing in the budget meets the rate, the plan says so and returns the layout at the budget
with the highest rate that still meets the target (DistServe's goodput: a binary search on rate).

Chunk size (``max_num_batched_tokens``) is searched where the profile's prefill model was fitted on
steps that large (its ``points``); the model is per step, so a smaller chunk changes the step mix,
not the cost law. Parallelism is the profile's own ``tensor_parallel_size``: another degree costs
differently and needs its own profile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.planner.baseline import ClosedForm, closed_form
from baton.planner.layout import Layout
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO, SimResult
from baton.planner.simulate import REMOTE_PREFILL_THRESHOLD, simulate
from baton.planner.workload import Workload

DEFAULT_ATTAINMENT = 0.9
CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
"""Chunk sizes tried, where the profile measured prefill steps at least that large."""
RATE_STEPS = 8
"""Halvings of the binary search on rate (the highest rate found is within rate / 2^8 below)."""


@dataclass(frozen=True)
class Budget:
    """What the layout may use; each bound set caps the workers."""

    max_workers: int | None = None
    cores: int | None = None
    """CPU cores in all; a worker takes the cores it was profiled on (``machine.cores``)."""
    gpus: int | None = None
    """GPUs in all; a worker takes its tensor-parallel ranks' (the profile's)."""

    def workers(self, profile: Profile) -> tuple[int, str]:
        """The most workers it allows, and which bound sets that."""
        caps = []
        if self.max_workers is not None:
            caps.append((self.max_workers, f"--max-workers {self.max_workers}"))
        if self.cores is not None:
            per = max(1, profile.machine.cores)
            caps.append((self.cores // per, f"{self.cores} cores at {per} a worker"))
        if self.gpus is not None:
            if not profile.machine.gpu:
                raise ValueError("a GPU budget, but the profile was taken on no GPU")
            per = profile.engine.tensor_parallel_size
            caps.append((self.gpus // per, f"{self.gpus} GPUs at {per} a worker"))
        if not caps:
            raise ValueError("a budget is needed: --max-workers, --cores or --gpus")
        n, why = min(caps)
        if n < 1:
            raise ValueError(f"the budget allows no worker ({why})")
        return n, why


@dataclass(frozen=True)
class Evaluation:
    """One simulated layout at one chunk size and rate."""

    layout: Layout
    chunk: int
    rate: float
    result: SimResult

    @property
    def workers(self) -> int:
        return self.layout.workers

    @property
    def attainment(self) -> float:
        return self.result.slo_attainment

    @property
    def goodput_per_worker(self) -> float:
        return self.result.goodput_req_s / self.workers


@dataclass(frozen=True)
class Baseline(ClosedForm):
    """The closed-form rule's layouts, and the simulator's verdict on each."""

    disaggregated_eval: Evaluation
    colocated_eval: Evaluation


@dataclass(frozen=True)
class Plan:
    chosen: Evaluation
    met: bool
    """Whether ``chosen`` meets the asked rate; if not, it is the best layout at the budget."""
    rate: float
    target: float
    slo: SLO
    budget_workers: int
    budget_bound: str
    max_rate: float | None
    """Unmet: the highest rate ``chosen`` serves at the target."""
    runners_up: list[tuple[Evaluation, str]]
    """Other layouts, each with why it lost."""
    baseline: Baseline
    chunks: tuple[int, ...]
    notes: list[str] = field(default_factory=list)
    simulations: int = 0
    wall_s: float = 0.0


def at_rate(workload: Workload, rate: float) -> Workload:
    """``workload`` sent at ``rate`` requests per second: a trace is replayed faster or slower."""
    if workload.trace is None:
        return dataclasses.replace(workload, rate=rate)
    own = trace_rate(workload)
    scale = own / rate if rate > 0 else 1.0
    rows = tuple((t * scale, i, o) for t, i, o in workload.trace)
    return dataclasses.replace(workload, trace=rows)


def trace_rate(workload: Workload) -> float:
    rows = workload.trace[: workload.num_prompts] if workload.num_prompts else workload.trace
    span = rows[-1][0] - rows[0][0] if rows else 0.0
    return (len(rows) - 1) / span if span > 0 else float(len(rows))


def mean_lengths(workload: Workload) -> tuple[float, float]:
    """Mean prompt and output tokens."""
    if workload.trace is None:
        return workload.input_len.mean, workload.output_len.mean
    rows = workload.trace
    return sum(r[1] for r in rows) / len(rows), sum(r[2] for r in rows) / len(rows)


def chunk_choices(profile: Profile) -> tuple[tuple[int, ...], str]:
    """Chunk sizes the profile's prefill model speaks for, and a note on the choice."""
    own = profile.engine.max_num_batched_tokens
    measured = [p.get("tokens", 0) for p in profile.points.get("prefill", [])]
    if not measured:
        note = f"chunk {own} (the profile's): it holds no prefill points to say how far its model reaches"
        return (own,), note
    top = max(measured)
    chunks = tuple(sorted({own, *(c for c in CHUNKS if c <= top)}))
    return chunks, f"chunks {', '.join(map(str, chunks))} (prefill measured up to {top:.0f} tokens a step)"


class Search:
    """Simulations of one workload, memoised by layout, chunk and rate."""

    def __init__(
        self,
        profile: Profile,
        workload: Workload,
        slo: SLO,
        target: float,
        seed: int = 0,
        transport: str | None = None,
        remote_prefill_threshold: int = REMOTE_PREFILL_THRESHOLD,
    ) -> None:
        self.profile, self.workload, self.slo, self.target = profile, workload, slo, target
        self.seed, self.transport, self.threshold = seed, transport, remote_prefill_threshold
        self.rate = trace_rate(workload) if workload.trace is not None else workload.rate
        self.seen: dict[tuple[str, int, float], Evaluation] = {}

    def run(self, layout: Layout, chunk: int, rate: float | None = None) -> Evaluation:
        rate = self.rate if rate is None else rate
        key = (str(layout), chunk, rate)
        if key not in self.seen:
            engine = dataclasses.replace(self.profile.engine, max_num_batched_tokens=chunk)
            profile = dataclasses.replace(self.profile, engine=engine)
            result = simulate(
                profile,
                layout,
                at_rate(self.workload, rate),
                self.slo,
                self.seed,
                transport=self.transport,
                remote_prefill_threshold=self.threshold,
            )
            self.seen[key] = Evaluation(layout, chunk, rate, result)
        return self.seen[key]

    def meets(self, e: Evaluation) -> bool:
        return e.attainment >= self.target

    def at_asked_rate(self) -> list[Evaluation]:
        return [e for e in self.seen.values() if e.rate == self.rate]


def fewest_colocated(search: Search, chunk: int, cap: int) -> Evaluation | None:
    """``colocated:N`` of the fewest workers that meets the target (binary search), or None."""
    lo, hi = 1, cap
    if not search.meets(search.run(Layout(0, cap, True), chunk)):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if search.meets(search.run(Layout(0, mid, True), chunk)):
            hi = mid
        else:
            lo = mid + 1
    return search.run(Layout(0, lo, True), chunk)


def staircase(search: Search, chunk: int, cap: int) -> list[Evaluation]:
    """For each prefill count P, ``PpDd`` with the fewest decode workers that meets the target
    (within ``cap`` workers); stops once more prefill workers cannot tie the fewest found."""
    found: list[Evaluation] = []
    best = cap + 1
    d = cap - 1
    for p in range(1, cap):
        if p + 1 > best:
            break
        d = min(d, cap - p)
        e = search.run(Layout(p, d, False), chunk)
        if not search.meets(e):
            continue  # D_min(P) > d: more prefill workers may still make up for it
        while d > 1:
            fewer = search.run(Layout(p, d - 1, False), chunk)
            if not search.meets(fewer):
                break
            d, e = d - 1, fewer
        found.append(e)
        best = min(best, e.workers)
    return found


def _rank(profile_chunk: int) -> Callable[[Evaluation], tuple]:
    """Fewest workers, then the highest goodput per worker, then the profile's own chunk."""
    return lambda e: (e.workers, -e.goodput_per_worker, e.chunk != profile_chunk, e.layout.prefill)


def max_rate(search: Search, layout: Layout, chunk: int, above: float = 0.0) -> Evaluation:
    """``layout`` at the highest rate it serves at the target, found by bisection between
    ``above`` and the asked rate (to ``rate / 2^RATE_STEPS``); when it misses the target just above
    ``above`` already, that evaluation (it cannot beat a layout serving ``above``)."""
    step = search.rate / 2**RATE_STEPS
    lo, hi = above + step, search.rate
    best = search.run(layout, chunk, lo)
    if not search.meets(best):
        return best
    while hi - lo > step:
        e = search.run(layout, chunk, (lo + hi) / 2)
        if search.meets(e):
            lo, best = e.rate, e
        else:
            hi = e.rate
    return best


def plan(
    profile: Profile,
    workload: Workload,
    slo: SLO,
    budget: Budget,
    target: float = DEFAULT_ATTAINMENT,
    seed: int = 0,
    *,
    transport: str | None = None,
    remote_prefill_threshold: int = REMOTE_PREFILL_THRESHOLD,
) -> Plan:
    """The layout of the fewest workers within ``budget`` meeting ``slo`` at ``target`` attainment
    for ``workload``; else the one at the budget with the highest rate meeting it. Deterministic
    for a seed. Raises ``ValueError`` on a budget, profile or workload it cannot plan for."""
    if not 0 < target <= 1:
        raise ValueError(f"the attainment target {target} is not in (0, 1]")
    start = time.perf_counter()
    cap, bound = budget.workers(profile)
    chunks, chunk_note = chunk_choices(profile)
    search = Search(profile, workload, slo, target, seed, transport, remote_prefill_threshold)
    meeting: list[Evaluation] = []
    for chunk in chunks:
        colocated = fewest_colocated(search, chunk, cap)
        meeting += ([colocated] if colocated else []) + staircase(search, chunk, cap)
    own = profile.engine.max_num_batched_tokens
    notes = [chunk_note, _parallel_note(profile), f"at most {cap} workers ({bound})"]
    lost: list[Evaluation] = []
    if meeting:
        chosen = min(meeting, key=_rank(own))
    else:
        chosen, lost = _best_at_budget(search, chunks, cap, own)
    return Plan(
        chosen=chosen,
        met=bool(meeting),
        rate=search.rate,
        target=target,
        slo=slo,
        budget_workers=cap,
        budget_bound=bound,
        max_rate=None if meeting else (chosen.rate if search.meets(chosen) else 0.0),
        runners_up=runners_up(search, chosen, None if meeting else lost),
        baseline=baseline(search, chosen.chunk),
        chunks=chunks,
        notes=notes,
        simulations=len(search.seen),
        wall_s=time.perf_counter() - start,
    )


def _best_at_budget(
    search: Search, chunks: tuple[int, ...], cap: int, own: int
) -> tuple[Evaluation, list[Evaluation]]:
    """Nothing meets the rate: the layout of ``cap`` workers with the highest rate that meets the
    target (DistServe's goodput), evaluated at that rate, and the others as they lost: at their
    own highest rate, or missing the target just above the best found before them. Each layout
    at each chunk is tried, the most promising (highest attainment at the asked rate) first, so
    that most are dismissed by one simulation."""
    full = [Layout(0, cap, True)] + [Layout(p, cap - p, False) for p in range(1, cap)]
    at_cap = [search.run(layout, chunk) for chunk in chunks for layout in full]
    at_cap.sort(key=lambda e: (-e.attainment, e.chunk != own, e.layout.prefill))
    best: Evaluation | None = None
    lost: list[Evaluation] = []
    for e in at_cap:
        got = max_rate(search, e.layout, e.chunk, best.rate if best else 0.0)
        if search.meets(got):
            lost += [best] if best else []
            best = got
        else:
            lost.append(got)
    if best is None:  # not even the lowest rate tried meets it
        best = max(lost, key=lambda e: e.attainment)
        lost.remove(best)
    return best, lost


def _parallel_note(profile: Profile) -> str:
    tp = profile.engine.tensor_parallel_size
    return (
        f"tensor parallel {tp} in both pools (the profile's); another degree costs differently "
        "and needs its own profile (baton profile --tensor-parallel-size N)"
    )


def baseline(search: Search, chunk: int) -> Baseline:
    """The closed-form rule at the asked rate, and the simulator's verdict on its layouts."""
    mean_in, mean_out = mean_lengths(search.workload)
    rule = closed_form(search.profile, search.rate, mean_in, mean_out, search.slo.tpot_ms, chunk)
    return Baseline(
        *(getattr(rule, f.name) for f in dataclasses.fields(ClosedForm)),
        disaggregated_eval=search.run(Layout(rule.prefill, rule.decode, False), chunk),
        colocated_eval=search.run(Layout(0, rule.colocated, True), chunk),
    )


RUNNERS_UP = 6
SATURATED = 0.9
"""A pool at least this busy (mean over its workers) is named saturated in a runner-up's reason."""


def runners_up(
    search: Search, chosen: Evaluation, lost: list[Evaluation] | None = None
) -> list[tuple[Evaluation, str]]:
    """Up to ``RUNNERS_UP`` other layouts, each with why it lost. A choice that meets the rate:
    its neighbours with one worker fewer first (they show it minimal), then the other layouts that
    meet it (fewest workers, most goodput per worker), then the nearest misses, each layout at its
    best chunk. Else ``lost``, the layouts of the search on rate: highest rate first."""
    if lost is not None:
        ranked = sorted(lost, key=lambda e: (not search.meets(e), -e.rate, -e.attainment))
    else:
        ranked = [search.run(n, chosen.chunk) for n in _one_fewer(chosen.layout)]
        ranked += sorted(search.at_asked_rate(), key=lambda e: _nearest(search, e, chosen))
    out: list[tuple[Evaluation, str]] = []
    seen = {str(chosen.layout)}
    for e in ranked:
        if str(e.layout) not in seen:
            seen.add(str(e.layout))
            out.append((e, _why_lost(search, e, chosen, lost is not None)))
    return out[:RUNNERS_UP]


def _nearest(search: Search, e: Evaluation, chosen: Evaluation) -> tuple:
    if search.meets(e):
        return (0, e.workers, -e.goodput_per_worker, e.chunk != chosen.chunk)
    return (1, -e.attainment, 0.0, e.chunk != chosen.chunk)


def _one_fewer(layout: Layout) -> list[Layout]:
    if layout.colocated:
        return [Layout(0, layout.decode - 1, True)] if layout.decode > 1 else []
    fewer = [Layout(layout.prefill - 1, layout.decode, False)] if layout.prefill > 1 else []
    return fewer + ([Layout(layout.prefill, layout.decode - 1, False)] if layout.decode > 1 else [])


def _why_lost(search: Search, e: Evaluation, chosen: Evaluation, on_rate: bool) -> str:
    chunk = f"chunk {e.chunk}: " if e.chunk != chosen.chunk else ""
    if on_rate and search.meets(e):
        return f"{chunk}at most {e.rate:.2f} req/s at the target, below the choice's {chosen.rate:.2f}"
    if on_rate:
        return f"{chunk}at {e.rate:.2f} req/s, " + missed(e.result, search.slo, search.target)
    if not search.meets(e):
        return chunk + missed(e.result, search.slo, search.target)
    if e.workers > chosen.workers:
        more = e.workers - chosen.workers
        return f"{chunk}meets it with {e.workers} workers, {more} more than the choice"
    mine, theirs = e.goodput_per_worker, chosen.goodput_per_worker
    if mine < theirs:
        return (
            f"{chunk}meets it with {e.workers} workers, as many as the choice, but less goodput per "
            f"worker ({mine:.3f} < {theirs:.3f} req/s)"
        )
    return (
        f"{chunk}meets it with {e.workers} workers and as much goodput per worker ({mine:.3f} req/s); "
        "ties go to the profile's chunk, then to fewer prefill workers"
    )


def missed(r: SimResult, slo: SLO, target: float) -> str:
    """Why a run misses ``target``: which p90 is over its SLO, and the busiest pool."""
    why = []
    if r.rejected:
        why.append(f"{r.rejected} requests never fit a worker's KV cache")
    if r.completed == 0:
        why.append("no request completed")
    if r.ttft_ms.p90 > slo.ttft_ms:
        why.append(f"TTFT p90 {fmt_ms(r.ttft_ms.p90)} > {fmt_ms(slo.ttft_ms)}")
    if r.tpot_ms.p90 > slo.tpot_ms:
        why.append(f"TPOT p90 {fmt_ms(r.tpot_ms.p90)} > {fmt_ms(slo.tpot_ms)}")
    if not why:
        why.append("both p90s within the SLO, but too few requests meet both")
    if r.pool_utilisation:
        pool, busy = max(r.pool_utilisation.items(), key=lambda kv: kv[1])
        why.append(
            f"{pool} saturated, {busy:.0%} busy" if busy >= SATURATED else f"busiest: {pool} {busy:.0%}"
        )
    return f"attainment {r.slo_attainment:.2f} < {target:.2f} ({'; '.join(why)})"


def fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"
