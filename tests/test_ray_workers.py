"""Trials through a Ray worker group: a placement group with one bundle per node, one actor per
device, a process group kept alive across trials, and clean failure when an actor dies."""

from __future__ import annotations

import os
import signal

import ray

from synctune.cluster import RayWorkerGroup, node_type_resource
from synctune.engine import TrialConfig
from synctune.models import model_spec
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy
from synctune.workload import zoo_workload

WORKLOAD = zoo_workload("cnn-small")


def test_group_runs_trials_and_keeps_its_workers(local_ray):
    cluster = cluster_preset("local-2x2")
    spec = model_spec("cnn-small")
    with RayWorkerGroup(cluster) as group:
        first = group.run_trial(build_strategy("ps-lb", spec, cluster), TrialConfig(warmup=1, iters=4), workload=WORKLOAD)
        pids = list(group.pids)
        second = group.run_trial(build_strategy("allreduce", spec, cluster), TrialConfig(warmup=1, iters=4),
                                 workload=WORKLOAD)
        assert first.status == second.status == "ok", (first.error, second.error)
        assert first.launcher == "ray" and len(second.iteration_times_s) == 4
        assert group.starts == 1 and group.pids == pids and len(set(pids)) == 4
        bundles = group._bundles(ray.cluster_resources())
        assert bundles == [{"CPU": 2.0, node_type_resource("local-cpu"): 1.0}] * 2
    assert not group.alive


def test_dead_actor_fails_the_trial_and_the_next_trial_restarts(local_ray):
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    strategy = build_strategy("ps", spec, cluster)
    with RayWorkerGroup(cluster) as group:
        group.start()
        victim = group.pids[1]

        def on_progress(msg):
            if msg.get("event") == "iteration" and msg["iteration"] == 3:
                os.kill(victim, signal.SIGKILL)

        result = group.run_trial(strategy, TrialConfig(warmup=2, iters=100_000, timeout_s=120), workload=WORKLOAD,
                                 on_progress=on_progress)
        assert result.status == "failed"
        assert result.error.startswith("rank 1: a worker died"), result.error
        assert not group.alive
        again = group.run_trial(strategy, TrialConfig(warmup=1, iters=2), workload=WORKLOAD)
        assert again.status == "ok" and group.starts == 2
