"""MLflow logging of searches and trials (one experiment per search, a parent run for the
search, a child run per trial), and the sync that logs records MLflow missed.

Trials never depend on MLflow: if the tracking server cannot be reached, logging gives up
after a bounded wait, the record keeps an empty ``mlflow_run_id`` and still lands in the
Parquet dataset; ``synctune mlflow sync`` logs it later. Runs carry the tag
``synctune.record_id``, which makes the sync idempotent.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable

from ..spec.files import check_regular
from .paths import artifact_root, default_tracking_uri
from .record import TrialRecord

__all__ = ["MlflowLogger", "sync_records", "check_tracking_uri", "RECORD_TAG", "SEARCH_TAG"]

RECORD_TAG = "synctune.record_id"
SEARCH_TAG = "synctune.search_id"
ROLE_TAG = "synctune.role"


#: MLflow's REST client retries for minutes by default; a trial must not wait that long. Set
#: once, before the first client is made (never toggled around calls: Tune's threads log too),
#: unless the user chose other values.
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _configure_http_once() -> None:
    for key, value in HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)


def check_tracking_uri(uri: str) -> str:
    """``uri``, refused (:class:`SpecError`) when it names a SQLite store that exists but is not a
    regular file: SQLite on a FIFO or device blocks or fails with "disk I/O error", which MLflow
    retries for minutes, though the fault is the path the user gave."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        if path and path != ":memory:" and os.path.lexists(path):
            check_regular(path, "MLflow SQLite store")
    return uri


