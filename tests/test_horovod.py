"""The ``horovod`` runtime: real Horovod trials, checked against single-process training.

Horovod is an optional build (scripts/install-horovod.sh, which ``.ci/run`` runs); without it
these tests skip with the reason, and under CI (which builds it) fail with it (tests/_optional.py).
A Horovod trial's loss is compared with one process training on the mean of every rank's
gradient, dense and sparse (Horovod all-gathers sparse rows), fp16 compression with the
rounding it does, and two trials with settings that give different losses on one warm Ray worker
group check that Horovod shuts down and starts again with the second trial's settings.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner
from _optional import optional_mark

from synctune.cli import cli
from synctune.engine.horovod import HOROVOD_DEFAULT, HorovodConfig, horovod_available, horovod_runtime
from synctune.engine.trial import TrialConfig, run_confirm_local, run_trial_local
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy.builders import build_strategy
from synctune.workload import zoo_workload

from test_runtimes import _assert_fp16_rounded, _cli, _fp16_references, _linear_probe, _reference_losses

pytestmark = optional_mark("Horovod's torch binding with gloo", horovod_available())

CLUSTER = cluster_preset("local-1x2")


@pytest.mark.parametrize("config", [HOROVOD_DEFAULT, HorovodConfig(fusion_threshold_mb=0.0, cycle_time_ms=5.0)],
                         ids=["defaults", "no-fusion"])
def test_horovod_trial_trains_as_single_process_sgd(config):
    workload = zoo_workload("cnn-small")
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    trial = TrialConfig(warmup=2, iters=3, lr=0.05)
    result = run_trial_local(strategy, CLUSTER, trial, workload=workload, runtime=horovod_runtime(config))
    assert result.status == "ok", result.error
    assert len(result.iteration_times_s) == 3 and result.comm_bytes_per_iter is None
    reference = _reference_losses(workload, strategy, trial)
    assert reference[-1] < reference[0]  # it trained: a frozen model would pass the comparison too
    assert result.extra["final_loss"] == pytest.approx(reference[-1], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["allgather-rows", "dense"])
def test_horovod_sparse_gradients_train_as_single_process_sgd(sparse_as_dense):
    workload = zoo_workload("ncf-small")
    assert any(v.sparse for v in workload.spec().variables)  # the case under test
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    trial = TrialConfig(warmup=1, iters=3, lr=0.5)
    result = run_trial_local(strategy, CLUSTER, trial, workload=workload,
                             runtime=horovod_runtime(HorovodConfig(sparse_as_dense=sparse_as_dense)))
    assert result.status == "ok", result.error
    reference = _reference_losses(workload, strategy, trial)
    assert reference[-1] < reference[0]
    assert result.extra["final_loss"] == pytest.approx(reference[-1], rel=1e-4, abs=1e-6)


def _horovod_fp16_mean(grads):
    return (sum(g.half() for g in grads) * (1 / len(grads))).float()


def test_horovod_fp16_compression_rounds_as_fp16(tmp_path):
    """hvd.Compression.fp16: each rank's gradient cast to fp16, summed in fp16, scaled by 1/size
    in fp16 (Average's postscale), cast back."""
    _assert_fp16_rounded(tmp_path, horovod_runtime(HorovodConfig(compression="fp16")), _horovod_fp16_mean)


def test_horovod_runtime_refuses_what_horovod_would_run_differently():
    workload = zoo_workload("cnn-small")
    even = build_strategy("allreduce", workload.spec(), CLUSTER)
    uneven = dataclasses.replace(even, batch_split=(even.batch_split[0] + 2, even.batch_split[1] - 2))
    with pytest.raises(SpecError, match="batch split is uneven"):
        run_trial_local(uneven, CLUSTER, workload=workload, runtime=horovod_runtime(HOROVOD_DEFAULT))
    # Horovod silently runs flat without NCCL: the runtime refuses instead of recording a lie.
    with pytest.raises(SpecError, match="hierarchical_allreduce: .*NCCL"):
        run_trial_local(even, CLUSTER, workload=workload,
                        runtime=horovod_runtime(HorovodConfig(hierarchical_allreduce=True)))
    sparse = zoo_workload("ncf-small")
    s = build_strategy("allreduce", sparse.spec(), CLUSTER)
    with pytest.raises(SpecError, match="compression: fp16 .* is sparse"):
        run_trial_local(s, CLUSTER, workload=sparse, runtime=horovod_runtime(HorovodConfig(compression="fp16")))
    with pytest.raises(SpecError, match="two arms are horovod"):
        run_confirm_local([(even, horovod_runtime(HOROVOD_DEFAULT)), (even, horovod_runtime(HOROVOD_DEFAULT))],
                          CLUSTER, workload=workload)
    for bad, message in [({"fusion_threshold_mb": -1}, "fusion_threshold_mb"), ({"cycle_time_ms": 0}, "cycle_time_ms"),
                         ({"compression": "int8"}, "compression"), ({"fusion": 4}, "unknown key")]:
        with pytest.raises(SpecError, match=message):
            HorovodConfig.from_dict(bad)


def test_two_horovod_trials_on_one_warm_ray_worker_group(local_ray, tmp_path):
    """Actor reuse: the second trial must run with its own settings after the first shut Horovod
    down. The two differ in compression, which moves the loss (tests/test_runtimes.py's linear
    probe): a second trial run with the first one's settings ends at the first one's loss."""
    from synctune.cluster.workers import RayWorkerGroup

    workload, strategy, trial = _linear_probe(tmp_path)
    rounded, exact, tol = _fp16_references(workload, strategy, trial, _horovod_fp16_mean)
    with RayWorkerGroup(CLUSTER) as group:
        for config, expected in ((HorovodConfig(compression="fp16", fusion_threshold_mb=1.0), rounded),
                                 (HorovodConfig(fusion_threshold_mb=0.0), exact)):
            result = group.run_trial(strategy, trial, workload=workload, runtime=horovod_runtime(config))
            assert result.status == "ok", result.error
            assert result.extra["final_loss"] == pytest.approx(expected, rel=0, abs=tol), config
        engine = group.run_trial(strategy, trial, workload=workload)  # the group still runs engine trials
        assert engine.status == "ok", engine.error
        assert engine.extra["final_loss"] == pytest.approx(exact, rel=0, abs=tol)


def test_trial_cli_runs_and_records_a_horovod_trial(tmp_path):
    from synctune.data import TrialDataset

    home = tmp_path / "home"
    done = _cli(home, "trial", "--runtime", "horovod", "-m", "bert-tiny", "-c", "local-2x2", "--horovod",
                "fusion_threshold_mb=32", "--warmup", "1", "--iters", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Horovod: horovod fusion 32 MiB, cycle 1 ms" in done.stdout and "status ok" in done.stdout
    (row,) = TrialDataset(home / "dataset").records()
    assert row.runtime == "horovod" and row.origin == "horovod" and row.num_replicas == 4
    assert json.loads(row.runtime_json)["fusion_threshold_mb"] == 32.0
    # Refused while parsing the command line: the CLI in this process (the run above went through
    # `python -m synctune`), one line each.
    runner = CliRunner(env={"SYNCTUNE_HOME": str(home)})
    for args, message in [(("--horovod", "fusion=3"), "--horovod: unknown key 'fusion'"),
                          (("--horovod", "hierarchical_allreduce=true"), "hierarchical_allreduce"),
                          (("--horovod", "cycle_time_ms=soon"), "cycle_time_ms: expected a number")]:
        bad = runner.invoke(cli, ["trial", "-m", "cnn-small", "-c", "local-1x2", "--runtime", "horovod", *args,
                                  "--no-record"])
        assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert message in bad.stderr


def _experiment(tmp_path, baselines: str, budget: int = 3, confirm_rounds: int = 0):
    path = tmp_path / "hvd.yaml"
    path.write_text(f"name: hvd\nmodel: cnn-small\ncluster: local-1x2\nbudget: {budget}\nalgorithm: random\n"
                    f"simulator: analytic\nproposals: 20\ncandidates: 2\nwarmup: 1\niters: 3\nbaselines: {baselines}\n"
                    f"ddp_trials: 0\nconfirm_rounds: {confirm_rounds}\nconfirm_iters: 2\n")
    return path


def _search(tmp_path, baselines: str, budget: int = 3, confirm_rounds: int = 0):
    import subprocess
    import sys

    from _searches import search_env

    path = _experiment(tmp_path, baselines, budget, confirm_rounds)
    return subprocess.run([sys.executable, "-m", "synctune", "search", str(path)], env=search_env(tmp_path / "home"),
                          capture_output=True, text=True, timeout=600)


def test_a_search_measures_real_horovod_baselines_and_confirms_against_them(tmp_path):
    """Horovod the only baseline: it is what the best searched strategy is confirmed against,
    interleaved on the same (restarted) processes."""
    from synctune.data import TrialDataset

    done = _search(tmp_path, "[hvd, 'hvd:fusion_threshold_mb=0,cycle_time_ms=2']", budget=2, confirm_rounds=2)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = TrialDataset(tmp_path / "home" / "dataset").read(search_id="hvd-seed0")
    hvd = rows[rows["runtime"] == "horovod"].sort_values("created_at")
    assert list(hvd["trial_id"]) == ["hvd-0", "hvd-1"] and (hvd["status"] == "ok").all()
    assert list(hvd["origin"]) == ["hvd", "hvd:fusion_threshold_mb=0,cycle_time_ms=2"]
    assert json.loads(hvd["runtime_json"].iloc[1])["fusion_threshold_mb"] == 0.0
    assert "Horovod   " in done.stdout and "real Horovod baseline" in done.stdout
    assert "against Horovod (hvd" in done.stdout, done.stdout  # the confirmation's baseline arm
    result = json.loads((tmp_path / "home" / "searches" / "hvd-seed0-best-result.json").read_text())
    assert result["confirmed"]["baseline"].startswith("Horovod (hvd")
    assert result["horovod_trials"] == 2 and result["horovod_best_s"] == pytest.approx(hvd["mean_s"].min())


@pytest.mark.parametrize("entry, message", [("'hvd:fusion=3'", "unknown Horovod setting 'fusion'"),
                                            ("'hvd:hierarchical_allreduce=true'", "hierarchical_allreduce"),
                                            ("'hvd:cycle_time_ms=fast'", "cycle_time_ms: expected a number"),
                                            ("'hvd:64'", "expected hvd or hvd:KEY=VALUE")])
def test_bad_horovod_baselines_are_refused_before_anything_runs(tmp_path, entry, message):
    # Refused while reading the experiment, before Ray starts: `synctune search` in this process
    # (the searches above run it as `python -m synctune`).
    path = _experiment(tmp_path, f"[allreduce, {entry}]")
    done = CliRunner(env={"SYNCTUNE_HOME": str(tmp_path / "home")}).invoke(cli, ["search", str(path)])
    assert done.exit_code == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert message in done.stderr and not (tmp_path / "home" / "dataset").exists()
