"""``baton simulate``: a discrete-event simulation of the gateway and both pools, fed by a profile.

The path, as the services run it (``services/gateway``, ``services/prefill``, ``services/decode``):

1. A request reaches the router ``gateway_ms`` after it arrives (the gateway's own cost).
2. The router picks a decode worker by ``uncached tokens + 256 x requests on it`` (no prefix cache
   here, so the least loaded; ties to the first) and, in a disaggregated layout, a prefill worker
   by ``uncached tokens + prompt tokens it has queued`` (the gateway's own count, from the pick
   until the request's first token comes back).
3. The decode worker reserves blocks for the prompt at its next step boundary; with no room, or a
   prompt under ``remote_prefill_threshold`` tokens, it prefills the prompt itself.
4. The prefill worker computes the prompt in chunks (many prompts share a step under the token
   budget) and sends each chunk's KV when its step ends; the sends share one link in order, each
   costing ``b x tokens`` of the transport's model plus ``a`` once per prompt. The prompt's blocks
   stay held on the prefill worker until its last send lands.
5. Then the decode worker resumes the request at its next step boundary: the prefill worker's
   sampled token goes out there (TTFT), and continuous batching produces the rest.

Each worker's steps are modelled by ``sim_engine.Engine`` (the scheduler's rules, one event per
step or per run of decode-only steps).

Why a plain heap and not ``simpy``: on a prototype of this loop (100 workers stepping a continuous
batch, one event per step, 12k Poisson arrivals, 282k steps; AMD EPYC, machine otherwise idle, best
of four) ``heapq`` ran 1.1 M steps/s and simpy 4.1.2 0.69 M steps/s (1.6x); and cutting a run of
decode steps short at the next boundary is a version number on a heap entry here, a process
interrupt there.
"""

from __future__ import annotations

import heapq
import time

from baton.planner.layout import Layout, parse_layout
from baton.planner.profile import Profile
from baton.planner.sim_engine import Engine, Seq
from baton.planner.sim_result import SLO, Dist, SimResult
from baton.planner.workload import Requests, Workload, draw

LOAD_COST_TOKENS = 256.0
"""The router's charge per request on a decode worker, in prompt tokens (``Router``'s)."""
REMOTE_PREFILL_THRESHOLD = 32
"""Prompts shorter than this are prefilled by their decode worker (``DecodeWorkerConfig``'s)."""
MAX_HOST_SHARE = 0.9
"""The most of the cores the host's per-token work takes from the workers (``Simulator.pace``)."""


class _LeastKey:
    """The index with the least key (ties to the lowest index), under updates: a heap whose stale
    entries are dropped when they surface."""

    def __init__(self, n: int) -> None:
        self.key = [0.0] * n
        self.heap = [(0.0, i) for i in range(n)]

    def add(self, i: int, delta: float) -> None:
        self.key[i] += delta
        heapq.heappush(self.heap, (self.key[i], i))

    def least(self) -> int:
        heap, key = self.heap, self.key
        while heap[0][0] != key[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][1]


