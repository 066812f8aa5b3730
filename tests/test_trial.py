"""Trials on local processes: results, and bounded failure when workers die, fail or hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from _engine_workers import failing_worker, hang_worker
from synctune.cli import cli
from synctune.engine import TrialConfig, run_trial_local
from synctune.workload import zoo_workload
from synctune.engine.local import WorkerFailure, classify_error, run_local
from synctune.models import model_spec
from synctune.spec import SpecError, cluster_preset
from synctune.strategy import Strategy, build_strategy

ROOT = Path(__file__).resolve().parents[1]


def test_cli_trial_json_has_40_timed_iterations():
    # cnn-small: 40 of its iterations take about 3 s where bert-tiny's took over 20 (what is
    # checked is the CLI's default and its JSON, not the model).
    result = CliRunner().invoke(cli, ["trial", "--model", "cnn-small", "--cluster", "local-2x2", "--builder", "ps-lb",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["status"] == "ok" and data["launcher"] == "local" and data["num_workers"] == 4
    times = data["iteration_times_s"]
    assert len(times) == 40 and all(t > 0 for t in times)
    assert data["mean_s"] == pytest.approx(sum(times) / 40)
    assert min(times) <= data["median_s"] <= max(times)
    assert data["samples_per_s"] == pytest.approx(64 / data["mean_s"])  # cnn-small: 16 a replica x 4
    assert data["comm_bytes_per_iter"] > 0 and data["peak_memory_bytes"] > 0


def test_uneven_batch_split_and_progress_events():
    cluster = cluster_preset("local-1x2")
    strategy = build_strategy("allreduce", model_spec("cnn-small"), cluster)
    strategy = type(strategy)(**{**strategy.__dict__, "batch_split": (3, 9)})
    events = []
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=3), on_progress=events.append,
                             workload=zoo_workload("cnn-small"))
    assert result.status == "ok" and result.global_batch_size == 12
    assert result.samples_per_s == pytest.approx(12 / result.mean_s)
    assert sorted(e["rank"] for e in events if e["event"] == "started") == [0, 1]
    assert [e["iteration"] for e in events if e["event"] == "iteration"] == [1, 2, 3, 4]


def test_killed_worker_fails_the_trial_quickly():
    cluster = cluster_preset("local-1x2")
    strategy = build_strategy("ps-lb", model_spec("cnn-small"), cluster)
    pids = {}

    def on_progress(msg):
        if msg["event"] == "started":
            pids[msg["rank"]] = msg["pid"]
        elif msg["event"] == "iteration" and msg["iteration"] == 3:
            os.kill(pids[1], signal.SIGKILL)

    start = time.monotonic()
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=2, iters=10_000, timeout_s=300),
                             workload=zoo_workload("cnn-small"),
                             on_progress=on_progress)
    assert result.status == "failed"
    assert "rank 1 killed by SIGKILL" in result.error
    # Noticed by the death, not by the trial's 300 s deadline: a bound that leaves start-up on two
    # busy shared cores its time (the kill itself comes at iteration 3, an event).
    assert time.monotonic() - start < 150


def test_hung_peer_is_a_timeout_not_a_hang():
    start = time.monotonic()
    with pytest.raises(WorkerFailure) as info:
        run_local(hang_worker, 2, (120.0,), timeout_s=8, collective_timeout_s=60)
    assert info.value.status == "timeout"
    assert "after 8 s" in info.value.message
    # The 8 s deadline ended it: the 60 s collective timeout or the 120 s sleep would take at least
    # 60 s, so anything below that (start-up on a busy machine included) tells them apart.
    assert time.monotonic() - start < 55


def test_worker_exception_is_reported_with_its_rank_and_kind():
    with pytest.raises(WorkerFailure) as info:
        run_local(failing_worker, 2, (), timeout_s=60)
    assert info.value.status == "oom"
    assert info.value.message == "rank 1: MemoryError: simulated allocation failure"


def test_classify_error():
    assert classify_error(RuntimeError("CUDA out of memory. Tried to allocate")) == "oom"
    assert classify_error(RuntimeError("[/gloo/transport/tcp/pair.cc] Timed out waiting 5000ms")) == "timeout"
    assert classify_error(ValueError("bad shape")) == "failed"


def test_unsupported_strategy_is_rejected_before_launch(tmp_path):
    cluster = cluster_preset("local-1x2")
    data = build_strategy("ps", model_spec("cnn-small"), cluster).to_dict()
    data["plans"][0]["shards"][0]["synchronizer"]["staleness"] = 1  # valid in the language, not executed
    strategy = Strategy.from_dict(data)
    with pytest.raises(SpecError, match="staleness: 1 is not supported"):
        run_trial_local(strategy, cluster, workload=zoo_workload("cnn-small"))
    path = tmp_path / "s.json"
    path.write_text(strategy.to_json())
    result = CliRunner().invoke(cli, ["trial", "-m", "cnn-small", "-c", "local-1x2", "-s", str(path)])
    assert result.exit_code == 2 and "staleness: 1 is not supported" in result.stderr


def test_gpu_preset_without_gpus_is_a_clear_error():
    result = CliRunner().invoke(cli, ["trial", "-m", "cnn-small", "-c", "B4", "-b", "allreduce"])
    assert result.exit_code == 2
    assert "needs 4 GPU worker(s) and this machine has 0 GPU(s)" in result.stderr


def test_an_iteration_counts_as_its_slowest_rank_and_warmup_is_not_timed():
    """Rank 1 sleeps 0.4 s in its update at steps 0 (warm-up), 3 and 5 (timed iterations 1 and 3),
    where rank 0 does not wait for it: the reported times show exactly those two iterations slow."""
    from _engine_workers import SlowStepWorkload

    cluster = cluster_preset("local-1x2")
    strategy = build_strategy("allreduce", model_spec("cnn-small"), cluster)
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=2, iters=6),
                             workload=SlowStepWorkload(sleepy_rank=1, sleep_steps=(0, 3, 5), sleep_s=0.4))
    assert result.status == "ok", result.error
    times = result.iteration_times_s
    assert len(times) == 6
    # Bounds from the sleep, not from this machine's speed: the two slowest iterations are the
    # sleepy ones and hold the whole 0.4 s; every other is at least half a sleep shorter than both
    # (a load that slows compute slows them all alike).
    slow = sorted(sorted(range(len(times)), key=times.__getitem__)[-2:])
    assert slow == [1, 3], times
    assert min(times[i] for i in slow) >= 0.4 * 0.99, times
    assert max(t for i, t in enumerate(times) if i not in slow) < min(times[i] for i in slow) - 0.2, times


def test_peak_memory_is_each_trials_own_when_workers_are_reused():
    """Two trials on one reused process group: a large batch (8 MB per sample in the loss), then a
    tiny one. The second trial's peak is its own, not the process's lifetime high-water mark."""
    from _engine_workers import HungryWorkload

    from synctune.engine.trial import run_trials_local

    cluster = cluster_preset("local-1x2")
    base = build_strategy("allreduce", model_spec("cnn-small"), cluster)
    big = type(base)(**{**base.__dict__, "batch_split": (48, 48)})
    small = type(base)(**{**base.__dict__, "batch_split": (1, 1)})
    first, second = run_trials_local([big, small], cluster, TrialConfig(warmup=1, iters=2),
                                     workload=HungryWorkload())
    assert first.status == second.status == "ok", (first.error, second.error)
    assert first.peak_memory_bytes > 48 * 8e6  # the scratch tensor was resident
    assert second.peak_memory_bytes < first.peak_memory_bytes - 250e6, (first.peak_memory_bytes,
                                                                        second.peak_memory_bytes)


def test_trials_on_different_replica_subsets_share_no_process_group():
    """A collection mixes strategies on every device with strategies on a replica subset (TAG
    §4.2). Each runs on as many processes as it has replicas: the subset trial's batch split is
    its own and its result matches the same strategy run alone (before the fix, every trial ran
    in the first trial's group: 'strategy has 2 replicas but the process group has 4 ranks')."""
    from synctune.engine.trial import run_trials_local
    from synctune.search import GuidedSampler

    spec, cluster = model_spec("cnn-small"), cluster_preset("local-2x2")
    full = build_strategy("allreduce", spec, cluster)
    subset = GuidedSampler(spec, cluster).on_nodes(full, [1])
    assert len(subset.replicas) == 2
    config = TrialConfig(warmup=1, iters=2, seed=3)
    results = run_trials_local([full, subset, subset, full], cluster, config, workload=zoo_workload("cnn-small"))
    assert [r.status for r in results] == ["ok"] * 4, [r.error for r in results]
    alone = run_trial_local(subset, cluster, config, workload=zoo_workload("cnn-small"))
    assert alone.status == "ok"
    assert results[1].extra.get("final_loss") == pytest.approx(alone.extra.get("final_loss"), rel=1e-6)


def test_progress_report_takes_the_loss_without_the_requires_grad_warning(monkeypatch, tmp_path):
    """A loss that still requires grad (a Hugging Face model's) goes into every progress report;
    float() of such a tensor warns once per iteration of every trial unless it is detached."""
    import warnings

    import torch
    import torch.distributed as dist

    from synctune.engine import local, measure

    reports = []
    monkeypatch.setattr(local, "_REPORTER", reports.append)
    weight = torch.ones(3, requires_grad=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="Converting a tensor with requires_grad=True", category=UserWarning)
            out = measure.timed_iterations(0, 1, TrialConfig(warmup=1, iters=2), torch.device("cpu"),
                                           measure.PeakMemory(torch.device("cpu")), lambda: (weight * 2).sum(),
                                           t_start=time.perf_counter())
    finally:
        dist.destroy_process_group()
    # The reported figures are the loss itself (independent: 2 * 3 ones), once per iteration.
    assert [r["loss"] for r in reports] == [6.0, 6.0, 6.0]
    assert out["final_loss"] == 6.0


def test_the_median_interval_is_the_published_order_statistics():
    """The 95% interval of a median from order statistics, against the ranks tabulated in
    Conover's Practical Nonparametric Statistics (n = 10: 2nd and 9th; 20: 6th and 15th; 30:
    10th and 21st; 100: 40th and 61st), and none below 6 values."""
    from synctune.stats import median_interval

    for n, (lo, hi) in {10: (2, 9), 20: (6, 15), 30: (10, 21), 100: (40, 61)}.items():
        values = [float(v) for v in range(1, n + 1)]  # the k-th smallest is k
        low, _mid, high = median_interval(values[::-1])
        assert (low, high) == (lo, hi), n
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0])[0] == float("-inf")


