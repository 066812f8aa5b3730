"""A heterogeneous multi-node Ray cluster on one machine (``ray.cluster_utils.Cluster``): node
types as custom resources, workers placed on matching node types, two slices running trials
concurrently, a node removed mid-search, and the cluster spec derived from the running nodes."""

from __future__ import annotations

import json

import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from synctune.cluster import HEAD_RESOURCE, RayWorkerGroup, cluster_spec_from_ray, node_type_resource
from synctune.engine import TrialConfig
from synctune.models import model_spec
from synctune.search.experiment import Experiment
from synctune.spec import ClusterSpec
from synctune.strategy import build_strategy
from synctune.workload import zoo_workload


# Two fake node types: a 1-device node and a 2-device node (B9/B12's shape, on CPU).
_LINK = {"device_kind": "cpu", "device_model": "cpu", "nic_gbps": 8.0, "single_flow_gbps": 8.0,
         "intra_node_gbps": 8.0}
HETERO = ClusterSpec.from_dict({"name": "hetero-1-2", "nodes": [
    {"instance_type": "cpu-small", "num_devices": 1, **_LINK},
    {"instance_type": "cpu-big", "num_devices": 2, **_LINK}]})


def _add(cluster: Cluster, kind: str, cpus: int, wait: bool = True):
    return cluster.add_node(wait=wait, num_cpus=cpus, resources={node_type_resource(kind): 1})


@pytest.fixture(scope="module")
def multinode():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # The four nodes start together; the cluster waits for all of them once.
    nodes = {"small": [_add(cluster, "cpu-small", 1, wait=False) for _ in range(2)],
             "big": [_add(cluster, "cpu-big", 2, wait=False) for _ in range(2)]}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def _types_by_node() -> dict[str, str | None]:
    return {n["NodeID"]: next((k.split(":", 1)[1] for k in n["Resources"] if k.startswith("synctune-node:")), None)
            for n in ray.nodes() if n["Alive"]}


def test_cluster_spec_from_running_nodes(multinode):
    spec = cluster_spec_from_ray("here")
    assert [n.instance_type for n in spec.nodes] == ["cpu-big", "cpu-big", "cpu-small", "cpu-small"]
    assert spec.gpu_distribution() == [2, 2, 1, 1]
    assert "nominal link speeds" in spec.description


def test_workers_land_on_their_node_types(multinode):
    spec = model_spec("cnn-small")
    with RayWorkerGroup(HETERO) as group:
        bundles = group._bundles(ray.cluster_resources())
        assert bundles == [{"CPU": 1.0, node_type_resource("cpu-small"): 1.0},
                           {"CPU": 2.0, node_type_resource("cpu-big"): 1.0}]
        assert group._strategy(bundles) == "STRICT_SPREAD"
        result = group.run_trial(build_strategy("ps-lb", spec, HETERO), TrialConfig(warmup=1, iters=3),
                                 workload=zoo_workload("cnn-small"))
        assert result.status == "ok", result.error
        assert result.extra["ray_node_types"] == ["cpu-small", "cpu-big", "cpu-big"]
        types = _types_by_node()
        assert [types[p["node_id"]] for p in group.placement] == ["cpu-small", "cpu-big", "cpu-big"]
        # The two devices of the 2-device node share one Ray node; the others do not.
        ids = [p["node_id"] for p in group.placement]
        assert ids[1] == ids[2] != ids[0]


def _experiment(name: str, budget: int, slices: int, iters: int) -> Experiment:
    return Experiment.from_keys(name=name, model="cnn-small", cluster="hetero-1-2", budget=budget,
                                simulator="analytic", proposals=40, candidates=2, warmup=1, iters=iters, slices=slices,
                                timeout_s=120, baselines=("allreduce", "ps-lb", "parallax", "horovod"), ddp_trials=0,
                                confirm_rounds=0)


