"""Recording trials: the MLflow run first (so the row carries its id), then the dataset row,
which lands whether or not MLflow was reachable ("record before tell": a search's dataset rows
are its memory); and :class:`SearchRecorder`, which owns all a running search records."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..data.record import TrialRecord
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.composed import ENGINE
from ..engine.measure import TrialResult
from ..engine.memory import breakdown_from_row
from ..engine.runtime import Runtime
from ..engine.runtimes import as_runtime, runtime_from_record
from ..search.interface import Proposal, SearchTrial, search_figures
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .baselines import BaselineLedger, BaselineTrial
from .prepare import SearchContext
from .summary import SearchSummary

__all__ = ["record_trial", "record_result", "SearchRecorder", "CONFIRM_PREFIX"]

#: The trial ids of a search's confirmation rows start with this.
CONFIRM_PREFIX = "confirm-"


def record_trial(record: TrialRecord, dataset: TrialDataset, logger: MlflowLogger | None, *,
                 parent_run_id: str = "", speedup_over_best_baseline: float | None = None) -> TrialRecord:
    """Log ``record`` to MLflow (when a logger is given), then append its dataset row; returns
    the record as stored (with its MLflow run id when logging worked)."""
    if logger is not None:
        run_id = logger.log_trial(record, parent_run_id=parent_run_id,
                                  speedup_over_best_baseline=speedup_over_best_baseline)
        if run_id:
            record = dataclasses.replace(record, mlflow_run_id=run_id)
    dataset.append([record])
    return record


def record_result(result: TrialResult, strategy: Strategy, model: ModelSpec,
                  cluster: ClusterSpec, *, dataset: TrialDataset, logger: MlflowLogger | None, origin: str,
                  runtime: Runtime | dict | None = None, parent_run_id: str = "",
                  speedup_over_best_baseline: float | None = None, **fields: Any) -> TrialRecord:
    """Make the record of a trial's result, run by ``runtime`` (default: the engine), and record
    it; the result and the runtime become plain data here, at the Parquet boundary. The row
    carries the strategy the runtime executed (:meth:`~synctune.engine.runtime.Runtime.executed`:
    a tuned Megatron trial's plan, not the skeleton it was handed)."""
    runtime = as_runtime(runtime)
    record = TrialRecord.from_trial(result.to_dict(), runtime.executed(strategy, model), model, cluster, origin=origin,
                                    runtime=runtime.name, runtime_json=runtime.config_json(), **fields)
    return record_trial(record, dataset, logger, parent_run_id=parent_run_id,
                        speedup_over_best_baseline=speedup_over_best_baseline)


def _search_trial(record: Any) -> SearchTrial:
    """The search trial of one of its dataset rows."""
    breakdown = record.memory_breakdown
    return SearchTrial(trial_id=record.trial_id, strategy=Strategy.from_json(record.strategy_json),
                       origin=record.origin, predicted=record.predicted_time_s,
                       mean_s=record.mean_s if record.status == "ok" else None,
                       memory=tuple(breakdown) if breakdown else None)


class SearchRecorder:
    """Everything a running search records, in one place: each trial's MLflow run and dataset row
    (before anyone hears of it), the search's own trials in the order recorded (what its figures
    and its confirmation are made of, and what a resumed search continues from), the ledger of
    the runtimes' baselines, and each strategy's last measured peak per rank. It starts from the
    rows the search recorded already (the context's ``done``): a confirmation's, a trial of a
    runtime that runs strategies (the search's own: the engine, TensorFlow, FSDP2 from the shard
    plans), or a baseline runtime's."""

    def __init__(self, context: SearchContext) -> None:
        self.context = context
        self.trials: list[SearchTrial] = []
        self.ledger = BaselineLedger()
        self.confirmations = 0
        #: Per (hash of the strategy executed, :meth:`~synctune.engine.runtime.Runtime.executed`;
        #: runtime settings), each rank's measured peak of the last trial that measured one (the
        #: summary's memory per rank, measured beside predicted).
        self.measured_peaks: dict[tuple[str, str], list[int | None]] = {}
        #: This search's rows recorded while MLflow was unreachable, oldest first: logged as soon
        #: as a later trial reaches MLflow again (:meth:`log_unlogged`), or at the search's end.
        self.unlogged: list[TrialRecord] = []
        for r in context.done:
            runtime = runtime_from_record(r.runtime, r.runtime_json)
            if r.trial_id.startswith(CONFIRM_PREFIX):
                self.confirmations += 1
            elif runtime.runs_strategy:
                self.trials.append(_search_trial(r))
            else:
                self.ledger.add(BaselineTrial.from_record(r))
            if r.memory_breakdown:
                strategy = Strategy.from_json(r.strategy_json)
                self.measured_peaks[(strategy.hash, runtime.config_json())] = [
                    m.get("peak_bytes") for m in r.memory_breakdown]
                if not r.trial_id.startswith(CONFIRM_PREFIX):
                    self.teach(strategy, runtime, r.memory_breakdown, r.status)
        self.started = time.monotonic()

    def teach(self, strategy: Strategy, runtime: Runtime, breakdown: list | None, status: str) -> None:
        """Show the memory model a measured trial (:meth:`~synctune.simulator.memory.MemoryBudget.observe`):
        the strategy whose memory its runtime's ranks held, its breakdown, and whether it broke the
        budget; every trial teaches it before the next proposal is judged."""
        ctx = self.context
        if not breakdown:
            return
        held = runtime.plans_of(strategy, lambda: ctx.module, ctx.model)
        ctx.memory.observe(held, runtime.fsdp_layout, breakdown, oom=status == "oom")

    def search_state(self) -> dict[str, Any]:
        """The search algorithm's state (:meth:`~synctune.search.algorithm.StrategySearch.state`'s
        form) from the search's own trials recorded so far."""
        return {"trials": [t.to_dict() for t in self.trials]}

    def record(self, trial_id: str, strategy: Strategy, origin: str, result: TrialResult, *,
               runtime: Runtime = ENGINE, predicted: float | None = None) -> None:
        """Record one trial (MLflow, then its dataset row) before anyone is told of it."""
        ctx = self.context
        best_base = self.summary().best_baseline_s
        mean = result.measured_s
        peaks = ((result.extra or {}).get("memory") or {}).get("peak_bytes")
        if peaks:
            # keyed as the row records the trial (the executed strategy), so a resumed search finds it
            self.measured_peaks[(runtime.executed(strategy, ctx.model).hash, runtime.config_json())] = list(peaks)
            if not trial_id.startswith(CONFIRM_PREFIX):
                self.teach(strategy, runtime, breakdown_from_row(result.extra["memory"]), result.status)
        stored = record_result(result, strategy, ctx.model, ctx.cluster, dataset=ctx.dataset, logger=ctx.logger,
                               origin=origin, runtime=runtime, search_id=ctx.search_id, trial_id=trial_id,
                               predicted_time_s=predicted, experiment=ctx.exp.name, parent_run_id=ctx.parent_run,
                               workload_source=ctx.workload.source,
                               speedup_over_best_baseline=best_base / mean if (best_base and mean) else None)
        if ctx.logger is None:
            return
        if not stored.mlflow_run_id:
            self.unlogged.append(stored)
        elif self.unlogged:  # MLflow is back: the rows it missed get their runs now
            self.log_unlogged()

    def log_unlogged(self) -> int:
        """Log to MLflow, oldest first, this search's rows recorded while it was unreachable (each
        run tagged with its record id, as ``synctune mlflow sync`` logs it, which then finds it
        present); stops at the first that fails. Returns how many remain unlogged."""
        ctx = self.context
        while self.unlogged and ctx.logger is not None:
            if not ctx.logger.log_trial(self.unlogged[0], parent_run_id=ctx.parent_run):
                break
            self.unlogged.pop(0)
        return len(self.unlogged)

    def record_proposal(self, proposal: Proposal, result: TrialResult, runtime: Runtime) -> SearchTrial:
        """Record a trial of the search algorithm's ``proposal``; returns it as the search's trial
        (what the algorithm is then told)."""
        self.record(proposal.trial_id, proposal.strategy, proposal.origin, result, runtime=runtime,
                    predicted=proposal.predicted)
        memory = breakdown_from_row((result.extra or {}).get("memory"))
        trial = SearchTrial(trial_id=proposal.trial_id, strategy=proposal.strategy, origin=proposal.origin,
                            predicted=proposal.predicted, mean_s=result.measured_s,
                            memory=tuple(memory) if memory else None)
        self.trials.append(trial)
        return trial

    def record_baseline(self, runtime: Runtime, origin: str, result: TrialResult, params: dict | None = None,
                        *, prefix: str | None = None) -> BaselineTrial:
        """Record a trial of a runtime's baseline (tuned DDP or FSDP2, a Horovod entry) on the
        context's skeleton, and keep it in the ledger; its id is ``prefix`` (the runtime's name by
        default) and how many of the runtime's trials came before."""
        trial_id = f"{prefix or runtime.name}-{len(self.ledger.of(runtime.name))}"
        self.record(trial_id, self.context.skeleton, origin, result, runtime=runtime)
        trial = BaselineTrial(trial_id=trial_id, runtime=runtime, origin=origin, mean_s=result.measured_s,
                              params=params)
        self.ledger.add(trial)
        return trial

    def record_confirmation(self, strategy: Strategy, result: TrialResult, runtime: Runtime) -> None:
        """Record a confirmation as a row of its candidate (its per-round medians)."""
        self.record(f"{CONFIRM_PREFIX}{self.confirmations}", strategy, "confirmation", result, runtime=runtime)
        self.confirmations += 1

    def summary(self, **final: Any) -> SearchSummary:
        """The search's figures now; ``final``: what only the end knows (``confirmed``,
        ``simulator_selection``, ``training_free_simulator``, ``recommended``, ``memory``)."""
        figures = search_figures(self.trials, self.ledger.best_times_s())
        builders = [t for t in self.trials if t.is_builder and t.ok]
        builder = min(builders, key=lambda t: t.mean_s) if builders else None
        best = figures.best
        return SearchSummary(
            search_id=self.context.search_id, trials=figures.trials, failed=figures.failed,
            best_mean_s=figures.best_mean_s, best_origin=best.origin if best else None,
            best_strategy=best.strategy if best else None, best_baseline_s=figures.best_baseline_s,
            speedup_over_best_baseline=figures.speedup, hit_rate=figures.hit_rate,
            trials_to_1_1x=figures.trials_to_1_1x, trials_to_1_2x=figures.trials_to_1_2x,
            best_builder_baseline_s=builder.mean_s if builder else None,
            best_baseline_strategy=builder.strategy if builder else None,
            best_baseline_origin=builder.origin if builder else None, baselines=tuple(self.ledger.trials),
            wall_s=time.monotonic() - self.started, mlflow_parent_run=self.context.parent_run, **final)
