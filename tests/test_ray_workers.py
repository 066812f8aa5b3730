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


def test_group_keeps_its_workers_and_runs_a_replica_subset_as_the_local_launcher(local_ray):
    """The group runs trials of different strategies on the same workers (one per device, one
    bundle per node). TAG §4.2: a strategy may leave devices idle. The group re-forms its
    process group over the strategy's replicas (rank order: the strategy's), the other actors
    stay reserved and idle; the trial trains exactly as the local launcher's processes do (same
    final loss on an uneven split), and the next whole-cluster trial re-forms the group over
    every device. One group for both: its workers' start-up is what costs here."""
    import dataclasses

    from synctune.engine.trial import run_trial_local
    from synctune.strategy import validate

    cluster = cluster_preset("local-2x2")
    spec = model_spec("cnn-small")
    full = build_strategy("allreduce", spec, cluster)
    subset = dataclasses.replace(full, replicas=("node1:1", "node0:1"), batch_split=(22, 10))
    validate(subset, spec, cluster)
    config = TrialConfig(warmup=1, iters=3, seed=5)
    reference = run_trial_local(subset, cluster, config, workload=WORKLOAD)
    with RayWorkerGroup(cluster) as group:
        first = group.run_trial(build_strategy("ps-lb", spec, cluster), TrialConfig(warmup=1, iters=4), workload=WORKLOAD)
        pids = list(group.pids)
        second = group.run_trial(full, TrialConfig(warmup=1, iters=4), workload=WORKLOAD)
        assert first.status == second.status == "ok", (first.error, second.error)
        assert first.launcher == "ray" and len(second.iteration_times_s) == 4
        assert group.starts == 1 and group.pids == pids and len(set(pids)) == 4
        bundles = group._bundles(ray.cluster_resources())
        assert bundles == [{"CPU": 2.0, node_type_resource("local-cpu"): 1.0}] * 2
        regroups = group.regroups  # the subset and the whole cluster again: two more

        result = group.run_trial(subset, config, workload=WORKLOAD)
        assert result.status == reference.status == "ok", (result.error, reference.error)
        assert result.num_workers == 2 and group.members == [3, 1]
        assert result.extra["final_loss"] == reference.extra["final_loss"]
        again = group.run_trial(full, config, workload=WORKLOAD)
        assert again.status == "ok" and again.num_workers == 4 and group.members == [0, 1, 2, 3]
        assert group.starts == 1 and group.regroups == regroups + 2  # the actors stayed; only the group re-formed
        assert group.pids == pids
        # A subset against every device: the arms alternate round by round, each on its replicas.
        c = group.run_confirm([(subset, None), (full, None)], config, workload=WORKLOAD, rounds=2, per_round=2)
        assert c["regrouped"] and len(c["a_s"]) == len(c["b_s"]) == 2 and c["low"] <= c["ratio"] <= c["high"]
        assert group.regroups == regroups + 2 + 3 and group.members == [3, 1]  # A B | B A: B twice in a row, A last
    assert not group.alive


def test_a_dead_worker_fails_its_trial_or_confirmation_and_fresh_workers_take_over(local_ray):
    """A worker killed mid-trial fails that trial (naming the rank) and the next trial restarts
    the group. A worker killed during the interleaved re-measurement: the confirmation starts
    over on fresh processes and pairs every round, naming the failure; with no retry left it
    fails. One group for all three: its workers' start-up is what costs here."""
    from synctune.cluster.workers import ConfirmFailed

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

        arms = [(strategy, None), (build_strategy("allreduce", spec, cluster), None)]
        config = TrialConfig(warmup=1, seed=0, timeout_s=120)
        killed = []

        def kill_once(msg):
            if not killed:
                killed.append(group.pids[1])
                os.kill(group.pids[1], signal.SIGKILL)

        out = group.run_confirm(arms, config, workload=WORKLOAD, rounds=3, per_round=2, on_progress=kill_once)
        assert killed and group.starts == 3 and killed[0] not in group.pids
        assert len(out["a_s"]) == len(out["b_s"]) == 3 and out["low"] <= out["ratio"] <= out["high"]
        assert len(out["retried"]) == 1 and "a worker died" in out["retried"][0], out["retried"]

        def kill_always(msg):
            if group.pids and group.pids[1] not in killed:
                killed.append(group.pids[1])
                os.kill(group.pids[1], signal.SIGKILL)

        try:
            group.run_confirm(arms, config, workload=WORKLOAD, rounds=3, per_round=2, on_progress=kill_always,
                              retries=0)
        except ConfirmFailed as exc:
            assert "a worker died" in str(exc)
        else:
            raise AssertionError("a confirmation whose worker died with no retry left must fail")


def test_rank_zero_holds_its_rendezvous_port_from_the_moment_it_names_it():
    """The group's rank 0 names its rendezvous port to the other ranks before any of them joins.
    A port that was only probed free at that moment can be taken by any socket on the node before
    rank 0 binds it (CI once failed with EADDRINUSE so); the port named must already be bound."""
    import socket

    from synctune.cluster.workers import _Worker

    import torch

    threads = torch.get_num_threads()
    worker = _Worker(threads)  # the actor body, here in the test's process (it sets torch's threads)
    try:
        host, port = worker.address(10.0, "127.0.0.1")
        assert host == "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            try:
                other.bind(("127.0.0.1", port))
            except OSError:
                pass
            else:
                raise AssertionError(f"port {port} was free after address() returned it: another socket could take it")
            # ...and it is the rendezvous store listening there, not an idle socket.
            other.settimeout(5)
            other.connect(("127.0.0.1", port))
    finally:
        worker._shutdown()
        torch.set_num_threads(threads)
