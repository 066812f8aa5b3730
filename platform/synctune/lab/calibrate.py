"""Calibrating a lab: what its shaped links achieve, measured with gloo itself, written into
the cluster spec the simulator reads (so the analytic model sees measured, not nominal,
bandwidth; AutoSync §3.1 feeds Eq. 2 with the cluster's link speeds).

Per node, a probe on the lab's bridge exchanges 16 MB with one worker in the node's namespace:
the probe's traffic crosses only that node's link, so the figures are the node's own
(egress and ingress), not its peer's. Latency is half the round trip of a 4-byte message.
Across nodes, one worker per node all-reduces 16 MB; its bus bandwidth is reported too. The
measuring code is the engine's (:mod:`synctune.engine.probes`, which a Ray slice's calibration
runs too); the lab only says where each worker lives.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any, Callable

from ..spec.cluster import ClusterSpec, NodeSpec
from ..spec.errors import InfraError, SpecError
from ..spec.files import check_name, path_under, write_text_atomic

__all__ = ["calibrate", "calibrated_spec", "calibration_path", "save_calibration"]

MB = 1 << 20


def calibration_path(preset: str, home: str | Path) -> Path:
    """Where the calibrated spec of lab preset ``preset`` is kept under the data folder ``home``."""
    return path_under(home, "lab", check_name(preset, "lab preset") + ".calibrated.yaml")


def calibrated_spec(preset: str, home: str | Path) -> ClusterSpec | None:
    """The calibrated spec of ``preset``, or None when it was never calibrated."""
    from ..spec.cluster import load_cluster_spec

    path = calibration_path(preset, home)
    return load_cluster_spec(path) if path.exists() else None


def calibrate(cluster: ClusterSpec, state: dict[str, Any], launch: Callable[..., list], *, nbytes: int = 16 * MB,
              reps: int = 5, on_step=None) -> tuple[ClusterSpec, dict[str, Any]]:
    """Measure the lab that ``state`` (from ``lab_up``) describes; returns the calibrated spec
    (nic and single-flow Gbit/s = the slower direction of each node's link, latency_ms = half
    the probe's round trip: beta and alpha of AutoDDL's communication model) and the figures.

    ``launch(fn, world, args, nets=..., threads=..., timeout_s=...)`` runs a function on worker
    processes in a gloo group, each in the namespace its net names (the engine's ``run_local``)."""
    from ..engine.probes import allreduce_probe, compute_probe, pair_probe
    from .netns import PROBE_ADDRESS, tbf_burst_bytes

    run_local = launch

    probe = {"netns": state["switch"], "ifname": "br0", "master": PROBE_ADDRESS}
    figures: dict[str, Any] = {"nodes": [], "nbytes": nbytes, "reps": reps}
    nodes = []
    for node, net in zip(cluster.nodes, state["nodes"]):
        if on_step:
            on_step(f"{node.name}: point to point through its link")
        # Rank 0 is the probe, rank 1 the node: each direction is timed by its sender.
        # Each timed payload follows an untimed one of at least the link's token bucket, which
        # empties it: the payload is timed at the link's rate, not at the burst saved while idle.
        outs = run_local(pair_probe, 2, (0, 1, nbytes, reps, tbf_burst_bytes(node.nic_gbps * 1000.0)), nets=[
            probe, {"netns": net["netns"], "ifname": net["ifname"], "master": PROBE_ADDRESS}], threads=1,
            timeout_s=300)
        # The quickest round trip is the link's own; a slower one waited on something else.
        rtt = min(outs[0]["rtt"])
        seconds = {"to_node": outs[0]["a_to_b"], "from_node": outs[1]["b_to_a"]}
        # Each timed exchange is the payload one way plus a 4-byte reply: take the reply's round trip off.
        payload = {d: statistics.median(t) - rtt for d, t in seconds.items()}
        if min(payload.values()) <= 0:
            raise InfraError(f"calibrating node {node.name!r}: a {nbytes}-byte payload took no longer than a 4-byte "
                             f"round trip ({min(statistics.median(t) for t in seconds.values()) * 1e3:.3f} ms against "
                             f"{rtt * 1e3:.3f} ms); nothing was measured: calibrate with a larger nbytes")
        gbps = {d: nbytes * 8 / t / 1e9 for d, t in payload.items()}
        measured = min(gbps.values())
        figures["nodes"].append({"node": node.name, "nominal_gbps": node.nic_gbps, "ingress_gbps": gbps["to_node"],
                                 "egress_gbps": gbps["from_node"], "latency_ms": rtt / 2 * 1e3,
                                 "efficiency": measured / node.nic_gbps})
        values = node.to_dict()
        values.update(nic_gbps=round(measured, 6), single_flow_gbps=round(measured, 6),
                      latency_ms=round(rtt / 2 * 1e3, 4))
        nodes.append(NodeSpec(**values))
    if len(cluster.nodes) > 1:
        if on_step:
            on_step(f"all-reduce across {len(cluster.nodes)} nodes")
        times = run_local(allreduce_probe, len(cluster.nodes), (nbytes, reps), threads=1, timeout_s=300, nets=[
            {"netns": n["netns"], "ifname": n["ifname"], "master": state["nodes"][0]["address"]}
            for n in state["nodes"]])
        slowest = statistics.median(max(ts) for ts in zip(*times))
        n = len(cluster.nodes)
        figures["allreduce"] = {"seconds": slowest, "algbw_gbps": nbytes * 8 / slowest / 1e9,
                                "busbw_gbps": 2 * (n - 1) / n * nbytes * 8 / slowest / 1e9}
    if any(n.cpu_share is not None for n in cluster.nodes):
        # Nodes of different compute speeds (CPU quotas): each worker's speed with all of them
        # busy at once, as in a trial; a node's figure is the median of its workers'.
        if on_step:
            on_step(f"compute speed of every worker ({cluster.num_devices}, all at once)")
        nets = [{"netns": net["netns"], "ifname": net["ifname"], "master": state["nodes"][0]["address"],
                 **({"cgroup": net["cgroup"]} if net.get("cgroup") else {})}
                for node, net in zip(cluster.nodes, state["nodes"]) for _ in range(node.num_devices)]
        speeds = run_local(compute_probe, len(nets), (3.0, 256), threads=1, timeout_s=300, nets=nets)
        figures["compute"] = []
        first = 0
        for i, node in enumerate(cluster.nodes):
            mine = speeds[first:first + node.num_devices]
            first += node.num_devices
            gflops = statistics.median(mine)
            figures["compute"].append({"node": node.name, "cpu_share": node.cpu_share, "workers_gflops": mine,
                                       "gflops": gflops})
            nodes[i] = NodeSpec(**{**nodes[i].to_dict(), "compute_gflops": round(gflops, 4)})
        fastest = max(c["gflops"] for c in figures["compute"])
        for c in figures["compute"]:
            c["relative"] = c["gflops"] / fastest
    figures["calibrated_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    spec = ClusterSpec(name=cluster.name, nodes=tuple(nodes), scale=cluster.scale,
                       description=f"{cluster.description}; links calibrated {figures['calibrated_at']}")
    return spec, figures


def save_calibration(spec: ClusterSpec, figures: dict[str, Any], home: str | Path) -> Path:
    """Write the calibrated spec under the data folder ``home`` (its figures next to it, as JSON)."""
    if not figures.get("nodes"):
        raise SpecError("nothing was measured")
    path = calibration_path(spec.name, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.save(path)
    write_text_atomic(path.with_suffix(".json"), json.dumps(figures, indent=1) + "\n")
    return path
