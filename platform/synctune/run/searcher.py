"""Ray Tune's side of a search: the searcher that asks the search algorithm for strategies and
tells it what they measured (Ray Tune's ``Searcher``: ask/tell by trial id), and the callback
that records each tuned-runtime trial as it completes.

Both hold the live :class:`~synctune.run.search.SearchSession` they serve, handed to them by
the driver, and pickle without it: Ray Tune writes its tuner, search algorithm and callbacks
into its experiment folder, and the session holds actors, a logger and callbacks that need not
pickle. A copy read back from there is detached and says so when used: a search resumes from its
dataset (``synctune search --resume``), not from Tune's files. The searcher owns the slices and
the proposals in flight; its state is the search algorithm's plain JSON (``save``/``restore``,
Ray Tune's protocol)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.search import Searcher

from ..engine.runtimes import runtime_class
from ..spec.errors import InfraError
from .prepare import search_algorithm
from .slices import outcome_of

__all__ = ["StrategySearcher", "RecordTunedTrials"]


class _HoldsSession:
    """A Tune object that serves one live session and pickles without it (see the module docstring)."""

    _session: Any = None

    @property
    def session(self):
        """The live session; an InfraError for a copy read back from Tune's experiment folder."""
        if self._session is None:
            raise InfraError(f"{type(self).__name__} of search {self.search_id!r} was read back from Ray Tune's "
                             f"experiment folder, detached from its search; resume the search with `synctune search "
                             f"--resume` (it continues from the dataset)")
        return self._session

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._live}

    _live: tuple[str, ...] = ("_session",)


class StrategySearcher(_HoldsSession, Searcher):
    """Ask/tell by Tune trial id over the search algorithm it owns (built from what the session
    recorded so far: a resumed search continues where its rows end); each proposal takes a free
    slice (the searcher owns them), and its result is recorded before the algorithm is told
    ("record before tell")."""

    _live = ("_session", "free_slices", "proposals", "_algorithm")

    def __init__(self, session: Any) -> None:
        super().__init__(metric="mean_s", mode="min")
        self._session = session
        self.search_id = session.search_id
        self._algorithm = None
        #: The slices no trial holds, and each running Tune trial's (proposal, slice).
        self.free_slices: list[str] = list(session.slice_names)
        self.proposals: dict[str, tuple[Any, str]] = {}

    @property
    def algorithm(self):
        """The search algorithm it owns (AutoDist's Algorithm 1 or the experiment's other choice),
        built on first use from what the session recorded so far."""
        if self._algorithm is None:
            self._algorithm = search_algorithm(self.session.context, self.session.recorder.search_state())
        return self._algorithm

    def save(self, checkpoint_path: str) -> None:
        """Write the search algorithm's state (plain JSON) to ``checkpoint_path``."""
        Path(checkpoint_path).write_text(json.dumps(self.algorithm.state()))

    def restore(self, checkpoint_path: str) -> None:
        """Continue from a state :meth:`save` wrote."""
        self._algorithm = search_algorithm(self.session.context, json.loads(Path(checkpoint_path).read_text()))

    def suggest(self, trial_id: str) -> dict | str | None:
        """The next proposal on a free slice, as the trial's config; None while every slice is busy."""
        s, algorithm = self.session, self.algorithm
        if algorithm.finished:
            return Searcher.FINISHED
        proposal = algorithm.ask() if self.free_slices else None
        if proposal is None:
            # Nothing new to try (every proposal measured already) ends the search; otherwise
            # Tune asks again once a running trial completes.
            return Searcher.FINISHED if algorithm.finished and not self.proposals else None
        slice_name = self.free_slices.pop(0)
        self.proposals[trial_id] = (proposal, slice_name)
        ctx = s.context
        return {"slice": slice_name, "strategy": proposal.strategy.to_dict(),
                "trial_config": asdict(ctx.trial_config),
                "memory_limits": s.memory_limits(proposal.strategy),
                "runtime": ctx.executor(proposal.strategy).to_dict()}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Record the trial, free its slice, then tell the algorithm what it measured."""
        s = self.session
        proposal, slice_name = self.proposals.pop(trial_id)
        self.free_slices.append(slice_name)
        outcome = outcome_of(result)
        trial = s.recorder.record_proposal(proposal, outcome, s.context.executor(proposal.strategy))
        self.algorithm.tell(trial.trial_id, trial.mean_s, memory=list(trial.memory) if trial.memory else None)
        s.notify(outcome)


class RecordTunedTrials(_HoldsSession, tune.Callback):
    """Records each trial of a tuned runtime as it completes (before Optuna's study moves on)."""

    def __init__(self, session: Any, runtime: str) -> None:
        self._session = session
        self.search_id, self.runtime = session.search_id, runtime

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._record(trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._record(trial)

    def _record(self, trial) -> None:
        s, cls = self.session, runtime_class(self.runtime)
        outcome = outcome_of(trial.last_result)
        params = {k: trial.config[k] for k in cls.tuning.params}
        s.recorder.record_baseline(cls.from_tuned(params), cls.tuning.origin, outcome, params)
        s.notify(outcome)
