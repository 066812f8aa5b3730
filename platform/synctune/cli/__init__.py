"""The ``synctune`` command line: wiring only (DESIGN.md "cli").

Heavy libraries (torch, ray, mlflow) are imported inside the commands that need them, so
``synctune --help`` answers at once. Bad input of any kind ends with one line on stderr,
``synctune: error: ...``, and exit status 2.
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..spec.errors import SpecError

__all__ = ["main", "cli"]


class _Group(click.Group):
    """A click group that turns input errors into one line on stderr and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecError as exc:
            click.echo(f"synctune: error: {exc}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("synctune: interrupted", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="synctune")
def cli() -> None:
    """Find the fastest way to synchronize a data-parallel training job on a cluster.

    Strategies decide, variable by variable, how gradients travel (parameter server or
    all-reduce, placement, partitioning, merge groups, compression). Start with
    `synctune models`, `synctune clusters` and `synctune strategy build`.
    """


# Sub-command groups register themselves on import.
from . import _cluster, _data, _lab, _report, _search, _sim, _specs, _strategy, _trial  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``synctune`` console script; returns the exit status."""
    try:
        cli.main(args=argv, prog_name="synctune", standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
