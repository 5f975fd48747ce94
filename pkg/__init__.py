"""Baton: LLM serving with disaggregated prefill and decode.

The distribution maps the repository's folders to ``baton.common``, ``baton.kernels``,
``baton.services``, ``baton.protos`` and ``baton.bench``. Importing ``baton`` imports nothing heavy.
"""

__version__ = "0.1.0"
