"""Ray Tune's side of a search: the searcher that asks the search algorithm for strategies and
tells it what they measured (Ray Tune's ``Searcher``: ask/tell by trial id), and the callback
that records each tuned-runtime trial as it completes.

Both are module-level and picklable: they hold only the search id and find the live
:class:`~synctune.run.search.SearchSession` in :data:`SESSIONS` (Tune checkpoints its
experiment; the session holds actors, a logger and callbacks that need not pickle). The
searcher's state is the search algorithm's plain-JSON state (``save``/``restore``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.search import Searcher

from ..engine.memory import breakdown_from_row
from .baselines import TUNERS, BaselineTrial
from .slices import outcome_of

__all__ = ["SESSIONS", "StrategySearcher", "RecordTunedTrials"]

#: Live search sessions by search id.
SESSIONS: dict[str, Any] = {}


class StrategySearcher(Searcher):
    """Ask/tell by Tune trial id over a session's search algorithm; each proposal takes a free
    slice, and its result is recorded before the algorithm is told ("record before tell")."""

    def __init__(self, search_id: str) -> None:
        super().__init__(metric="mean_s", mode="min")
        self.search_id = search_id

    @property
    def session(self):
        return SESSIONS[self.search_id]

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps(self.session.algo.state()))

    def restore(self, checkpoint_path: str) -> None:
        self.session.algo = self.session.new_algorithm(json.loads(Path(checkpoint_path).read_text()))

    def suggest(self, trial_id: str) -> dict | str | None:
        s = self.session
        if s.algo.finished:
            return Searcher.FINISHED
        proposal = s.algo.ask() if s.free_slices else None
        if proposal is None:
            # Nothing new to try (every proposal measured already) ends the search; otherwise
            # Tune asks again once a running trial completes.
            return Searcher.FINISHED if s.algo.finished and not s.proposals else None
        slice_name = s.free_slices.pop(0)
        s.proposals[trial_id] = (proposal, slice_name)
        config = {"slice": slice_name, "strategy": proposal.strategy.to_dict(),
                  "trial_config": asdict(s.trial_config), "memory_limits": s.memory_limits(proposal.strategy)}
        runtime = s.proposal_runtime(proposal.strategy)
        if runtime.name != "engine":
            config["runtime"] = runtime.to_dict()
        return config

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        s = self.session
        proposal, slice_name = s.proposals.pop(trial_id)
        s.free_slices.append(slice_name)
        outcome = outcome_of(result)
        s.record(proposal.trial_id, proposal.strategy, proposal.origin, outcome,
                 runtime=s.proposal_runtime(proposal.strategy), predicted=proposal.predicted)
        s.algo.tell(proposal.trial_id, outcome.measured_s, memory=breakdown_from_row(outcome.extra.get("memory")))
        s.notify(outcome)


class RecordTunedTrials(tune.Callback):
    """Records each trial of a tuned runtime as it completes (before Optuna's study moves on)."""

    def __init__(self, search_id: str, runtime: str) -> None:
        self.search_id, self.runtime = search_id, runtime

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._record(trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._record(trial)

    def _record(self, trial) -> None:
        s, tuner = SESSIONS[self.search_id], TUNERS[self.runtime]
        outcome = outcome_of(trial.last_result)
        params = {k: trial.config[k] for k in tuner.space}
        runtime = tuner.runtime_of(params)
        trial_id = f"{tuner.runtime}-{len(s.ledger.of(tuner.runtime))}"
        s.record(trial_id, s.skeleton, tuner.origin, outcome, runtime=runtime)
        s.ledger.add(BaselineTrial(trial_id=trial_id, runtime=runtime, origin=tuner.origin,
                                   mean_s=outcome.measured_s, params=params))
        s.notify(outcome)
