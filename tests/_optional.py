"""The one rule for optional parts of the test environment (Horovod and its bindings, TensorFlow,
Chromium, a CUDA build of torch on a GPU machine): where one is missing or broken, its tests
skip with the reason on a developer's machine, and FAIL with the reason under CI (``CI=true``),
where ``.ci/run`` installs every one of them, so a broken install is never reported as a pass.

Three forms of the same rule: :func:`require_optional` inside a test, :func:`optional_mark`
for a whole module (``pytestmark``; conftest applies it when each test is set up, so a missing
part under CI fails each test rather than stopping collection), and :func:`optional_present`
where a test runs an optional part only when it is there."""

from __future__ import annotations

import os

import pytest

#: The pytest mark :func:`optional_mark` makes; tests/conftest.py acts on it at setup.
MARK = "requires_optional"


def under_ci() -> bool:
    """True where the environment says CI (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_optional(name: str, reason: str | None) -> None:
    """Nothing when ``reason`` is None (``name`` is usable here); else skip with the reason, or
    under CI fail with it."""
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"{name} is required under CI (.ci/run installs it) but is unusable: {reason}", pytrace=False)
    pytest.skip(f"{name}: {reason}")


def optional_present(name: str, reason: str | None) -> bool:
    """True when ``name`` is usable (``reason`` is None); False where it is not, outside CI; under
    CI a missing one fails the test (:func:`require_optional`)."""
    if reason is None:
        return True
    if under_ci():
        require_optional(name, reason)
    return False


def optional_mark(name: str, reason: str | None) -> pytest.MarkDecorator:
    """A mark for ``pytestmark``: every test of the module calls ``require_optional(name, reason)``
    when it is set up."""
    return getattr(pytest.mark, MARK)(name, reason)
