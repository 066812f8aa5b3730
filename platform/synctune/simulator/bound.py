"""A simulator bound to one (model, cluster) domain: the face the search sees
(:class:`synctune.search.SimulatorProtocol`), every member of it given a default by
:class:`DomainScorer`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .features import DomainContext, encode
from .models import Domain, Simulator

__all__ = ["DomainScorer", "BoundSimulator", "RuntimeResidual"]


class DomainScorer:
    """The search's simulator protocol (:class:`synctune.search.SimulatorProtocol`) with a
    default for each member: ``predicts_seconds`` False (a ranker), ``training_free`` itself,
    ``score_columns`` through strategy objects, ``fit`` learning nothing, no ``history`` of
    judgements. Subclasses score (:meth:`score`) and override what they know better."""

    #: Its scores are negated iteration times (else a ranker's scores).
    predicts_seconds: bool = False

    @property
    def kind(self) -> str:
        """What scores, in a word (a simulator registry name)."""
        raise NotImplementedError

    @property
    def training_free(self) -> "DomainScorer":
        """The simulator without learned weights it scores with (itself: no learned one)."""
        return self

    @property
    def history(self) -> tuple[dict, ...]:
        """Its judgements of learned against training-free scoring (none by default)."""
        return ()

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """Higher is better."""
        raise NotImplementedError

    def score_columns(self, columns) -> np.ndarray:
        """:meth:`score` of the strategies of :class:`~synctune.strategy.columns.StrategyColumns`."""
        return self.score([columns.strategy(i) for i in range(columns.size)])

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        """Learn from the search's trials (nothing by default: a training-free simulator)."""


class BoundSimulator(DomainScorer):
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
        """The bound simulator's kind."""
        return self.simulator.kind

    @property
    def predicts_seconds(self) -> bool:
        """Whether its scores are negated iteration times (else a ranker's scores)."""
        return self.simulator.predicts_seconds

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """Higher is better: the negated prediction (a strategy that splits modules replayed on its
        own: :meth:`_split_seconds`)."""
        if any(s.tensor_parallel is not None for s in strategies):
            return -self._split_seconds(strategies)
        return -self.simulator._predict_batch(encode(strategies, self.ctx), self.ctx)

    def _split_seconds(self, strategies: list[Strategy]) -> np.ndarray:
        """Predicted seconds of ``strategies``, some with ``tensor_parallel``: only a simulator that
        replays tensor parallelism (its split compute and TP collectives, ``replays_tensor_parallel``)
        prices them; any other would price the data-parallel strategy alone, so it is refused."""
        if not getattr(self.simulator, "replays_tensor_parallel", False):
            raise SpecError(f"search.simulator: the {self.simulator.kind} simulator does not price tensor "
                            f"parallelism (a strategy's tensor_parallel: split compute, TP collectives); use "
                            f"simulator: replay, or leave tensor parallelism out of the search "
                            f"(search.tensor_parallel: false)")
        return np.asarray(self.simulator.predict(list(strategies), self.ctx.model, self.ctx.cluster), dtype=np.float64)

    #: Proposals scored at once: a round of 30,000 BERT-large proposals is 17 million rows, and
    #: every simulator's per-row temporaries would otherwise span all of them.
    SCORE_CHUNK = 4096

    def score_columns(self, columns) -> np.ndarray:
        """:meth:`score` of :class:`~synctune.strategy.columns.StrategyColumns` (a round's
        proposals, never made objects: the form every simulator reads), a chunk of
        :attr:`SCORE_CHUNK` proposals at a time (every simulator scores a strategy on its own)."""
        n = columns.size
        if n <= self.SCORE_CHUNK:
            out = -self.simulator._predict_batch(columns, self.ctx)
        else:
            out = -np.concatenate([self.simulator._predict_batch(columns.take(lo, min(n, lo + self.SCORE_CHUNK)),
                                                                 self.ctx) for lo in range(0, n, self.SCORE_CHUNK)])
        split = np.flatnonzero(columns.splits_modules())
        if len(split):  # the rows priced the data-parallel part alone: those strategies replayed whole
            out = np.array(out, dtype=np.float64)
            out[split] = -self._split_seconds([columns.strategy(int(i)) for i in split])
        return out

    def _domain(self, strategies: list[Strategy], times_s: np.ndarray) -> Domain:
        return Domain(self.ctx, list(strategies), np.asarray(times_s, dtype=np.float64))

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        """Learn from the search's trials: a calibrated replay recalibrates its constants, a
        learned simulator is trained afresh (fine-tuned where it was transferred), a
        training-free one ignores them."""
        if self.simulator.calibrates:  # a calibrated replay: its constants, not weights
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
        """Go on training a learned simulator from where it is (AutoSync §3.3's transfer)."""
        if self.simulator.learned:
            self.simulator.fine_tune([self._domain(strategies, times_s)])


