"""How Baton starts its own processes (workers, ranks, replicas): ``python -m`` with this interpreter.

``python -m`` puts the current directory first on ``sys.path``. Run from a checkout of this
repository, whose top-level folders are the ``baton.*`` packages (``kernels/`` is
``baton.kernels``), that folder would shadow Hugging Face's ``kernels`` package, which transformers
>= 5.25 requires and imports when it loads a model or a tokenizer class. ``-P`` (Python 3.11+)
keeps the current directory off the path; Baton itself is imported from where it is installed.
"""

from __future__ import annotations

import sys


def python_module(module: str) -> list[str]:
    """The argv prefix that runs ``module`` as ``python -m`` would, minus the current directory."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", module]
