"""The ``synctune`` command line: wiring only (DESIGN.md "cli").

Heavy libraries (torch, ray, mlflow) are imported inside the commands that need them, so
``synctune --help`` answers at once. Every failure ends with one line on stderr,
``synctune: error: ...``, never a traceback: status 2 when the user's input is wrong (a file,
a key, an option, a usage error), status 1 when the environment failed (a slice that never came
up, a lab command, an unreachable store). SIGTERM and SIGHUP unwind like Ctrl-C, so every
command stops the processes it started (status 128 + signal number).
"""

from __future__ import annotations

import sys

from ._group import cli
from ._signals import Terminated, install_signal_handlers

__all__ = ["main", "cli", "Terminated", "install_signal_handlers"]

# Sub-command groups register themselves on import.
from . import _apply, _cluster, _data, _lab, _report, _search, _sim, _specs, _strategy, _trial  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``synctune`` console script; returns the exit status."""
    try:
        return cli.main(args=argv, prog_name="synctune", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
