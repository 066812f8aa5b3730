"""The ``synctune`` click group: every error one line on stderr with the status it means."""

from __future__ import annotations

import errno
import os
import signal
import sys

import click

from .. import __version__
from ..spec.errors import InfraError, SpecError
from . import _common
from ._signals import Terminated, install_signal_handlers, signal_cause

__all__ = ["cli"]


#: Longest word of an error line shown whole; a longer one (a user's 100 KB name) is cut.
_LONGEST_WORD = 200


def _one_line(text: str) -> str:
    """``text`` on one line, each word longer than :data:`_LONGEST_WORD` characters cut short."""
    return " ".join(w if len(w) <= _LONGEST_WORD else f"{w[:_LONGEST_WORD // 2]}...({len(w)} characters)"
                    for w in str(text).split())


def _stop_ray() -> None:
    """Shut down the Ray this command started or joined, if any, before its last line.

    Left to Ray's exit hook, the shutdown would print after the command's final line (errors
    of object references that a cancelled search never read, e.g. "The actor is dead because
    it was killed by `ray.kill`"), so "one line on stderr, last" would not hold."""
    ray = sys.modules.get("ray")
    if ray is None or not _common.RAY_STARTED_HERE:
        return  # a Ray the caller started (a test, a notebook) is the caller's to stop
    _common.RAY_STARTED_HERE = False
    try:
        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the command's own outcome is what gets reported
        pass


def _absolute_homes() -> None:
    """Make the data folders named by the environment absolute, as the command starts: a user's
    workload imported in this process may change the current folder (``os.chdir``), and the data
    home must stay the one the command was started with."""
    for name in ("SYNCTUNE_HOME", "XDG_DATA_HOME"):
        value = os.environ.get(name)
        if value and not os.path.isabs(value):
            try:
                os.environ[name] = os.path.abspath(value)
            except (OSError, ValueError):  # a folder gone, a NUL byte: the data home says so, in one line
                pass


class _Group(click.Group):
    """A click group whose every error is one line on stderr with the status it means."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _absolute_homes()
        handlers = install_signal_handlers()
        try:
            code = self._run(args, prog_name, complete_var, **extra)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if standalone_mode:
            sys.exit(code)
        return code

    def _run(self, args, prog_name, complete_var, **extra) -> int:
        def fail(message: str, code: int) -> int:
            _stop_ray()
            click.echo(f"synctune: {message}", err=True)
            return code

        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
            _stop_ray()
            return rv if isinstance(rv, int) else 0
        except click.UsageError as exc:
            return fail(f"error: {_one_line(exc.format_message())} (synctune --help)", 2)
        except click.ClickException as exc:
            return fail(f"error: {_one_line(exc.format_message())}", exc.exit_code)
        except SpecError as exc:
            return fail(f"error: {_one_line(exc)}", 2)
        except InfraError as exc:
            return fail(f"error: {_one_line(exc)}", 1)
        except (click.Abort, KeyboardInterrupt):
            return fail("interrupted", 130)
        except Terminated as exc:
            return fail(str(exc), 128 + exc.signum)
        except BrokenPipeError:
            return 1
        except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen environment: still one line
            if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
                # a name the user gave that no check reached before the file system: still the user's
                return fail(f"error: {_one_line(os.fsdecode(exc.filename or ''))}: {exc.strerror}", 2)
            if isinstance(exc, ValueError) and str(exc) == "embedded null byte":  # os's refusal of a name
                return fail("error: a name or path given holds a NUL byte, which no file name can", 2)
            cause = signal_cause(exc)
            if cause is not None:  # a signal that surfaced inside C code (Ray's) comes wrapped
                return fail(str(cause), 128 + cause.signum) if isinstance(cause, Terminated) else fail(
                    "interrupted", 130)
            if os.environ.get("SYNCTUNE_DEBUG"):
                raise
            return fail(f"error: unexpected {type(exc).__name__}: {_one_line(exc)[:500]} "
                        f"(SYNCTUNE_DEBUG=1 shows the traceback)", 1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="synctune")
def cli() -> None:
    """Find the fastest way to synchronize a data-parallel training job on a cluster.

    Strategies decide, variable by variable, how gradients travel (parameter server or
    all-reduce, placement, partitioning, merge groups, compression). Start with the README's
    first search, `synctune search experiments/quickstart.yaml`, then browse it with
    `synctune ui`; your own model: `synctune models -w my_job.py:workload`. Documentation:
    README.md and docs/ (a MkDocs site: `mkdocs serve`).
    """