class Simulator:
    """One run: build it, ``run()``, then ``result()``."""

    def __init__(
        self,
        profile: Profile,
        layout: Layout,
        requests: Requests,
        slo: SLO,
        transport: str | None = None,
        remote_prefill_threshold: int = REMOTE_PREFILL_THRESHOLD,
    ) -> None:
        self.profile, self.layout, self.requests, self.slo = profile, layout, requests, slo
        self.threshold = remote_prefill_threshold
        self.tx_a = self.tx_b = 0.0
        if not layout.colocated:
            name = transport or ("ucx" if "ucx" in profile.transfer else next(iter(profile.transfer), ""))
            if name not in profile.transfer:
                have = ", ".join(profile.transfer) or "none"
                raise ValueError(f"the profile has no {name or 'KV transfer'!r} model (it has: {have})")
            self.tx_a, self.tx_b = profile.transfer[name].a, profile.transfer[name].b
        pool = "colocated" if layout.colocated else "decode"
        self.decode = [Engine(f"{pool}-{i}", profile, self) for i in range(layout.decode)]
        self.prefill = [Engine(f"prefill-{i}", profile, self, hand_off=True) for i in range(layout.prefill)]
        self.decode_load = _LeastKey(layout.decode)
        self.prefill_queue = _LeastKey(layout.prefill)
        n = len(requests)
        self.ttft = [-1.0] * n
        self.finish = [-1.0] * n
        self.prefill_of = [-1] * n
        self.decode_of = [0] * n
        self.heap: list = []
        self.count = 0
        self.events = 0
        self.remote = 0
        self.rejected = 0
        self.wall_s = 0.0
        self.host_ms = profile.host_ms
        self.token_rate = 0.0  # tokens a ms: every engine's as its current step started
        self.busy_engines = 0

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        start = time.perf_counter()
        heap, pop = self.heap, heapq.heappop
        gw = self.profile.gateway_ms
        arrivals = [t * 1000.0 + gw for t in self.requests.arrival_s]
        i, n = 0, len(arrivals)
        while True:
            if heap and (i >= n or heap[0][0] < arrivals[i]):
                t, _, obj, version = pop(heap)
                self.events += 1
                if version < 0:
                    self._landed(obj, t)
                elif version == obj.version:
                    obj.boundary(t)
            elif i < n:
                self._arrive(i, arrivals[i])
                i += 1
            else:
                break
        self.wall_s = time.perf_counter() - start

    def pace(self, engine: Engine, tokens: int, ms: float) -> float:
        """``engine`` starts a step of ``ms`` (as profiled) streaming ``tokens``, or goes idle
        (``ms`` 0): how much slower the step runs for the host's work, ``host_ms`` of CPU a
        streamed token at the layout's token rate (every engine's as its current step started).
        The work takes an idle worker's core first (one each); what is left is taken evenly from
        the busy workers' steps, and a worker on several cores waits for the one it is taken from."""
        if not self.host_ms:
            return 1.0
        busy = ms > 0
        rate = tokens / ms if busy else 0.0
        self.token_rate += rate - engine.rate
        self.busy_engines += busy - engine.pacing
        engine.rate, engine.pacing = rate, busy
        if not busy:
            return 1.0
        idle = len(self.prefill) + len(self.decode) - self.busy_engines
        left = self.host_ms * max(0.0, self.token_rate) - idle
        share = min(MAX_HOST_SHARE, left / self.busy_engines) if left > 0 else 0.0
        return 1.0 / (1.0 - share)

    def schedule(self, t: float, engine: Engine, version: int) -> None:
        self.count += 1
        heapq.heappush(self.heap, (t, self.count, engine, version))

    def _arrive(self, rid: int, t: float) -> None:
        r = self.requests
        seq = Seq(rid, r.arrival_s[rid] * 1000.0, r.input_len[rid], r.output_len[rid])
        if seq.prompt + seq.out > self.decode[0].capacity * self.decode[0].bs:
            self.rejected += 1  # the engine refuses what its cache can never hold
            return
        d = self.decode_load.least()
        self.decode_load.add(d, 1.0)
        self.decode_of[rid] = d
        engine = self.decode[d]
        if self.layout.colocated or seq.prompt < self.threshold:
            engine.command(t, Engine.ADD, seq)
            return
        p = self.prefill_queue.least()
        self.prefill_queue.add(p, seq.prompt)
        self.prefill_of[rid] = p
        engine.command(t, Engine.RESERVE, seq)

    # -- what the engines report -----------------------------------------------------------------
    def reserved(self, seq: Seq, t: float, ok: bool) -> None:
        if ok:
            self.remote += 1
            remote = Seq(seq.rid, seq.arrival, seq.prompt, 1)
            remote.worker = seq
            self.prefill[self.prefill_of[seq.rid]].command(t, Engine.ADD, remote)

    def chunk_sent(self, seq: Seq, tokens: int, t: float) -> None:
        start = max(t, seq.tx_end) if seq.tx_end >= 0 else t + self.tx_a
        seq.tx_end = start + self.tx_b * tokens

    def prefilled(self, seq: Seq, t: float) -> None:
        self.count += 1
        heapq.heappush(self.heap, (max(t, seq.tx_end), self.count, seq, -1))

    def _landed(self, seq: Seq, t: float) -> None:
        """A prompt's KV landed: its prefill worker lets the blocks go, the decode worker resumes."""
        self.prefill[self.prefill_of[seq.rid]].command(t, Engine.RELEASE, seq.held)
        self.decode[self.decode_of[seq.rid]].command(t, Engine.RESUME, seq.worker)

    def first_token(self, seq: Seq, t: float) -> None:
        self.ttft[seq.rid] = t - seq.arrival
        p = self.prefill_of[seq.rid]
        if p >= 0:
            self.prefill_queue.add(p, -seq.prompt)

    def finished(self, seq: Seq, t: float) -> None:
        self.finish[seq.rid] = t
        self.decode_load.add(self.decode_of[seq.rid], -1.0)

    # -- the report ------------------------------------------------------------------------------
    def result(self) -> SimResult:
        r, slo = self.requests, self.slo
        ttfts, tpots, e2es = [], [], []
        met = 0
        for rid, end in enumerate(self.finish):
            if end < 0:
                continue
            ttft, e2e = self.ttft[rid], end - r.arrival_s[rid] * 1000.0
            out = r.output_len[rid]
            tpot = (e2e - ttft) / (out - 1) if out > 1 else None
            ttfts.append(ttft)
            e2es.append(e2e)
            if tpot is not None:
                tpots.append(tpot)
            met += ttft <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)
        n = len(r)
        window = r.arrival_s[-1] - r.arrival_s[0] if n else 0.0
        makespan = max(self.finish, default=0.0) / 1000.0
        busy = {e.name: e.busy_ms / (makespan * 1000.0) if makespan > 0 else 0.0 for e in self.engines}
        return SimResult(
            layout=str(self.layout),
            num_requests=n,
            completed=len(e2es),
            rejected=self.rejected,
            window_s=window,
            makespan_s=makespan,
            ttft_ms=Dist.of(ttfts),
            tpot_ms=Dist.of(tpots),
            e2e_ms=Dist.of(e2es),
            slo_attainment=met / n if n else 0.0,
            goodput_req_s=met / window if window > 0 else float(met),
            throughput_req_s=len(e2es) / makespan if makespan > 0 else 0.0,
            output_tok_s=sum(o for o, f in zip(r.output_len, self.finish) if f >= 0) / makespan
            if makespan > 0
            else 0.0,
            utilisation=busy,
            preemptions=sum(e.preemptions for e in self.engines),
            remote_prefills=self.remote,
            events=self.events,
            wall_s=self.wall_s,
            pool_utilisation=_pool_means(busy),
        )

    @property
    def engines(self) -> list[Engine]:
        """Every worker's engine model, prefill workers first."""
        return [*self.prefill, *self.decode]