class MlflowLogger:
    """Logs to one MLflow experiment. Each call is tried ``attempts`` times with a doubling pause
    (from ``backoff_s``); when all fail it warns on stderr and returns quietly (no run id), and
    the next call tries again: one outage never switches logging off for the rest of a search."""

    def __init__(self, experiment: str, tracking_uri: str | None = None, *, attempts: int = 3,
                 backoff_s: float = 0.5, quiet: bool = False) -> None:
        _configure_http_once()
        self.experiment = experiment
        self.tracking_uri = check_tracking_uri(tracking_uri or default_tracking_uri())
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self._client = None
        self._experiment_id: str | None = None
        self.available = True  # whether the last call reached the store
        self.last_error = ""
        self.quiet = quiet  # no warning on stderr (callers that report failures themselves)

    def _warn(self, what: str, exc: BaseException) -> None:
        self.available = False
        self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if self.quiet:
            return
        print(f"synctune: warning: MLflow at {self.tracking_uri} unavailable ({what}): {self.last_error}; "
              f"the dataset still has the record, `synctune mlflow sync` logs it later", file=sys.stderr)

    def _call(self, what: str, fn, default=None):
        """``fn()`` with bounded retries; ``default`` (and a warning) when every attempt failed."""
        import time

        for attempt in range(self.attempts):
            try:
                if not self._open():
                    raise self._open_error
                out = fn()
                self.available = True
                return out
            except Exception as exc:  # noqa: BLE001 - any failure means "MLflow unavailable now"
                if attempt + 1 == self.attempts:
                    self._warn(what, exc)
                    return default
                time.sleep(self.backoff_s * 2 ** attempt)
        return default

    def _open(self) -> bool:
        """Make the client and find (or create) the experiment, once it works."""
        if self._experiment_id is not None:
            return True
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
            exp = self._client.get_experiment_by_name(self.experiment)
            if exp is None:
                location = None
                if self.tracking_uri.startswith("sqlite:"):
                    location = (artifact_root() / self.experiment).resolve().as_uri()
                # Model-training experiments: the MLflow UI then opens on the runs table, not
                # its GenAI overview.
                self._experiment_id = self._client.create_experiment(
                    self.experiment, artifact_location=location,
                    tags={"mlflow.experimentKind": "custom_model_development"})
            else:
                self._experiment_id = exp.experiment_id
            return True
        except Exception as exc:  # noqa: BLE001
            self._open_error = exc
            return False

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment's id, found or created on first use; None while MLflow is unreachable."""
        return self._experiment_id if self._call("opening the experiment", lambda: True, False) else None

    def start_search(self, search_id: str, params: dict[str, Any], *, run_name: str | None = None) -> str:
        """Create (or find, when resuming) the parent run of a search; returns its id or ''."""
        def start() -> str:
            found = self._find_search(search_id)
            if found:
                return found
            run = self._client.create_run(self._experiment_id, run_name=run_name or f"search-{search_id[:8]}",
                                          tags={SEARCH_TAG: search_id, ROLE_TAG: "search"})
            self._log_params(run.info.run_id, params)
            return run.info.run_id

        return self._call("starting the search run", start, "")

    def _find_search(self, search_id: str) -> str:
        found = self._client.search_runs([self._experiment_id],
                                         f"tags.`{SEARCH_TAG}` = '{search_id}' and tags.`{ROLE_TAG}` = 'search'")
        return found[0].info.run_id if found else ""

    def find_search(self, search_id: str) -> str:
        """The id of the parent run of search ``search_id``, or '' when there is none."""
        return self._call("finding the search run", lambda: self._find_search(search_id), "")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items() if v is not None]
        for i in range(0, len(items), 100):
            self._client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float | None], *, final_status: str | None = None) -> None:
        """Log metrics (None values skipped) to a run, e.g. the search summary on the parent."""
        if not run_id:
            return

        def log() -> None:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            items = [Metric(k, float(v), now, 0) for k, v in metrics.items() if v is not None]
            if items:
                self._client.log_batch(run_id, metrics=items)
            if final_status:
                self._client.set_terminated(run_id, final_status)

        self._call("logging metrics", log)

    def log_text(self, run_id: str, text: str, name: str) -> None:
        """Attach ``text`` to a run as the artifact ``name`` (e.g. the search's best strategy)."""
        if run_id:
            self._call("logging an artifact", lambda: self._client.log_text(run_id, text, name))

    def log_trial(self, record: TrialRecord, *, parent_run_id: str = "",
                  speedup_over_best_baseline: float | None = None) -> str:
        """Log one trial as a (child) run: params, metrics, status tag, strategy and per-iteration
        times as artifacts. Returns the run id, or '' when MLflow is unavailable."""
        def log() -> str:
            from mlflow.entities import Metric

            tags = {RECORD_TAG: record.record_id, SEARCH_TAG: record.search_id, ROLE_TAG: "trial",
                    "status": record.status, "origin": record.origin}
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
            run = self._client.create_run(self._experiment_id, run_name=f"{record.origin}-{record.trial_id}",
                                          tags=tags)
            run_id = run.info.run_id
            self._log_params(run_id, {
                "model": record.model_name, "cluster": record.cluster_name, "origin": record.origin,
                "strategy_hash": record.strategy_hash, "num_replicas": record.num_replicas,
                "global_batch_size": record.global_batch_size, "num_ps_shards": record.num_ps_shards,
                "num_ps_servers": record.num_ps_servers, "num_allreduce_shards": record.num_allreduce_shards,
                "num_merge_groups": record.num_merge_groups, "num_allgather_shards": record.num_allgather_shards,
                "num_partitioned": record.num_partitioned, "num_shards": record.num_shards,
                "num_local_aggregation": record.num_local_aggregation,
                "compressors": ",".join(record.compressors), "warmup": record.warmup, "iters": record.iters,
                "launcher": record.launcher, "backend": record.backend, "trial_id": record.trial_id,
                "workload": record.workload_source,
                **({"tp_degree": record.tp_degree,
                    "tp_mesh": f"dp {record.num_replicas // record.tp_degree} x tp {record.tp_degree}"}
                   if record.tp_degree > 1 else {}),
            })
            stamp = int(record.created_at.timestamp() * 1000)
            metrics = {
                "mean_iteration_time_s": record.mean_s, "median_iteration_time_s": record.median_s,
                "std_iteration_time_s": record.std_s, "samples_per_s": record.samples_per_s,
                "predicted_time_s": record.predicted_time_s, "comm_bytes_per_iter": record.comm_bytes_per_iter,
                "peak_memory_bytes": record.peak_memory_bytes,
                "speedup_over_best_baseline": speedup_over_best_baseline,
            }
            items = [Metric(k, float(v), stamp, 0) for k, v in metrics.items() if v is not None]
            items += [Metric("iteration_time_s", float(t), stamp, i) for i, t in enumerate(record.iteration_times_s)]
            for i in range(0, len(items), 900):
                self._client.log_batch(run_id, metrics=items[i:i + 900])
            self._client.log_text(run_id, json.dumps(json.loads(record.strategy_json), indent=1, sort_keys=True),
                                  "strategy.json")
            self._client.log_text(run_id, json.dumps({"iteration_times_s": list(record.iteration_times_s),
                                                      "error": record.error}, indent=1), "trial.json")
            self._client.set_terminated(run_id, "FINISHED" if record.status == "ok" else "FAILED")
            return run_id

        # A retried call may find the run it created before failing: look it up by record id first.
        def log_once() -> str:
            found = self._client.search_runs([self._experiment_id], f"tags.`{RECORD_TAG}` = '{record.record_id}'")
            if found and found[0].info.status in ("FINISHED", "FAILED"):
                return found[0].info.run_id
            return log()

        return self._call("logging a trial", log_once, "")

    def drop_unrecorded_trials(self, search_id: str, recorded: set[str]) -> int:
        """Delete the trial runs of search ``search_id`` whose record id is not in ``recorded``
        (the dataset's rows of that search): what a driver killed between logging a trial and
        appending its row leaves, since the trial runs again on resume under a new record. Keeps
        a resumed search at one run per row. Returns how many were deleted."""
        def drop() -> int:
            gone, token = [], None
            while True:
                page = self._client.search_runs(
                    [self._experiment_id], f"tags.`{SEARCH_TAG}` = '{search_id}' and tags.`{ROLE_TAG}` = 'trial'",
                    max_results=1000, page_token=token)
                gone += [r.info.run_id for r in page if r.data.tags.get(RECORD_TAG, "") not in recorded]
                token = page.token
                if not token:
                    break
            for run_id in gone:
                self._client.delete_run(run_id)
            return len(gone)

        return self._call("dropping the runs of unrecorded trials", drop, 0)

    def logged_record_ids(self) -> set[str]:
        """Record ids that already have a run in this experiment."""
        def collect() -> set[str]:
            ids: set[str] = set()
            token = None
            while True:
                page = self._client.search_runs([self._experiment_id], f"tags.`{ROLE_TAG}` = 'trial'",
                                                max_results=1000, page_token=token)
                ids.update(r.data.tags.get(RECORD_TAG, "") for r in page)
                token = page.token
                if not token:
                    return ids

        return self._call("listing logged trials", collect, set())