def test_a_trial_with_a_target_interval_measures_until_it_holds_or_a_cap():
    """With ``target_ci`` a trial times at least ``iters`` and at most ``max_iters`` iterations,
    every rank stopping after the same one (the trial finishes), and records why it stopped
    with the interval of its median; that interval is the one the recorded times give
    (``median_interval`` of them, the independent reference), within the target when it says
    so. A target no machine reaches runs to the cap."""
    from synctune.stats import median_interval

    cluster = cluster_preset("local-1x2")
    strategy = build_strategy("allreduce", model_spec("cnn-small"), cluster)
    for target, cap in ((0.2, 60), (1e-6, 24)):
        result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=8, target_ci=target, max_iters=cap),
                                 workload=zoo_workload("cnn-small"))
        assert result.ok, result.error
        m = result.extra["measure"]
        times = result.iteration_times_s
        assert 8 <= len(times) == result.iters == m["iterations"] <= cap
        low, mid, high = median_interval(times)
        assert m["median_ci_s"] == [low, high] and m["median_ci_rel"] == pytest.approx(max(mid - low, high - mid) / mid)
        if m["stopped"] == "target":
            assert m["median_ci_rel"] <= target
        else:
            assert m["stopped"] in ("max_iters", "max_timed_s")
        if target == 1e-6:
            assert m["stopped"] == "max_iters" and len(times) == cap
    fixed = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=7), workload=zoo_workload("cnn-small"))
    assert fixed.iters == len(fixed.iteration_times_s) == 7 and fixed.extra["measure"]["rule"] == "fixed"


