"""Redis credentials: where a service finds its password, and how it rides in the Redis URL.

A service gets the password as a value (``BATON_REDIS_PASSWORD``) or as a file whose stripped
content it is (``--redis-password-file`` / ``BATON_REDIS_PASSWORD_FILE``: a mounted secret), and
an optional ACL user (``--redis-username`` / ``BATON_REDIS_USERNAME``, Redis 6+). The command line
(``services/cli_args.py``) reads them once at start-up and puts them into the URL that every client of
the process is built from (``client.connect``), so nothing below the command line knows where
they came from. A password already inside ``--redis-url`` (``redis://user:pw@host``) wins.

Pure: no redis, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from baton.env import REDIS_PASSWORD, REDIS_USERNAME

PASSWORD_ENV = REDIS_PASSWORD.name
PASSWORD_FILE_ENV = REDIS_PASSWORD.file
USERNAME_ENV = REDIS_USERNAME.name


def read_secret(name: str, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The secret called ``name`` (an environment variable): the stripped content of the file at
    ``path`` (a flag), else of the file named by ``<name>_FILE``, else the value of ``<name>``;
    None when none is set. ValueError for a file that cannot be read or is empty."""
    path = path or environ.get(f"{name}_FILE") or None
    if path is None:
        return environ.get(name) or None
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read the secret file {path}: {e.strerror}") from None
    if not value:
        raise ValueError(f"the secret file {path} is empty")
    return value


def with_credentials(url: str, username: str | None, password: str | None) -> str:
    """``url`` with ``username`` and ``password`` in it (quoted), unless it has a password of its
    own, which wins (its user too); ``url`` unchanged when there is no password to add."""
    parts = urlsplit(url)
    if not password or parts.password is not None:
        return url
    user = quote(username or parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``(url without its user and password, username, password)``: what ``baton up`` passes on a
    command line (which ``ps`` shows) and what it passes in the environment instead."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    host = parts.netloc.rpartition("@")[2]
    bare = urlunsplit(parts._replace(netloc=host))
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return bare, username, password
