"""What a search found, as one frozen value: its figures (AutoSync §5: best strategy, speed-up
over the best baseline, hit rate, trials to 1.1x and 1.2x), the baselines, the confirmation
and the recommendation. The CLI, the result file and MLflow read it by attribute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..data.confirmation import Confirmation
from ..engine.composed import ENGINE
from ..engine.runtime import Runtime
from ..engine.runtimes import RUNTIMES, as_runtime
from ..strategy.builders import BUILDERS
from ..strategy.schema import Strategy
from .baselines import BaselineLedger, BaselineTrial

__all__ = ["SearchSummary", "Recommendation", "MemorySummary", "recommend"]


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """What the search recommends running: a searched strategy or a baseline (``kind``), named,
    with the runtime that runs it (the engine for a strategy; tuned DDP or Horovod with their
    settings, the strategy then giving replicas and batch split only) and why."""

    kind: str
    name: str
    strategy: Strategy
    runtime: Runtime = ENGINE
    why: str = ""
    #: For a searched strategy, what it does that torch DDP does not, in one line
    #: (:func:`synctune.strategy.explain.differences_from_ddp`).
    differs: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The result file's form: the runtime by name with its settings, and one key per baseline
        runtime whatever was recommended (the file's keys do not depend on the outcome), holding
        its settings where it is the one recommended, else null (``"ddp": null`` for a searched
        strategy)."""
        baselines = {name: self.runtime.config_dict() if name == self.runtime.name else None
                     for name, cls in RUNTIMES.items() if not cls.runs_strategy}
        return {"kind": self.kind, "name": self.name, "strategy": self.strategy.to_dict(),
                "runtime": self.runtime.name, "runtime_config": self.runtime.config_dict(), "why": self.why,
                "differs_from_ddp": self.differs, **baselines}


