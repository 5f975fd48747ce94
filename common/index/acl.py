"""Redis ACL users, one per role: each service may run only the commands its own code sends, on
Baton's keys only.

The gateway faces clients: a leak of its credentials must not let anyone write the registry (route
prompts to a worker of their own) or the prefix index. Its user reads. Prefill and decode workers
write their own records, the prefix index, and (decode) the block locations; none may run
``FLUSHALL``, ``CONFIG``, ``KEYS``, ``MONITOR`` or ``DEBUG``, nor touch a key outside ``baton:*``.
The ``default`` user stays the operator's (``requirepass``: probes, ``redis-cli``, ``baton up``
itself). Worker records are signed besides (``record_mac``): a user that may write is still not
trusted for that alone.

The command lists are what ``common/index`` sends (``registry``, ``prefix_index``, ``locations``,
their Lua scripts: Redis checks a script's calls against the caller's user too) and what redis-py
sends on connecting; ``tests/index/test_redis_acl.py`` runs each role's real code under its user
and finds no denial in ``ACL LOG``.

Pure: no redis, no torch. Works on Redis 6.0 and later (``~pattern``; ``%R~`` would need 7.0).
"""

from __future__ import annotations

import hashlib

from baton.common.index import keys

ROLES = ("gateway", "prefill", "decode")
KEY_PATTERN = f"~{keys.ROOT}:*"

# What redis-py sends on connecting (AUTH, HELLO, SELECT for a database other than 0; ``client.connect``
# sends no CLIENT SETINFO) and PING for health.
_CONNECTION = ("auth", "hello", "ping", "echo", "select", "client|setname", "client|getname")
_REGISTRY_READ = ("scan", "get", "mget", "exists", "pttl")
_REGISTRY_WRITE = ("multi", "exec", "discard", "set", "del", "unlink", "pexpire")
_PREFIX_READ = ("smembers", "zcard")
# The prefix index's own writes and its Lua bound (``_TRIM``, ``_REMOVE``).
_PREFIX_WRITE = (
    "sadd", "srem", "zadd", "zrange", "zrem", "zremrangebyrank", "zremrangebyscore", "eval", "evalsha",
)  # fmt: skip
_LOCATIONS = ("hset", "hgetall", "hdel")

COMMANDS: dict[str, tuple[str, ...]] = {
    "gateway": (*_CONNECTION, *_REGISTRY_READ, *_PREFIX_READ),
    "prefill": (*_CONNECTION, *_REGISTRY_READ, *_REGISTRY_WRITE, *_PREFIX_READ, *_PREFIX_WRITE),
    "decode": (*_CONNECTION, *_REGISTRY_READ, *_REGISTRY_WRITE, *_PREFIX_READ, *_PREFIX_WRITE, *_LOCATIONS),
}


def username(role: str) -> str:
    """The Redis user of ``role``."""
    if role not in COMMANDS:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    return f"baton-{role}"


def rule(role: str, password: str) -> str:
    """``role``'s ACL rule as ``ACL SETUSER`` takes it after the user name (and a redis.conf
    ``user`` line does): on, this password only (as its SHA-256: the file holds no password),
    Baton's keys only, no channels, only the role's commands."""
    if not password:
        raise ValueError("a Redis ACL user needs a password")
    username(role)  # a ValueError for an unknown role
    digest = hashlib.sha256(password.encode()).hexdigest()
    allowed = " ".join(f"+{c}" for c in COMMANDS[role])
    return f"reset on #{digest} resetkeys {KEY_PATTERN} resetchannels -@all {allowed}"


def conf_lines(passwords: dict[str, str]) -> str:
    """redis.conf ``user`` lines for each role in ``passwords`` (role -> password)."""
    return "".join(f"user {username(role)} {rule(role, pw)}\n" for role, pw in sorted(passwords.items()))
