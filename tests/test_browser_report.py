"""Browser check of the dashboards: a real search's report and the dataset dashboard opened
in headless Chromium render every chart, log no console errors and load nothing from the
network; the same report opens inside the MLflow UI's artifact view."""

from __future__ import annotations

import subprocess
import sys
import time

from _browser import browser, serve_ui
from _browser import pytestmark  # noqa: F401 - skips the module without Chromium
from _searches import search_env


def _check_page(driver, expected_charts: int) -> None:
    until = time.monotonic() + 60
    rendered = -1
    while time.monotonic() < until:
        rendered = driver.execute_script(
            "return [...document.querySelectorAll('.synctune-chart')].filter("
            "c => c.querySelector('.plotly .main-svg')).length")
        if rendered == expected_charts:
            break
        time.sleep(0.5)
    total = driver.execute_script("return document.querySelectorAll('.synctune-chart').length")
    assert total == expected_charts and rendered == expected_charts, (total, rendered)
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [u for u in fetched if u.startswith(("http:", "https:"))], fetched


def test_search_and_dataset_pages_render_offline(tiny_search, tmp_path):
    home = tiny_search[0]
    done = subprocess.run([sys.executable, "-m", "synctune", "report", "--dataset", "-o", str(tmp_path / "ds.html")],
                          env=search_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    driver = browser()
    try:
        driver.get((home / "reports" / "tiny-seed0.html").as_uri())  # written by the search itself
        _check_page(driver, 5)
        assert "tiny-seed0" in driver.title
        driver.get((tmp_path / "ds.html").as_uri())
        _check_page(driver, 3)
    finally:
        driver.save_screenshot(str(tmp_path / "report.png"))
        driver.quit()


def test_report_opens_in_the_mlflow_artifact_view(tiny_search, monkeypatch):
    from mlflow.tracking import MlflowClient
    from selenium.webdriver.common.by import By

    from synctune.data import MlflowLogger

    home = tiny_search[0]
    monkeypatch.setenv("SYNCTUNE_HOME", str(home))  # the search's own store, found as the search found it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lg = MlflowLogger("tiny")
    run_id = lg.find_search("tiny-seed0")
    experiment_id = lg.experiment_id
    artifacts = [a.path for a in MlflowClient(lg.tracking_uri).list_artifacts(run_id)]
    assert "report.html" in artifacts
    with serve_ui(home) as url:
        driver = browser()
        try:
            driver.get(f"{url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/report.html")
            until = time.monotonic() + 60
            frames = []
            while not frames and time.monotonic() < until:
                frames = driver.find_elements(By.TAG_NAME, "iframe")
                time.sleep(0.5)
            assert frames, "the artifact view shows no page"
            driver.switch_to.frame(frames[0])
            until = time.monotonic() + 60
            rendered = 0
            while rendered < 5 and time.monotonic() < until:
                rendered = driver.execute_script(
                    "return document.querySelectorAll('.synctune-chart .plotly .main-svg').length ? "
                    "[...document.querySelectorAll('.synctune-chart')].filter("
                    "c => c.querySelector('.plotly .main-svg')).length : 0")
                time.sleep(0.5)
            assert rendered == 5
        finally:
            driver.quit()