class RuntimeResidual(DomainScorer):
    """A seconds-predicting simulator (``inner``, a :class:`BoundSimulator`) whose predictions are
    scaled per runtime by what the search measured: ``runtime_of`` names the runtime a strategy
    runs on (the engine, or FSDP2 for one whose units reshard), ``runtimes_of`` the same of each
    strategy of :class:`~synctune.strategy.columns.StrategyColumns`, and after every :meth:`fit` each
    runtime's factor is the median of measured / predicted over its trials (two at least; 1
    before). The replay times the engine's collectives; FSDP2's per-unit all-gathers and
    reduce-scatters, issued by its own hooks, cost what the replay does not model (several
    times its prediction over gloo), and a search that proposes both would otherwise keep
    proposing the slower one (dPRO §4.3: calibrate the replay on the job's own measurements, here
    one constant per runtime). Ranks within one runtime are the inner simulator's."""

    predicts_seconds = True

    def __init__(self, inner, runtime_of: Callable[[Strategy], str],
                 runtimes_of: Callable[[Any], Sequence[str]]) -> None:
        self.inner = inner
        self.runtime_of, self.runtimes_of = runtime_of, runtimes_of
        #: Per runtime, measured / predicted (the median over its trials).
        self.factors: dict[str, float] = {}

    @property
    def kind(self) -> str:
        """The inner simulator's kind."""
        return self.inner.kind

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """Higher is better: the negated prediction, scaled by its runtime's factor."""
        scores = np.asarray(self.inner.score(strategies), dtype=np.float64)
        scale = np.array([self.factors.get(self.runtime_of(s), 1.0) for s in strategies], dtype=np.float64)
        return scores * scale

    def score_columns(self, columns) -> np.ndarray:
        """:meth:`score` of :class:`~synctune.strategy.columns.StrategyColumns`."""
        scores = np.asarray(self.inner.score_columns(columns), dtype=np.float64)
        if not self.factors:
            return scores
        scale = np.array([self.factors.get(r, 1.0) for r in self.runtimes_of(columns)], dtype=np.float64)
        return scores * scale

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        """Fit the inner simulator, then each runtime's factor (measured / predicted, median)."""
        self.inner.fit(strategies, times_s)
        if not len(strategies):
            return
        predicted = -np.asarray(self.inner.score(strategies), dtype=np.float64)
        times = np.asarray(times_s, dtype=np.float64)
        runtimes = [self.runtime_of(s) for s in strategies]
        factors = {}
        for runtime in sorted(set(runtimes)):
            pick = np.array([r == runtime for r in runtimes]) & (predicted > 0) & np.isfinite(times)
            if pick.sum() >= 2:
                factors[runtime] = float(np.median(times[pick] / predicted[pick]))
        self.factors = factors

    def fine_tune(self, strategies: list[Strategy], times_s: np.ndarray) -> None:
        """Fine-tune the inner simulator."""
        self.inner.fine_tune(strategies, times_s)
