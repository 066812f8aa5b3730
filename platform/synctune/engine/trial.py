"""A trial: one strategy run for real, W warm-up then M timed iterations (AutoDist §3.3: 10 + 40).

Timing is taken on every rank around whole iterations, each started after a barrier, and an
iteration's time is the slowest rank's (the step is not done until every replica has its
parameters). Data is synthetic, of the model's shapes, made once per rank: the trial times
synchronization and compute, not input pipelines.
"""

from __future__ import annotations

import itertools
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
           "check_trial", "PeakMemory", "STATUSES", "confirm_worker", "confirm_payload", "run_confirm_local",
           "interleave"]

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
    if "arms" in payload:
        return confirm_worker(rank, world, payload)
    kind = (payload.get("runtime") or {}).get("kind")
    if getattr(payload["workload"], "framework", "torch") == "tensorflow" and kind in ("tensorflow", "horovod"):
        from .tensorflow import tensorflow_trial_worker

        return tensorflow_trial_worker(rank, world, payload)
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


class _Arm:
    """One way of training on this rank: our engine running ``strategy``, or (``runtime`` set)
    torch DDP or real Horovod configured by it. The model and the batch are built the same way
    for all, so two arms in one process differ only in how gradients travel."""

    def __init__(self, rank: int, payload: dict, strategy: Strategy, runtime: dict | None, device) -> None:
        import torch

        from .core import StrategyEngine

        workload = payload["workload"]
        config = TrialConfig(**payload["config"])
        self.workload, self.device = workload, device
        torch.manual_seed(config.seed)
        with torch.device(device):
            self.model = workload.build_model()
        make_opt = lambda params: workload.make_optimizer(params, name=config.optimizer, lr=config.lr)  # noqa: E731
        self.engine = self.horovod = None
        kind = runtime["kind"] if runtime is not None else "engine"
        if kind == "engine":
            self.engine = StrategyEngine(self.model, strategy, ModelSpec.from_dict(payload["model_spec"]),
                                         ClusterSpec.from_dict(payload["cluster"]), make_opt, seed=config.seed)
            self.forward_model = self.model
        elif kind == "ddp":
            from .ddp import DDPConfig, wrap_ddp

            self.forward_model = wrap_ddp(self.model, DDPConfig.from_dict(runtime["ddp"]),
                                          device_ids=[device.index] if device.type == "cuda" else None)
            self.optimizer = make_opt(list(self.forward_model.parameters()))
        else:
            import os

            from .horovod import HorovodConfig, HorovodSession

            cluster = ClusterSpec.from_dict(payload["cluster"])
            hv_config = HorovodConfig.from_dict(runtime["horovod"])
            hosts = [cluster.node_of(d).name for d in strategy.replicas]
            self.horovod = HorovodSession(hv_config, rank, hosts, os.environ.get("SYNCTUNE_MASTER_ADDR", "127.0.0.1"),
                                          timeout_s=config.collective_timeout_s)
            self.forward_model = self.model
            self.optimizer = self.horovod.optimizer(make_opt(list(self.model.parameters())), self.model, hv_config)
        gen = torch.Generator(device=device).manual_seed(config.seed * 100_003 + rank)
        self.batch = workload.make_batch(strategy.batch_split[rank], rank=rank, generator=gen, device=device)

    def iteration(self):
        """One training iteration; returns the loss (the step is done on return)."""
        import torch

        loss = self.workload.loss(self.forward_model, self.batch)
        loss.backward()
        if self.engine is not None:
            self.engine.step()
            self.engine.zero_grad()
        elif self.horovod is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments (torch's default: set to None)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss

    def take_comm_bytes(self) -> int | None:
        """Bytes handed to collectives since the last call (counted by our engine; DDP's and
        Horovod's are their own business and not counted)."""
        return self.engine.take_comm_bytes() if self.engine is not None else None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.horovod is not None:
            self.horovod.close()


def _device(cluster: ClusterSpec, strategy: Strategy, rank: int, gpu_per_rank: bool):
    import torch

    node = cluster.node_of(strategy.replicas[rank])
    if node.device_kind == "gpu":
        # Local launches own every GPU of the machine (rank r takes GPU r); a Ray actor sees only
        # the GPU Ray gave it, as index 0.
        device = torch.device("cuda", rank % torch.cuda.device_count() if gpu_per_rank else 0)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _gather_max(times: list[float], device) -> list[float]:
    """Per iteration, the slowest rank's time (every rank calls it)."""
    import torch
    import torch.distributed as dist

    # Bookkeeping travels on the engine's device: a CUDA-only backend (NCCL) takes nothing else.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return torch.stack(gathered).max(dim=0).values.cpu().tolist()


def _measure(rank: int, world: int, payload: dict, strategy: Strategy, gpu_per_rank: bool,
             progress: bool = True) -> dict:
    import torch.distributed as dist

    t_start = time.perf_counter()
    config = TrialConfig(**payload["config"])
    device = _device(ClusterSpec.from_dict(payload["cluster"]), strategy, rank, gpu_per_rank)
    memory = PeakMemory(device)
    memory.reset()
    arm = _Arm(rank, payload, strategy, payload.get("runtime"), device)
    timed = timed_iterations(rank, world, config, device, memory, arm.iteration, t_start=t_start,
                             take_comm=arm.take_comm_bytes, close=arm.close, progress=progress)
    return {**timed, "backend": dist.get_backend(), "device_kind": device.type}


def timed_iterations(rank: int, world: int, config: TrialConfig, device, memory: PeakMemory,
                     iteration: Callable[[], Any], *, t_start: float, take_comm: Callable[[], int | None] | None = None,
                     close: Callable[[], None] | None = None, progress: bool = True) -> dict:
    """What every trial measures, whatever runs its iterations (AutoDist §3.3's W + M): warm-up
    then timed iterations, each timed one started after a barrier, ``iteration()`` returning once
    the step is done (its loss); then, across ranks, the slowest rank per iteration, the peak
    memory and the bytes handed to collectives (``take_comm``, where the runtime counts them).
    ``close`` runs after the gathering."""
    import torch
    import torch.distributed as dist

    from .local import report

    t_loop = time.perf_counter()
    total = config.warmup + config.iters
    times: list[float] = []
    comm: list[int] = []
    for it in range(total):
        timed = it >= config.warmup
        if timed:
            dist.barrier()
            t0 = time.perf_counter()
        loss = iteration()
        if timed:
            times.append(time.perf_counter() - t0)
        sent = take_comm() if take_comm is not None else None
        if timed and sent is not None:
            comm.append(sent)
        if rank == 0 and progress:
            report({"event": "iteration", "iteration": it + 1, "total": total, "loss": float(loss)})
    t_end = time.perf_counter()
    slowest = _gather_max(times, device)
    peak = torch.tensor([memory.peak_bytes(), sum(comm) // max(1, len(comm)) if comm else -1],
                        dtype=torch.float64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if close is not None:
        close()
    return {
        # Where a trial's time goes on rank 0 (the overhead benchmark reads it): building the
        # model, runtime and batch; every iteration, warm-up included; gathering the results.
        "phases_s": {"setup": t_loop - t_start, "iterations": t_end - t_loop, "gather": time.perf_counter() - t_end},
        "times": slowest,
        "peak_memory_bytes": int(max(p[0].item() for p in peaks)),
        "comm_bytes_per_iter": int(sum(p[1].item() for p in peaks)) if comm else None,
        "final_loss": float(loss.detach()) if hasattr(loss, "detach") else float(loss),
    }


def confirm_worker(rank: int, world: int, payload: dict) -> dict:
    """Interleaved re-measurement on the same processes (DESIGN.md "confirmed speed-up"): every
    arm is built once and warmed up, then each round times ``per_round`` iterations of one arm
    and then of the other, the order alternating between rounds (A B, B A, A B, ...) so a slow
    drift of the machine weighs on both alike. Returns, per round, each arm's median iteration
    time (slowest rank per iteration).

    With ``screen_rounds`` and more than two arms (candidates, then the baseline last), a
    screening comes first: ``screen_rounds`` rounds of every arm, the order rotating, pick the
    candidate whose per-round ratio to the baseline has the smallest median; then the rounds
    above compare that pick with the baseline on fresh iterations, so the reported speed-up is
    not the maximum of several noisy ones (the winner's curse, one level up)."""
    import statistics

    import torch.distributed as dist

    from .local import report

    config = TrialConfig(**payload["config"])
    arms_spec = payload["arms"]
    strategies = [Strategy.from_dict(a["strategy"]) for a in arms_spec]
    cluster = ClusterSpec.from_dict(payload["cluster"])
    device = _device(cluster, strategies[0], rank, payload.get("gpu_per_rank", True))
    arms = [_Arm(rank, payload, s, a.get("runtime"), device)
            for s, a in zip(strategies, arms_spec)]
    for arm in arms:
        for _ in range(config.warmup):
            arm.iteration()
            arm.take_comm_bytes()
    per_round = int(payload["per_round"])

    def timed(which: int) -> float:
        arm, times = arms[which], []
        for _ in range(per_round):
            dist.barrier()
            t0 = time.perf_counter()
            arm.iteration()
            times.append(time.perf_counter() - t0)
            arm.take_comm_bytes()
        # Every rank gets the same gathered times, so every rank makes the same pick.
        return statistics.median(_gather_max(times, device))

    def on_screen_round(r: int, rounds: int) -> None:
        report({"event": "screen_round", "round": r, "rounds": rounds})

    def on_round(r: int, rounds: int, medians: list[list[float]]) -> None:
        report({"event": "confirm_round", "round": r, "rounds": rounds, "a_s": medians[0][-1], "b_s": medians[1][-1]})

    medians, picked, screen = interleave(
        timed, len(arms), rounds=int(payload["rounds"]), screen_rounds=int(payload.get("screen_rounds", 0)),
        on_screen_round=on_screen_round if rank == 0 else None, on_round=on_round if rank == 0 else None)
    for arm in arms:
        arm.close()
    out = {"a_s": medians[0], "b_s": medians[1], "backend": dist.get_backend(), "device_kind": device.type}
    if screen:
        out.update({"picked": picked, "screen_s": screen})
    return out


def interleave(timed: Callable[[int], float], arms: int, *, rounds: int, screen_rounds: int = 0,
               on_screen_round: Callable[[int, int], None] | None = None,
               on_round: Callable[[int, int, list[list[float]]], None] | None = None
               ) -> tuple[list[list[float]], int, list[list[float]] | None]:
    """The schedule of a confirmation (:func:`confirm_worker`), over ``timed(arm)``, which times
    one round of an arm: with more than two arms (candidates, the baseline last) and
    ``screen_rounds``, that many rounds of every arm, the order rotating, and the pick: the
    candidate whose per-round ratio to the baseline has the smallest median; then ``rounds``
    rounds of the pick and the baseline, alternating A B, B A. Returns (per-round times of the
    pick and of the baseline, the pick's index, the screening's times or None)."""
    import statistics

    screen_rounds = screen_rounds if arms > 2 else 0
    screen: list[list[float]] = [[] for _ in range(arms)]
    for r in range(screen_rounds):
        for which in [(r + j) % arms for j in range(arms)]:
            screen[which].append(timed(which))
        if on_screen_round:
            on_screen_round(r + 1, screen_rounds)
    picked = 0
    if screen_rounds:
        picked = min(range(arms - 1), key=lambda i: statistics.median(a / b for a, b in zip(screen[i], screen[-1])))
    pair = (picked, arms - 1)
    medians: list[list[float]] = [[], []]
    for r in range(rounds):
        for slot in ((0, 1) if r % 2 == 0 else (1, 0)):
            medians[slot].append(timed(pair[slot]))
        if on_round:
            on_round(r + 1, rounds, medians)
    return medians, picked, screen if screen_rounds else None


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
        extra={"final_loss": out["final_loss"], "phases_s": out.get("phases_s", {})},
        **_describe(strategy, cluster, config, launcher))


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


def check_trial(workload, strategy: Strategy, cluster: ClusterSpec, runtime: dict | None = None) -> ModelSpec:
    """Validate ``strategy`` for ``workload`` on ``cluster`` and refuse, before any worker starts,
    what the engine (or, with ``runtime``, torch DDP) does not execute; returns the workload's
    model spec."""
    from ..strategy.validate import validate
    from .core import check_supported

    spec = workload.spec()
    validate(strategy, spec, cluster)
    kind = runtime.get("kind") if isinstance(runtime, dict) else None
    if getattr(workload, "framework", "torch") == "tensorflow" and kind not in ("tensorflow", "horovod"):
        raise SpecError(f"workload {workload.name!r} is a Keras model: it runs with the tensorflow runtime "
                        f"(--runtime tensorflow) or Horovod's TensorFlow binding (--runtime horovod), not "
                        f"{kind or 'the engine'}")
    if runtime is not None:
        check_runtime(runtime, strategy, spec, cluster, workload)
    else:
        check_supported(strategy, spec)
    return spec


def check_runtime(runtime: dict, strategy: Strategy, spec: ModelSpec, cluster: ClusterSpec,
                  workload: Any = None) -> None:
    """Refuse a trial ``runtime`` (``ddp``, ``horovod`` or ``tensorflow``) that would not run
    what it claims."""
    kind = runtime.get("kind") if isinstance(runtime, dict) else None
    if kind == "tensorflow":
        from .tensorflow import check_tensorflow_trial

        check_tensorflow_trial(runtime, strategy, spec, cluster, workload)
        return
    if kind == "ddp":
        from .ddp import check_ddp_trial

        check_ddp_trial(runtime, strategy, spec, cluster)
    elif kind == "horovod":
        from .horovod import check_horovod_trial

        check_horovod_trial(runtime, strategy, spec, cluster, workload)
    else:
        raise SpecError(f"trial runtime: kind: expected ddp, horovod or tensorflow, got {kind!r}")


def run_trial_local(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *, workload,
                    on_progress: Callable[[dict], None] | None = None, node_net=None,
                    runtime: dict | None = None) -> TrialResult:
    """Run a trial of ``workload`` on local worker processes, one per replica (CPU clusters, or
    GPUs of this machine).

    ``node_net`` (node name -> ``{"netns", "address", "ifname"}``, a lab's network) runs each
    node's workers inside that node's namespace, over its shaped link. ``runtime`` (see
    :func:`synctune.engine.ddp.ddp_runtime`) runs torch DDP instead of the engine; ``strategy``
    then gives replicas and batch split only. Never raises for a trial that fails at run time:
    the result's status says what happened.
    """
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    spec = check_trial(workload, strategy, cluster, runtime)
    backend = _backend_for(cluster, strategy)
    payload = trial_payload(workload, strategy, cluster, config, spec, runtime=runtime)
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


def _backend_for(cluster: ClusterSpec, strategy: Strategy) -> str:
    kinds = {cluster.node_of(d).device_kind for d in strategy.replicas}
    if "gpu" not in kinds:
        return "gloo"
    import torch

    needed = len(strategy.replicas)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kinds != {"gpu"} or have < needed:
        raise SpecError(f"cluster {cluster.name!r} needs {needed} GPU worker(s) and this machine has {have} GPU(s); "
                        f"run it on a Ray cluster with matching nodes, or use a local-* preset")
    return GPU_BACKEND


def confirm_payload(workload, arms: list[tuple[Strategy, dict | None]], cluster: ClusterSpec, config: TrialConfig,
                    *, rounds: int, per_round: int, screen_rounds: int = 0) -> dict:
    """The payload of an interleaved re-measurement of arms (strategy, runtime or None): two, or
    with ``screen_rounds`` several candidates and the baseline last (:func:`confirm_worker`);
    every arm is checked as a trial first. All arms must use the same replicas."""
    if len(arms) < 2 or (len(arms) > 2 and not screen_rounds):
        raise SpecError(f"a confirmation compares two arms (more only with screening rounds), got {len(arms)}")
    if any(list(s.replicas) != list(arms[0][0].replicas) for s, _r in arms):
        raise SpecError("a confirmation runs its arms on the same processes: their strategies must have the same "
                        f"replicas, got {sorted({tuple(s.replicas) for s, _r in arms})}")
    if not (in_range(rounds, 2, 1000) and in_range(per_round, 1, LIMITS["iterations"])
            and in_range(screen_rounds, 0, 1000)):
        raise SpecError(f"confirmation: rounds must be an integer from 2 to 1000, per_round from 1 to "
                        f"{LIMITS['iterations']} and screen_rounds from 0 to 1000, got {rounds!r}, {per_round!r} "
                        f"and {screen_rounds!r}")
    if any(r and r.get("kind") == "tensorflow" for _, r in arms):
        raise SpecError("confirmation: the tensorflow runtime runs whole trials only (TensorFlow starts once per "
                        "process); confirm engine, ddp or horovod arms")
    if sum(1 for _, r in arms if r and r.get("kind") == "horovod") > 1:
        raise SpecError("confirmation: two arms are horovod runtimes, and Horovod runs once per process; compare a "
                        "Horovod arm with engine or ddp arms")
    spec = None
    for strategy, runtime in arms:
        spec = check_trial(workload, strategy, cluster, runtime)
    return trial_payload(workload, arms[0][0], cluster, config, spec, rounds=rounds, per_round=per_round,
                         screen_rounds=screen_rounds,
                         arms=[{"strategy": s.to_dict(), "runtime": r} for s, r in arms])


def run_confirm_local(arms: list[tuple[Strategy, dict | None]], cluster: ClusterSpec,
                      config: TrialConfig = TrialConfig(), *, workload, rounds: int = 10, per_round: int = 5,
                      screen_rounds: int = 0, node_net=None, on_progress: Callable[[dict], None] | None = None
                      ) -> dict:
    """Re-measure arms interleaved on one set of local worker processes (see
    :func:`confirm_worker`); returns the per-round medians (``a_s``, ``b_s``) and, from them,
    the speed-up of A over B with its 95% interval (:func:`synctune.strategy.outcomes.paired_ratio`).
    With ``screen_rounds`` and several candidates before the baseline, A is the screening's
    pick (``picked``). Raises :class:`~synctune.engine.local.WorkerFailure` if a worker fails."""
    from .local import rank_networks, run_local

    check_network(cluster, node_net)
    payload = confirm_payload(workload, arms, cluster, config, rounds=rounds, per_round=per_round,
                              screen_rounds=screen_rounds)
    strategy = arms[0][0]
    start = time.monotonic()
    total_s = confirm_timeout_s(config, rounds, per_round, arms=len(arms), screen_rounds=screen_rounds)
    outs = run_local(trial_worker, len(strategy.replicas), (payload,), backend=_backend_for(cluster, strategy),
                     timeout_s=total_s, collective_timeout_s=config.collective_timeout_s,
                     on_progress=(lambda _rank, msg: on_progress(msg)) if on_progress else None,
                     nets=rank_networks(cluster, strategy.replicas, node_net))
    return confirm_figures(outs[0], rounds, per_round, "local", time.monotonic() - start)


def confirm_timeout_s(config: TrialConfig, rounds: int, per_round: int, *, arms: int = 2,
                      screen_rounds: int = 0) -> float:
    """A confirmation's time limit: the trial timeout scaled by how many more iterations it runs
    (every arm's warm-up, the screening and every round), never below two trials' worth."""
    iterations = arms * config.warmup + (arms * screen_rounds + 2 * rounds) * per_round
    return config.timeout_s * max(2.0, iterations / (config.warmup + config.iters))


def confirm_figures(out: dict, rounds: int, per_round: int, launcher: str, wall_s: float) -> dict:
    """Rank 0's confirmation output with the speed-up of arm A over arm B and its interval."""
    from ..strategy.outcomes import paired_ratio

    return {**out, **paired_ratio(out["b_s"], out["a_s"]).to_dict(), "rounds": rounds, "per_round": per_round,
            "launcher": launcher, "wall_s": wall_s}


def run_trials_local(strategies: list[Strategy], cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *,
                     workload, on_result: Callable[[int, TrialResult], None] | None = None, node_net=None
                     ) -> list[TrialResult]:
    """Run many trials of ``workload`` on one cluster and one local process group, in order.

    Start-up (spawn, imports, rendezvous) is paid once per group, not per trial; consecutive
    trials on the same replicas share a group. If a trial fails, it gets its failure as result and the remaining trials continue in a fresh group.
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
        # One process group runs consecutive trials on the same replicas only: a strategy on a
        # replica subset (TAG §4.2) needs a group of its own size and placement.
        run = list(itertools.takewhile(lambda i: strategies[i].replicas == strategies[first].replicas, pending))
        group = [strategies[i] for i in run]
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
            culprit = next(i for i in run if i not in results)
            results[culprit] = failed_result(failure.status, failure.message, strategies[culprit], cluster, config,
                                             "local", time.monotonic() - last[0])
            if on_result:
                on_result(culprit, results[culprit])
        pending = [i for i in pending if i not in results]
    return [results[i] for i in range(len(strategies))]
