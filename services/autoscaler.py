"""``baton autoscaler``: the planner's autoscaler (``planner/autoscale.py``) as a service.

Each interval it reads the gateway, which sees every request and knows every worker, so the same
two URLs serve ``baton up`` and a cluster (the gateway's Service). It reads it at each half interval
too: the decision at the interval's end sizes for the higher of the whole interval's rate and its
last half's (a step late in the interval is not halved), and a half interval whose rate is over
what the last decision sized for by more than the noise (``planner.autoscale.surged``) is decided at
once, the interval clock restarting from it: a step is acted on within one interval of it.

- ``GET /metrics`` (Prometheus text, parsed with prometheus_client's parser): arrivals are the
  change of ``baton:request_success_total`` (finished) plus ``baton:gateway_requests_in_flight``;
  mean prompt tokens ``baton:prompt_tokens_total`` per first token
  (``baton:time_to_first_token_seconds_count``), mean output tokens ``baton:generation_tokens_total``
  per finished request; p90 TTFT and TPOT interpolated in the interval's change of the
  ``time_to_first_token`` and ``inter_token_latency`` histograms' buckets (as ``histogram_quantile``);
- ``GET /workers`` (the registry): each pool's ready workers, their waiting requests and queued
  prompt tokens (the heartbeat's load).

It decides, exports ``baton:desired_replicas{pool="prefill"|"decode"|"colocated"}`` on its own
``/metrics`` (text format: the ``:`` survives, ``common/metrics.serve_metrics``) for KEDA to scale
each Deployment to, and logs each decision with its reasons. Replicas it asked for and does not yet
see in the registry count as starting for ``cold_start_s`` x 3 (then they are taken as lost).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from baton.env import api_keys
from baton.planner.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Decision,
    Observation,
    PoolObservation,
    surged,
)
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO, parse_slo

log = logging.getLogger("baton.autoscaler")

Buckets = list[tuple[float, float]]
"""A histogram's cumulative counts by upper bound (``le``), ascending."""


@dataclass(frozen=True)
class GatewayCounters:
    """What one scrape of the gateway's ``/metrics`` holds, summed over label sets."""

    finished: float = 0.0
    in_flight: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    first_tokens: float = 0.0
    ttft: Buckets = field(default_factory=list)
    itl: Buckets = field(default_factory=list)

    @property
    def started(self) -> float:
        return self.finished + self.in_flight


