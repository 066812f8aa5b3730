"""The two error types every layer raises for problems a user must act on.

The CLI prints either as one line, ``synctune: error: ...``: :class:`SpecError` (the user's
input is wrong: a file, a key, an option) exits with status 2; :class:`InfraError` (the
environment failed: a slice that never came up, a lab command that failed, an unreachable
store) exits with status 1.
"""

__all__ = ["SpecError", "InfraError"]


class SpecError(ValueError):
    """Bad input: a message that names the file, key or variable, expected and actual value.

    The CLI prints ``str(error)`` as one line and exits with status 2.
    """


class InfraError(RuntimeError):
    """An infrastructure failure (not the user's input): the message says what failed and
    what to check. The CLI prints ``str(error)`` as one line and exits with status 1."""
