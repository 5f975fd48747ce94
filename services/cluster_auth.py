"""The cluster's locks, as every service's flags: Redis's password and the registry's secret.

A Redis password, when given, authenticates every Redis client of a service (``--redis-url``'s own
password wins); a cluster secret signs the worker's registry record and makes the service ignore
records that are not signed with it (``common/index/record_mac.py``). Each comes as a value in the
environment or as a file (a mounted secret), never as a value on the command line, where ``ps``
shows it:

    BATON_REDIS_PASSWORD   or  --redis-password-file PATH  /  BATON_REDIS_PASSWORD_FILE
    BATON_REDIS_USERNAME   or  --redis-username NAME        (a Redis 6 ACL user)
    BATON_CLUSTER_SECRET   or  --cluster-secret-file PATH  /  BATON_CLUSTER_SECRET_FILE

``baton up`` makes both for the cluster it starts and hands them to its children in their
environment (``ClusterAuth.child_env``).
"""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from baton.common.index import auth
from baton.common.index.record_mac import SECRET_ENV
from baton.env import CLUSTER_SECRET, REDIS_PASSWORD, REDIS_USERNAME


@dataclass(frozen=True)
class ClusterAuth:
    """What a service authenticates with; the secrets never show in a ``repr``."""

    redis_username: str | None = None
    """Redis 6 ACL user; None: the default user."""
    redis_password: str | None = field(default=None, repr=False)
    """Redis's password; None: none is sent (unless the URL has one)."""
    cluster_secret: str | None = field(default=None, repr=False)
    """Signs and checks registry records; None: records are neither signed nor checked."""

    @property
    def secret(self) -> bytes | None:
        """The cluster secret as the registry takes it."""
        return self.cluster_secret.encode() if self.cluster_secret else None

    def url(self, redis_url: str) -> str:
        """``redis_url`` with the credentials in it (for this process's clients only)."""
        return auth.with_credentials(redis_url, self.redis_username, self.redis_password)

    def as_user(self, username: str, password: str) -> ClusterAuth:
        """A copy that authenticates to Redis as ``username`` (a role's ACL user, ``acl.py``)."""
        return replace(self, redis_username=username, redis_password=password)

    def with_generated(self) -> ClusterAuth:
        """A copy where a missing Redis password or cluster secret is a fresh random one."""
        return replace(
            self,
            redis_password=self.redis_password or secrets.token_urlsafe(32),
            cluster_secret=self.cluster_secret or secrets.token_urlsafe(32),
        )

    def child_env(self) -> dict[str, str]:
        """The environment that gives a child service these credentials (and clears the ``_FILE``
        variables it may inherit, which would win over the values)."""
        return {
            auth.USERNAME_ENV: self.redis_username or "",
            auth.PASSWORD_ENV: self.redis_password or "",
            auth.PASSWORD_FILE_ENV: "",
            SECRET_ENV: self.cluster_secret or "",
            CLUSTER_SECRET.file: "",
        }


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags (``baton gateway|prefill|decode|up``)."""
    p.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help=f"Redis's password is this file's content (or {REDIS_PASSWORD.file}, or the value in "
        f"{REDIS_PASSWORD.name}); a password inside --redis-url wins",
    )
    p.add_argument(
        "--redis-username",
        default=None,
        help=f"a Redis 6 ACL user to authenticate as ({REDIS_USERNAME.name})",
    )
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="PATH",
        help="sign this service's registry records with the secret in this file and trust no record "
        f"without it (or {CLUSTER_SECRET.file}, or the value in {CLUSTER_SECRET.name})",
    )


def from_args(a: argparse.Namespace, environ: Mapping[str, str]) -> ClusterAuth:
    """The credentials of ``a``'s flags and ``environ``; ValueError for an unreadable file."""
    return ClusterAuth(
        redis_username=a.redis_username or environ.get(auth.USERNAME_ENV) or None,
        redis_password=auth.read_secret(auth.PASSWORD_ENV, a.redis_password_file, environ),
        cluster_secret=auth.read_secret(SECRET_ENV, a.cluster_secret_file, environ),
    )
