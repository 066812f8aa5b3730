"""Dashboards: the numbers behind each view, pages that load nothing from outside, and the
`synctune report` command (a real search's report, the dataset's, bad input)."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from _searches import search_env

from synctune.models import model_spec
from synctune.report import SearchData, best_per_domain, dataset_report, progress_series, variable_table
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "dataset" / "sample-local-v0" / "data"
# Anything a page could fetch: script/img/iframe/link sources, CSS url(), @import.
EXTERNAL = re.compile(r"""<(?:script|img|iframe|link|source|audio|video|embed)\b[^>]*\b(?:src|href)\s*=\s*["']?"""
                      r"""(?:https?:)?//|url\(\s*["']?(?:https?:)?//|@import""", re.I)


def _rows(spec):
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    return pd.DataFrame([{"trial_id": tid, "status": st, "mean_s": m, "origin": tid.split("-")[-1],
                          "created_at": t0 + datetime.timedelta(seconds=i)} for i, (tid, st, m) in enumerate(spec)])


def test_progress_series_is_figure_9s_view():
    rows = _rows([("baseline-allreduce", "ok", 0.20), ("baseline-ps", "ok", 0.25), ("r1-0", "ok", 0.22),
                  ("r1-1", "failed", None), ("r2-0", "ok", 0.16), ("r2-1", "ok", 0.19)])
    s = progress_series(SearchData("x", rows))
    assert s["trial"] == [1, 2, 3, 4, 5, 6]
    assert s["best_speedup"] == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.20 / 0.16, 0.20 / 0.16])
    assert s["speedup"][:3] == pytest.approx([1.0, 0.8, 0.20 / 0.22]) and s["speedup"][3] is None
    assert s["hit_rate"][:2] == [None, None]  # no searched trial yet
    assert s["hit_rate"][2:] == pytest.approx([0.0, 0.0, 1 / 3, 2 / 4])


def test_variable_table_follows_backward_order_and_the_strategy():
    spec, cluster = model_spec("cnn-small"), cluster_preset("local-2x2")
    strategy = build_strategy("partitioned-ps", spec, cluster)
    table = variable_table(strategy.to_dict(), spec.to_dict())
    assert [r["variable"] for r in table] == [v.name for v in spec.variables]
    assert sum(r["bytes"] for r in table) == sum(v.num_bytes for v in spec.variables)
    assert {r["synchronizer"] for r in table} == {"ps"}
    plans = {p.variable: p for p in strategy.plans}
    assert [r["shards"] for r in table] == [len(plans[v.name].shards) for v in spec.variables]
    assert max(r["shards"] for r in table) > 1


def test_best_per_domain_compares_with_the_builders_of_that_domain():
    from synctune.data import TrialDataset

    rows = TrialDataset(SAMPLE).read()
    rows["domain"] = rows["model_name"] + " @ " + rows["cluster_name"]
    best = {b["domain"]: b for b in best_per_domain(rows)}
    assert len(best) == 4
    part = rows[(rows["domain"] == "ncf-small @ local-1x2") & (rows["status"] == "ok")]
    fastest = part["mean_s"].min()
    builders = part[part["origin"] != "random"]["mean_s"].min()
    assert best["ncf-small @ local-1x2"]["best_ms"] == pytest.approx(fastest * 1e3)
    assert best["ncf-small @ local-1x2"]["speedup_over_builders"] == pytest.approx(builders / fastest)


def test_dataset_page_is_self_contained():
    page = dataset_report(SAMPLE)
    assert page.count('class="synctune-chart"') == 3
    assert not EXTERNAL.search(page), EXTERNAL.search(page).group(0)
    assert page.count("<script") == 1 + 3  # plotly.js once, one call per chart


def _report(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "synctune", "report", *args], env=search_env(home),
                          capture_output=True, text=True, timeout=300)


def test_search_report_of_a_real_search(tiny_search, tmp_path):
    home, experiment, _done = tiny_search
    out = tmp_path / "tiny.html"
    done = _report(home, str(experiment), "-o", str(out))  # an experiment file names its search
    assert done.returncode == 0, done.stderr
    assert "attached as report.html to MLflow run" in done.stderr
    page = out.read_text()
    assert page.count('class="synctune-chart"') == 5  # progress, simulator, strategy bars + table, baselines
    assert not EXTERNAL.search(page)
    for text in ("Search progress", "pairwise ranking accuracy", "variable by variable", "Against each baseline",
                 "cnn-small on local-1x2", "confirmed speed-up", "interleaved rounds", "ddp-tuned",
                 "Where the best strategy spends its iteration", 'class="critical-path"', "waited for"):
        assert text in page, text
    assert not (tmp_path / "index.html").exists()  # nothing beside the named page
    index = (home / "reports" / "index.html").read_text()  # the list of reports is the data home's
    assert out.as_uri() in index


def test_report_bad_input_is_one_line(tiny_search, tmp_path):
    home = tiny_search[0]
    for args, message in ((["nope-seed0"], "no trials of search 'nope-seed0'"),
                          ([], "give a SEARCH"),
                          (["tiny-seed0", "--dataset"], "give a SEARCH"),
                          (["--dataset", "--data", str(tmp_path)], "is empty")):
        done = _report(home, *args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], done.stderr


def test_the_custom_view_example_builds_a_page(tiny_search, tmp_path):
    home = tiny_search[0]
    out = tmp_path / "custom.html"
    done = subprocess.run([sys.executable, str(ROOT / "dashboards" / "custom_view.py"), "tiny-seed0", "-o", str(out)],
                          env=search_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert page.count('class="synctune-chart"') == 6 and "Every timed iteration" in page
    assert not EXTERNAL.search(page)
