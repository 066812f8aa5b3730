"""Signals as exceptions: SIGTERM and SIGHUP unwind like Ctrl-C, so every command stops the
processes it started."""

from __future__ import annotations

import signal
import threading

__all__ = ["Terminated", "install_signal_handlers", "signal_cause"]


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


def signal_cause(exc: BaseException) -> BaseException | None:
    """The Terminated or KeyboardInterrupt an exception was raised while handling, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (Terminated, KeyboardInterrupt)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
