"""How the tests start the long-lived processes they own (clusters, workers, pods)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up once, in the parent: a dlopen in the child between fork and exec can hang for good
# where another thread of the parent held the loader's lock at the fork (gRPC's threads here).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """A ``preexec_fn`` (it runs in the child between fork and exec): on Linux the child gets
    SIGTERM when its parent dies, so a killed pytest(-xdist) worker leaves no cluster spinning.

    The signal fires when the parent *thread* that forked the child ends, not only the process:
    start the child from a thread that outlives it (the tests start theirs from the main thread).
    Elsewhere than Linux it does nothing."""
    if _PRCTL is not None:
        if _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))  # Popen raises it in the parent
