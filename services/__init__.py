"""The processes around common/: the gateway, the workers, ``baton up`` and the autoscaler, each
with the subcommand that runs it (``register``), which the ``baton`` command (``baton.cli``) assembles."""
