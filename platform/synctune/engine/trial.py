"""A trial: one strategy run for real, W warm-up then M timed iterations (AutoDist §3.3: 10 + 40).

Timing is taken on every rank around whole iterations, each started after a barrier, and an
iteration's time is the slowest rank's (the step is not done until every replica has its
parameters). Data is synthetic, of the model's shapes, made once per rank: the trial times
synchronization and compute, not input pipelines.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..spec._util import is_int, is_number
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..strategy.schema import Strategy

__all__ = ["TrialConfig", "TrialResult", "run_trial_local", "run_trials_local", "trial_worker", "STATUSES"]

#: Every trial ends in one of these.
STATUSES = ("ok", "failed", "timeout", "oom")
OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """How a trial runs: iteration counts, optimizer, seed and the bounds on waiting."""

    warmup: int = 10
    iters: int = 40
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    timeout_s: float = 900.0
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not (is_int(self.warmup) and self.warmup >= 0):
            raise SpecError(f"trial config: warmup: expected a non-negative integer, got {self.warmup!r}")
        if not (is_int(self.iters) and self.iters >= 1):
            raise SpecError(f"trial config: iters: expected a positive integer, got {self.iters!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"trial config: optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for key in ("lr", "timeout_s", "collective_timeout_s"):
            value = getattr(self, key)
            if not (is_number(value) and value > 0):
                raise SpecError(f"trial config: {key}: expected a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What a trial measured. Times in seconds; ``iteration_times_s`` are per timed iteration,
    the max over ranks. ``comm_bytes_per_iter`` is the payload all ranks together handed to
    collectives in one iteration (counted by the engine, not estimated)."""

    status: str
    error: str = ""
    model: str = ""
    cluster: str = ""
    cluster_scale: float = 1.0  # link speeds' scale-down (lab clusters), as in the cluster spec
    strategy_hash: str = ""
    launcher: str = "local"
    backend: str = ""
    device_kind: str = ""
    num_workers: int = 0
    warmup: int = 0
    iters: int = 0
    global_batch_size: int = 0
    iteration_times_s: tuple[float, ...] = ()
    mean_s: float | None = None
    median_s: float | None = None
    std_s: float | None = None
    samples_per_s: float | None = None
    comm_bytes_per_iter: int | None = None
    peak_memory_bytes: int | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["iteration_times_s"] = list(self.iteration_times_s)
        return out

    @classmethod
    def from_times(cls, times: list[float], **kw: Any) -> "TrialResult":
        mean = statistics.fmean(times)
        return cls(status="ok", iteration_times_s=tuple(times), mean_s=mean, median_s=statistics.median(times),
                   std_s=statistics.pstdev(times) if len(times) > 1 else 0.0,
                   samples_per_s=kw["global_batch_size"] / mean if mean > 0 else math.inf, **kw)


def _optimizer_factory(name: str, lr: float) -> Callable:
    import torch

    def make(params):
        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr)

    return make


def _peak_memory_bytes(device) -> int:
    import resource

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def trial_worker(rank: int, world: int, payload: dict) -> dict:
    """The body of one rank of a trial (runs inside a process of the group)."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    return _measure(rank, world, Strategy.from_dict(payload["strategy"]), ClusterSpec.from_dict(payload["cluster"]),
                    TrialConfig(**payload["config"]), payload.get("gpu_per_rank", True))


def trials_worker(rank: int, world: int, payload: dict) -> int:
    """Several trials in one process group, one after another; rank 0 reports each result as it
    completes (event ``trial_done``), so finished trials survive a later failure."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    cluster = ClusterSpec.from_dict(payload["cluster"])
    config = TrialConfig(**payload["config"])
    for index, strategy in enumerate(payload["strategies"]):
        out = _measure(rank, world, Strategy.from_dict(strategy), cluster, config, True, progress=False)
        if rank == 0:
            report({"event": "trial_done", "index": payload["first_index"] + index, "out": out})
    return len(payload["strategies"])


