"""``python -m baton.cli``: the ``baton`` command with this interpreter (how ``baton up`` starts
its services)."""

import sys

from baton.cli.main import main

sys.exit(main())
