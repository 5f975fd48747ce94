"""The one way Baton builds a Redis client: every call bounded in time.

redis-py's defaults suit a cache that must not miss, not a registry that serving must outlive: a
5 s socket timeout and ten retries with backoff (redis-py 8), so one call to a Redis that accepts
connections but answers nothing (a stopped or partitioned server) sits for about a minute. Baton's
Redis holds hints (who is alive, who caches what) that serving can do without for a while, so a
call fails fast instead and the caller carries on with what it knew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RedisClientConfig:
    """Time bounds of every Redis call.

    The defaults: a Redis next to its workers answers in well under a millisecond, so half a
    second is hundreds of times a normal reply and still short against what waits on it: a
    heartbeat (every ``ttl / 3`` = 2 s by default) that takes at most ``(1 + retries) x 0.5 s`` never
    runs into the next one, and a worker stays registered through a slow patch. One retry covers
    the common harmless failure: a pooled connection that a restarted Redis closed.
    """

    socket_timeout_s: float = 0.5
    """Bound on waiting for one reply (a black-holed Redis: connections open, nothing answers)."""
    connect_timeout_s: float = 0.5
    """Bound on opening a connection (a Redis that is down and whose host drops packets)."""
    retries: int = 1
    """Retries of a call that failed on a connection error or timeout, without backoff."""

    def __post_init__(self) -> None:
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("Redis timeouts must be positive")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    @property
    def worst_case_s(self) -> float:
        """The longest one call can take against a black-holed Redis."""
        return (1 + self.retries) * (self.connect_timeout_s + self.socket_timeout_s)


def connect(url: str, config: RedisClientConfig | None = None, **kwargs: Any) -> Any:
    """A ``redis.Redis`` for ``url`` whose every call is bounded by ``config`` (nothing connects
    until the first call). ``kwargs`` go to ``redis.Redis.from_url`` (e.g. ``decode_responses``)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.maint_notifications import MaintNotificationsConfig
    from redis.retry import Retry

    cfg = config or RedisClientConfig()
    return redis.Redis.from_url(
        url,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        retry=Retry(NoBackoff(), cfg.retries),
        # No CLIENT command on connecting (SETINFO, MAINT_NOTIFICATIONS: a cloud Redis's failover
        # hints): a role's ACL user (``acl.py``) may not run CLIENT, and each refusal would fill
        # ACL LOG, where an operator looks for real denials.
        driver_info=None,
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
        **kwargs,
    )
