"""`synctune search` for real: a tiny search on a local preset through Ray Tune, and a driver
killed mid-search that `--resume` completes with exactly the budget of recorded trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _searches import search_env, tiny_experiment

from synctune.data import TrialDataset

ROOT = Path(__file__).resolve().parents[1]


def _experiment(tmp_path: Path, budget: int, iters: int = 3) -> Path:
    return tiny_experiment(tmp_path, budget, iters=iters)


def _env(tmp_path: Path) -> dict:
    return search_env(tmp_path / "home")


def _search(tmp_path: Path, experiment: Path, *extra: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "synctune", "search", str(experiment), *extra], env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)


def _rows(tmp_path: Path):
    return TrialDataset(tmp_path / "home" / "dataset").read(search_id="tiny-seed0")


def test_tiny_real_search(tiny_search, tmp_path):
    home, experiment, done = tiny_search
    out = done.stdout
    assert "search tiny-seed0: 6 trials (0 failed)" in out
    assert "single " in out and "hit rate" in out
    rows = TrialDataset(home / "dataset").read(search_id="tiny-seed0")
    assert len(rows) == 6 + 2 + 1 and (rows["status"] == "ok").all()
    # Rows are committed one file per trial; the search leaves its partition as one file.
    assert len(TrialDataset(home / "dataset").files()) == 1
    assert set(rows["origin"]) >= {"allreduce", "ps-lb", "partitioned-ps", "autodist", "ddp-tuned", "confirmation"}
    assert rows["mlflow_run_id"].str.len().eq(32).all()
    # Tuned DDP: real DDP trials, recorded with their configuration; the first is DDP's default.
    ddp = rows[rows["runtime"] == "ddp"].sort_values("created_at")
    assert list(ddp["trial_id"]) == ["ddp-0", "ddp-1"] and (rows["runtime"] != "ddp").sum() == 7
    first = json.loads(ddp["runtime_json"].iloc[0])
    assert (first["bucket_cap_mb"], first["first_bucket_mb"], first["comm_hook"]) == (25.0, 1.0, "none")
    assert "DDP " in out and "tuned torch DDP" in out
    # The confirmation: a row of the candidate, its interval in the summary, the result file.
    confirm = rows[rows["trial_id"] == "confirm-0"]
    figures = json.loads(confirm["extra_json"].iloc[0])["confirmation"]
    assert len(figures["a_s"]) == len(figures["b_s"]) == figures["rounds"] and figures["low"] <= figures["ratio"] <= figures["high"]
    # Rounds from 3 until the interval decides, up to 12 (four times), a look every round.
    assert figures["rule"] == {"min_rounds": 3, "max_rounds": 12, "step": 1, "width": 0.1, "alpha": 0.05}
    assert 3 <= figures["rounds"] <= 12 and figures["stopped"] in ("verdict", "narrow", "cap")
    assert f"confirmed {figures['ratio']:.3f}x [{figures['low']:.3f}, {figures['high']:.3f}] (95% sequential)" in out
    assert f"rounds 3 to 12, stopped at {figures['rounds']}" in out
    # Both sides screened: the searched strategies and the fastest baselines (builders, tuned DDP).
    assert figures["screened_baselines"] and figures["baseline"] in figures["screened_baselines"]
    assert any(b.startswith("tuned DDP") for b in figures["screened_baselines"])
    result = json.loads((home / "searches" / "tiny-seed0-best-result.json").read_text())
    assert result["confirmed"]["ratio"] == pytest.approx(figures["ratio"])
    assert result["recommended"]["kind"] == ("search" if figures["verdict"] == "faster" else "baseline")
    assert (home / "searches" / "tiny-seed0-best.json").is_file()
    assert (home / "reports" / "tiny-seed0.html").is_file() and "report " in done.stderr
    again = subprocess.Popen([sys.executable, "-m", "synctune", "search", str(experiment)], env=search_env(home),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _out, err = again.communicate(timeout=300)
    assert again.returncode == 2 and "pass --resume" in err


def _processes_of(session: int, marker: str) -> list:
    """This machine's processes in process session ``session`` or naming ``marker`` (a Ray temp
    folder) on their command line: a search driver and the Ray instance it started."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session or any(marker in a for a in proc.cmdline()):
                out.append(proc)
        except (OSError, psutil.Error):
            continue
    return out


