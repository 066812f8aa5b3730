"""``python -m synctune``: the same as the ``synctune`` command.

``python -m`` puts the current folder first on ``sys.path``; a user's ``tokenize.py`` or
``queue.py`` there would then be imported instead of Python's by whatever synctune or torch
imports next. The ``synctune`` script has no such entry; here it is dropped before anything
else is imported (a workload in that folder is still found: it is imported by its location),
unless synctune itself was found there (run from its source folder, not installed).
"""

import os
import sys

import synctune

if (sys.path and sys.path[0] in ("", os.getcwd())
        and os.path.dirname(os.path.dirname(os.path.abspath(synctune.__file__))) != os.path.abspath(sys.path[0])):
    del sys.path[0]

from synctune.cli import main  # noqa: E402

sys.exit(main())
