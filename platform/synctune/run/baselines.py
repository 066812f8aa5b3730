"""The baselines a search measures besides the builders (AutoDist §3.1's hand-optimised
systems, run for real): the runtimes a search tunes (each declares its own space:
:meth:`~synctune.engine.runtime.Runtime.tuning_space`; torch DDP's buckets and comm hook, FSDP2's
mesh, units, resharding, prefetch and reduce dtype, Megatron-style tensor parallelism's degree,
sequence parallelism, resharding and checkpointing), drawn by Optuna's TPE through Ray Tune as
Horovod's autotune tunes its fusion buffer, only among the settings the memory budget admits;
the experiment's real Horovod entries; and the ledger that keeps the best of each."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..engine.horovod import HOROVOD_DEFAULT, HorovodConfig, HorovodRuntime
from ..engine.runtime import Runtime
from ..engine.runtimes import runtime_from_record
from ..engine.trial import check_runtime
from ..engine.tuning import Categorical, LogUniform, TuningSpace
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy

__all__ = ["tuned_searcher", "horovod_baselines", "BaselineTrial", "BaselineLedger"]


def _distribution(param: Categorical | LogUniform):
    import optuna

    if isinstance(param, Categorical):
        return optuna.distributions.CategoricalDistribution(list(param.choices))
    return optuna.distributions.FloatDistribution(param.low, param.high, log=True)


def tuned_searcher(space: TuningSpace, *, seed: int, budget: int, done: list[tuple[dict, float]]):
    """Ray Tune's Optuna searcher (TPE, seeded by ``seed`` and the points told) over ``space``,
    told the points this search measured already (``done``: (point, seconds); those outside the
    space, after an edited experiment or a changed budget, are not told; one recorded before a
    setting was tuned is told with the space's ``defaults`` for it); the first point of a
    fresh search is ``space.first``. TPE models the space after 3 trials (Optuna's default waits
    10, more than a search's tuned trials); a resumed search draws from a stream of its own, so it
    does not redraw the points it was told about. A drawn point the space does not admit (the
    memory budget's) is marked failed to Optuna and the first of its fallbacks that is admitted is
    suggested in its place."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # progress is ours to show, one line per trial
    done = [(space.completed(p), t) for p, t in done if space.holds(space.completed(p))]
    points = [dict(p) for p, _t in done] or [dict(space.first)]
    rewards = [t for _p, t in done] or None
    sampler = optuna.samplers.TPESampler(seed=(seed * 1_000_003 + len(done)) % 2**32,
                                         n_startup_trials=max(1, min(3, budget)))
    return _admitting_search_class()(
        admits=space.admits, fallbacks=space.fallbacks,
        space={name: _distribution(p) for name, p in space.params.items()}, metric="mean_s", mode="min",
        sampler=sampler, points_to_evaluate=points, evaluated_rewards=rewards)


def _admitting_search_class():
    """Ray Tune's ``OptunaSearch`` that suggests only points ``admits`` accepts (built on first
    use: Ray is imported only by the commands that tune)."""
    global _ADMITTING_SEARCH
    if _ADMITTING_SEARCH is not None:
        return _ADMITTING_SEARCH
    from optuna.trial import TrialState
    from ray.tune.search import Searcher
    from ray.tune.search.optuna import OptunaSearch

    class AdmittingOptunaSearch(OptunaSearch):
        def __init__(self, *, admits, fallbacks, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._admits, self._fallbacks = admits, fallbacks

        def suggest(self, trial_id: str) -> dict | None:
            point = super().suggest(trial_id)
            if point is None or self._admits is None or self._admits(point):
                return point
            # The draw is recorded as failed, so TPE learns no time for it; the nearest admitted
            # point takes its place. Once the memory model has learned from trials over the
            # budget, none may be admitted: tuning stops rather than trial what it refuses.
            self._ot_study.tell(self._ot_trials.pop(trial_id), None, state=TrialState.FAIL)
            admitted = next((p for p in self._fallbacks(point) if self._admits(p)), None)
            if admitted is None:
                return Searcher.FINISHED
            self._ot_study.enqueue_trial(admitted)
            return super().suggest(trial_id)

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            # A trial without a time (failed, or over the memory budget) reports NaN to Tune;
            # Optuna takes it as a failed trial, not as a value it would warn about.
            value = (result or {}).get(self.metric)
            if isinstance(value, float) and math.isnan(value):
                result, error = None, True
            super().on_trial_complete(trial_id, result, error)

        def __getstate__(self) -> dict:
            # Tune pickles its searcher when the Tuner is made (tuner.pkl); the predicates hold
            # the live session's memory model and need not travel with it.
            return {**self.__dict__, "_admits": None, "_fallbacks": None}

        def save(self, checkpoint_path: str) -> None:
            # The predicates are the session's (closures over its memory model): not part of the state.
            admits, fallbacks = self._admits, self._fallbacks
            self._admits = self._fallbacks = None
            try:
                super().save(checkpoint_path)
            finally:
                self._admits, self._fallbacks = admits, fallbacks

    _ADMITTING_SEARCH = AdmittingOptunaSearch
    return _ADMITTING_SEARCH


_ADMITTING_SEARCH = None


def horovod_baselines(exp: Experiment, model: ModelSpec, cluster: ClusterSpec,
                      workload: Any = None) -> list[tuple[str, HorovodRuntime]]:
    """The experiment's real-Horovod baselines as (entry, runtime), each checked as a trial
    (Horovod installed, with the binding ``workload`` needs; settings it executes) before
    anything runs."""
    out = []
    where = exp.source or exp.name
    label = exp.baselines.key("horovod")  # as the file wrote it: baselines or baselines.horovod
    for entry in exp.baselines.horovod:
        options = {}
        for item in filter(None, entry.partition(":")[2].split(",")):
            key, _eq, text = item.partition("=")
            options[key.strip()] = text.strip()
        unknown = [k for k in options if k not in HOROVOD_DEFAULT.to_dict()]
        if unknown:
            raise SpecError(f"{where}: {label}: {entry!r}: unknown Horovod setting {unknown[0]!r}; valid: "
                            f"{', '.join(HOROVOD_DEFAULT.to_dict())}")
        try:
            runtime = HorovodRuntime(HorovodConfig.from_options(options))
            check_runtime(runtime, build_strategy("allreduce", model, cluster), model, cluster, workload)
        except SpecError as exc:
            raise SpecError(f"{where}: {label}: {entry!r}: {exc}") from None
        out.append((entry, runtime))
    return out


@dataclass(frozen=True, kw_only=True)
class BaselineTrial:
    """One measured trial of a baseline run by another runtime than the engine (tuned DDP, FSDP2
    or Megatron, real Horovod): ``mean_s`` None when it did not finish; ``params`` the tuner's point, if tuned."""

    trial_id: str
    runtime: Runtime
    origin: str
    mean_s: float | None
    params: dict | None = None

    @property
    def label(self) -> str:
        """How summaries name it, e.g. ``tuned DDP: ddp bucket 25 MiB, hook none``."""
        tuning = self.runtime.tuning
        kind = tuning.label if tuning and tuning.origin == self.origin else f"{self.runtime.label} ({self.origin})"
        return f"{kind}: {self.runtime.summary()}"

    @classmethod
    def from_record(cls, record: Any) -> "BaselineTrial":
        """The baseline trial of a dataset row (a resumed search's memory)."""
        extra = json.loads(record.extra_json or "{}")
        return cls(trial_id=record.trial_id, runtime=runtime_from_record(record.runtime, record.runtime_json),
                   origin=record.origin, mean_s=record.mean_s if record.status == "ok" else None,
                   params=extra.get(f"{record.runtime}_params"))


class BaselineLedger:
    """The baselines run by other runtimes, by runtime name, in the order they were measured;
    the best of each and of all (by their single trials: the confirmation screens them)."""

    def __init__(self, trials: list[BaselineTrial] | tuple = ()) -> None:
        self.trials: list[BaselineTrial] = list(trials)

    def add(self, trial: BaselineTrial) -> None:
        """Record one more measured (or failed) baseline trial, after those measured before it."""
        self.trials.append(trial)

    def of(self, runtime: str) -> list[BaselineTrial]:
        """The trials run by ``runtime``."""
        return [t for t in self.trials if t.runtime.name == runtime]

    def best(self, runtime: str | None = None) -> BaselineTrial | None:
        """The fastest finished trial of ``runtime`` (of every runtime when None)."""
        ok = [t for t in (self.trials if runtime is None else self.of(runtime)) if t.mean_s is not None]
        return min(ok, key=lambda t: t.mean_s) if ok else None

    def runtimes(self) -> list[str]:
        """The runtimes measured, in the order first measured."""
        return list(dict.fromkeys(t.runtime.name for t in self.trials))

    def best_times_s(self) -> tuple[float, ...]:
        """The best time of each runtime (what the search's figures count as baselines)."""
        return tuple(b.mean_s for b in map(self.best, self.runtimes()) if b is not None)