def test_pinned_workers_each_run_on_their_own_cpu():
    """``pin_cpus``: rank r may run on the r-th CPU this process may use (cyclically) and on no
    other; unpinned, a worker may run on every one."""
    from _engine_workers import affinity_worker

    cpus = sorted(os.sched_getaffinity(0))
    pinned = run_local(affinity_worker, 3, timeout_s=120, pin_cpus=True)
    assert pinned == [[cpus[r % len(cpus)]] for r in range(3)]
    assert run_local(affinity_worker, 2, timeout_s=120) == [cpus, cpus]


def _fork_server_launcher_env() -> dict[str, str]:
    """The environment of a launcher whose unpinned workers are forked from the fork server
    (skips the test where the launcher never forks: a machine with an NVIDIA device)."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("an NVIDIA device here: every worker starts a fresh interpreter (the fork server is CPU-only)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), str(ROOT / "tests")]))
    env.pop("SYNCTUNE_WORKER_START", None)
    return env


def test_workers_see_the_launchers_environment_as_it_is_at_each_run(tmp_path):
    """Workers are forked from a fork server that imported torch once; they must still see the
    launcher's environment as it is at each run, as fresh interpreters do (a variable set, one
    unset since the server started), and a changed variable that torch reads when it loads must
    start fresh interpreters again. A launcher process of its own, so the server starts here."""
    script = tmp_path / "launcher.py"
    script.write_text(
        "import json, os, sys\n"
        "from _engine_workers import environment_worker\n"
        "from synctune.engine.local import run_local\n"
        "def run(name):\n"
        "    return run_local(environment_worker, 2, (name,), timeout_s=120, threads=1)\n"
        "if __name__ == '__main__':\n"
        "    os.environ['SYNCTUNE_CHECK_GONE'] = 'before'\n"
        "    first = run('SYNCTUNE_CHECK_GONE')\n"
        "    del os.environ['SYNCTUNE_CHECK_GONE']\n"
        "    os.environ['SYNCTUNE_CHECK_NEW'] = 'after'\n"
        "    gone, new = run('SYNCTUNE_CHECK_GONE'), run('SYNCTUNE_CHECK_NEW')\n"
        "    os.environ['OMP_NUM_THREADS'] = '1'\n"
        "    loaded = run('OMP_NUM_THREADS')\n"
        "    print(json.dumps({'me': os.getpid(), 'first': first, 'gone': gone, 'new': new, 'loaded': loaded}))\n")
    env = _fork_server_launcher_env()
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [w["value"] for w in out["first"]] == ["before", "before"]
    assert [w["value"] for w in out["gone"]] == [None, None]
    assert [w["value"] for w in out["new"]] == ["after", "after"]
    # Forked: the parent is the fork server, not the launcher; after OMP_NUM_THREADS changed, a
    # fresh interpreter each, whose parent is the launcher.
    assert all(w["parent"] != out["me"] for key in ("first", "gone", "new") for w in out[key])
    assert [w["value"] for w in out["loaded"]] == ["1", "1"]
    assert all(w["parent"] == out["me"] for w in out["loaded"])


def test_workers_bound_to_other_cpus_than_the_fork_servers_start_fresh(tmp_path):
    """Torch's OpenMP runtime counts the CPUs it may use when torch loads, and spins its threads
    by that count (libgomp's GOMP_SPINCOUNT): a worker forked from the fork server kept the
    server's count, and one pinned to a CPU with two threads ran an iteration 30 times slower
    than a fresh interpreter. So pinned workers start fresh; and a launcher whose own CPUs
    changed since the server started gets workers on its CPUs, not the server's (forked ones
    ran on every CPU of the server). A launcher process of its own, so the server starts there."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here: no worker can be bound to other CPUs than the fork server's")
    script = tmp_path / "launcher.py"
    script.write_text(
        "import json, os\n"
        "from _engine_workers import cpus_worker\n"
        "from synctune.engine.local import run_local\n"
        "if __name__ == '__main__':\n"
        "    free = run_local(cpus_worker, 2, timeout_s=120)\n"
        "    pinned = run_local(cpus_worker, 2, timeout_s=120, pin_cpus=True)\n"
        "    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "    narrowed = run_local(cpus_worker, 2, timeout_s=120)\n"
        "    print(json.dumps({'me': os.getpid(), 'free': free, 'pinned': pinned, 'narrowed': narrowed}))\n")
    done = subprocess.run([sys.executable, str(script)], env=_fork_server_launcher_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [w["cpus"] for w in out["free"]] == [cpus, cpus]
    assert all(w["parent"] != out["me"] for w in out["free"])  # forked: the fork server's children
    assert [w["cpus"] for w in out["pinned"]] == [[cpus[0]], [cpus[1]]]
    assert all(w["parent"] == out["me"] for w in out["pinned"] + out["narrowed"])  # fresh interpreters
    assert [w["cpus"] for w in out["narrowed"]] == [[cpus[0]], [cpus[0]]]


def test_a_collection_without_a_terminal_prints_a_line_per_trial(tmp_path):
    """With no terminal for the progress bar (nohup, output to a log file) a long collection
    showed nothing between its start and its end; now each trial is one line, with the median
    the dataset recorded for it."""
    import pyarrow.dataset as pds
    from click.testing import CliRunner

    from synctune.cli import cli

    data = tmp_path / "data"
    result = CliRunner(env={"SYNCTUNE_HOME": str(tmp_path / "home")}).invoke(cli, [
        "dataset", "collect", "--data", str(data), "-m", "cnn-small", "-c", "local-1x2", "--random", "2",
        "--no-builders", "--warmup", "0", "--iters", "2"])
    assert result.exit_code == 0, result.output
    rows = pds.dataset(data, format="parquet", partitioning="hive").to_table().to_pylist()
    assert len(rows) == 2
    for i, row in enumerate(sorted(rows, key=lambda r: r["trial_id"]), start=1):
        assert f"cnn-small@local-1x2: {i}/2 {row['trial_id']}: {row['median_s'] * 1e3:.1f} ms" in result.stderr


def test_a_rendezvous_port_taken_before_rank_0_listens_is_replaced(monkeypatch):
    """The launcher names rank 0's rendezvous port before the workers start; a socket that takes
    it meanwhile (CI once lost a run so, EADDRINUSE) must cost a new port, not the trial."""
    import operator
    import socket

    from synctune.engine import local

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        given = [busy.getsockname()[1]]  # the first port the launcher gets is taken
        real = local.free_port
        monkeypatch.setattr(local, "free_port", lambda: given.append(real()) or given[-2])
        assert local.run_local(operator.add, 2, timeout_s=120, threads=1) == [2, 3]  # rank + world
        assert len(given) == 3  # a second port was asked for, and it was the one used
