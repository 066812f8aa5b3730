"""The strategy layer's error and its one-line field check."""

from __future__ import annotations

from typing import Any

from ..spec.checks import require
from ..spec.errors import SpecError

__all__ = ["StrategyError", "req"]


class StrategyError(SpecError):
    """A strategy that is malformed or inconsistent with its model/cluster spec."""


def req(cond: bool, where: str, expected: str, actual: Any) -> None:
    """Raise :class:`StrategyError` ``"<where>: expected <expected>, got <actual>"`` unless ``cond``."""
    try:
        require(cond, where, expected, actual)
    except SpecError as exc:
        raise StrategyError(str(exc)) from None