def _placement_groups_alive() -> list:
    return [pg for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED" and pg["name"].startswith("synctune-")]


def test_two_slices_run_trials_concurrently_and_are_released(multinode):
    from synctune.run import run_search, search_id_of

    exp = _experiment("two-slices", budget=4, slices=2, iters=30)
    outcomes, slice_nodes = [], set()
    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and HEAD_RESOURCE in n["Resources"])

    def on_trial(outcome, _summary):
        outcomes.append(outcome)
        for i in range(exp.run.slices):
            actor = ray.get_actor(f"synctune-slice-{search_id_of(exp)}-{i}")
            slice_nodes.add(ray.get(actor.where.remote(), timeout=30))

    summary = run_search(exp, model_spec("cnn-small"), HETERO, workload=zoo_workload("cnn-small"), on_trial=on_trial)
    assert summary.trials == 4 and summary.failed == 0, [o.error for o in outcomes]
    assert all(o.extra["ray_node_types"] == ["cpu-small", "cpu-big", "cpu-big"] for o in outcomes)
    spans = sorted((o.extra["started_at"], o.extra["finished_at"]) for o in outcomes)
    overlapping = sum(b_start < a_end for (_a0, a_end), (b_start, _b1) in zip(spans, spans[1:]))
    assert overlapping >= 1, spans
    assert slice_nodes == {head}  # the driver side stays on the head
    deadline = time.monotonic() + 30
    while _placement_groups_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _placement_groups_alive()


_MARKED_WORKLOAD = """
import os, time
import synctune.workload as sw
from synctune.models.zoo import MODELS, make_batch

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "iterations.log")


def _loss(model, batch):
    # One line per iteration of any rank: the test's evidence that a trial is running.
    with open(LOG, "a") as f:
        f.write(f"{time.time()}\\n")
    return model(*batch)


def workload():
    entry = MODELS.get("cnn-small")
    return sw.define(name="cnn-small", model=entry.build, batch_size=entry.batch_size, loss=_loss,
                     batch=lambda n, rank, generator: make_batch("cnn-small", n, generator=generator))
"""


def test_node_removed_mid_search_runs_that_trial_again_and_the_search_goes_on(multinode, tmp_path):
    from synctune.run import run_search
    from synctune.data import TrialDataset, dataset_dir
    from synctune.workload import ImportedWorkload

    cluster, nodes = multinode
    exp = _experiment("node-loss", budget=3, slices=1, iters=200)
    # cnn-small whose loss logs each iteration: the node is removed once the second trial has
    # run one (of its 201), an event rather than a guess at how long start-up takes here.
    (tmp_path / "marked.py").write_text(_MARKED_WORKLOAD)
    workload = ImportedWorkload(f"{tmp_path / 'marked.py'}:workload")
    log = tmp_path / "iterations.log"
    first_done = threading.Event()
    first_done_at = []
    removed = []

    def second_trial_iterating() -> bool:
        return log.exists() and any(float(t) > first_done_at[0] for t in log.read_text().split())

    def remove_the_busy_big_node():
        if not first_done.wait(timeout=300):
            return
        deadline = time.monotonic() + 300
        while not second_trial_iterating():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        live = [pg for pg in ray.util.placement_group_table().values()
                if pg["state"] == "CREATED" and pg["name"].startswith("synctune-")]  # not Tune's own
        busy = live[0]["bundles_to_node_id"][1]  # bundle 1 is the 2-device node
        victim = next(n for n in nodes["big"] if n.node_id == busy)
        cluster.remove_node(victim, allow_graceful=False)
        nodes["big"].remove(victim)  # the other big node stands in, as an autoscaled one would
        removed.append(busy)

    def on_trial(_outcome, _summary):
        if not first_done.is_set():
            first_done_at.append(time.time())
            first_done.set()

    killer = threading.Thread(target=remove_the_busy_big_node, daemon=True)
    killer.start()
    summary = run_search(exp, workload.spec(), HETERO, workload=workload, on_trial=on_trial)
    killer.join(timeout=60)
    assert removed, "the node was never removed"
    rows = TrialDataset(dataset_dir()).read(search_id="node-loss-seed0").sort_values("created_at")
    assert len(rows) == 3 and summary.trials == 3
    # The trial that lost its node ran again on a fresh slice (the other big node standing in):
    # still one row, marked retried with the lost attempt's error; the trial after it ran as usual.
    assert list(rows["status"]) == ["ok", "ok", "ok"], rows[["trial_id", "status", "error"]].to_string()
    retried = [json.loads(e).get("retried") for e in rows["extra_json"]]
    assert [bool(r) for r in retried] == [False, True, False], retried
    assert "a worker died" in retried[1][0], retried[1]
