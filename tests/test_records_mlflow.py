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
