"""Calibrating a Ray cluster's slice: what its links and devices achieve, measured with the
process group trials use, written into the cluster spec the simulators read (AutoDDL's
alpha-beta communication model; TAG §2.1's per-device compute speed).

On a :class:`~synctune.cluster.workers.RayWorkerGroup` (one actor per device, the slice a search
reserves), with every actor in the group and only the probed ones sending:

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
import time
from typing import Any, Callable

from ..spec.cluster import ClusterSpec, NodeSpec
from ..spec.errors import SpecError

__all__ = ["calibrate_ray", "PROBES"]

MB = 1 << 20


def _device(backend: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def pair_probe(rank: int, world: int, a: int, b: int, nbytes: int, reps: int) -> dict | None:
    """Ranks ``a`` and ``b`` exchange ``nbytes`` each way and 4 bytes 20 times; the other ranks
    wait at the barriers. Each direction is timed by its sender, from the barrier to the 4-byte
    reply that says the payload arrived (rank ``a`` returns ``a_to_b`` and ``rtt``, rank ``b``
    ``b_to_a``; the others None)."""
    import torch
    import torch.distributed as dist

    device = _device(str(dist.get_backend()))
    me = rank in (a, b)
    peer = b if rank == a else a
    big = torch.ones(nbytes // 4, device=device) if me else None
    tiny = torch.ones(1, device=device)
    out: dict[str, list[float]] = {"a_to_b": [], "b_to_a": [], "rtt": []}

    def exchange(sender: int, payload) -> None:
        if rank == sender:
            dist.send(payload, peer)
            dist.recv(tiny, peer)
        else:
            dist.recv(payload, peer)
            dist.send(tiny, peer)

    def timed(sender: int, payload) -> float:
        dist.barrier()  # every rank, probed or not: the group's collectives stay in step
        start = time.perf_counter()
        if me:
            exchange(sender, payload)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter() - start

    if me:
        for _ in range(3):  # warm the connection
            exchange(a, tiny)
    for _ in range(reps):
        for key, sender in (("a_to_b", a), ("b_to_a", b)):
            out[key].append(timed(sender, big))
    out["rtt"] = [timed(a, tiny) for _ in range(20)]
    if rank == a:
        return {"a_to_b": out["a_to_b"], "rtt": out["rtt"]}
    return {"b_to_a": out["b_to_a"]} if rank == b else None


def allreduce_probe(rank: int, world: int, nbytes: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` all-reduces of ``nbytes`` over the whole group."""
    import torch
    import torch.distributed as dist

    device = _device(str(dist.get_backend()))
    buf = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(buf)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def compute_probe(rank: int, world: int, seconds: float, size: int) -> float:
    """GFLOP/s of float32 matrix products on this device, every device computing at once."""
    import torch
    import torch.distributed as dist

    device = _device(str(dist.get_backend()))
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if device.type == "cuda" and count % 10 == 0:
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    return 2 * size ** 3 * count / elapsed / 1e9


#: The probes a worker group's actors run by name (``RayWorkerGroup.probe``).
PROBES: dict[str, Callable[..., Any]] = {"pair": pair_probe, "allreduce": allreduce_probe, "compute": compute_probe}


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