@dataclass(frozen=True, kw_only=True)
class MemorySummary:
    """The memory budget (``budget`` in words, ``limit_bytes`` per rank) and what the
    recommendation costs per rank, predicted and measured (its last trial's probe; None where
    none was measured); the trials the budget cost (``oom_trials``) or spared (builders never
    trialled) and the share of sampled strategies that sharded; ``stopped``: why the search
    stopped early because nothing in its space fits (one line, levers included), or None."""

    budget: str
    limit_bytes: tuple[int | None, ...] = ()
    oom_trials: int = 0
    over_budget_builders: tuple[str, ...] = ()
    shard_share: float = 0.0
    predicted_peak_bytes: tuple[int, ...] | None = None
    measured_peak_bytes: tuple[int | None, ...] | None = None
    stopped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (the result file's ``memory`` entry)."""
        out: dict[str, Any] = {"budget": self.budget, "limit_bytes": list(self.limit_bytes),
                               "oom_trials": self.oom_trials, "over_budget_builders": list(self.over_budget_builders),
                               "shard_share": self.shard_share}
        if self.predicted_peak_bytes is not None:
            out["predicted_peak_bytes"] = list(self.predicted_peak_bytes)
        if self.measured_peak_bytes is not None:
            out["measured_peak_bytes"] = list(self.measured_peak_bytes)
        if self.stopped:
            out["stopped"] = self.stopped
        return out


@dataclass(frozen=True, kw_only=True)
class SearchSummary:
    """A search's outcome, so far or final. Seconds are mean iteration times of single trials
    except in ``confirmed`` (interleaved re-measurement, with its interval)."""

    search_id: str
    trials: int
    failed: int
    best_mean_s: float | None
    best_origin: str | None
    best_strategy: Strategy | None
    #: The fastest baseline's single trial: builders and the runtimes' baselines.
    best_baseline_s: float | None
    speedup_over_best_baseline: float | None
    hit_rate: float | None
    trials_to_1_1x: int | None
    trials_to_1_2x: int | None
    best_builder_baseline_s: float | None
    best_baseline_strategy: Strategy | None
    best_baseline_origin: str | None
    #: Every trial of the runtimes' baselines (tuned DDP, Horovod), in the order measured.
    baselines: tuple[BaselineTrial, ...] = ()
    wall_s: float = 0.0
    mlflow_parent_run: str | None = None
    confirmed: Confirmation | None = None
    recommended: Recommendation | None = None
    simulator_selection: tuple[dict, ...] = ()
    training_free_simulator: str | None = None
    memory: MemorySummary | None = None

    def runtime_trials(self, runtime: str) -> int:
        """How many baseline trials ``runtime`` ran."""
        return len(BaselineLedger(self.baselines).of(runtime))

    def runtime_best(self, runtime: str | None = None) -> BaselineTrial | None:
        """The fastest finished baseline trial of ``runtime`` (of any runtime when None)."""
        return BaselineLedger(self.baselines).best(runtime)

    @property
    def all_trials(self) -> int:
        """Every trial measured: the search's and the runtimes' baselines."""
        return self.trials + len(self.baselines)

    def _per_runtime(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, cls in RUNTIMES.items():
            if cls.runs_strategy:
                continue  # strategies' runtimes: their trials are the search's own
            best = self.runtime_best(name)
            out.update({f"{name}_trials": self.runtime_trials(name), f"{name}_best_s": best.mean_s if best else None,
                        f"{name}_best_config": best.runtime.config_dict() if best else None})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The result file's form (``<search>-best-result.json``): plain JSON."""
        return {"search_id": self.search_id, "recommended": self.recommended.to_dict() if self.recommended else None,
                "confirmed": self.confirmed.to_dict() if self.confirmed else None, "best_mean_s": self.best_mean_s,
                "best_builder_baseline_s": self.best_builder_baseline_s,
                "speedup_over_best_baseline": self.speedup_over_best_baseline, "hit_rate": self.hit_rate,
                "trials": self.trials, "memory": self.memory.to_dict() if self.memory else {}, **self._per_runtime()}

    def metrics(self) -> dict[str, float | None]:
        """The search run's MLflow metrics."""
        out = {"speedup_over_best_baseline": self.speedup_over_best_baseline, "hit_rate": self.hit_rate,
               "best_mean_s": self.best_mean_s, "best_baseline_s": self.best_baseline_s, "trials": self.trials,
               "failed": self.failed, "trials_to_1_1x": self.trials_to_1_1x, "trials_to_1_2x": self.trials_to_1_2x,
               "best_builder_baseline_s": self.best_builder_baseline_s}
        out.update({k: v for k, v in self._per_runtime().items() if k.endswith("_best_s")})
        memory = self.memory
        if memory is not None:
            peaks = [p for p in memory.measured_peak_bytes or () if p is not None]
            if peaks:
                out["recommended_measured_peak_bytes"] = max(peaks)
            if memory.predicted_peak_bytes:
                out["recommended_predicted_peak_bytes"] = max(memory.predicted_peak_bytes)
            out["oom_trials"] = memory.oom_trials
        confirmed = self.confirmed
        if confirmed is not None and confirmed.interval is not None:
            out.update({"confirmed_speedup": confirmed.interval.ratio, "confirmed_speedup_low": confirmed.interval.low,
                        "confirmed_speedup_high": confirmed.interval.high})
        return out


def _baseline(best: BaselineTrial, skeleton: Strategy, why: str) -> Recommendation:
    return Recommendation(kind="baseline", name=best.label, strategy=skeleton, runtime=best.runtime, why=why)


def recommend(summary: SearchSummary, skeleton: Strategy) -> Recommendation | None:
    """What the search recommends: the best searched strategy when the confirmation found it
    faster than the best baseline; else that baseline; without a confirmation, the fastest
    single trial (engine, or a runtime's baseline, which runs on ``skeleton``'s replicas)."""
    confirmed = summary.confirmed
    runtime_best = summary.runtime_best()
    if confirmed is not None and confirmed.measured:
        if confirmed.verdict == "faster":
            return Recommendation(kind="search", name=confirmed.candidate,
                                  strategy=Strategy.from_dict(confirmed.candidate_strategy),
                                  why="confirmed faster than the best baseline")
        return Recommendation(kind="baseline", name=confirmed.baseline,
                              strategy=Strategy.from_dict(confirmed.baseline_strategy),
                              runtime=as_runtime(confirmed.baseline_runtime),
                              why=f"the best searched strategy was not confirmed faster ({confirmed.verdict})")
    if confirmed is not None:  # attempted and failed: nothing searched is confirmed, so the best baseline
        base = summary.best_builder_baseline_s
        why = (f"nothing was confirmed ({(confirmed.error or '')[:120]})" if confirmed.nothing_to_confirm
               else f"the confirmation did not finish ({(confirmed.error or '')[:120]})")
        if runtime_best is not None and (base is None or runtime_best.mean_s < base):
            return _baseline(runtime_best, skeleton, why)
        if base is not None and summary.best_baseline_strategy is not None:
            return Recommendation(kind="baseline", name=summary.best_baseline_origin or "",
                                  strategy=summary.best_baseline_strategy, why=why)
    best = summary.best_mean_s
    if runtime_best is not None and (best is None or runtime_best.mean_s < best):
        return _baseline(runtime_best, skeleton, "fastest single trial (unconfirmed)")
    if summary.best_strategy is None:
        return None
    origin = summary.best_origin or ""
    return Recommendation(kind="baseline" if origin.partition(":")[0] in BUILDERS else "search", name=origin,
                          strategy=summary.best_strategy, why="fastest single trial (unconfirmed)")
