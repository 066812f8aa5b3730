"""The one error type of user-facing input problems (specs, strategies, files)."""

__all__ = ["SpecError"]


class SpecError(ValueError):
    """Bad input: a message that names the file, key or variable, expected and actual value.

    The CLI prints ``str(error)`` as one line and exits with status 2.
    """
