"""What every trial measures, whatever runtime runs it: the trial's settings, its result, the
peak memory of a rank, and the timed loop (AutoDist §3.3: W warm-up, then M timed iterations).

Timing is taken on every rank around whole iterations, each started after a barrier, and an
iteration's time is the slowest rank's (the step is not done until every replica has its
parameters). Runtimes (:mod:`synctune.engine.runtime`) import this module; it imports none of
them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from ..spec.checks import LIMITS, in_range, is_number
from ..spec.errors import SpecError

__all__ = ["TrialConfig", "TrialResult", "PeakMemory", "STATUSES", "OPTIMIZERS", "timed_iterations", "device_done", "gather_max", "loss_value"]

#: Every trial ends in one of these.
STATUSES = ("ok", "failed", "timeout", "oom")
OPTIMIZERS = ("sgd", "adam")  # names a workload's make_optimizer takes


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """How a trial runs: iteration counts, optimizer, seed and the bounds on waiting.

    With ``target_ci`` above 0 the trial measures until it knows its median: after ``iters``
    timed iterations it adds more until the 95% interval of the median iteration time
    (:func:`synctune.stats.median_interval`) lies within ``target_ci`` of the median on both
    sides, or ``max_iters`` timed iterations or ``max_timed_s`` seconds of them are spent
    (whichever comes first). 0 (the default): exactly ``iters``, as AutoDist §3.3's W + M."""

    warmup: int = 10
    iters: int = 40
    target_ci: float = 0.0
    max_iters: int = 100
    max_timed_s: float = 30.0
    #: Local launcher: bind each worker to one CPU (rank r to the r-th), so a trial's workers
    #: share cores the same way in every trial (:func:`synctune.engine.local.cpu_of_rank`).
    pin_cpus: bool = False
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
        if not (is_number(self.target_ci) and 0 <= self.target_ci < 1):
            raise SpecError(f"trial config: target_ci: expected a relative half-width from 0 (off) to below 1, e.g. "
                            f"0.03 for +-3%, got {self.target_ci!r}")
        low = self.iters if self.target_ci else 1  # a cap below iters caps nothing measured to a target
        if not in_range(self.max_iters, low, top):
            raise SpecError(f"trial config: max_iters: expected an integer from {low} to {top}"
                            f"{' (at least iters with target_ci)' if self.target_ci else ''}, got {self.max_iters!r}")
        if not (is_number(self.max_timed_s) and 0 < self.max_timed_s <= LIMITS["timeout_s"]):
            raise SpecError(f"trial config: max_timed_s: expected a positive number of seconds, got "
                            f"{self.max_timed_s!r}")
        if not isinstance(self.pin_cpus, bool):
            raise SpecError(f"trial config: pin_cpus: expected true or false, got {self.pin_cpus!r}")
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
        """The result as plain data (what crosses Ray and Tune; :meth:`from_dict` reads it back)."""
        out = asdict(self)
        out["iteration_times_s"] = list(self.iteration_times_s)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        """The result back from its plain-data form (:meth:`to_dict`: what crosses Ray and Tune)."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw["iteration_times_s"] = tuple(kw.get("iteration_times_s") or ())
        kw["extra"] = dict(kw.get("extra") or {})
        return cls(**kw)

    @property
    def ok(self) -> bool:
        """Whether the trial finished and measured its iterations."""
        return self.status == "ok"

    @property
    def measured_s(self) -> float | None:
        """The mean iteration time of a finished trial, else None (what a search ranks by)."""
        return self.mean_s if self.status == "ok" else None

    @classmethod
    def from_times(cls, times: list[float], **kw: Any) -> "TrialResult":
        """A finished trial's result from its timed iterations ``times`` (seconds): their mean,
        median and population deviation, and samples per second from ``kw``'s
        ``global_batch_size``; ``kw`` gives the other fields."""
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
        """Start a new peak here (at a trial's start), so an earlier trial's peak is not reported."""
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
        """The peak in bytes since :meth:`reset`: CUDA's allocated peak, or the CPU's VmHWM (the
        process's lifetime ``ru_maxrss`` where ``/proc`` is not there)."""
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


def loss_value(loss: Any) -> float:
    """A step's loss as a float, detached first: ``float()`` of a tensor that still requires grad
    warns on every call (a Hugging Face model's loss does), once per iteration of every trial."""
    return float(loss.detach()) if hasattr(loss, "detach") else float(loss)


def gather_max(times: list[float], device) -> list[float]:
    """Per iteration, the slowest rank's time (every rank calls it)."""
    import torch
    import torch.distributed as dist

    # Bookkeeping travels on the engine's device: a CUDA-only backend (NCCL) takes nothing else.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return torch.stack(gathered).max(dim=0).values.cpu().tolist()



def device_done(device) -> None:
    """Return once ``device`` has run every kernel launched so far (a no-op off CUDA): what ends
    a timed iteration on a GPU, whose kernels run after the calls that launch them return."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed_iterations(rank: int, world: int, config: TrialConfig, device, memory: PeakMemory,
                     iteration: Callable[[], Any], *, t_start: float, take_comm: Callable[[], int | None] | None = None,
                     close: Callable[[], None] | None = None, progress: bool = True,
                     memory_probe: Callable[[], dict] | None = None) -> dict:
    """What every trial measures, whatever runs its iterations (AutoDist §3.3's W + M): warm-up
    then timed iterations, each timed one started after a barrier, ``iteration()`` returning once
    the step is done (its loss); then, across ranks, the slowest rank per iteration, the peak
    memory and the bytes handed to collectives (``take_comm``, where the runtime counts them).
    ``memory_probe`` (every rank) runs more, instrumented, iterations after the timed ones and
    returns the rank's memory part by part (:mod:`synctune.engine.memory`), gathered into
    ``memory`` (part -> per rank); its iterations count in neither the times, the bytes sent nor
    the peak. ``close`` runs after the gathering."""
    import torch
    import torch.distributed as dist

    t_loop = time.perf_counter()
    times, slowest, comm, loss, stopped = _iterate(rank, config, device, iteration, take_comm, progress)
    t_end = time.perf_counter()
    if slowest is None:  # the fixed count: gathered once, after the loop (the "gather" phase)
        slowest = gather_max(times, device)
    peak = torch.tensor([memory.peak_bytes(), sum(comm) // max(1, len(comm)) if comm else -1],
                        dtype=torch.float64, device=device)
    parts = None
    if memory_probe is not None:
        from .memory import MEMORY_PARTS, breakdown_to_row

        mine = memory_probe()
        if take_comm is not None:
            take_comm()  # the probe's bytes are not the trial's
        # -1: a part this runtime does not expose (bytes are never negative).
        parts = torch.tensor([-1 if mine.get(k) is None else mine[k] for k in MEMORY_PARTS], dtype=torch.float64,
                             device=device)
        peak = torch.cat([peak, parts])
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if parts is not None:
        per_rank = [{k: (None if v < 0 else int(v)) for k, v in zip(MEMORY_PARTS, p[2:].tolist())} for p in peaks]
        parts = breakdown_to_row(per_rank)
    if close is not None:
        close()
    return {
        # Where a trial's time goes on rank 0 (the overhead benchmark reads it): building the
        # model, runtime and batch; every iteration, warm-up included; gathering the results.
        "phases_s": {"setup": t_loop - t_start, "iterations": t_end - t_loop, "gather": time.perf_counter() - t_end},
        "times": slowest,
        "peak_memory_bytes": int(max(p[0].item() for p in peaks)),
        "comm_bytes_per_iter": int(sum(p[1].item() for p in peaks)) if comm else None,
        "final_loss": loss_value(loss),
        "memory": parts,
        "measure": measure_figures(slowest, config, stopped),
    }


def _iterate(rank: int, config: TrialConfig, device, iteration: Callable[[], Any],
             take_comm: Callable[[], int | None] | None, progress: bool
             ) -> tuple[list[float], list[float] | None, list[int], Any, str]:
    """The warm-up and timed iterations: (this rank's seconds per timed iteration, the slowest
    rank's where a target interval already gathered them, else None, the bytes sent per timed
    iteration, the last loss, why timing stopped). With a target interval,
    after ``iters`` it times a few more at a time until :func:`_enough` says stop, decided from
    the gathered times, the same on every rank, so every rank stops after the same iteration."""
    import torch.distributed as dist

    from .local import report

    total = config.warmup + config.iters
    times: list[float] = []
    comm: list[int] = []
    it = 0
    while True:
        if it == total:
            if config.target_ci <= 0:
                return times, None, comm, loss, "iters"
            slowest = gather_max(times, device)
            stopped = _enough(slowest, config)
            if stopped:
                return times, slowest, comm, loss, stopped
            total = min(total + max(2, len(times) // 4), config.warmup + config.max_iters)  # few gathers
        timed = it >= config.warmup
        if timed:
            dist.barrier()
            t0 = time.perf_counter()
        loss = iteration()
        # CUDA kernels run after the calls that launch them return: without waiting for them the
        # times were launch times, the GPU's work paid in the next barrier, outside every window.
        device_done(device)
        if timed:
            times.append(time.perf_counter() - t0)
        sent = take_comm() if take_comm is not None else None
        if timed and sent is not None:
            comm.append(sent)
        if rank == 0 and progress:
            report({"event": "iteration", "iteration": it + 1, "total": total, "loss": loss_value(loss)})
        it += 1


def _enough(times: list[float], config: TrialConfig) -> str:
    """Why an adaptive trial stops now ("target", "max_iters", "max_timed_s"), or "" to go on."""
    from ..stats import median_interval

    low, mid, high = median_interval(times)
    if mid > 0 and max(mid - low, high - mid) <= config.target_ci * mid:
        return "target"
    if len(times) >= config.max_iters:
        return "max_iters"
    if sum(times) >= config.max_timed_s:
        return "max_timed_s"
    return ""


def measure_figures(times: list[float], config: TrialConfig, stopped: str) -> dict:
    """What a trial records of how it measured: the rule (fixed ``iters``, or the target
    interval and its caps), why it stopped, the timed iterations and the 95% interval of the
    median (relative half-width: the larger side over the median; None below 6 iterations)."""
    from ..stats import median_interval

    low, mid, high = median_interval(times)
    half = max(mid - low, high - mid) / mid if mid > 0 and math.isfinite(low) and math.isfinite(high) else None
    out = {"rule": "ci" if config.target_ci > 0 else "fixed", "stopped": stopped, "iterations": len(times),
           "median_ci_s": [low, high] if half is not None else None, "median_ci_rel": half}
    if config.target_ci > 0:
        out |= {"target_ci": config.target_ci, "max_iters": config.max_iters, "max_timed_s": config.max_timed_s}
    return out
