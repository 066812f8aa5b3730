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

from ..spec._util import LIMITS, in_range, is_number
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy

__all__ = ["TrialConfig", "TrialResult", "run_trial_local", "run_trials_local", "trial_worker", "trial_payload",
           "check_trial", "PeakMemory", "STATUSES"]

#: The process-group backend of GPU trials: NCCL for CUDA tensors, gloo beside it for the CPU
#: tensors a training loop may still hand a collective (a count, a flag).
GPU_BACKEND = "cpu:gloo,cuda:nccl"

#: Every trial ends in one of these.
STATUSES = ("ok", "failed", "timeout", "oom")
OPTIMIZERS = ("sgd", "adam")  # names a workload's make_optimizer takes


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
        top = LIMITS["iterations"]
        if not in_range(self.warmup, 0, top):
            raise SpecError(f"trial config: warmup: expected an integer from 0 to {top}, got {self.warmup!r}")
        if not in_range(self.iters, 1, top):
            raise SpecError(f"trial config: iters: expected an integer from 1 to {top}, got {self.iters!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"trial config: optimizer: expected one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not in_range(self.seed, 0, LIMITS["seed"]):
            raise SpecError(f"trial config: seed: expected an integer from 0 to {LIMITS['seed']}, got {self.seed!r}")
        for key, top in (("lr", 1e6), ("timeout_s", LIMITS["timeout_s"]), ("collective_timeout_s", LIMITS["timeout_s"])):
            value = getattr(self, key)
            if not (is_number(value) and 0 < value <= top):
                raise SpecError(f"trial config: {key}: expected a positive number up to {top:g}, got {value!r}")


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


class PeakMemory:
    """The peak memory of this process during one trial (workers are reused across trials, so a
    lifetime high-water mark would only grow): CUDA's allocator peak, reset per trial; on the
    CPU the peak resident set (Linux: ``/proc/self/clear_refs`` resets VmHWM; elsewhere the
    lifetime maximum is all there is)."""

    def __init__(self, device) -> None:
        self.device = device
        self.cuda = getattr(device, "type", "cpu") == "cuda"

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def peak_bytes(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def trial_payload(workload, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, spec: ModelSpec,
                  **extra: Any) -> dict:
    """What every rank of a trial receives (picklable: it crosses process boundaries)."""
    return {"workload": workload, "model_spec": spec.to_dict(), "strategy": strategy.to_dict(),
            "cluster": cluster.to_dict(), "config": asdict(config), **extra}


def trial_worker(rank: int, world: int, payload: dict) -> dict:
    """The body of one rank of a trial (runs inside a process of the group)."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    return _measure(rank, world, payload, Strategy.from_dict(payload["strategy"]), payload.get("gpu_per_rank", True))


def trials_worker(rank: int, world: int, payload: dict) -> int:
    """Several trials in one process group, one after another; rank 0 reports each result as it
    completes (event ``trial_done``), so finished trials survive a later failure."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    for index, strategy in enumerate(payload["strategies"]):
        out = _measure(rank, world, payload, Strategy.from_dict(strategy), True, progress=False)
        if rank == 0:
            report({"event": "trial_done", "index": payload["first_index"] + index, "out": out})
    return len(payload["strategies"])


def _measure(rank: int, world: int, payload: dict, strategy: Strategy, gpu_per_rank: bool,
             progress: bool = True) -> dict:
    import torch
    import torch.distributed as dist

    from .core import StrategyEngine
    from .local import report

    workload = payload["workload"]
    spec = ModelSpec.from_dict(payload["model_spec"])
    cluster = ClusterSpec.from_dict(payload["cluster"])
    config = TrialConfig(**payload["config"])
    node = cluster.node_of(strategy.replicas[rank])
    if node.device_kind == "gpu":
        # Local launches own every GPU of the machine (rank r takes GPU r); a Ray actor sees only
        # the GPU Ray gave it, as index 0.
        device = torch.device("cuda", rank % torch.cuda.device_count() if gpu_per_rank else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    memory = PeakMemory(device)
    memory.reset()
    torch.manual_seed(config.seed)
    with torch.device(device):
        model = workload.build_model()
    engine = StrategyEngine(model, strategy, spec, cluster,
                            lambda params: workload.make_optimizer(params, name=config.optimizer, lr=config.lr),
                            seed=config.seed)
    gen = torch.Generator(device=device).manual_seed(config.seed * 100_003 + rank)
    batch = workload.make_batch(strategy.batch_split[rank], rank=rank, generator=gen, device=device)
    total = config.warmup + config.iters
    times: list[float] = []
    comm: list[int] = []
    for it in range(total):
        timed = it >= config.warmup
        if timed:
            dist.barrier()
            t0 = time.perf_counter()
        loss = workload.loss(model, batch)
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
    # Bookkeeping travels on the engine's device: a CUDA-only backend (NCCL) takes nothing else.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    peak = torch.tensor([memory.peak_bytes(), sum(comm) // max(1, len(comm))], dtype=torch.float64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    engine.close()
    return {
        "times": torch.stack(gathered).max(dim=0).values.cpu().tolist(),
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


def check_trial(workload, strategy: Strategy, cluster: ClusterSpec) -> ModelSpec:
    """Validate ``strategy`` for ``workload`` on ``cluster`` and refuse, before any worker starts,
    what the engine does not execute; returns the workload's model spec."""
    from ..strategy.validate import validate
    from .core import check_supported

    spec = workload.spec()
    validate(strategy, spec, cluster)
    check_supported(strategy, spec)
    return spec


def run_trial_local(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *, workload,
                    on_progress: Callable[[dict], None] | None = None, node_net=None) -> TrialResult:
    """Run a trial of ``workload`` on local worker processes, one per replica (CPU clusters, or
    GPUs of this machine).

    ``node_net`` (node name -> ``{"netns", "address", "ifname"}``, a lab's network) runs each
    node's workers inside that node's namespace, over its shaped link. Never raises for a trial
    that fails at run time: the result's status says what happened.
    """
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    spec = check_trial(workload, strategy, cluster)
    kinds = {cluster.node_of(d).device_kind for d in strategy.replicas}
    backend = "gloo"
    if "gpu" in kinds:
        import torch

        needed = len(strategy.replicas)
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if kinds != {"gpu"} or have < needed:
            raise SpecError(f"cluster {cluster.name!r} needs {needed} GPU worker(s) and this machine has {have} GPU(s); "
                            f"run it on a Ray cluster with matching nodes, or use a local-* preset")
        backend = GPU_BACKEND
    payload = trial_payload(workload, strategy, cluster, config, spec)
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
                     workload, on_result: Callable[[int, TrialResult], None] | None = None, node_net=None
                     ) -> list[TrialResult]:
    """Run many trials of ``workload`` on one cluster and one local process group, in order.

    Start-up (spawn, imports, rendezvous) is paid once per group, not per trial. If a trial
    fails, it gets its failure as result and the remaining trials continue in a fresh group.
    ``on_result(index, result)`` is called as each trial finishes; ``node_net`` as for
    :func:`run_trial_local`.
    """
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    if any(cluster.node_of(d).device_kind != "cpu" for s in strategies for d in s.replicas):
        raise SpecError("run_trials_local runs CPU clusters; use run_trial_local or a Ray worker group for GPUs")
    spec = workload.spec()
    for s in strategies:
        check_trial(workload, s, cluster)
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

        payload = trial_payload(workload, group[0], cluster, config, spec, first_index=first,
                                strategies=[s.to_dict() for s in group])
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