def sync_records(records: Iterable[TrialRecord], tracking_uri: str | None = None) -> dict[str, int]:
    """Log every record that has no run yet in its experiment (``record.experiment``, default
    "synctune"); returns counts of logged and already-present runs."""
    by_experiment: dict[str, list[TrialRecord]] = {}
    for rec in records:
        by_experiment.setdefault(rec.experiment or "synctune", []).append(rec)
    logged = present = 0
    for experiment, recs in by_experiment.items():
        logger = MlflowLogger(experiment, tracking_uri, quiet=True)
        done = logger.logged_record_ids()
        if not logger.available:
            raise ConnectionError(f"MLflow at {logger.tracking_uri} is unavailable: {logger.last_error}")
        parents: dict[str, str] = {}
        for rec in recs:
            if rec.record_id in done:
                present += 1
                continue
            parent = ""
            if rec.search_id:
                if rec.search_id not in parents:
                    parents[rec.search_id] = logger.start_search(rec.search_id, {"model": rec.model_name,
                                                                                "cluster": rec.cluster_name})
                parent = parents[rec.search_id]
            if logger.log_trial(rec, parent_run_id=parent):
                logged += 1
            else:
                raise ConnectionError(f"MLflow at {logger.tracking_uri} failed while syncing: {logger.last_error}")
    return {"logged": logged, "present": present}
