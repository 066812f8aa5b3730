"""Rows lost when nodes die during a search on the local autoscaling cluster.

`synctune cluster up --local` starts a cluster of two CPU node types (`cpu-small`, 1 CPU, at most
2; `cpu-big`, 2 CPUs, at most 1) from zero workers, idle timeout 15 s. A search of ``--budget``
trials whose cluster spec needs one node of each runs on it, with trials of a few seconds; each
time one more trial row has landed (after the 1st, 2nd, ... ``--kills``th), a node of the slice,
`cpu-small` and `cpu-big` in turn, is killed as a machine is lost: its raylet and every process
it started, SIGKILL by process id (as ``tests/test_local_cluster.py`` does). Printed: the trials
the search counted, the rows in the dataset, the rows marked retried, the rows lost (trials
without a row) and the duplicates (rows beyond one per trial id), and the kills with the node
each hit.

    python experiments/findings/node_kills.py [--kills 3] [--budget 5] [--home DIR]

Runs for about two minutes on 2 cores; the cluster is stopped (``cluster down --local``) and its
Ray session folders removed however the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, markdown_table  # noqa: E402

sys.path.insert(0, str(ROOT / "platform"))

CLUSTER_YAML = """
cluster_name: node-kills
max_workers: 3
idle_timeout_minutes: 0.25
provider: {type: aws, region: us-west-2}
auth: {ssh_user: ubuntu}
head_node_type: head
available_node_types:
  head: {resources: {CPU: 1}, node_config: {InstanceType: m5.large}}
  small:
    min_workers: 0
    max_workers: 2
    resources: {"synctune-node:cpu-small": 1, CPU: 1}
    node_config: {InstanceType: cpu-small}
  big:
    min_workers: 0
    max_workers: 1
    resources: {"synctune-node:cpu-big": 1, CPU: 2}
    node_config: {InstanceType: cpu-big}
"""

_LINK = "device_kind: cpu, device_model: cpu, nic_gbps: 8.0, single_flow_gbps: 8.0, intra_node_gbps: 8.0"


def _alive_nodes(dashboard: str, kind: str) -> list[str]:
    """Ids of the alive nodes of synctune node type ``kind``, from Ray's node table."""
    from ray.util.state import list_nodes

    return [n.node_id for n in list_nodes(address=dashboard, detail=True, limit=1000, raise_on_missing_output=False)
            if n.state == "ALIVE" and f"synctune-node:{kind}" in (n.resources_total or {})]


def _kill_node(cluster, node_id: str) -> bool:
    """Kills node ``node_id`` of the local cluster as a lost machine: its raylet and every process
    the raylet started, SIGKILL by pid. False when its raylet is not found."""
    from synctune.cluster.local import cluster_processes

    for proc in cluster_processes(cluster):
        try:
            if proc.name() == "raylet" and f"--node_id={node_id}" in proc.cmdline():
                for victim in [proc, *proc.children(recursive=True)]:
                    try:
                        victim.send_signal(signal.SIGKILL)
                    except Exception:  # noqa: BLE001 - gone meanwhile
                        pass
                return True
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--budget", type=int, default=5)
    parser.add_argument("--home", default=None, help="the data folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    if args.kills >= args.budget:
        parser.error("--kills must be below --budget: each kill waits for one more trial row")

    from synctune.cluster.local import cluster_processes, running_local_cluster, stop_local_cluster
    from synctune.data import TrialDataset

    work = Path(tempfile.mkdtemp(prefix="synctune-node-kills-"))
    home = Path(args.home) if args.home else work / "home"
    print(f"data folder: {home}", flush=True)
    env = dict(os.environ, SYNCTUNE_HOME=str(home), PYTHONPATH=str(ROOT / "platform"), RAY_AUTH_MODE="disabled")
    for name in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        env.pop(name, None)
    (work / "cluster.yaml").write_text(CLUSTER_YAML)
    (work / "spec.yaml").write_text("name: small-big\nnodes:\n"
                                    f"  - {{instance_type: cpu-small, num_devices: 1, {_LINK}}}\n"
                                    f"  - {{instance_type: cpu-big, num_devices: 2, {_LINK}}}\n")
    (work / "exp.yaml").write_text(f"name: node-kills\nmodel: cnn-small\ncluster: {work / 'spec.yaml'}\n"
                                   f"budget: {args.budget}\nsimulator: analytic\nproposals: 20\ncandidates: 1\n"
                                   "warmup: 1\niters: 250\nbaselines: [allreduce, ps-lb]\nddp_trials: 0\n"
                                   "confirm_rounds: 0\nslice_timeout_s: 120\n")
    cli = [sys.executable, "-m", "synctune"]
    state = home / "local-cluster"
    kills: list[tuple[int, str, str]] = []
    search = None
    try:
        up = subprocess.run([*cli, "cluster", "up", "--local", "cluster.yaml"], env=env, cwd=work,
                            capture_output=True, text=True, timeout=180)
        if up.returncode != 0:
            print(up.stdout + up.stderr, file=sys.stderr)
            return 1
        cluster = running_local_cluster(state)
        started = time.time()
        search = subprocess.Popen([*cli, "search", str(work / "exp.yaml"), "--ray-address", cluster.address],
                                  env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        dataset = home / "dataset"
        deadline = time.monotonic() + 480
        while search.poll() is None and len(kills) < args.kills and time.monotonic() < deadline:
            rows = len(TrialDataset(dataset).read(search_id="node-kills-seed0")) if dataset.exists() else 0
            if rows > len(kills):  # one more row: the next trial is starting on the slice
                time.sleep(2.0)
                kind = ("cpu-small", "cpu-big")[len(kills) % 2]
                alive = _alive_nodes(cluster.dashboard_url, kind)
                if alive and _kill_node(cluster, alive[0]):
                    kills.append((rows, kind, alive[0][-8:]))
                    print(f"{time.time() - started:6.1f} s: killed {kind} node {alive[0][-8:]} "
                          f"after {rows} row(s)", flush=True)
            time.sleep(0.3)
        out, err = search.communicate(timeout=max(60.0, deadline - time.monotonic()))
        wall = time.time() - started
    finally:
        if search is not None and search.poll() is None:
            search.kill()
            search.communicate()
        recorded = running_local_cluster(state)
        subprocess.run([*cli, "cluster", "down", "--local"], env=env, cwd=work, capture_output=True, text=True,
                       timeout=120)
        if recorded is not None:
            if cluster_processes(recorded):
                stop_local_cluster(state)
            shutil.rmtree(recorded.temp_dir, ignore_errors=True)
    summary = re.search(r"search node-kills-seed0: (\d+) trials \((\d+) failed\)", out)
    if search.returncode != 0 or summary is None:
        print(f"the search failed (exit {search.returncode}):\n{(out + err)[-3000:]}", file=sys.stderr)
        return 1
    trials, failed = int(summary.group(1)), int(summary.group(2))
    rows = TrialDataset(home / "dataset").read(search_id="node-kills-seed0")
    retried = sum(bool(json.loads(e).get("retried")) for e in rows["extra_json"])
    unique = rows["trial_id"].nunique()
    print()
    print(markdown_table(
        ["node kills", "trials (failed)", "rows", "retried rows", "rows lost", "duplicates", "search wall s"],
        [[len(kills), f"{trials} ({failed})", len(rows), retried, trials - unique, len(rows) - unique,
          f"{wall:.0f}"]]))
    if args.home is not None:  # the rows are in --home; the rest is scratch
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
