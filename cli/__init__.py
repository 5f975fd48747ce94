"""The ``baton`` command (``baton.cli.main``): the top floor, above services, bench and planner. It
only assembles the subcommands each of them registers; nothing below imports it."""
