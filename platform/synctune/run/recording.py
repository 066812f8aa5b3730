"""Recording a trial: the MLflow run first (so the row carries its id), then the dataset row,
which lands whether or not MLflow was reachable ("record before tell": a search's dataset
rows are its memory)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..data.record import TrialRecord
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.measure import TrialResult
from ..engine.runtime import Runtime
from ..engine.runtimes import as_runtime
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy

__all__ = ["record_trial", "record_result"]


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
    it; the result and the runtime become plain data here, at the Parquet boundary."""
    runtime = as_runtime(runtime)
    record = TrialRecord.from_trial(result.to_dict(), strategy, model, cluster, origin=origin, runtime=runtime.name,
                                    runtime_json=runtime.config_json(), **fields)
    return record_trial(record, dataset, logger, parent_run_id=parent_run_id,
                        speedup_over_best_baseline=speedup_over_best_baseline)
