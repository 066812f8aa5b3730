"""Browser check: `synctune ui` on a store holding a logged search, opened in headless Chromium,
shows the search's trial runs and their metrics."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from synctune.data import MlflowLogger, TrialRecord
from synctune.engine import TrialConfig, run_trial_local
from synctune.engine.local import free_port
from synctune.models import model_spec
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="Chromium and chromedriver are not installed (apt-get install chromium "
                                       "chromium-driver; .ci/run does this)")


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1600,1000", f"--user-data-dir={tempfile.mkdtemp(prefix='synctune-chromium-')}"):
        opts.add_argument(arg)
    # An explicit driver path: Selenium must not try to download one.
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _wait_text(driver, text: str, timeout_s: float = 60.0) -> str:
    from selenium.webdriver.common.by import By

    until = time.monotonic() + timeout_s
    body = ""
    while time.monotonic() < until:
        body = driver.find_element(By.TAG_NAME, "body").text
        if text in body:
            return body
        time.sleep(0.5)
    raise AssertionError(f"{text!r} did not appear within {timeout_s:g} s; page shows: {body[:800]!r}")


@pytest.fixture()
def logged_search(tmp_path, monkeypatch):
    """A search with two real trials, logged to a fresh SQLite MLflow store."""
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path))
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    logger = MlflowLogger("browser-check")
    parent = logger.start_search("browsersearch01", {"model": spec.name, "cluster": cluster.name})
    runs = {}
    for i, builder in enumerate(("ps-lb", "allreduce")):
        strategy = build_strategy(builder, spec, cluster)
        result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=3))
        assert result.status == "ok", result.error
        record = TrialRecord.from_trial(result.to_dict(), strategy, spec, cluster, origin=builder,
                                        search_id="browsersearch01", trial_id=f"trial{i}", experiment="browser-check")
        runs[f"{builder}-trial{i}"] = (logger.log_trial(record, parent_run_id=parent), record)
    logger.log_metrics(parent, {"best_speedup": 1.0}, final_status="FINISHED")
    return logger.experiment_id, runs


@pytest.fixture()
def ui_server(logged_search, tmp_path):
    port = free_port()
    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "ui", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        until = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > until:
                pytest.fail(f"synctune ui did not come up on port {port} (exit status {proc.poll()})")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        # The UI runs worker processes of its own: stop the whole session we started.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


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
