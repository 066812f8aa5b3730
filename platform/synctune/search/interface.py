"""What a search hands out and what it needs (AutoDist §2.4, as Ray Tune's ``Searcher``: ask/tell
by trial id): the :class:`Proposal` a caller trials, and the :class:`SimulatorProtocol` the search
scores proposals with. Both are shared by the search shell and its round policies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from ..stats import search_outcome
from ..strategy.schema import Strategy

__all__ = ["Proposal", "SimulatorProtocol", "MemoryCheck", "SearchTrial", "SearchFigures", "search_figures",
           "RoundContext"]


class SimulatorProtocol(Protocol):
    """What the search needs of a simulator bound to its domain (AutoSync §3.2). Every member is
    required; the simulator layer's :class:`~synctune.simulator.bound.DomainScorer` gives each
    one a default its simulators override.

    ``score(strategies)``: one number per strategy, higher is better. ``score_columns(columns)``:
    the same of :class:`~synctune.strategy.columns.StrategyColumns` (a round's proposals then stay
    columns until picked). ``fit(strategies, times_s)``: learn from what was measured, mean
    iteration times in seconds (a training-free simulator ignores it). ``predicts_seconds``:
    whether its scores are negated seconds (a proposal then records a predicted time).
    ``training_free``: the simulator without learned weights it scores with until a learned one
    ranks better (itself when it is one): what the simulator-only local searches explore with.
    """

    predicts_seconds: bool

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        """One number per strategy, higher is better."""
        ...

    def score_columns(self, columns: Any) -> np.ndarray:
        """One number per strategy of ``columns``, higher is better."""
        ...

    def fit(self, strategies: list[Strategy], times_s: np.ndarray) -> Any:
        """Learn from the measured mean iteration times (a training-free simulator ignores them)."""
        ...

    @property
    def training_free(self) -> "SimulatorProtocol":
        """The simulator without learned weights (itself for a training-free one)."""
        ...


class MemoryCheck:
    """What the search needs of a memory budget (DESIGN.md "memory budget"): ``fits(strategy)``,
    whether every rank's predicted peak is within its device's budget; ``fit(strategies,
    breakdowns)``, learning from the memory the trials measured (per trial, per rank, part by
    part; None where a trial measured none), called where the simulator learns, so a resumed
    search judges as the uninterrupted one did; and ``state()``/``restore(state)``, what a resumed
    search must judge with (by default nothing). A strategy that does not fit is never proposed
    (the memory model lives with the simulators: :class:`synctune.simulator.memory.MemoryBudget`;
    the search's driver subclasses this with it)."""

    def fits(self, strategy: Strategy) -> bool:
        """Whether every rank's predicted peak is within its device's budget."""
        raise NotImplementedError

    def fit(self, strategies: list[Strategy], breakdowns: list[Any]) -> None:
        """Learn from the memory the trials measured (per trial, per rank, part by part)."""

    def state(self) -> dict[str, Any]:
        """Plain JSON kept in the search's state, so a resumed search judges with what the
        interrupted one measured before its first trial (nothing by default)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` gave (nothing by default)."""

    def nothing_fits(self) -> str | None:
        """Why nothing in the search's space fits, in one line, once what the trials measured says
        so (the search then stops at once); None while something may (the default)."""
        return None


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A strategy to trial (AutoDist §2.4): its id, origin (builder name or the algorithm) and
    predicted iteration time in seconds (None for baselines, and where the simulator scoring it
    ranks rather than predicts times)."""

    trial_id: str
    strategy: Strategy
    origin: str
    predicted: float | None


#: The trial ids of the builder baselines a search measures first start with this.
BUILDER_PREFIX = "baseline-"


@dataclass(frozen=True, kw_only=True)
class SearchTrial:
    """A finished trial of the search (AutoDist §2.4): the proposal's id, strategy, origin and
    predicted seconds, what it measured (``mean_s``, None for a failed trial or one over the
    memory budget) and, where measured, its memory per rank part by part (``memory``)."""

    trial_id: str
    strategy: Strategy
    origin: str
    predicted: float | None
    mean_s: float | None
    memory: tuple[Mapping[str, Any], ...] | None = None

    @property
    def is_builder(self) -> bool:
        """Whether it is one of the builder baselines the search measures first."""
        return self.trial_id.startswith(BUILDER_PREFIX)

    @property
    def ok(self) -> bool:
        """Whether it finished with a time."""
        return self.mean_s is not None

    def to_dict(self) -> dict[str, Any]:
        """The search state's plain-JSON form of the trial (:meth:`StrategySearch.state`)."""
        out = {"trial_id": self.trial_id, "strategy": self.strategy.to_dict(), "hash": self.strategy.hash,
               "origin": self.origin, "predicted": self.predicted, "mean_s": self.mean_s}
        if self.memory:
            out["memory"] = [dict(m) for m in self.memory]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SearchTrial":
        """A trial of a saved state: its strategy in the current schema (older schemas migrate),
        its time under ``mean_s`` (states of version 2 and before, and states rebuilt from older
        dataset rows, call it ``runtime``)."""
        if "mean_s" in data:
            mean_s = data["mean_s"]
        elif "runtime" in data:
            mean_s = data["runtime"]
        else:
            raise ValueError(f"search state: trial {data.get('trial_id')!r}: expected a mean_s entry (seconds, or "
                             f"None for a failed trial), got keys {sorted(data)}")
        memory = data.get("memory")
        return cls(trial_id=data["trial_id"], strategy=Strategy.from_dict(data["strategy"]), origin=data["origin"],
                   predicted=data.get("predicted"), mean_s=mean_s,
                   memory=tuple(memory) if memory else None)


@dataclass(frozen=True, kw_only=True)
class SearchFigures:
    """What a search's trials say so far (AutoDist §3.3, AutoSync §5): how many ran and failed,
    the fastest (``best``), the best baseline's time, the speed-up over it, the hit rate (share
    of searched trials faster than it) and the trials it took to reach 1.1x and 1.2x."""

    trials: int
    failed: int
    best: SearchTrial | None
    best_baseline_s: float | None
    speedup: float | None
    hit_rate: float | None
    trials_to_1_1x: int | None
    trials_to_1_2x: int | None

    @property
    def best_mean_s(self) -> float | None:
        """The fastest trial's time (None before any finished)."""
        return self.best.mean_s if self.best else None


def search_figures(trials: Sequence[SearchTrial], other_baselines: Iterable[float] = ()) -> SearchFigures:
    """:class:`SearchFigures` of ``trials`` in the order they were told; ``other_baselines``:
    baseline times in seconds measured outside the search (tuned torch DDP, FSDP2, Horovod)."""
    out = search_outcome(((t.is_builder, t.mean_s) for t in trials), other_baselines=tuple(other_baselines))
    return SearchFigures(trials=out.num_trials, failed=out.num_failed,
                         best=trials[out.best_index] if out.best_index is not None else None,
                         best_baseline_s=out.best_baseline_s, speedup=out.speedup, hit_rate=out.hit_rate,
                         trials_to_1_1x=out.trials_to[1.1], trials_to_1_2x=out.trials_to[1.2])


@dataclass(frozen=True, kw_only=True)
class RoundContext:
    """What a round policy reads of the search when it draws a round (AutoDist §2.4): the domain
    (``model``, ``cluster``), the experiment's ``settings`` (its ``search:`` section) and
    ``seed``, the ``simulator`` (None for the unscored variants), the ``project``-ion of every
    proposal into what the trials' runtime executes (None: none), the share of sampled
    strategies that shard units, the trials told so far (``trials``; the simulator learned from
    the first ``fitted_on``), the hashes measured, pending or queued (``seen``), the diversity
    ``index``, and two predicates: ``fits`` (the search's, which counts what the budget refuses)
    and ``budget_fits`` (the memory budget's own, for a sampler that grows a draw until it fits;
    None without a budget). A policy keeps nothing between rounds: everything it reads is here."""

    model: Any
    cluster: Any
    settings: Any
    seed: int
    simulator: SimulatorProtocol | None
    project: Callable[[Strategy], Strategy] | None
    shard_prob: float
    trials: tuple[SearchTrial, ...]
    fitted_on: int
    seen: frozenset[str]
    index: Any
    fits: Callable[[Strategy], bool]
    budget_fits: Callable[[Strategy], bool] | None
    #: The share of sampled strategies split by tensor parallelism (0: the search proposes none).
    tp_prob: float = 0.0

    def measured(self, upto: int | None = None) -> tuple[list[Strategy], np.ndarray]:
        """The successful trials among the first ``upto`` told (all by default): their strategies
        and mean iteration times in seconds."""
        done = [t for t in self.trials[:upto] if t.ok]
        return [t.strategy for t in done], np.array([t.mean_s for t in done], float)

    def elite(self, scores: np.ndarray) -> np.ndarray:
        """Indices of the proposals scored at or above the simulator's fidelity level on what it
        learned from (AutoDist §2.4 "Filtering"; every proposal while fewer than 4 trials were
        measured, or when none reaches the level)."""
        from .selection import fidelity_level

        strategies, times_s = self.measured(self.fitted_on)
        level = -np.inf
        if len(strategies) >= 4:
            level = fidelity_level(np.asarray(self.simulator.score(strategies), dtype=float), times_s,
                                   self.settings.fidelity_accuracy)
        elite = np.flatnonzero(scores >= level)
        return elite if len(elite) else np.arange(len(scores))

    def predicted_s(self, score: float, model: SimulatorProtocol | None = None) -> float | None:
        """A proposal's predicted iteration time: the negated score where the model that scored
        it (``model``, else the simulator scoring now) predicts seconds (analytic, replay); None
        where it ranks (a learned ranker's scores are not times, and the dataset's
        ``predicted_time_s`` must not pretend they are)."""
        model = self.simulator if model is None else model
        return float(-score) if model is not None and model.predicts_seconds else None
