"""`python -m uibus` is the `uibus` command."""

import sys

from uibus.clients.cli import main

sys.exit(main())
