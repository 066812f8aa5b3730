"""The MLflow page a user lands on after a search: the runs to compare are chosen from the search's
rows (the confirmation, the confirmed pick, the screened baselines), their link is saved beside the
search, `synctune ui` prints it, and MLflow's compare view at that link, opened in headless
Chromium, shows exactly those runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
from _browser import browser as _browser
from _browser import pytestmark  # noqa: F401 - skips the module without Chromium
from _browser import wait_text as _wait_text
from _browser import stop_session, wait_until_serving

from synctune.cli._search import _save_links
from synctune.data import MlflowLogger, TrialDataset, TrialRecord, dataset_dir
from synctune.data.confirmation import Confirmation
from synctune.engine import TrialConfig, run_trial_local
from synctune.engine.local import free_port
from synctune.models import model_spec
from synctune.engine.ddp import DDPConfig, DDPRuntime
from synctune.run.baselines import BaselineTrial
from synctune.run.links import SearchLinks, compared_records, links_path
from synctune.spec import cluster_preset
from synctune.stats import PairedRatio
from synctune.strategy import build_strategy
from synctune.workload import zoo_workload

SEARCH = "comparesearch01"
CONFIRMED = Confirmation(interval=PairedRatio(ratio=1.2, low=1.1, high=1.3, rounds=10, per_round_ratios=(1.2,) * 10),
                         rounds=10, per_round=5, candidate="trial2 (autodist)", baseline="builder allreduce",
                         screened=("trial2 (autodist)",), screened_baselines=("builder allreduce", "builder ps-lb"))


@pytest.fixture(scope="module")
def logged_search(tmp_path_factory):
    """A search's rows, logged to a fresh SQLite MLflow store and the dataset: two builder
    baselines, a searched trial that was not screened, the confirmed pick and its confirmation
    (one real trial of cnn-small stands for every row's times: the page, not the figures, is checked).
    Logged once for both tests: (data home, experiment id, search run id)."""
    home = tmp_path_factory.mktemp("compare-home")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("SYNCTUNE_HOME", str(home))
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        logged = _log_search()
    return home, *logged


@pytest.fixture()
def search_home(logged_search, monkeypatch):
    """The logged search, with its data home set for the test."""
    monkeypatch.setenv("SYNCTUNE_HOME", str(logged_search[0]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return logged_search


def _log_search() -> tuple[str, str]:
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    logger = MlflowLogger("compare-check")
    parent = logger.start_search(SEARCH, {"model": spec.name, "cluster": cluster.name})
    dataset = TrialDataset(dataset_dir())
    arms = [("allreduce", "allreduce", "trial0"), ("ps-lb", "ps-lb", "trial1"), ("allreduce", "autodist", "trial2"),
            ("ps", "autodist", "trial3"), ("allreduce", "confirmation", "confirm-0")]
    measured = run_trial_local(build_strategy("allreduce", spec, cluster), cluster, TrialConfig(warmup=1, iters=2),
                               workload=zoo_workload(spec.name))
    assert measured.status == "ok", measured.error
    for builder, origin, trial_id in arms:
        strategy = build_strategy(builder, spec, cluster)
        result = dict(measured.to_dict(), strategy_hash=strategy.hash)  # one measurement stands for every row
        record = TrialRecord.from_trial(result, strategy, spec, cluster, origin=origin,
                                        search_id=SEARCH, trial_id=trial_id, experiment="compare-check")
        record = dataclasses.replace(record, mlflow_run_id=logger.log_trial(record, parent_run_id=parent))
        dataset.append([record])
    logger.log_metrics(parent, {"best_speedup": 1.2}, final_status="FINISHED")
    return logger.experiment_id, parent


def test_the_compared_runs_are_the_pick_its_confirmation_and_the_screened_baselines(search_home):
    records = TrialDataset(dataset_dir()).records(search_id=SEARCH)
    chosen = compared_records(records, CONFIRMED)
    assert [r.trial_id for r in chosen] == ["confirm-0", "trial2", "trial0", "trial1"]
    assert compared_records(records, None) == []
    # a tuned runtime's baseline is found by the name the confirmation gives it, its fastest trial
    ddp_json = DDPRuntime(DDPConfig(bucket_cap_mb=8.0)).config_json()
    ddp = [dataclasses.replace(records[0], trial_id=f"ddp-{i}", origin="ddp-tuned", runtime="ddp",
                               runtime_json=ddp_json, mlflow_run_id=f"run-ddp-{i}", mean_s=mean)
           for i, mean in enumerate((0.3, 0.2))]
    label = BaselineTrial.from_record(ddp[0]).label
    assert label.startswith("tuned DDP: ")
    against_ddp = dataclasses.replace(CONFIRMED, baseline=label, screened_baselines=(label, "builder ps-lb"))
    chosen = compared_records(records + ddp, against_ddp)
    assert [r.trial_id for r in chosen] == ["confirm-0", "trial2", "ddp-1", "trial1"]
    # without a confirmation, the link is the search's own run
    _, _, parent = search_home
    links = _save_links(SimpleNamespace(search_id=SEARCH, mlflow_parent_run=parent, confirmed=None), None)
    assert links.compare == () and links.search_url().endswith(f"/runs/{parent}")


def test_synctune_ui_prints_the_latest_search_and_its_compare_view_shows_the_runs(search_home, tmp_path):
    from selenium.webdriver.common.by import By

    home, experiment_id, parent = search_home
    # what `synctune search` does after its summary: the links saved beside the search
    links = _save_links(SimpleNamespace(search_id=SEARCH, mlflow_parent_run=parent, confirmed=CONFIRMED), None)
    records = TrialDataset(dataset_dir()).records(search_id=SEARCH)
    assert links.compare == tuple(r.mlflow_run_id for r in compared_records(records, CONFIRMED))
    assert links.experiment_id == experiment_id and len(links.compare) == 4
    saved = json.loads(links_path(home / "searches", SEARCH).read_text())
    assert SearchLinks.from_dict(saved) == links

    port = free_port()
    log = tmp_path / "ui.log"
    env = dict(os.environ, SYNCTUNE_HOME=str(home))
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "synctune", "ui", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    driver = None
    try:
        wait_until_serving(proc, port, 120)
        deadline = time.monotonic() + 30
        while not re.search(r"latest search \S+: (\S+)", log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        printed = re.search(rf"latest search {SEARCH}: (\S+)", log.read_text())
        assert printed, log.read_text()
        url = printed.group(1)
        assert url == links.compare_url(port) and url.startswith(f"http://127.0.0.1:{port}/#/compare-runs?")

        driver = _browser()
        driver.get(url)
        body = _wait_text(driver, "confirmation-confirm-0")
        for name in ("autodist-trial2", "allreduce-trial0", "ps-lb-trial1"):
            assert name in body, name
        assert "autodist-trial3" not in body  # a searched trial that was not screened is not compared
        assert "mean_iteration_time_s" in body  # the metrics are compared side by side
        assert driver.find_elements(By.TAG_NAME, "table") or "Run ID" in body
    finally:
        if driver is not None:
            driver.save_screenshot(str(tempfile.gettempdir() + "/synctune-mlflow-compare.png"))
            driver.quit()
        stop_session(proc)
