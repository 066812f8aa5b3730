"""Calibration probes: what a process group's links and devices achieve, measured with the
collectives trials use (AutoDDL §3.2: alpha and beta measured, not taken from data sheets;
TAG §2.1: per-device compute speed).

Each probe is ``fn(rank, world, *args)`` run by every rank of an initialised
``torch.distributed`` group (gloo on CPU, NCCL on GPU): the Ray worker group's actors run them
by name (:data:`PROBES`, ``synctune.cluster.calibrate``) and the lab's worker processes by
function (``synctune.lab.calibrate``, launched with :func:`synctune.engine.local.run_local`).
Every wait is a collective all ranks enter, probed or not, so the group stays in step. What a
caller makes of the seconds (bandwidth, latency, a cluster spec) is its own.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["PROBES", "pair_probe", "allreduce_probe", "compute_probe"]


def _device(backend: str):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def pair_probe(rank: int, world: int, a: int, b: int, nbytes: int, reps: int, drain: int = 0) -> dict | None:
    """Ranks ``a`` and ``b`` exchange ``nbytes`` each way and 4 bytes 20 times; the other ranks
    wait at the barriers. Each direction is timed by its sender, from the barrier to the 4-byte
    reply that says the payload arrived (rank ``a`` returns ``a_to_b`` and ``rtt``, rank ``b``
    ``b_to_a``; the others None).

    With ``drain`` > 0 the sender first sends ``drain`` bytes, untimed, just before each timed
    payload: a shaped link (a token bucket) sends what it saved while idle at once, so a payload
    that follows an idle spell times the bucket, not the rate; ``drain`` at least the bucket
    empties it."""
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

    flush = torch.ones(max(drain, 4) // 4, device=device) if me and drain > 0 else None

    def timed(sender: int, payload) -> float:
        dist.barrier()  # every rank, probed or not: the group's collectives stay in step
        if flush is not None and payload is big:
            exchange(sender, flush)
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


#: The probes by name (``RayWorkerGroup.probe`` runs them on its actors).
PROBES: dict[str, Callable[..., Any]] = {"pair": pair_probe, "allreduce": allreduce_probe, "compute": compute_probe}
