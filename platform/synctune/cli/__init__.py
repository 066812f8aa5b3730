"""The ``synctune`` command line: wiring only (DESIGN.md "cli").

Heavy libraries (torch, ray, mlflow) are imported inside the commands that need them, so
``synctune --help`` answers at once. Every failure ends with one line on stderr,
``synctune: error: ...``, never a traceback: status 2 when the user's input is wrong (a file,
a key, an option, a usage error), status 1 when the environment failed (a slice that never came
up, a lab command, an unreachable store). SIGTERM and SIGHUP unwind like Ctrl-C, so every
command stops the processes it started (status 128 + signal number).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

from .. import __version__
from ..spec.errors import InfraError, SpecError

__all__ = ["main", "cli"]


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM or SIGHUP, so cleanup code runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum, _frame) -> None:
    raise Terminated(signum)


def install_signal_handlers() -> dict:
    """Make SIGTERM and SIGHUP raise :class:`Terminated` in the main thread; returns the handlers
    they replace (empty off the main thread, where Python cannot install any)."""
    replaced = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            replaced[sig] = signal.signal(sig, _raise_terminated)
    return replaced


def _signal_cause(exc: BaseException) -> BaseException | None:
    """The Terminated or KeyboardInterrupt an exception was raised while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (Terminated, KeyboardInterrupt)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _stop_ray() -> None:
    """Shut down the Ray this command started or joined, if any, before its last line.

    Left to Ray's exit hook, the shutdown would print after the command's final line (errors
    of object references that a cancelled search never read, e.g. "The actor is dead because
    it was killed by `ray.kill`"), so "one line on stderr, last" would not hold."""
    from . import _common

    ray = sys.modules.get("ray")
    if ray is None or not _common.RAY_STARTED_HERE:
        return  # a Ray the caller started (a test, a notebook) is the caller's to stop
    _common.RAY_STARTED_HERE = False
    try:
        if ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - the command's own outcome is what gets reported
        pass


class _Group(click.Group):
    """A click group whose every error is one line on stderr with the status it means."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
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
            cause = _signal_cause(exc)
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
    all-reduce, placement, partitioning, merge groups, compression). Start with
    `synctune models`, `synctune clusters` and `synctune strategy build`.
    """


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
