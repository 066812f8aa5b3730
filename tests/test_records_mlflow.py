"""Trials recorded to MLflow and the dataset; an unreachable MLflow never loses a record."""

from __future__ import annotations

import json

from click.testing import CliRunner

from synctune.cli import cli
from synctune.data import TrialDataset


def test_trial_lands_in_dataset_when_mlflow_is_down_and_sync_logs_it_later(tmp_path, monkeypatch):
    home = tmp_path / "home"
    blocker = tmp_path / "later"
    blocker.write_text("a file where the store's folder should be: the store cannot be opened")
    store = blocker / "mlflow.db"
    monkeypatch.setenv("SYNCTUNE_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    runner = CliRunner()
    res = runner.invoke(cli, ["trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "allreduce", "--warmup", "1",
                              "--iters", "2", "--json", "--experiment", "outage"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["status"] == "ok"
    assert "MLflow at sqlite:///" in res.stderr and "mlflow sync" in res.stderr
    rows = TrialDataset(home / "dataset").read()
    assert len(rows) == 1 and rows["mlflow_run_id"].iloc[0] == "" and rows["experiment"].iloc[0] == "outage"

    blocker.unlink()
    blocker.mkdir()  # the store comes back
    res = runner.invoke(cli, ["mlflow", "sync"])
    assert res.exit_code == 0, res.output
    assert "logged 1 run(s); 0 were already in MLflow" in res.output
    res = runner.invoke(cli, ["mlflow", "sync"])
    assert "logged 0 run(s); 1 were already in MLflow" in res.output

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    exp = client.get_experiment_by_name("outage")
    (run,) = client.search_runs([exp.experiment_id])
    record = rows.iloc[0]
    assert run.data.tags["synctune.record_id"] == record["record_id"]
    assert run.data.params["strategy_hash"] == record["strategy_hash"]
    assert run.data.metrics["mean_iteration_time_s"] == record["mean_s"]
    history = client.get_metric_history(run.info.run_id, "iteration_time_s")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == list(record["iteration_times_s"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"strategy.json", "trial.json"} <= artifacts


def test_trial_with_mlflow_up_records_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path))
    res = CliRunner().invoke(cli, ["trial", "-m", "ncf-small", "-c", "local-1x2", "-b", "parallax", "--warmup", "1",
                                   "--iters", "2"])
    assert res.exit_code == 0, res.output
    rows = TrialDataset(tmp_path / "dataset").read()
    assert len(rows) == 1 and len(rows["mlflow_run_id"].iloc[0]) == 32 and rows["origin"].iloc[0] == "parallax"
    assert "MLflow run" in res.stderr


def _record(i: int):
    from synctune.data import TrialRecord
    from synctune.models import model_spec
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy

    spec, cl = model_spec("cnn-small"), cluster_preset("local-1x2")
    result = {"status": "ok", "iteration_times_s": [0.1, 0.2], "mean_s": 0.15, "median_s": 0.15, "std_s": 0.05,
              "samples_per_s": 200.0, "comm_bytes_per_iter": 10, "peak_memory_bytes": 10, "launcher": "local"}
    return TrialRecord.from_trial(result, build_strategy("allreduce", spec, cl), spec, cl, origin="allreduce",
                                  trial_id=f"t{i}", experiment="flaky")


def test_one_outage_does_not_switch_logging_off_and_a_call_retries(tmp_path):
    """The store is down for the first trial (its row keeps no run id), back for the second: the
    same logger logs it. Then the store goes down during a call and comes back within the
    call's backoff: that call still logs."""
    import threading

    from synctune.data import MlflowLogger

    blocker = tmp_path / "later"
    blocker.write_text("the store's folder is a file: the store cannot be opened")
    logger = MlflowLogger("flaky", f"sqlite:///{blocker / 'mlflow.db'}", attempts=2, backoff_s=0.05)
    assert logger.log_trial(_record(0)) == ""
    blocker.unlink()
    blocker.mkdir()
    assert len(logger.log_trial(_record(1))) == 32

    other = tmp_path / "other"
    other.write_text("down")
    logger = MlflowLogger("flaky", f"sqlite:///{other / 'mlflow.db'}", attempts=3, backoff_s=0.5)

    def come_back():
        other.unlink()
        other.mkdir()

    timer = threading.Timer(0.2, come_back)
    timer.start()
    try:
        assert len(logger.log_trial(_record(2))) == 32  # the first attempt failed, a retry logged it
    finally:
        timer.cancel()


def test_logging_never_changes_the_environment_under_other_threads(tmp_path):
    """MLflow's HTTP settings are set once; logging does not flip process-wide variables that
    other threads (Tune's) read at the same moment."""
    import os
    import threading

    from synctune.data import MlflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # One trial logged to another experiment of the store first: MLflow's tables and the modules it
    # imports on a first run, made before the watcher starts (under a thread that never yields the
    # GIL they took most of the test). Every call of the logger under test is watched.
    assert len(MlflowLogger("env-warm", uri).log_trial(_record(9))) == 32
    logger = MlflowLogger("env", uri)
    keys = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    before = {k: os.environ.get(k) for k in keys}
    seen: set = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.add(tuple(os.environ.get(k) for k in keys))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(3):
            assert len(logger.log_trial(_record(10 + i))) == 32
    finally:
        stop.set()
        watcher.join()
    assert seen == {tuple(before[k] for k in keys)}


def test_a_resumed_search_drops_the_runs_of_trials_that_have_no_row(tmp_path):
    """A driver killed after logging a trial's run but before appending its row: on resume the
    trial runs again under a new record, so the old run goes; runs with rows, and other searches',
    stay."""
    import dataclasses

    from synctune.data import MlflowLogger

    logger = MlflowLogger("resumed", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mine = [dataclasses.replace(_record(i), search_id="s1") for i in range(3)]
    other = dataclasses.replace(_record(9), search_id="s2")
    ids = {r.record_id: logger.log_trial(r) for r in [*mine, other]}
    assert all(ids.values())
    assert logger.drop_unrecorded_trials("s1", {mine[0].record_id}) == 2
    assert logger.logged_record_ids() == {mine[0].record_id, other.record_id}
    assert logger.drop_unrecorded_trials("s1", {mine[0].record_id}) == 0


def test_a_search_logs_the_runs_mlflow_missed_once_it_is_back(tmp_path, local_ray, monkeypatch):
    """MLflow unreachable when a search starts, back after its first trial: every row lands in
    the dataset (the first without a run id), and the first trial that reaches MLflow again logs
    the missed ones, so the store has exactly one trial run per row, each tagged with its record
    id, with no `synctune mlflow sync` run."""
    from mlflow.tracking import MlflowClient

    from _searches import tiny_experiment
    from synctune.models import model_spec
    from synctune.run import run_search
    from synctune.search.experiment import load_experiment
    from synctune.spec import cluster_preset
    from synctune.workload import zoo_workload

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home"))
    blocker = tmp_path / "later"
    blocker.write_text("the store's folder is a file: the store cannot be opened")
    uri = f"sqlite:///{blocker / 'mlflow.db'}"
    exp = load_experiment(str(tiny_experiment(tmp_path, budget=3)))
    seen: list[str] = []

    def on_trial(result, _summary):
        seen.append(result.status)
        if blocker.is_file():  # the store comes back after the first trial
            blocker.unlink()
            blocker.mkdir()

    summary = run_search(exp, model_spec("cnn-small"), cluster_preset("local-1x2"), workload=zoo_workload("cnn-small"),
                         tracking_uri=uri, on_trial=on_trial)
    assert summary.trials == 3 and summary.failed == 0, seen
    rows = TrialDataset(tmp_path / "home" / "dataset").read()
    assert (rows["mlflow_run_id"] == "").sum() >= 1  # the rows recorded while it was down keep no run id
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(exp.name).experiment_id],
                              "tags.`synctune.role` = 'trial'")
    assert sorted(r.data.tags["synctune.record_id"] for r in runs) == sorted(rows["record_id"])
