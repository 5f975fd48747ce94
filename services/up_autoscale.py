"""``baton up --autoscale``: the autoscaler (``planner/autoscale.py``, read as
``services/autoscaler.py`` reads it) inside ``baton up``, starting and retiring real workers.

Each interval it scrapes the gateway, decides, and moves each pool to its desired count (at each
half interval it scrapes too, and decides at once on a surge: ``services/autoscaler.py``): a worker
is added with the pool's own command line (the first worker's, unpinned) under the next free name
(``decode-2``, ...); a worker removed is the pool's newest, retired with one SIGTERM
(``Supervisor.retire``): it leaves the registry at once, finishes the streams it holds within the
drain timeout, exits, and is not restarted. Workers started and not yet in the registry are the
decision's ``starting`` replicas, exactly.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from baton.planner.autoscale import AutoscaleConfig, Autoscaler, Decision
from baton.planner.profile import Profile
from baton.planner.sim_result import SLO
from baton.services.autoscaler import (
    AutoscalerService,
    add_autoscaler_args,
    autoscale_config,
    http_get,
    load_inputs,
)
from baton.services.procs import Supervisor

log = logging.getLogger("baton.autoscaler")


@dataclass(frozen=True)
class UpAutoscale:
    """What ``baton up --autoscale`` decides with."""

    profile: Profile
    slo: SLO
    config: AutoscaleConfig


def add_up_autoscale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="add and retire workers each interval from the gateway's metrics (needs --profile and --slo)",
    )
    p.add_argument("--profile", default=None, help="with --autoscale: a `baton profile` JSON")
    p.add_argument("--slo", nargs="+", default=None, metavar="ttft:MS|tpot:MS", help="with --autoscale")
    add_autoscaler_args(p, prefix="autoscale-")


def up_autoscale_from_args(a: argparse.Namespace) -> UpAutoscale | None:
    """None without ``--autoscale``; raises ``ValueError`` (or ``OSError``) on what cannot run."""
    if not a.autoscale:
        if a.profile or a.slo:
            raise ValueError("--profile and --slo go with --autoscale")
        return None
    if not (a.profile and a.slo):
        raise ValueError("--autoscale needs --profile P.json and --slo ttft:MS tpot:MS")
    profile, slo = load_inputs(a.profile, a.slo)
    return UpAutoscale(profile, slo, autoscale_config(a, prefix="autoscale-"))


class WorkerPool:
    """One pool's workers in the supervisor: ``role-i`` children started from one command line."""

    def __init__(
        self, group: Supervisor, role: str, args: list[str], env: dict, log_path: Callable[[str], str | None]
    ) -> None:
        self.group, self.role, self.args, self.env, self.log_path = group, role, args, env, log_path
        self.next_index = 1 + max((self._index(n) for n, _ in group.procs if self._index(n) >= 0), default=-1)

    def _index(self, name: str) -> int:
        head, _, tail = name.rpartition("-")
        return int(tail) if head == self.role and tail.isdigit() else -1

    def serving(self) -> list[str]:
        """The pool's children, not retiring, oldest first."""
        retiring = set(self.group.retiring())
        names = [n for n, _ in self.group.procs if self._index(n) >= 0 and n not in retiring]
        return sorted(names, key=self._index)

    def add(self) -> str:
        name = f"{self.role}-{self.next_index}"
        self.next_index += 1
        self.group.spawn(name, self.args, env=self.env, log_path=self.log_path(name))
        return name

    def retire(self, drain_timeout_s: float) -> str:
        name = self.serving()[-1]
        self.group.retire(name, drain_timeout_s)
        return name


class UpAutoscaler:
    """Called from ``baton up``'s supervision loop (``tick``); one decision per interval, and one
    on a surge at a half interval."""

    def __init__(
        self,
        setup: UpAutoscale,
        base_url: str,
        api_key: str | None,
        pools: dict[str, WorkerPool],
        colocated: bool,
        drain_timeout_s: float,
    ) -> None:
        self.pools, self.drain_timeout_s = pools, drain_timeout_s
        autoscaler = Autoscaler(setup.profile, setup.slo, colocated, setup.config)
        missing = [p for p in autoscaler.pools if p not in pools]
        if missing:
            raise ValueError(f"--autoscale needs at least one {' and one '.join(missing)} worker to copy")
        self.service = AutoscalerService(autoscaler, base_url, http_get(api_key), starting=self.starting)
        self.interval_s = setup.config.interval_s
        self.next_at = time.monotonic()

    def starting(self, registered: dict[str, dict[str, float]], now: float) -> dict[str, int]:
        return {p: max(0, len(wp.serving()) - int(registered[p]["ready"])) for p, wp in self.pools.items()}

    def tick(self) -> Decision | None:
        now = time.monotonic()
        if now < self.next_at:
            return None
        try:
            decision = self.service.step()
        except (OSError, ValueError, KeyError) as e:
            log.warning("autoscale: could not read the gateway, nothing changed: %s", e)
            self.next_at = now + self.interval_s / 2
            return None
        self.next_at = self.service.t0 + self.service.next_scrape_s()
        if decision is not None:
            self.apply(decision)
        return decision

    def apply(self, decision: Decision) -> None:
        for pool, want in decision.desired.items():
            wp = self.pools[pool]
            have = len(wp.serving())
            for _ in range(want - have):
                log.info("autoscale: started %s", wp.add())
            for _ in range(have - want):
                log.info("autoscale: retiring %s (draining)", wp.retire(self.drain_timeout_s))