def _pool_means(busy: dict[str, float]) -> dict[str, float]:
    pools: dict[str, list[float]] = {}
    for name, value in busy.items():
        pools.setdefault(name.rsplit("-", 1)[0], []).append(value)
    return {pool: sum(v) / len(v) for pool, v in pools.items()}


def simulate(
    profile: Profile,
    layout: Layout | str,
    workload: Workload,
    slo: SLO,
    seed: int = 0,
    *,
    transport: str | None = None,
    remote_prefill_threshold: int = REMOTE_PREFILL_THRESHOLD,
) -> SimResult:
    """Replay ``workload`` (drawn with ``seed``) through ``layout``'s workers (a ``Layout`` or its
    text, ``"2p4d"``) costed by ``profile``, and measure it against ``slo``. ``transport`` names the
    profile's KV transfer model (default ``ucx``, else the profile's first); prompts shorter than
    ``remote_prefill_threshold`` tokens are prefilled by their decode worker. Deterministic for a
    seed: ``wall_s`` is the only field that varies between runs. Raises ``ValueError`` on a
    workload or profile it cannot run."""
    sim = Simulator(
        profile,
        parse_layout(layout) if isinstance(layout, str) else layout,
        draw(workload, seed),
        slo,
        transport=transport,
        remote_prefill_threshold=remote_prefill_threshold,
    )
    sim.run()
    return sim.result()