def parse_gateway_metrics(text: str) -> GatewayCounters:
    """The counters the autoscaler reads, from the gateway's Prometheus text exposition."""
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {"ttft": {}, "itl": {}}
    hist = {"baton:time_to_first_token_seconds": "ttft", "baton:inter_token_latency_seconds": "itl"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name in hist and s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                b = buckets[hist[family.name]]
                b[le] = b.get(le, 0.0) + s.value
            else:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return GatewayCounters(
        finished=sums.get("baton:request_success_total", 0.0),
        in_flight=sums.get("baton:gateway_requests_in_flight", 0.0),
        prompt_tokens=sums.get("baton:prompt_tokens_total", 0.0),
        generation_tokens=sums.get("baton:generation_tokens_total", 0.0),
        first_tokens=sums.get("baton:time_to_first_token_seconds_count", 0.0),
        ttft=sorted(buckets["ttft"].items()),
        itl=sorted(buckets["itl"].items()),
    )


def histogram_quantile(q: float, before: Buckets, after: Buckets) -> float | None:
    """The ``q`` quantile of what a histogram observed between two scrapes, in its unit; linear
    within the bucket it falls in (Prometheus' ``histogram_quantile``); None with no observations."""
    prior = dict(before)
    delta = [(le, c - prior.get(le, 0.0)) for le, c in after]
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    lo_le, lo_count = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if math.isinf(le):
                return lo_le  # past the last finite bound: the bound is all that is known
            width = count - lo_count
            return lo_le + (le - lo_le) * ((rank - lo_count) / width if width > 0 else 1.0)
        lo_le, lo_count = le, count
    return lo_le


def pool_of(worker: dict, colocated: bool) -> str:
    """The pool a ``/workers`` entry belongs to."""
    return "colocated" if colocated and worker.get("role") == "decode" else str(worker.get("role"))


def pools_from_workers(
    workers: list[dict], pools: tuple[str, ...], colocated: bool
) -> dict[str, dict[str, float]]:
    """Per pool: ready workers, waiting requests, queued prompt tokens, from ``/workers``."""
    out = {p: {"ready": 0.0, "waiting": 0.0, "queued_tokens": 0.0} for p in pools}
    for w in workers:
        p = pool_of(w, colocated)
        if p not in out:
            continue
        load = w.get("load", {})
        out[p]["ready"] += 1
        out[p]["waiting"] += float(load.get("num_waiting", 0.0))
        out[p]["queued_tokens"] += float(load.get("queued_prefill_tokens", 0.0))
    return out


def observation(
    t_s: float,
    interval_s: float,
    before: GatewayCounters,
    after: GatewayCounters,
    pools: dict[str, dict[str, float]],
    starting: dict[str, int],
    half: GatewayCounters | None = None,
    half_s: float = 0.0,
) -> Observation:
    """The interval between two scrapes as the autoscaler takes it; ``half``: a scrape ``half_s``
    before ``after`` (the interval's half-way one), whose arrivals since are the recent rate."""
    arrivals = max(0, round(after.started - before.started))
    finished = after.finished - before.finished
    firsts = after.first_tokens - before.first_tokens
    ttft = histogram_quantile(0.9, before.ttft, after.ttft)
    itl = histogram_quantile(0.9, before.itl, after.itl)
    return Observation(
        t_s=t_s,
        arrivals=arrivals,
        input_len=(after.prompt_tokens - before.prompt_tokens) / firsts if firsts > 0 else 0.0,
        output_len=(after.generation_tokens - before.generation_tokens) / finished if finished > 0 else 0.0,
        pools={
            p: PoolObservation(
                int(v["ready"]), starting.get(p, 0), int(v["waiting"]), int(v["queued_tokens"])
            )
            for p, v in pools.items()
        },
        p90_ttft_ms=ttft * 1000.0 if ttft is not None else None,
        p90_tpot_ms=itl * 1000.0 if itl is not None else None,
        interval_s=interval_s,
        recent_arrivals=max(0, round(after.started - half.started)) if half is not None else None,
        recent_s=half_s if half is not None else 0.0,
    )


def http_get(api_key: str | None, timeout_s: float = 5.0) -> Callable[[str], str]:
    """``url -> body`` over HTTP, with the gateway's API key when one is set."""

    def get(url: str) -> str:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read().decode()

    return get


@dataclass(frozen=True)
class Scrape:
    t_s: float
    counters: GatewayCounters


class AutoscalerService:
    """Scrapes, decides and exports; ``step()`` is one scrape (a decision at an interval's end, or
    on a surge at its half), ``next_scrape_s()`` when the next is due, ``run(stop)`` the loop."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        gateway_url: str,
        get: Callable[[str], str],
        starting: Callable[[dict[str, dict[str, float]], float], dict[str, int]] | None = None,
    ) -> None:
        """``starting(pools, now)``: replicas starting per pool where the caller knows (``baton up``
        does); by default those asked for and not yet registered (``starting`` below)."""
        self.autoscaler = autoscaler
        self.count_starting = starting or self.starting
        self.gateway_url = gateway_url.rstrip("/")
        self.get = get
        self.registry = CollectorRegistry()
        self.desired = Gauge(
            "baton:desired_replicas",
            "Replicas the autoscaler wants in each pool (KEDA scales the pool's Deployment to it).",
            ["pool"],
            registry=self.registry,
        )
        self.last: Scrape | None = None
        """The scrape of the last decision (the interval's start), or the baseline."""
        self.half: Scrape | None = None
        """This interval's half-way scrape."""
        self.sized_for: float | None = None
        """Requests/s the last decision sized for: a half interval over it is a surge."""
        self.asked: dict[str, tuple[int, float]] = {}  # pool -> (desired, when it last rose)
        self.decisions: list[Decision] = []
        self.t0 = time.monotonic()

    def scrape(self) -> tuple[GatewayCounters, dict[str, dict[str, float]]]:
        counters = parse_gateway_metrics(self.get(f"{self.gateway_url}/metrics"))
        workers = json.loads(self.get(f"{self.gateway_url}/workers"))["workers"]
        a = self.autoscaler
        return counters, pools_from_workers(workers, a.pools, a.colocated)

    def starting(self, pools: dict[str, dict[str, float]], now: float) -> dict[str, int]:
        """Replicas asked for and not yet in the registry, within three cold starts of the ask."""
        horizon = 3 * self.autoscaler.config.cold_start_s
        return {
            p: max(0, want - int(pools[p]["ready"])) if now - since < horizon else 0
            for p, (want, since) in self.asked.items()
        }

    def next_scrape_s(self) -> float:
        """When the next scrape is due (service seconds): half an interval after the last decision,
        then a whole one."""
        if self.last is None:
            return 0.0
        interval = self.autoscaler.config.interval_s
        return self.last.t_s + (interval if self.half is not None else interval / 2)

    def step(self, now: float | None = None) -> Decision | None:
        """One scrape at ``now`` (seconds since the service started by default). The first is the
        counters' baseline (None). One within three quarters of an interval of the last decision is
        the half-way scrape: it decides only on a surge since that decision (a surge decision), else
        None. A later one decides on the interval since the last decision, its last half being the
        time since the half-way scrape."""
        now = time.monotonic() - self.t0 if now is None else now
        counters, pools = self.scrape()
        last, cfg = self.last, self.autoscaler.config
        if last is None:
            self.last = Scrape(now, counters)
            for p in self.autoscaler.pools:
                self.desired.labels(pool=p).set(max(1, int(pools[p]["ready"])))
            return None
        elapsed = now - last.t_s
        starting = self.count_starting(pools, now)
        if elapsed < 0.75 * cfg.interval_s:
            self.half = Scrape(now, counters)
            arrivals = max(0, round(counters.started - last.counters.started))
            if self.sized_for is None or not surged(arrivals, elapsed, self.sized_for, cfg.surge_sigmas):
                return None
            obs = observation(now, elapsed, last.counters, counters, pools, starting)
            return self._decide(dataclasses.replace(obs, surge=True), Scrape(now, counters))
        half = self.half
        obs = observation(
            now,
            elapsed,
            last.counters,
            counters,
            pools,
            starting,
            half.counters if half is not None else None,
            now - half.t_s if half is not None else 0.0,
        )
        return self._decide(obs, Scrape(now, counters))

    def _decide(self, obs: Observation, scrape: Scrape) -> Decision:
        """Decide on ``obs``, export and log it; the interval clock restarts at ``scrape``."""
        now = scrape.t_s
        d = self.autoscaler.decide(obs)
        self.last, self.half, self.sized_for = scrape, None, d.sizing_rate
        for p, n in d.desired.items():
            self.desired.labels(pool=p).set(n)
            prev = self.asked.get(p)
            if prev is None or n > prev[0]:
                self.asked[p] = (n, now)
            else:
                self.asked[p] = (n, prev[1])
        self.decisions.append(d)
        del self.decisions[:-100]
        log.info("%s", d)
        return d

    def run(self, stop: threading.Event) -> None:
        """Step at each half interval until ``stop``; a failed scrape is logged and retried half an
        interval later."""
        while not stop.is_set():
            wait = 0.0
            try:
                self.step()
            except (OSError, ValueError, KeyError) as e:
                log.warning("autoscaler: scrape or decision failed, keeping the last desired counts: %s", e)
                wait = self.autoscaler.config.interval_s / 2
            now = time.monotonic() - self.t0
            stop.wait(max(wait, self.next_scrape_s() - now))


# -- the command -----------------------------------------------------------------------------------
def add_autoscaler_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The decision's flags (``baton autoscaler``; ``baton up --autoscale`` shares them)."""
    p.add_argument(f"--{prefix}interval", type=float, default=10.0, help="seconds between decisions")
    p.add_argument(
        f"--{prefix}cold-start",
        type=float,
        default=30.0,
        help="seconds from asking for a worker to its serving",
    )
    p.add_argument(
        f"--{prefix}cooldown",
        type=float,
        default=60.0,
        help="seconds after a pool's change before it may scale down (or reverse on the forecast alone)",
    )
    for pool in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{prefix}min-{pool}", type=int, default=1, help=f"fewest {pool} replicas")
        p.add_argument(f"--{prefix}max-{pool}", type=int, default=8, help=f"most {pool} replicas")


def autoscale_config(a: argparse.Namespace, prefix: str = "") -> AutoscaleConfig:
    v = vars(a)
    key = prefix.replace("-", "_")
    bounds = {
        pool: (v[f"{key}min_{pool}"], v[f"{key}max_{pool}"]) for pool in ("prefill", "decode", "colocated")
    }
    for pool, (lo, hi) in bounds.items():
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"{pool}: the bounds need 0 <= min <= max and max >= 1, got {lo}..{hi}")
    if v[f"{key}interval"] <= 0 or v[f"{key}cold_start"] < 0 or v[f"{key}cooldown"] < 0:
        raise ValueError("the interval must be positive, the cold start and cooldown not negative")
    return AutoscaleConfig(
        interval_s=v[f"{key}interval"],
        cold_start_s=v[f"{key}cold_start"],
        cooldown_s=v[f"{key}cooldown"],
        bounds=bounds,
    )


def add_autoscaler_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "autoscaler",
        help="decide each pool's replicas from the gateway's metrics; export baton:desired_replicas",
        description="Reads the gateway's /metrics and /workers each interval, decides each pool's "
        "replicas (planner/autoscale.py) and serves baton:desired_replicas{pool} on --port for KEDA.",
    )
    p.add_argument("--profile", required=True, help="a profile JSON written by `baton profile`")
    p.add_argument("--slo", nargs="+", required=True, metavar="ttft:MS|tpot:MS", help="e.g. ttft:500 tpot:50")
    p.add_argument("--gateway-url", required=True, help="e.g. http://baton-gateway:8000")
    p.add_argument("--host", default="0.0.0.0", help="address of the /metrics server")
    p.add_argument("--port", type=int, default=9400, help="port of the /metrics server")
    p.add_argument("--colocated", action="store_true", help="one pool of workers that prefill and decode")
    add_autoscaler_args(p)
    p.set_defaults(func=run_autoscaler)
    return p


def load_inputs(profile_path: str, slo_items: list[str]) -> tuple[Profile, SLO]:
    slo = parse_slo(slo_items)
    if math.isinf(slo.ttft_ms) and math.isinf(slo.tpot_ms):
        raise ValueError("--slo needs ttft:MS, tpot:MS or both")
    return Profile.load(profile_path), slo


def run_autoscaler(a: argparse.Namespace) -> int:
    from baton.common.metrics import serve_metrics

    try:
        profile, slo = load_inputs(a.profile, a.slo)
        cfg = autoscale_config(a)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: baton autoscaler: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    key = next(iter(api_keys()), None)
    service = AutoscalerService(Autoscaler(profile, slo, a.colocated, cfg), a.gateway_url, http_get(key))
    server, _ = serve_metrics(a.port, a.host, service.registry)
    print(f"Autoscaler metrics: http://{a.host}:{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service.run(stop)
    finally:
        server.shutdown()
    return 0
