"""The local autoscaling cluster (`synctune cluster up --local`): Ray's autoscaler launches the node
types a search's slices ask for, from zero workers, the trials run on them, and the autoscaler
removes them after the idle timeout; a slice the cluster can never form is refused before any
trial. Every fact is read from Ray's own node table (the state API), not from synctune.

The tests that start the cluster are marked ``cluster`` (about a minute on 2 cores): deselect
them with ``-m "not cluster"``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _searches import search_env
from synctune.cluster import workers
from synctune.cluster.config import check_cluster_config
from synctune.cluster.local import (HEAD_NODE_TYPE, PROVIDER_MODULE, cluster_processes, local_autoscaling_config,
                                    running_local_cluster, stop_local_cluster)
from synctune.data import TrialDataset
from synctune.spec import ClusterSpec
from synctune.spec.errors import SpecError

#: Idle timeout of the test cluster: short, so scale-down is seen within the test.
IDLE_MIN = 0.25

CLUSTER_YAML = f"""
cluster_name: two-types
max_workers: 3
idle_timeout_minutes: {IDLE_MIN}
provider: {{type: aws, region: us-west-2}}
auth: {{ssh_user: ubuntu}}
head_node_type: head
available_node_types:
  head: {{resources: {{CPU: 1}}, node_config: {{InstanceType: m5.large}}}}
  small:
    min_workers: 0
    max_workers: 2
    resources: {{"synctune-node:cpu-small": 1, CPU: 1}}
    node_config: {{InstanceType: cpu-small}}
  big:
    min_workers: 0
    max_workers: 1
    resources: {{"synctune-node:cpu-big": 1, CPU: 2}}
    node_config: {{InstanceType: cpu-big}}
"""

_LINK = "device_kind: cpu, device_model: cpu, nic_gbps: 8.0, single_flow_gbps: 8.0, intra_node_gbps: 8.0"


def _spec(folder: Path, name: str, nodes: list[tuple[str, int]]) -> Path:
    path = folder / f"{name}.yaml"
    lines = [f"name: {name}", "nodes:"]
    lines += [f"  - {{instance_type: {kind}, num_devices: {devices}, {_LINK}}}" for kind, devices in nodes]
    path.write_text("\n".join(lines) + "\n")
    return path


def _experiment(folder: Path, name: str, spec: Path, budget: int) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nmodel: cnn-small\ncluster: {spec}\nbudget: {budget}\nsimulator: analytic\n"
                    "proposals: 20\ncandidates: 1\nwarmup: 1\niters: 3\nbaselines: [allreduce, ps-lb]\n"
                    "ddp_trials: 0\nconfirm_rounds: 0\nslice_timeout_s: 120\n")
    return path


def _synctune(*args: str, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "synctune", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _nodes(dashboard: str) -> list[dict]:
    """Ray's node table (alive and dead), each node with its synctune node type (None: the head)."""
    from ray.util.state import list_nodes

    out = []
    for node in list_nodes(address=dashboard, detail=True, limit=1000, raise_on_missing_output=False):
        typed = [k.split(":", 1)[1] for k in (node.resources_total or {}) if k.startswith("synctune-node:")]
        out.append({"id": node.node_id, "state": node.state, "type": typed[0] if typed else None,
                    "start": (node.start_time_ms or 0) / 1e3, "end": (node.end_time_ms or 0) / 1e3})
    return out


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """`synctune cluster up --local` on the two-type config; `down --local` afterwards, and
    whatever of its process session outlived that stopped by pid."""
    work = tmp_path_factory.mktemp("local-cluster")
    (work / "cluster.yaml").write_text(CLUSTER_YAML)
    home = work / "home"
    # Token auth off, whatever ~/.ray holds: this process reads Ray's tables without a token
    # (tests/test_job_submit.py runs a head with it on).
    env = dict(search_env(home), RAY_AUTH_MODE="disabled")
    up = _synctune("cluster", "up", "--local", "cluster.yaml", env=env, cwd=work, timeout=180)
    state = home / "local-cluster"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        cluster = running_local_cluster(state)
        assert cluster is not None
        yield {"cluster": cluster, "work": work, "home": home, "env": env}
    finally:
        recorded = running_local_cluster(state)
        down = _synctune("cluster", "down", "--local", env=env, cwd=work, timeout=120)
        if recorded is not None:
            left = cluster_processes(recorded)
            if left:  # the command failed to stop them: stop them here, and fail
                stop_local_cluster(state)
            shutil.rmtree(recorded.temp_dir, ignore_errors=True)  # Ray's session folders, under /tmp
            assert down.returncode == 0 and not left, (down.stderr, [p.pid for p in left])


