"""Bounded waits and process checks for the index tests."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, step_s: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a reaped child no longer does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
