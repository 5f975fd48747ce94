"""Baton: LLM serving with disaggregated prefill and decode.

The distribution maps the repository's folders to ``baton.common``, ``baton.kernels``,
``baton.services``, ``baton.planner``, ``baton.protos``, ``baton.bench`` and ``baton.cli`` (the
``baton`` command); ``baton.env`` declares every ``BATON_*`` environment variable. Importing
``baton`` imports nothing heavy.
"""

__version__ = "0.1.0"