def test_a_driver_killed_mid_trial_resumes_exactly_once_per_trial(tmp_path):
    """The driver killed (SIGKILL, its process group) while a trial runs, after at least three rows
    landed: `--resume` completes the search to exactly the budget, with one row and one MLflow
    trial run per trial (none lost, none twice, nothing measured twice), and prints the summary;
    the uninterrupted search of the same seed, fed the same measurements, proposes exactly those
    strategies under those ids, in that order. The killed driver's Ray instance goes with it,
    and both Ray instances' folders are removed here (a temp folder of their own, RAY_TMPDIR)."""
    import shutil
    import tempfile

    import mlflow

    ray_tmp = tempfile.mkdtemp(prefix="st-ray-")  # short: Ray's socket paths live under it
    env = dict(_env(tmp_path), RAY_TMPDIR=ray_tmp)
    experiment = _experiment(tmp_path, 6, iters=60)
    started: list[subprocess.Popen] = []

    def search(*extra: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "synctune", "search", str(experiment), *extra], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        return proc

    try:
        proc = search()
        until, landed = time.monotonic() + 400, 0
        while time.monotonic() < until and proc.poll() is None and landed < 3:
            if (tmp_path / "home" / "dataset").is_dir():
                landed = len(_rows(tmp_path))
            time.sleep(0.2)
        time.sleep(0.5)  # into the next trial (a second or more each)
        assert landed >= 3 and proc.poll() is None, "the search ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        before = len(_rows(tmp_path))
        assert 3 <= before < 6
        # Nothing of the killed driver outlives it: its Ray instance shares its fate.
        deadline = time.monotonic() + 30
        while (left := _processes_of(proc.pid, ray_tmp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [(p.pid, p.name()) for p in left]

        resumed = search("--resume")
        out, err = resumed.communicate(timeout=600)
        assert resumed.returncode == 0, err[-3000:]
        assert "search tiny-seed0: 6 trials (0 failed)" in out and "hit rate" in out, out
        rows = _rows(tmp_path).sort_values(["created_at", "record_id"])
        assert len(rows) == 6 and rows["trial_id"].is_unique and rows["strategy_hash"].is_unique
        assert (rows["status"] == "ok").all()
        # The uninterrupted search of the same seed, fed the same measurements, proposes exactly
        # these strategies under these ids, in this order.
        from synctune.run.simulators import make_search_simulator
        from synctune.search import StrategySearch, load_experiment
        from synctune.spec import cluster_preset
        from synctune.workload import zoo_workload

        exp = load_experiment(experiment)
        model, cluster = zoo_workload(exp.domain.model).spec(), cluster_preset(exp.domain.cluster)
        measured = {r.trial_id: (r.strategy_hash, r.mean_s if r.status == "ok" else None) for r in rows.itertuples()}
        reference = StrategySearch(model, cluster, exp, make_search_simulator(exp, model, cluster))
        proposed = []
        while (p := reference.ask()) is not None:
            proposed.append((p.trial_id, p.strategy.hash))
            reference.tell(p.trial_id, measured[p.trial_id][1])
        assert proposed == [(r.trial_id, r.strategy_hash) for r in rows.itertuples()]
        # MLflow: one finished trial run per row, none left over from the killed attempt.
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`synctune.role` = 'trial'")
        assert sorted(r.info.run_id for r in runs) == sorted(rows["mlflow_run_id"]), \
            [(r.info.run_name, r.info.status) for r in runs]
        assert {r.info.status for r in runs} == {"FINISHED"}
    finally:
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=60)
            for left in _processes_of(proc.pid, ray_tmp):
                try:
                    left.kill()
                except Exception:  # noqa: BLE001 - gone meanwhile
                    pass
        shutil.rmtree(ray_tmp, ignore_errors=True)

def test_the_tune_searcher_pickles_without_its_session_and_a_copy_says_it_is_detached():
    """Tune writes its searcher and callbacks into its experiment folder: they must pickle without
    the live session (actors, logger, callbacks: here a lock, which pickle refuses), and a copy
    read back refuses to serve, naming how a search resumes, where it once reached a process-wide
    registry of sessions."""
    import pickle
    import threading
    from types import SimpleNamespace

    from synctune.run.searcher import RecordTunedTrials, StrategySearcher
    from synctune.spec.errors import InfraError

    session = SimpleNamespace(search_id="pickle-check", slice_names=["s0", "s1"], lock=threading.Lock())
    searcher, callback = StrategySearcher(session), RecordTunedTrials(session, "ddp")
    assert searcher.session is session and callback.session is session and searcher.free_slices == ["s0", "s1"]
    copy = pickle.loads(pickle.dumps(searcher))
    assert (copy.metric, copy.mode, copy.search_id) == ("mean_s", "min", "pickle-check")
    with pytest.raises(InfraError, match="detached from its search; resume the search with `synctune search --resume`"):
        copy.suggest("trial-1")
    again = pickle.loads(pickle.dumps(callback))
    assert again.runtime == "ddp"
    with pytest.raises(InfraError, match="RecordTunedTrials of search 'pickle-check'"):
        again.session
