"""``python -m millpond.cli``: the ``millpond`` command."""

import sys

from millpond.cli.main import main

sys.exit(main())
