"""Browser check: `synctune ui` on a store holding a logged search, opened in headless Chromium,
shows the search's trial runs and their metrics."""

from __future__ import annotations

import tempfile

import pytest
from _browser import browser as _browser
from _browser import pytestmark  # noqa: F401 - skips the module without Chromium
from _browser import serve_ui
from _browser import wait_text as _wait_text

from synctune.data import MlflowLogger, TrialRecord
from synctune.engine import TrialConfig, run_trial_local
from synctune.workload import zoo_workload
from synctune.models import model_spec
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy


@pytest.fixture()
def logged_search(tmp_path, monkeypatch):
    """A search with two trial runs, logged to a fresh SQLite MLflow store (one real trial of
    cnn-small stands for both rows' times: the page and the figure it shows are checked)."""
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path))
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    logger = MlflowLogger("browser-check")
    parent = logger.start_search("browsersearch01", {"model": spec.name, "cluster": cluster.name})
    measured = run_trial_local(build_strategy("allreduce", spec, cluster), cluster, TrialConfig(warmup=1, iters=3),
                               workload=zoo_workload(spec.name))
    assert measured.status == "ok", measured.error
    runs = {}
    for i, builder in enumerate(("ps-lb", "allreduce")):
        strategy = build_strategy(builder, spec, cluster)
        result = dict(measured.to_dict(), strategy_hash=strategy.hash)  # one measurement stands for both rows
        record = TrialRecord.from_trial(result, strategy, spec, cluster, origin=builder,
                                        search_id="browsersearch01", trial_id=f"trial{i}", experiment="browser-check")
        runs[f"{builder}-trial{i}"] = (logger.log_trial(record, parent_run_id=parent), record)
    logger.log_metrics(parent, {"best_speedup": 1.0}, final_status="FINISHED")
    return logger.experiment_id, runs


@pytest.fixture()
def ui_server(logged_search, tmp_path):
    with serve_ui(tmp_path) as url:
        yield url


def test_mlflow_ui_shows_the_search_trials_and_their_metrics(logged_search, ui_server):
    from selenium.webdriver.common.by import By

    experiment_id, runs = logged_search
    driver = _browser()
    try:
        driver.get(f"{ui_server}/#/experiments/{experiment_id}/runs")
        _wait_text(driver, "search-browsers")
        parent = driver.find_element(By.LINK_TEXT, "search-browsers")
        parent.find_element(By.XPATH, "./ancestor::*[@role='row'][1]").find_element(By.TAG_NAME, "button").click()
        body = _wait_text(driver, "allreduce-trial1")
        assert "ps-lb-trial0" in body and "3 matching runs" in body

        run_id, record = runs["allreduce-trial1"]
        driver.get(f"{ui_server}/#/experiments/{experiment_id}/runs/{run_id}")
        body = _wait_text(driver, "mean_iteration_time_s")
        for name in ("samples_per_s", "comm_bytes_per_iter", "strategy_hash", "local-1x2"):
            assert name in body, name
        assert f"{record.mean_s:.3g}"[:4] in body  # the measured value itself is displayed
    finally:
        driver.save_screenshot(str(tempfile.gettempdir() + "/synctune-mlflow-ui.png"))
        driver.quit()