@pytest.mark.cluster
def test_search_scales_two_node_types_from_zero_and_back(local_cluster):
    cluster, work, home = local_cluster["cluster"], local_cluster["work"], local_cluster["home"]
    before = _nodes(cluster.dashboard_url)
    assert [n["type"] for n in before if n["state"] == "ALIVE"] == [None]  # the head only: zero workers
    spec = _spec(work, "small-big", [("cpu-small", 1), ("cpu-big", 2)])
    exp = _experiment(work, "scales", spec, budget=3)
    submitted = time.time()
    run = _synctune("search", str(exp), "--ray-address", cluster.address, env=local_cluster["env"], cwd=work)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "search scales-seed0: 3 trials (0 failed)" in run.stdout, run.stdout + run.stderr[-3000:]

    # The trials ran on the launched nodes' types, each rank where the spec puts it.
    rows = TrialDataset(home / "dataset").read(search_id="scales-seed0")
    assert len(rows) == 3 and (rows["status"] == "ok").all()
    extras = [json.loads(e) for e in rows["extra_json"]]
    assert all(e["ray_node_types"] == ["cpu-small", "cpu-big", "cpu-big"] for e in extras), extras
    last_trial = max(e["finished_at"] for e in extras)

    # Exactly those node types were launched, one node each (the slice was reused across trials).
    launched = [n for n in _nodes(cluster.dashboard_url) if n["type"] is not None]
    assert sorted(n["type"] for n in launched) == ["cpu-big", "cpu-small"], launched
    # ... and removed after the idle timeout, not before.
    deadline = time.monotonic() + IDLE_MIN * 60 + 90
    while time.monotonic() < deadline:
        launched = [n for n in _nodes(cluster.dashboard_url) if n["type"] is not None]
        if all(n["state"] == "DEAD" for n in launched):
            break
        time.sleep(2)
    assert all(n["state"] == "DEAD" for n in launched), launched
    for node in launched:
        assert node["end"] - last_trial >= IDLE_MIN * 60 - 2, (node, last_trial)
    print("\nlocal cluster figures:", _figures(cluster.dashboard_url, submitted, extras, launched))


def _figures(dashboard: str, submitted: float, extras: list[dict], launched: list[dict]) -> str:
    """The issue-table figures of one search on the local cluster, from Ray's tables: submit to
    the first trial, per node type the node's start and the slice's readiness after the slice was
    asked for, the share of node-seconds spent in trials, and scale-down after the last trial."""
    from ray.util.state import list_placement_groups

    first_trial = min(e["started_at"] for e in extras)
    last_trial = max(e["finished_at"] for e in extras)
    pgs = [pg for pg in list_placement_groups(address=dashboard, detail=True, limit=1000,
                                              raise_on_missing_output=False) if pg.name.startswith("synctune-")]
    stats = pgs[0].stats or {} if pgs else {}
    asked = int(stats.get("creation_request_received_ns", 0)) / 1e9
    ready = asked + int(stats.get("end_to_end_creation_latency_us", 0)) / 1e6
    in_trials = sum(e["finished_at"] - e["started_at"] for e in extras) * len(launched)
    lived = sum(n["end"] - n["start"] for n in launched)
    return (f"submit to first trial {first_trial - submitted:.1f} s; slice asked {asked - submitted:.1f} s after "
            f"submit, " + ", ".join(f"{n['type']} node up {n['start'] - asked:.1f} s" for n in launched)
            + f" after that, slice ready {ready - asked:.1f} s after; node-seconds in trials "
            f"{in_trials:.1f} of {lived:.1f} ({in_trials / lived:.0%}); removed after the last trial "
            + ", ".join(f"{n['type']} {n['end'] - last_trial:.1f} s" for n in launched)
            + f" (idle timeout {IDLE_MIN * 60:g} s)")


