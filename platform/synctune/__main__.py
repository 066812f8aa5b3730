"""``python -m synctune``: the same as the ``synctune`` command."""

import sys

from synctune.cli import main

sys.exit(main())
