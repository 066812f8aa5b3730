"""Calibrating a Ray cluster's slice: what its links and devices achieve, measured with the
process group trials use, written into the cluster spec the simulators read (AutoDDL's
alpha-beta communication model; TAG §2.1's per-device compute speed).

On a :class:`~synctune.cluster.workers.RayWorkerGroup` (one actor per device, the slice a search
reserves), with every actor in the group and only the probed ones sending (the probes are the
engine's, :mod:`synctune.engine.probes`, which the lab's calibration runs too):

- links: the first device of every pair of nodes exchanges ``nbytes`` each way and a 4-byte
  message 20 times. A pair's throughput is bounded by the slower of its two links, so a node's
  bandwidth (``nic_gbps``, ``single_flow_gbps``: one flow, as a probe is) is the best of its
  pairs in its slower direction, and its latency (``latency_ms``, alpha) half the shortest
  round trip among its pairs. One node alone has no link to measure: its ``latency_ms`` is then
  that of its devices' exchange, if it has several.
- inside a node of several devices: its first two devices the same way (``intra_node_gbps``);
- compute: every device multiplies float32 matrices at once, as in a trial (``compute_gflops``:
  the median of the node's devices);
- an all-reduce of ``nbytes`` over every device (its bus bandwidth, reported only).
"""

from __future__ import annotations

import datetime
import statistics
from typing import Any, Callable

from ..engine.probes import PROBES
from ..spec.cluster import ClusterSpec, NodeSpec
from ..spec.errors import SpecError

__all__ = ["calibrate_ray", "PROBES"]

MB = 1 << 20


def _gbps(nbytes: int, seconds: float, rtt: float) -> float:
    # The sender's time is the payload one way plus the 4-byte reply back: take half a round trip off.
    return nbytes * 8 / max(seconds - rtt / 2, 1e-9) / 1e9


def _pair(group, a: int, b: int, nbytes: int, reps: int) -> dict[str, float]:
    out = group.probe("pair", a, b, nbytes, reps)
    rtt = statistics.median(out[a]["rtt"])
    return {"a_to_b": _gbps(nbytes, statistics.median(out[a]["a_to_b"]), rtt),
            "b_to_a": _gbps(nbytes, statistics.median(out[b]["b_to_a"]), rtt), "rtt_s": rtt}


def calibrate_ray(group, *, nbytes: int = 16 * MB, reps: int = 5, compute_s: float = 2.0, matrix: int = 512,
                  on_step: Callable[[str], None] | None = None) -> tuple[ClusterSpec, dict[str, Any]]:
    """Measure the slice ``group`` (a started :class:`RayWorkerGroup`) holds; returns the
    calibrated cluster spec and the figures (see the module docstring)."""
    cluster: ClusterSpec = group.cluster
    if nbytes < 4 or reps < 1:
        raise SpecError(f"calibration: nbytes (>= 4) and reps (>= 1) expected, got {nbytes} and {reps}")
    first, at = [], 0
    for node in cluster.nodes:
        first.append(at)
        at += node.num_devices
    figures: dict[str, Any] = {"nbytes": nbytes, "reps": reps, "pairs": [], "nodes": []}
    w = len(cluster.nodes)
    for i in range(w):
        for j in range(i + 1, w):
            if on_step:
                on_step(f"{cluster.nodes[i].name} <-> {cluster.nodes[j].name}: point to point")
            p = _pair(group, first[i], first[j], nbytes, reps)
            figures["pairs"].append({"nodes": [cluster.nodes[i].name, cluster.nodes[j].name], **p})
    nodes = []
    for i, node in enumerate(cluster.nodes):
        values = node.to_dict()
        # What the spec said before (nominal, or an earlier calibration's figure).
        fig: dict[str, Any] = {"node": node.name, "nominal_gbps": node.nic_gbps}
        mine = [(p, 0 if p["nodes"][0] == node.name else 1) for p in figures["pairs"] if node.name in p["nodes"]]
        if mine:
            # The node's slower direction in each pair; the best pair bounds its own link from below.
            out_in = [(p["a_to_b"], p["b_to_a"]) if side == 0 else (p["b_to_a"], p["a_to_b"]) for p, side in mine]
            gbps = max(min(o, i_) for o, i_ in out_in)
            rtt = min(p["rtt_s"] for p, _side in mine)
            fig.update(gbps=gbps, latency_ms=rtt / 2 * 1e3)
            values.update(nic_gbps=round(gbps, 6), single_flow_gbps=round(gbps, 6), latency_ms=round(rtt / 2 * 1e3, 4))
        if node.num_devices > 1:
            if on_step:
                on_step(f"{node.name}: between two of its devices")
            p = _pair(group, first[i], first[i] + 1, nbytes, reps)
            intra = min(p["a_to_b"], p["b_to_a"])
            fig["intra_gbps"] = intra
            values.update(intra_node_gbps=round(intra, 6))
            if w == 1:  # one node: its devices' latency is the only alpha there is
                fig["latency_ms"] = p["rtt_s"] / 2 * 1e3
                values.update(latency_ms=round(p["rtt_s"] / 2 * 1e3, 4))
        figures["nodes"].append(fig)
        nodes.append(values)
    if on_step:
        on_step(f"compute speed of every device ({cluster.num_devices}, all at once)")
    speeds = group.probe("compute", compute_s, matrix)
    for i, node in enumerate(cluster.nodes):
        gflops = statistics.median(speeds[first[i]:first[i] + node.num_devices])
        figures["nodes"][i].update(devices_gflops=speeds[first[i]:first[i] + node.num_devices], gflops=gflops)
        nodes[i]["compute_gflops"] = round(gflops, 4)
    if cluster.num_devices > 1:
        if on_step:
            on_step(f"all-reduce over {cluster.num_devices} devices")
        times = group.probe("allreduce", nbytes, reps)
        slowest = statistics.median(max(ts) for ts in zip(*times))
        n = cluster.num_devices
        figures["allreduce"] = {"seconds": slowest, "busbw_gbps": 2 * (n - 1) / n * nbytes * 8 / slowest / 1e9}
    figures["calibrated_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    spec = ClusterSpec(name=cluster.name, nodes=tuple(NodeSpec(**v) for v in nodes), scale=cluster.scale,
                       description=f"{cluster.description}; calibrated on Ray {figures['calibrated_at']}".lstrip("; "))
    return spec, figures