def _raylet_of(cluster, node_id: str):
    """The raylet process of node ``node_id`` among the cluster's processes."""
    for proc in cluster_processes(cluster):
        try:
            if proc.name() == "raylet" and any(a == f"--node_id={node_id}" for a in proc.cmdline()):
                return proc
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
    return None


@pytest.mark.cluster
def test_a_node_killed_mid_trial_is_replaced_and_the_trial_counted_once(local_cluster):
    """The cpu-small node is killed (its raylet and its workers, SIGKILL by pid) while the second trial runs: that
    trial runs again on a fresh slice, whose cpu-small node the autoscaler adds; the search ends
    with one row per trial, the retried one marked."""
    import signal

    cluster, work, home = local_cluster["cluster"], local_cluster["work"], local_cluster["home"]
    spec = _spec(work, "small-big-kill", [("cpu-small", 1), ("cpu-big", 2)])
    exp = _experiment(work, "killed", spec, budget=2)
    # Trials of a few seconds each, so the kill lands inside the second one.
    exp.write_text(exp.read_text().replace("iters: 3", "iters: 250"))
    search = subprocess.Popen([sys.executable, "-m", "synctune", "search", str(exp), "--ray-address", cluster.address],
                              env=local_cluster["env"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and search.poll() is None and killed is None:
            rows = TrialDataset(home / "dataset").read(search_id="killed-seed0") if (home / "dataset").exists() else []
            if len(rows) == 1:  # the first trial recorded: the second one is starting on the same slice
                time.sleep(2.0)
                small = [n for n in _nodes(cluster.dashboard_url) if n["type"] == "cpu-small" and n["state"] == "ALIVE"]
                raylet = _raylet_of(cluster, small[0]["id"]) if small else None
                if raylet is not None:
                    # The node is lost as a machine is: its raylet and every process it started
                    # (a raylet killed alone leaves its workers serving their actors for a while).
                    for proc in [raylet, *raylet.children(recursive=True)]:
                        proc.send_signal(signal.SIGKILL)
                    killed, killed_at = small[0]["id"], time.time()
            time.sleep(0.3)
        out, err = search.communicate(timeout=300)
    finally:
        if search.poll() is None:
            search.kill()
            search.communicate()
    assert killed is not None, "the search ended before a trial could be interrupted"
    assert search.returncode == 0, (out + err)[-4000:]
    assert "search killed-seed0: 2 trials (0 failed)" in out, out + err[-3000:]
    rows = TrialDataset(home / "dataset").read(search_id="killed-seed0")
    assert len(rows) == 2 and rows["trial_id"].is_unique and (rows["status"] == "ok").all()
    extras = [json.loads(e) for e in rows["extra_json"]]
    retried = [e["retried"] for e in extras if e.get("retried")]
    spans = sorted((e["started_at"] - killed_at, e["finished_at"] - killed_at) for e in extras)
    assert len(retried) == 1 and "a worker died" in retried[0][0], (spans, retried)
    nodes = _nodes(cluster.dashboard_url)
    assert any(n["id"] == killed and n["state"] == "DEAD" for n in nodes)
    assert any(n["type"] == "cpu-small" and n["id"] != killed and n["start"] > 0 for n in nodes)  # a fresh node


@pytest.mark.cluster
@pytest.mark.parametrize("name, nodes, line", [
    ("two-bigs", [("cpu-big", 2), ("cpu-big", 2)],
     "cluster 'two-bigs' needs 2 node(s) of type 'cpu-big'; the Ray cluster's autoscaler launches at most 1 "
     "(max_workers)"),
    ("one-huge", [("cpu-huge", 1)],
     "cluster 'one-huge' needs 1 node(s) of type 'cpu-huge'; the Ray cluster has no node type advertising "
     "'synctune-node:cpu-huge'"),
], ids=["over-max-workers", "unknown-type"])
def test_a_slice_the_cluster_cannot_form_is_refused_before_any_trial(local_cluster, name, nodes, line):
    cluster, work, home = local_cluster["cluster"], local_cluster["work"], local_cluster["home"]
    exp = _experiment(work, f"refused-{name}", _spec(work, name, nodes), budget=2)
    asked = time.time()
    run = _synctune("search", str(exp), "--ray-address", cluster.address, env=local_cluster["env"], cwd=work)
    assert run.returncode == 2, run.stdout + run.stderr
    assert line in run.stderr and "Traceback" not in run.stderr, run.stderr
    rows = TrialDataset(home / "dataset").read(search_id=f"refused-{name}-seed0") if (home / "dataset").exists() else []
    assert len(rows) == 0
    # Nothing was launched for it (nodes of the tests before may still be idling).
    assert not [n for n in _nodes(cluster.dashboard_url) if n["start"] >= asked]


def test_the_autoscaling_config_mirrors_the_cluster_file(tmp_path):
    """Node types, counts, resources and idle timeout come from the user's file; a GPU type
    becomes a node with as many CPUs as GPUs, keeping its node-type resource."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML.replace(
        "  big:", "  gpu:\n    min_workers: 1\n    max_workers: 3\n    resources: {\"synctune-node:g4dn.12xlarge\": 1}\n"
        "    node_config: {InstanceType: g4dn.12xlarge}\n  big:"))
    config = local_autoscaling_config(check_cluster_config(tmp_path / "cluster.yaml"), "127.0.0.1:6400")
    assert config["provider"]["type"] == "external" and config["provider"]["module"] == PROVIDER_MODULE
    assert config["provider"]["gcs_address"] == "127.0.0.1:6400" and config["provider"]["launch_multiple"]
    assert config["idle_timeout_minutes"] == IDLE_MIN and config["head_node_type"] == HEAD_NODE_TYPE
    types = config["available_node_types"]
    assert {k: v for k, v in types["gpu"]["resources"].items() if k != "object_store_memory"} == {
        "CPU": 4, "synctune-node:g4dn.12xlarge": 1}
    assert (types["gpu"]["min_workers"], types["gpu"]["max_workers"]) == (1, 3)
    assert types["small"]["resources"]["CPU"] == 1 and types["big"]["resources"]["CPU"] == 2
    assert types[HEAD_NODE_TYPE]["max_workers"] == 0 and "synctune-node:cpu-small" not in types[HEAD_NODE_TYPE]["resources"]


_TWO = ClusterSpec.from_dict({"name": "two", "nodes": [
    {"instance_type": "cpu-big", "num_devices": 2, "device_kind": "cpu", "device_model": "cpu", "nic_gbps": 8.0,
     "single_flow_gbps": 8.0, "intra_node_gbps": 8.0, "count": 2}]})


@pytest.mark.parametrize("limits, alive, error", [
    (None, {}, None),                      # no published limits: the slice waits for its nodes
    ({"cpu-big": 2}, {}, None),
    ({"cpu-big": 1}, {"cpu-big": 2}, None),  # more alive than the autoscaler's limit (static nodes)
    ({"cpu-big": 1}, {}, "needs 2 node(s) of type 'cpu-big'; the Ray cluster's autoscaler launches at most 1"),
    ({"cpu-small": 3}, {}, "the Ray cluster has no node type advertising 'synctune-node:cpu-big' (it offers: "
                           "cpu-small (at most 3))"),
])
def test_infeasible_slices_are_refused_by_type_and_limit(monkeypatch, limits, alive, error):
    monkeypatch.setattr(workers, "node_type_limits", lambda: limits)
    monkeypatch.setattr(workers, "_alive_node_types", lambda: alive)
    if error is None:
        workers.check_slice_feasible(_TWO)
    else:
        with pytest.raises(SpecError, match=re.escape(error)):
            workers.check_slice_feasible(_TWO)


def test_cpu_slices_ask_for_their_node_types_where_the_cluster_autoscales():
    group = workers.RayWorkerGroup(_TWO)
    assert group._bundles({}) == [{"CPU": 2.0}, {"CPU": 2.0}]  # one machine standing in: packed on it
    assert group._bundles({}, autoscaled=True) == [{"CPU": 2.0, "synctune-node:cpu-big": 1.0}] * 2


@pytest.mark.parametrize("failure, reason", [
    (workers.SlicePending("cluster 'two': Ray could not reserve a matching slice within 5 s"),
     "Ray could not reserve a matching slice within 5 s (run.slice_timeout_s)"),
    (RuntimeError("the actor could not be scheduled\nmore"),
     "the slice did not start: RuntimeError: the actor could not be scheduled"),
])
def test_a_slice_that_does_not_start_is_a_failed_trial_with_the_reason(monkeypatch, failure, reason):
    from synctune.models import model_spec
    from synctune.run.slices import SliceActor
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    holder = SliceActor(_TWO.to_dict(), 5.0, None, zoo_workload("cnn-small"))

    def fail():
        raise failure

    monkeypatch.setattr(holder.group, "start", fail)
    strategy = build_strategy("allreduce", model_spec("cnn-small"), _TWO)
    out = holder.run(strategy.to_dict(), {"warmup": 1, "iters": 2})
    assert out["status"] == "failed" and reason in out["error"], out["error"]


@pytest.mark.parametrize("deaths, status, retried", [(1, "ok", 1), (2, "failed", 1), (0, "ok", 0)],
                         ids=["once", "twice", "never"])
def test_a_trial_whose_worker_died_runs_again_on_a_fresh_slice(monkeypatch, deaths, status, retried):
    """One retry on a fresh slice (the old one released): one result, marked with the lost attempt."""
    from synctune.engine.trial import failed_result
    from synctune.models import model_spec
    from synctune.run.slices import SliceActor
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    holder = SliceActor(_TWO.to_dict(), 5.0, None, zoo_workload("cnn-small"))
    strategy = build_strategy("allreduce", model_spec("cnn-small"), _TWO)
    calls = {"run": 0, "shutdown": 0}

    def run_trial(plan, config, **_kw):
        calls["run"] += 1
        if calls["run"] <= deaths:
            return failed_result("failed", "rank 2: a worker died: the node was lost", plan, _TWO, config, "ray", 1.0)
        return dataclasses.replace(failed_result("failed", "", plan, _TWO, config, "ray", 1.0), status="ok",
                                   error=None)

    monkeypatch.setattr(holder.group, "start", lambda: None)
    monkeypatch.setattr(holder.group, "run_trial", run_trial)
    monkeypatch.setattr(holder.group, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    out = holder.run(strategy.to_dict(), {"warmup": 1, "iters": 2})
    assert out["status"] == status and calls["run"] == 1 + retried and calls["shutdown"] == retried
    assert out["extra"].get("retried", []) == ["rank 2: a worker died: the node was lost"] * retried


def test_a_refused_start_leaves_the_callers_ray_auth_mode_alone(tmp_path, monkeypatch):
    """``cluster up --local`` with a token in ~/.ray switches token auth on for the Ray it starts;
    refused (here: no such file), it leaves the calling process's mode as it was, which the Ray
    instances that process starts later would otherwise read (a test runner's: every later
    ``ray.init`` then starts a GCS that wants a token its client does not send)."""
    from synctune.cluster.local import start_local_cluster
    from synctune.spec.errors import SpecError

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0" * 64)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(SpecError, match="no such cluster config file"):
        start_local_cluster(tmp_path / "no-such.yaml", tmp_path / "state")
    assert "RAY_AUTH_MODE" not in os.environ