def _measure(rank: int, world: int, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig,
             gpu_per_rank: bool, progress: bool = True) -> dict:
    import torch
    import torch.distributed as dist

    from ..models.zoo import build_model, make_batch, model_spec
    from .core import StrategyEngine
    from .local import report

    name = strategy.model["name"]
    spec = model_spec(name)
    node = cluster.node_of(strategy.replicas[rank])
    if node.device_kind == "gpu":
        # Local launches own every GPU of the machine (rank r takes GPU r); a Ray actor sees only
        # the GPU Ray gave it, as index 0.
        device = torch.device("cuda", rank if gpu_per_rank else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(config.seed)
    model = build_model(name, device=device)
    engine = StrategyEngine(model, strategy, spec, cluster, _optimizer_factory(config.optimizer, config.lr),
                            seed=config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed * 100_003 + rank)
    batch = make_batch(name, strategy.batch_split[rank], generator=gen, device=device)
    total = config.warmup + config.iters
    times: list[float] = []
    comm: list[int] = []
    for it in range(total):
        timed = it >= config.warmup
        if timed:
            dist.barrier()
            t0 = time.perf_counter()
        loss = model(*batch)
        loss.backward()
        engine.step()
        engine.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if timed:
            times.append(time.perf_counter() - t0)
            comm.append(engine.take_comm_bytes())
        else:
            engine.take_comm_bytes()
        if rank == 0 and progress:
            report({"event": "iteration", "iteration": it + 1, "total": total, "loss": float(loss.detach())})
    t = torch.tensor(times, dtype=torch.float64)
    gathered = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    peak = torch.tensor([_peak_memory_bytes(device), sum(comm) // max(1, len(comm))], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    engine.close()
    return {
        "times": torch.stack(gathered).max(dim=0).values.tolist(),
        "peak_memory_bytes": int(max(p[0].item() for p in peaks)),
        "comm_bytes_per_iter": int(sum(p[1].item() for p in peaks)),
        "backend": dist.get_backend(),
        "device_kind": device.type,
        "final_loss": float(loss.detach()),
    }


def _describe(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, launcher: str) -> dict[str, Any]:
    return {"model": strategy.model["name"], "cluster": cluster.name, "cluster_scale": cluster.scale,
            "strategy_hash": strategy.hash,
            "launcher": launcher, "num_workers": len(strategy.replicas), "warmup": config.warmup,
            "iters": config.iters, "global_batch_size": strategy.global_batch_size}


def result_from_rank0(out: dict, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, launcher: str,
                      wall_s: float) -> TrialResult:
    """Assemble the :class:`TrialResult` of a finished trial from rank 0's report."""
    return TrialResult.from_times(
        out["times"], backend=out["backend"], device_kind=out["device_kind"],
        comm_bytes_per_iter=out["comm_bytes_per_iter"], peak_memory_bytes=out["peak_memory_bytes"], wall_s=wall_s,
        extra={"final_loss": out["final_loss"]}, **_describe(strategy, cluster, config, launcher))


def failed_result(status: str, error: str, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig,
                  launcher: str, wall_s: float) -> TrialResult:
    """A :class:`TrialResult` for a trial that did not finish."""
    return TrialResult(status=status, error=error, wall_s=wall_s, **_describe(strategy, cluster, config, launcher))


def check_network(cluster: ClusterSpec, node_net) -> None:
    from ..spec.cluster import is_lab_cluster

    if is_lab_cluster(cluster) and not node_net:
        raise SpecError(f"cluster {cluster.name!r} is a lab cluster: its workers run in the lab's network namespaces "
                        f"(synctune lab up {cluster.name}; the CLI then finds them)")
    if node_net:
        missing = [n.name for n in cluster.nodes if n.name not in node_net]
        if missing:
            raise SpecError(f"cluster {cluster.name!r}: the node network has no entry for node(s) {missing}")


def run_trial_local(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *,
                    on_progress: Callable[[dict], None] | None = None, node_net=None) -> TrialResult:
    """Run a trial on local worker processes, one per replica (CPU clusters, or GPUs of this machine).

    ``node_net`` (node name -> ``{"netns", "address", "ifname"}``, a lab's network) runs each
    node's workers inside that node's namespace, over its shaped link. Never raises for a trial
    that fails at run time: the result's status says what happened.
    """
    from ..models.zoo import model_spec
    from ..strategy.validate import validate
    from .core import check_supported
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    spec = model_spec(strategy.model["name"])
    validate(strategy, spec, cluster)
    check_supported(strategy, spec)
    kinds = {cluster.node_of(d).device_kind for d in strategy.replicas}
    backend = "gloo"
    if "gpu" in kinds:
        import torch

        needed = len(strategy.replicas)
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if kinds != {"gpu"} or have < needed:
            raise SpecError(f"cluster {cluster.name!r} needs {needed} GPU worker(s) and this machine has {have} GPU(s); "
                            f"run it on a Ray cluster with matching nodes, or use a local-* preset")
        backend = "nccl"
    payload = {"strategy": strategy.to_dict(), "cluster": cluster.to_dict(), "config": asdict(config)}
    start = time.monotonic()
    try:
        outs = run_local(trial_worker, len(strategy.replicas), (payload,), backend=backend, timeout_s=config.timeout_s,
                         collective_timeout_s=config.collective_timeout_s,
                         on_progress=(lambda _rank, msg: on_progress(msg)) if on_progress else None,
                         nets=rank_networks(cluster, strategy.replicas, node_net))
    except WorkerFailure as failure:
        return failed_result(failure.status, failure.message, strategy, cluster, config, "local",
                             time.monotonic() - start)
    return result_from_rank0(outs[0], strategy, cluster, config, "local", time.monotonic() - start)



def run_trials_local(strategies: list[Strategy], cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *,
                     on_result: Callable[[int, TrialResult], None] | None = None, node_net=None
                     ) -> list[TrialResult]:
    """Run many trials of one cluster on one local process group, in order.

    Start-up (spawn, imports, rendezvous) is paid once per group, not per trial. If a trial
    fails, it gets its failure as result and the remaining trials continue in a fresh group.
    ``on_result(index, result)`` is called as each trial finishes; ``node_net`` as for
    :func:`run_trial_local`.
    """
    from ..models.zoo import model_spec
    from ..strategy.validate import validate
    from .core import check_supported
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    if any(cluster.node_of(d).device_kind != "cpu" for s in strategies for d in s.replicas):
        raise SpecError("run_trials_local runs CPU clusters; use run_trial_local or a Ray worker group for GPUs")
    for s in strategies:
        spec = model_spec(s.model["name"])
        validate(s, spec, cluster)
        check_supported(s, spec)
    results: dict[int, TrialResult] = {}
    pending = list(range(len(strategies)))
    while pending:
        first = pending[0]
        group = [strategies[i] for i in pending]
        start = time.monotonic()
        last = [start]

        def on_progress(_rank, msg):
            if msg.get("event") == "trial_done":
                i = msg["index"]
                now = time.monotonic()
                results[i] = result_from_rank0(msg["out"], strategies[i], cluster, config, "local", now - last[0])
                last[0] = now
                if on_result:
                    on_result(i, results[i])

        payload = {"strategies": [s.to_dict() for s in group], "cluster": cluster.to_dict(),
                   "config": asdict(config), "first_index": first}
        world = len(group[0].replicas)
        try:
            run_local(trials_worker, world, (payload,), timeout_s=config.timeout_s * len(group),
                      collective_timeout_s=config.collective_timeout_s, on_progress=on_progress,
                      nets=rank_networks(cluster, group[0].replicas, node_net))
        except WorkerFailure as failure:
            culprit = next(i for i in pending if i not in results)
            results[culprit] = failed_result(failure.status, failure.message, strategies[culprit], cluster, config,
                                             "local", time.monotonic() - last[0])
            if on_result:
                on_result(culprit, results[culprit])
        pending = [i for i in pending if i not in results]
    return [results[i] for i in range(len(strategies))]
