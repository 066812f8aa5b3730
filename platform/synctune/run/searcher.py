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

from ..engine.memory import breakdown_from_row
from ..spec.errors import InfraError
from .baselines import TUNERS, BaselineTrial
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
    """Ask/tell by Tune trial id over a session's search algorithm; each proposal takes a free
    slice (the searcher owns them), and its result is recorded before the algorithm is told
    ("record before tell")."""

    _live = ("_session", "free_slices", "proposals")

    def __init__(self, session: Any) -> None:
        super().__init__(metric="mean_s", mode="min")
        self._session = session
        self.search_id = session.search_id
        #: The slices no trial holds, and each running Tune trial's (proposal, slice).
        self.free_slices: list[str] = list(session.slice_names)
        self.proposals: dict[str, tuple[Any, str]] = {}

    def save(self, checkpoint_path: str) -> None:
        """Write the search algorithm's state (plain JSON) to ``checkpoint_path``."""
        Path(checkpoint_path).write_text(json.dumps(self.session.algo.state()))

    def restore(self, checkpoint_path: str) -> None:
        """Continue from a state :meth:`save` wrote."""
        self.session.algo = self.session.new_algorithm(json.loads(Path(checkpoint_path).read_text()))

    def suggest(self, trial_id: str) -> dict | str | None:
        """The next proposal on a free slice, as the trial's config; None while every slice is busy."""
        s = self.session
        if s.algo.finished:
            return Searcher.FINISHED
        proposal = s.algo.ask() if self.free_slices else None
        if proposal is None:
            # Nothing new to try (every proposal measured already) ends the search; otherwise
            # Tune asks again once a running trial completes.
            return Searcher.FINISHED if s.algo.finished and not self.proposals else None
        slice_name = self.free_slices.pop(0)
        self.proposals[trial_id] = (proposal, slice_name)
        config = {"slice": slice_name, "strategy": proposal.strategy.to_dict(),
                  "trial_config": asdict(s.trial_config), "memory_limits": s.memory_limits(proposal.strategy)}
        runtime = s.proposal_runtime(proposal.strategy)
        if runtime.name != "engine":
            config["runtime"] = runtime.to_dict()
        return config

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Record the trial, free its slice, then tell the algorithm what it measured."""
        s = self.session
        proposal, slice_name = self.proposals.pop(trial_id)
        self.free_slices.append(slice_name)
        outcome = outcome_of(result)
        s.record(proposal.trial_id, proposal.strategy, proposal.origin, outcome,
                 runtime=s.proposal_runtime(proposal.strategy), predicted=proposal.predicted)
        s.algo.tell(proposal.trial_id, outcome.measured_s, memory=breakdown_from_row(outcome.extra.get("memory")))
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
        s, tuner = self.session, TUNERS[self.runtime]
        outcome = outcome_of(trial.last_result)
        params = {k: trial.config[k] for k in tuner.space}
        runtime = tuner.runtime_of(params)
        trial_id = f"{tuner.runtime}-{len(s.ledger.of(tuner.runtime))}"
        s.record(trial_id, s.skeleton, tuner.origin, outcome, runtime=runtime)
        s.ledger.add(BaselineTrial(trial_id=trial_id, runtime=runtime, origin=tuner.origin,
                                   mean_s=outcome.measured_s, params=params))
        s.notify(outcome)
