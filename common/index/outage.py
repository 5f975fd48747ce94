"""Logging for a dependency that can be away for a while (Redis): one line when it goes, a reminder
now and then while it stays away, one line when it is back. A call retried every beat or every
request would otherwise log the same traceback many times a second."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class OutageLog:
    """Tracks whether calls to ``what`` fail, and logs the changes rather than every failure.

    ``failed(error)`` and ``ok()`` are called after each attempt (from any thread). The first
    failure logs a warning; further failures log at most once per ``every_s``; the first success
    after failures logs how long it lasted. ``ok()`` returns True on that first success (the
    caller may have something to catch up on).
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._what = what
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_logged = 0.0
        self._failures = 0

    @property
    def down(self) -> bool:
        """Whether the latest attempt failed."""
        return self._down_since is not None

    @property
    def down_since(self) -> float | None:
        return self._down_since

    def failed(self, error: BaseException) -> None:
        now = self._clock()
        with self._lock:
            self._failures += 1
            if self._down_since is None:
                self._down_since = self._last_logged = now
                first = True
            elif now - self._last_logged >= self._every_s:
                self._last_logged = now
                first = False
            else:
                return
            failures, since = self._failures, now - self._down_since
        if first:
            self._log.warning(
                "%s unreachable: %s (retrying; logged again every %g s)", self._what, error, self._every_s
            )
        else:
            self._log.warning(
                "%s still unreachable after %.0f s (%d failures): %s", self._what, since, failures, error
            )

    def ok(self) -> bool:
        with self._lock:
            if self._down_since is None:
                return False
            since, failures = self._clock() - self._down_since, self._failures
            self._down_since, self._failures = None, 0
        self._log.warning("%s reachable again after %.1f s (%d failures)", self._what, since, failures)
        return True
