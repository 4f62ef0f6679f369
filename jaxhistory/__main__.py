"""``python -m jaxhistory``: the ``jaxhistory`` command."""

import sys

from jaxhistory.cli import main

sys.exit(main())
