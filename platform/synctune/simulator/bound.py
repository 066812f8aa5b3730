"""A simulator bound to one (model, cluster) domain: the face the search sees
(:class:`synctune.search.SimulatorProtocol`: ``score``, ``fit``, ``fine_tune``)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .features import DomainContext, encode
from .models import Domain, Simulator

__all__ = ["BoundSimulator"]


class BoundSimulator:
    """``simulator`` scoring strategies of (``model``, ``cluster``).

    ``fit(strategies, times_s)`` lets it learn from what the search measured: a training-free
    simulator ignores it, a calibrated replay refits its constants for this domain; a learned one
    is trained from scratch on everything measured (``make`` gives the untrained one), or, when it
    was learned elsewhere (``transfer``), fine-tuned from where it was, so what it brought is kept
    (AutoSync §3.3).
    """

    def __init__(self, simulator: Simulator, model: ModelSpec, cluster: ClusterSpec, *,
                 make: Callable[[], Simulator] | None = None, transfer: bool = False) -> None:
        self.simulator = simulator
        self.ctx = DomainContext(model, cluster)
        self.make = make
        self.transfer = transfer

    @property
    def kind(self) -> str:
        return self.simulator.kind

    @property
    def predicts_seconds(self) -> bool:
        """Whether its scores are negated iteration times (else a ranker's scores)."""
        return bool(getattr(self.simulator, "predicts_seconds", False))

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """Higher is better: the negated prediction."""
        return -self.simulator._predict_batch(encode(strategies, self.ctx), self.ctx)

    def score_columns(self, columns) -> np.ndarray:
        """:meth:`score` of :class:`~synctune.strategy.columns.StrategyColumns` (a round's
        proposals, never made objects: the form every simulator reads)."""
        return -self.simulator._predict_batch(columns, self.ctx)

    def _domain(self, strategies: list[Strategy], times_s: np.ndarray) -> Domain:
        return Domain(self.ctx, list(strategies), np.asarray(times_s, dtype=np.float64))

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        if getattr(self.simulator, "calibrates", False):  # a calibrated replay: its constants, not weights
            self.simulator.calibrate(self._domain(strategies, times_s))
            return
        if not self.simulator.learned:
            return
        if self.transfer:
            self.fine_tune(strategies, times_s)
            return
        fresh = self.make() if self.make else self.simulator
        self.simulator = fresh.fit([self._domain(strategies, times_s)])

    def fine_tune(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        if self.simulator.learned:
            self.simulator.fine_tune([self._domain(strategies, times_s)])
