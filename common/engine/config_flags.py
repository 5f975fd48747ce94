"""``EngineConfig``'s command line, generated from its fields (each one's ``Flag``), torch-free:
the flags of every engine command, the config's fields from the parsed flags, and the command line
that hands a config on to a child worker (``baton up``'s). An option is declared once, on its field.

The parsed namespace holds each option under its field's name (``--no-prefix-caching`` sets
``enable_prefix_caching`` False), so that a namespace and a config read alike."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import MISSING, Field, fields

from baton.common.engine.config import EngineConfig, Flag, flag_of

_TYPES: dict[str, Callable[[str], object]] = {"int": int, "float": float, "str": str}


def _options() -> list[tuple[Field, Flag]]:
    """The fields that are command-line options, in declaration order."""
    return [(f, spec) for f in fields(EngineConfig) if (spec := flag_of(f)) is not None]


def _default(f: Field):
    return getattr(EngineConfig, f.name) if f.default is MISSING else f.default


def _add(p: argparse.ArgumentParser, f: Field, spec: Flag, default) -> None:
    names = [spec.flag(f.name), *spec.aliases]
    help_ = spec.help.format(default=default) if spec.help else None
    if isinstance(default, bool):  # a switch: --no-x turns an on-by-default one off
        action = "store_false" if spec.negated else "store_true"
        p.add_argument(*names, dest=f.name, action=action, default=default, help=help_)
        return
    kind = _TYPES[str(f.type).split(" |")[0]]
    choices = list(spec.choices) if spec.choices else None
    p.add_argument(
        *names, dest=f.name, type=kind, default=default, choices=choices, metavar=spec.metavar, help=help_
    )


def add_engine_args(p: argparse.ArgumentParser, **defaults) -> None:
    """Every engine command's flags on ``p``; ``defaults`` overrides a field's default for this
    command (``baton up`` and the workers: ``dtype="auto"``)."""
    for f, spec in _options():
        if spec.engine_group:
            _add(p, f, spec, defaults.get(f.name, _default(f)))


def add_emulate_arg(p: argparse.ArgumentParser) -> None:
    """``--emulate PROFILE`` (``EngineConfig.emulate``): the workers' and ``baton up``'s."""
    f = next(f for f in fields(EngineConfig) if f.name == "emulate")
    _add(p, f, flag_of(f), None)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields of a parsed command line (those of its options it declares)."""
    return {f.name: getattr(a, f.name) for f, spec in _options() if spec.engine_group or hasattr(a, f.name)}


def engine_flags(source) -> list[str]:
    """The options of ``source`` (an ``EngineConfig``, or a namespace of parsed flags) as the command
    line of a worker process that is to run the same engine: each that differs from the worker's
    default, but those ``baton up`` resolves first (``Flag.to_children``, the dtype) and those that
    mean nothing alone (``Flag.only_with``); files absolute."""
    flags: list[str] = []
    for f, spec in _options():
        value = getattr(source, f.name, None) if not spec.engine_group else getattr(source, f.name)
        if not spec.to_children or value == _default(f):
            continue
        if spec.only_with and not getattr(source, spec.only_with):
            continue
        if isinstance(value, bool):  # differs from the default: the switch is given
            flags.append(spec.flag(f.name))
        else:
            flags += [spec.flag(f.name), os.path.abspath(str(value)) if spec.path else str(value)]
    return flags
