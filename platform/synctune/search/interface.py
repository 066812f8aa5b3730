"""What a search hands out and what it needs (AutoDist §2.4, as Ray Tune's ``Searcher``: ask/tell
by trial id): the :class:`Proposal` a caller trials, and the :class:`SimulatorProtocol` the search
scores proposals with. Both are shared by the search shell and its round policies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..strategy.schema import Strategy

__all__ = ["Proposal", "SimulatorProtocol", "MemoryCheck", "OPTIONAL_SIMULATOR_MEMBERS", "scores_columns"]


class SimulatorProtocol(Protocol):
    """What the search needs of a simulator bound to its domain (AutoSync §3.2).

    ``score(strategies)``: one number per strategy, higher is better. ``fit(strategies,
    times_s)``: learn from what was measured, mean iteration times in seconds (a training-free
    simulator ignores it). An optional ``score_columns(columns)`` scores
    :class:`~synctune.strategy.columns.StrategyColumns` (the round's proposals then stay columns
    until picked); an optional ``predicts_seconds`` says its scores are negated seconds (so a
    proposal records a predicted time); an optional ``fine_tune(strategies, times_s)`` is the
    caller's business, not the search's (:data:`OPTIONAL_SIMULATOR_MEMBERS`).
    """

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """One number per strategy, higher is better."""
        ...

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> Any:
        """Learn from the measured mean iteration times (a training-free simulator ignores them)."""
        ...


class MemoryCheck(Protocol):
    """What the search needs of a memory budget (DESIGN.md "memory budget"; issue 34 item 1):
    ``fits(strategy)``, whether every rank's predicted peak is within its device's budget; and
    ``fit(strategies, breakdowns)``, learning from the memory the trials measured (per trial,
    per rank, part by part; None where a trial measured none), called where the simulator
    learns, so a resumed search judges as the uninterrupted one did. A strategy that does not
    fit is never proposed (the memory model lives with the simulators:
    :class:`synctune.simulator.memory.MemoryBudget`)."""

    def fits(self, strategy: Strategy) -> bool:
        """Whether every rank's predicted peak is within its device's budget."""
        ...

    def fit(self, strategies: list[Strategy], breakdowns: list[Any]) -> Any:
        """Learn from the memory the trials measured (per trial, per rank, part by part)."""
        ...

    # Optional: ``state()`` (plain JSON) and ``restore(state)``, kept in the search's state, so a
    # resumed search judges with what the interrupted one measured before its first trial.


#: What a simulator may also offer the search beyond :class:`SimulatorProtocol`'s two methods.
OPTIONAL_SIMULATOR_MEMBERS = ("score_columns", "predicts_seconds", "fine_tune")


def scores_columns(simulator: Any) -> bool:
    """Whether ``simulator`` offers the optional ``score_columns`` (:data:`OPTIONAL_SIMULATOR_MEMBERS`):
    the one place the search asks, so a round's proposals stay columns until picked wherever
    the simulator can score them so."""
    return callable(getattr(simulator, "score_columns", None))


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A strategy to trial (AutoDist §2.4): its id, origin (builder name or the algorithm) and
    predicted iteration time in seconds (None for baselines, and where the simulator scoring it
    ranks rather than predicts times)."""

    trial_id: str
    strategy: Strategy
    origin: str
    predicted: float | None
