"""The Redis side of Baton: worker registry, prefix index, block locations, embedded server.

Import the submodules directly; this package ``__init__`` imports nothing, so that
``baton.common.index.keys`` stays importable without redis (or torch) installed.
"""
