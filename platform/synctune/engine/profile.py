"""Measuring a workload's compute profile: the replay simulator's compute input (dPRO §4.1).

dPRO replays an iteration from a trace of the real run; synctune's equivalent of that trace for
the computation is one short profiling pass: ``workers`` processes (the trial's contention:
on CPUs they share the cores exactly as a trial's workers do) each run forward, backward and
an optimizer step on their own batch, without any synchronization, and record when each
variable's gradient becomes ready (a post-accumulate-grad hook, the same event the engine's
units wait for). Warm-up iterations are not timed; each timed iteration starts after a barrier
so the workers compete for the machine as they do in a trial. The profile keeps, per figure,
the median over iterations of the slowest worker; a CPU worker under a CFS quota (a lab node's
``cpu_share``) is timed for at least :data:`QUOTA_WINDOW_S` and keeps the mean, since the kernel
grants a quota per 100 ms period (cgroup v1 ``cpu.cfs_quota_us``, "CFS Bandwidth Control" in the
kernel's scheduler documentation): a few short iterations fit in one period's burst at a whole
core's speed. Other CPU workers can be timed over a window too (``min_timed_s``), keeping the
median; by default they time ``iters`` iterations.

On a GPU the kernels run after the Python calls return, so the figures are taken from CUDA
events instead of the host clock: one recorded at the start of the iteration, one in each
gradient's hook (on the stream backward runs on), one at each phase's end; the iteration ends
with a device synchronization, outside the figures (PyTorch's "CUDA semantics: asynchronous
execution" and its timing advice). A GPU profile also records the host's own path: when an
iteration's last call returns (``launch_s``, from plain iterations without the events' hooks)
and the host time the engine's gradient path adds per variable (``hook_s``, :func:`hook_cost`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..spec.model import ModelSpec
from ..spec.profile import ComputeProfile

__all__ = ["profile_compute", "profile_per_device_type", "profile_worker", "hook_cost", "under_cpu_quota",
           "QUOTA_WINDOW_S", "io_elements"]


def profile_worker(rank: int, world: int, payload: dict) -> dict:
    """One worker of :func:`profile_compute` (module level: it is pickled to spawned processes)."""
    import torch
    import torch.distributed as dist

    workload, spec = payload["workload"], ModelSpec.from_dict(payload["model_spec"])
    device = torch.device(payload.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank)  # one GPU per worker
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(payload["seed"])
    model = workload.build_model().to(device)
    params = dict(model.named_parameters())
    names = [v.name for v in spec.variables]
    index = {name: i for i, name in enumerate(names)}
    optimizer = workload.make_optimizer([params[n] for n in names], name=payload["optimizer"], lr=payload["lr"])
    gen = torch.Generator(device=device).manual_seed(payload["seed"] * 100_003 + rank)  # the trial's batch
    batch = workload.make_batch(payload["batch_size"], rank=rank, generator=gen, device=device)
    clock = _CudaClock(len(names)) if device.type == "cuda" else _HostClock(len(names))

    def hook_of(i: int):
        def hook(_param) -> None:
            clock.mark(i)
        return hook

    handles = [params[n].register_post_accumulate_grad_hook(hook_of(index[n])) for n in names]
    rows = []
    # A CPU worker under a CFS quota (a lab node's cpu_share) is measured over whole periods.
    quota = device.type == "cpu" and under_cpu_quota()
    window_s = payload["quota_window_s"] if quota else payload["min_timed_s"] if device.type == "cpu" else 0.0
    more = _more_iterations(dist, torch, device, payload["warmup"], payload["iters"], window_s)
    try:
        it = 0
        while more(it):
            it += 1
            clock.start()
            loss = workload.loss(model, batch)
            clock.phase(0)
            loss.backward()
            clock.phase(1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.phase(2)
            if it > payload["warmup"]:
                rows.append(clock.read())
            else:
                clock.read()
    finally:
        for h in handles:
            h.remove()
    # Under a quota an iteration runs at a core's full speed until the group's quota for the
    # period is spent, then waits for the next period: iteration times are two clusters, and
    # their median is either; the mean over whole periods is the rate the quota grants.
    med = statistics.fmean if quota and window_s else statistics.median
    out = {"forward_s": med(r[0] for r in rows), "backward_s": med(r[1] for r in rows),
           "step_s": med(r[2] for r in rows), "ready_s": [med(r[3][i] for r in rows) for i in range(len(names))]}
    if device.type == "cuda":
        out["launch_s"] = _launch_time(workload, model, batch, optimizer, iters=payload["iters"],
                                       warmup=min(payload["warmup"], 2))
        out["hook_s"] = hook_cost(device, warmup=payload["warmup"])
    out["io_elements"] = io_elements(workload, model, batch, payload["batch_size"])
    if payload.get("blocks"):
        out["recompute_s"] = _recompute_times(workload, payload, device, batch, payload["blocks"], out["backward_s"],
                                              med, window_s)
    return out


def _recompute_times(workload, payload: dict, device, batch, blocks: list[str], backward_s: float, med,
                     window_s: float) -> dict:
    """Per checkpointing mode, how much longer backward takes with every block checkpointed in
    that mode (a model built afresh, as the trial's is; the same iterations and statistic as the
    plain profile's): the recomputed forwards the replay adds to a checkpointed block's backward.
    A mode torch cannot recompute on this model is left out."""
    import torch
    import torch.distributed as dist

    from .checkpoint import apply_checkpointing
    from .measure import device_done

    out = {}
    for mode in ("full", "selective"):
        torch.manual_seed(payload["seed"])
        with torch.device(device):
            model = workload.build_model()
        apply_checkpointing(model, [(b, mode) for b in blocks])
        optimizer = workload.make_optimizer(list(model.parameters()), name=payload["optimizer"], lr=payload["lr"])
        times, failed = [], torch.zeros(1)
        more_mode = _more_iterations(dist, torch, device, payload["warmup"], payload["iters"], window_s)
        it = 0
        while more_mode(it):
            it += 1
            try:
                loss = workload.loss(model, batch)
                device_done(device)
                t0 = time.perf_counter()
                loss.backward()
                device_done(device)
                elapsed = time.perf_counter() - t0
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            except RuntimeError:
                failed[0] = 1
                elapsed = 0.0
            if it > payload["warmup"]:
                times.append(elapsed)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item() and times:
            out[mode] = max(0.0, med(times) - backward_s)
    return out


#: How long a CPU worker under a CFS quota is timed at least (ten of the kernel's default
#: 100 ms periods): its iterations last a few milliseconds, its quota is granted per period.
QUOTA_WINDOW_S = 1.0


def under_cpu_quota() -> bool:
    """Whether this process's CPU group, or a group above it, has a CFS quota (cgroup v1
    ``cpu.cfs_quota_us`` > 0: a lab node's ``cpu_share``); False where none can be read. The
    ``cpu`` controller's mount is read from /proc/self/mountinfo (proc(5))."""
    from pathlib import Path

    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    path = next((line.split(":", 2)[2] for line in groups if "cpu" in line.split(":", 2)[1].split(",")), None)
    root = None
    for line in mounts:
        fields, _, fs = line.partition(" - ")
        fs = fs.split()
        if len(fs) >= 3 and fs[0] == "cgroup" and "cpu" in fs[2].split(","):
            # The mount shows the hierarchy from its own root down (a container's mount starts lower).
            mounted_from, root = fields.split()[3], Path(fields.split()[4])
            break
    if path is None or root is None:
        return False
    group = root / Path(path).relative_to(mounted_from) if Path(path).is_relative_to(mounted_from) else root
    for parent in (group, *group.parents):
        try:
            if int((parent / "cpu.cfs_quota_us").read_text()) > 0:
                return True
        except (OSError, ValueError):
            pass
        if parent == root:
            break
    return False


def _more_iterations(dist, torch, device, warmup: int, iters: int, window_s: float):
    """``more(it)``: whether iteration ``it`` (0-based; the first ``warmup`` untimed) runs, the
    same answer on every worker; it also starts the workers' iterations together, as a barrier
    would. CPU workers run ``warmup + iters`` iterations and, while any worker's ``window_s``
    (0: none) since its first timed iteration has not passed, more (at most ``100 * iters``
    timed); GPU workers exactly ``warmup + iters`` (no quotas there, and NCCL's collectives
    take CUDA tensors: a barrier starts them)."""
    count = warmup + iters
    if device.type != "cpu":
        def fixed(it: int) -> bool:
            if it < count:
                dist.barrier()
            return it < count
        return fixed
    start = [0.0]

    def more(it: int) -> bool:
        now = time.perf_counter()
        if it == warmup:
            start[0] = now
        want = it < count or (window_s > 0 and now - start[0] < window_s and it < warmup + 100 * iters)
        flag = torch.tensor([int(want)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    return more


def _launch_time(workload, model, batch, optimizer, *, iters: int, warmup: int = 2) -> float:
    """Median host seconds until an iteration's last call returns on a GPU (the kernels may still
    run), from plain iterations with no hook: in the profiled ones every gradient's hook records a
    CUDA event, whose host time ``hook_s`` would then count a second time, so a model of many
    variables would have its host path overstated."""
    import torch
    import torch.distributed as dist

    launches = []
    for it in range(warmup + iters):
        torch.cuda.synchronize()
        dist.barrier()  # as in the profiled iterations: the workers' hosts busy at once
        t0 = time.perf_counter()
        workload.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it >= warmup:
            launches.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(launches)


def hook_cost(device, *, variables: int = 256, warmup: int = 5, iters: int = 40) -> float:
    """Host seconds the engine's gradient path (hook, bucket copy, the all-reduce's launch) adds
    per variable on this host and device: a chain of ``variables`` small parameters, trained once
    plainly and once through the engine (the all-reduce builder), interleaved iteration by
    iteration in this process (a process group of one must be up); the median difference over
    ``variables``. The model is synthetic, so the figure says nothing of the profiled workload's
    own iteration: it is what the replay adds per variable when the host sets the pace (dPRO §4:
    the framework's CPU work is part of the replayed graph). Never negative."""
    import torch
    import torch.nn as nn

    from ..spec.cluster import ClusterSpec
    from ..strategy import build_strategy
    from .core import StrategyEngine
    from .measure import device_done

    device = torch.device(device)

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ParameterList(nn.Parameter(torch.ones(32)) for _ in range(variables))

        def forward(self, x):
            for w in self.w:
                x = x * w
            return x.sum()

    # Backward order: the last parameter's gradient is ready first.
    spec = ModelSpec.from_dict({"name": "hook-probe", "family": "mlp", "batch_size": 1, "variables": [
        {"name": f"w.{i}", "shape": [32], "dtype": "float32", "sparse": False} for i in reversed(range(variables))]})
    gpu = device.type == "cuda"
    cluster = ClusterSpec.from_dict({"name": "hook-probe", "nodes": [{
        "instance_type": "this-machine", "device_kind": "gpu" if gpu else "cpu",
        "device_model": torch.cuda.get_device_name(device) if gpu else "cpu", "num_devices": 1,
        "nic_gbps": 100.0, "single_flow_gbps": 100.0, "intra_node_gbps": 100.0}]})
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-6)  # noqa: E731
    plain, through = Chain().to(device), Chain().to(device)
    plain_opt = sgd(plain.parameters())
    engine = StrategyEngine(through, build_strategy("allreduce", spec, cluster), spec, cluster, sgd,
                            broadcast_initial=False, broadcast_buffers=False)
    x = torch.ones(32, device=device)

    def alone() -> None:
        plain(x).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def engined() -> None:
        through(x).backward()
        engine.step()
        engine.zero_grad()

    diffs = []
    for it in range(warmup + iters):
        times = []
        for fn in (alone, engined):
            device_done(device)
            t0 = time.perf_counter()
            fn()
            device_done(device)
            times.append(time.perf_counter() - t0)
        if it >= warmup:
            diffs.append(times[1] - times[0])
    engine.close()
    return max(0.0, statistics.median(diffs) / variables)


class _HostClock:
    """Phase ends and gradient ready times on the host clock (CPU workers: the call returns when
    the work is done). ``read`` returns (forward, backward, step, ready times from backward's start)."""

    def __init__(self, n: int) -> None:
        self.ready = [0.0] * n
        self.marks = [0.0] * 4

    def start(self) -> None:
        self.marks[0] = time.perf_counter()

    def phase(self, i: int) -> None:
        self.marks[i + 1] = time.perf_counter()

    def mark(self, i: int) -> None:
        self.ready[i] = time.perf_counter() - self.marks[1]

    def read(self) -> tuple:
        m = self.marks
        return (m[1] - m[0], m[2] - m[1], m[3] - m[2], list(self.ready))


class _CudaClock:
    """The same figures from CUDA events (the GPU's own clock), read after a synchronization."""

    def __init__(self, n: int) -> None:
        import torch

        event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self.torch = torch
        self.ready = [event() for _ in range(n)]
        self.marks = [event() for _ in range(4)]

    def start(self) -> None:
        self.marks[0].record()

    def phase(self, i: int) -> None:
        self.marks[i + 1].record()

    def mark(self, i: int) -> None:
        self.ready[i].record()  # the hook runs on backward's stream, after the gradient's kernels

    def read(self) -> tuple:
        self.torch.cuda.synchronize()
        m = self.marks
        s = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  (milliseconds -> seconds)
        return (s(m[0], m[1]), s(m[1], m[2]), s(m[2], m[3]), [s(m[1], e) for e in self.ready])


def io_elements(workload, model, batch, batch_size: int) -> dict[str, list[float]]:
    """Per module holding parameters of its own, the elements per sample of its first tensor
    input and of its (first tensor) output, from one forward without gradients: what a
    tensor-parallel split of the module sends (:attr:`~synctune.spec.profile.ComputeProfile.io_elements`)."""
    import torch

    found: dict[str, list[float]] = {}

    def first(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):
            return next((x for x in (first(v) for v in value) if x is not None), None)
        return getattr(value, "last_hidden_state", None) if not isinstance(value, dict) else None

    def hook_of(name: str):
        def hook(_module, args, output) -> None:
            x, y = first(args), first(output)
            if x is not None and y is not None and name not in found:
                found[name] = [x.numel() / batch_size, y.numel() / batch_size]
        return hook

    handles = [sub.register_forward_hook(hook_of(name)) for name, sub in model.named_modules()
               if name and any(True for _ in sub.parameters(recurse=False))]
    try:
        with torch.no_grad():
            workload.loss(model, batch)
    finally:
        for h in handles:
            h.remove()
    return found


def profile_compute(workload, *, workers: int, batch_size: int | None = None, device: str = "cpu", warmup: int = 3,
                    iters: int = 10, seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
                    timeout_s: float = 600.0, nets: list[dict[str, str]] | None = None,
                    device_type: str | None = None, pin_cpus: bool = False,
                    quota_window_s: float = QUOTA_WINDOW_S, min_timed_s: float = 0.0,
                    recompute: bool = False) -> ComputeProfile:
    """Profile ``workload`` with ``workers`` concurrent worker processes (local launcher): CPU
    workers (``device="cpu"``), or one GPU of this machine each (``device="cuda"``).

    ``batch_size`` is each worker's batch (default: the model's). ``device_type`` names what the
    profile is filed under (default ``"cpu"``, or this machine's GPU model): the replay looks a
    node's profile up by its ``device_model``. ``quota_window_s``: how long a worker under a CPU
    quota is timed at least, keeping the mean (0: ``iters`` iterations and the median, as for
    any other worker; the module's docstring says why not). ``min_timed_s``: how long any other
    CPU worker is timed at least, keeping the median (0: ``iters`` iterations). Either window
    stops at ``100 * iters`` timed iterations. ``recompute``: also time backward with every
    block checkpointed in each mode (``recompute_s``). Raises
    :class:`~synctune.engine.local.WorkerFailure` when a worker fails.
    """
    spec = workload.spec()
    outs = _profile_workers(workload, spec, workers=workers, batch_size=batch_size, device=device, warmup=warmup,
                            iters=iters, seed=seed, optimizer=optimizer, lr=lr, timeout_s=timeout_s, nets=nets,
                            pin_cpus=pin_cpus, quota_window_s=quota_window_s, min_timed_s=min_timed_s,
                            recompute=recompute)
    return _slowest(spec, device_type or _device_type(device), workers, batch_size or spec.batch_size, outs)


def profile_per_device_type(workload, cluster, *, nets: list[dict[str, str]] | None = None, warmup: int = 3,
                            iters: int = 10, seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
                            timeout_s: float = 600.0, pin_cpus: bool = False,
                            quota_window_s: float = QUOTA_WINDOW_S, min_timed_s: float = 0.0,
                            recompute: bool = False) -> list[ComputeProfile]:
    """One profile per device type of ``cluster`` (a node's ``device_model``), all its devices
    computing at once: the contention of a trial on every device, each worker where its node
    runs (``nets`` from :func:`~synctune.engine.local.rank_networks`: a lab node's namespace and
    CPU quota; ``pin_cpus`` as the trials run; ``quota_window_s`` and ``min_timed_s`` as
    :func:`profile_compute`'s; ``recompute`` as there).
    Each type's figures are its slowest worker's.
    CPU clusters only (the workers run on this machine)."""
    spec = workload.spec()
    if cluster.device_kind != "cpu":
        raise ValueError(f"profile_per_device_type: cluster {cluster.name!r} has GPU nodes; profile each GPU type "
                         f"on a machine with it (profile_compute with device='cuda')")
    outs = _profile_workers(workload, spec, workers=cluster.num_devices, batch_size=None, device="cpu",
                            warmup=warmup, iters=iters, seed=seed, optimizer=optimizer, lr=lr, timeout_s=timeout_s,
                            nets=nets, pin_cpus=pin_cpus, quota_window_s=quota_window_s, min_timed_s=min_timed_s,
                            recompute=recompute)
    types = [cluster.node_of(d).device_model for d in cluster.devices]
    return [_slowest(spec, t, cluster.num_devices, spec.batch_size, [o for o, ot in zip(outs, types) if ot == t])
            for t in sorted(set(types))]


def _device_type(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _profile_workers(workload, spec, *, workers: int, batch_size: int | None, device: str, warmup: int, iters: int,
                     seed: int, optimizer: str, lr: float, timeout_s: float, nets, pin_cpus: bool = False,
                     quota_window_s: float = 0.0, min_timed_s: float = 0.0, recompute: bool = False) -> list[dict]:
    from .local import run_local
    from .trial import GPU_BACKEND

    if workers < 1 or iters < 1 or warmup < 0 or not quota_window_s >= 0 or not min_timed_s >= 0:
        raise ValueError(f"profile_compute: workers >= 1, iters >= 1, warmup >= 0, quota_window_s >= 0, "
                         f"min_timed_s >= 0 expected, got {workers}, {iters}, {warmup}, {quota_window_s}, {min_timed_s}")
    from ..strategy.checkpoint import checkpoint_blocks

    payload: dict[str, Any] = {"workload": workload, "model_spec": spec.to_dict(),
                               "blocks": checkpoint_blocks(v.name for v in spec.variables) if recompute else [],
                               "batch_size": batch_size or spec.batch_size, "device": device,
                               "warmup": warmup, "iters": iters, "seed": seed, "optimizer": optimizer, "lr": lr,
                               "quota_window_s": quota_window_s, "min_timed_s": min_timed_s}
    # GPU workers as a GPU trial's: NCCL for CUDA tensors (the hook probe's all-reduce).
    backend = "gloo" if device == "cpu" else GPU_BACKEND
    return run_local(profile_worker, workers, (payload,), timeout_s=timeout_s, nets=nets, pin_cpus=pin_cpus,
                     backend=backend)


def _slowest(spec, device_type: str, workers: int, batch: int, outs: list[dict]) -> ComputeProfile:
    # The slowest worker sets the pace of a synchronous iteration: take its figures.
    host = {k: max(o[k] for o in outs) for k in ("launch_s", "hook_s") if all(o.get(k) is not None for o in outs)}
    modes = set.intersection(*(set(o.get("recompute_s") or {}) for o in outs)) if outs else set()
    if any(o.get("recompute_s") is not None for o in outs):
        host["recompute_s"] = {m: max(o["recompute_s"][m] for o in outs) for m in sorted(modes)}
    if outs and all(o.get("io_elements") is not None for o in outs):
        host["io_elements"] = outs[0]["io_elements"]  # shapes: the same on every worker
    return ComputeProfile(model=spec.name, device=device_type, workers=workers, batch_size=batch,
                          forward_s=max(o["forward_s"] for o in outs), backward_s=max(o["backward_s"] for o in outs),
                          step_s=max(o["step_s"] for o in outs),
                          ready_s=tuple(max(o["ready_s"][i] for o in outs) for i in range(len(spec.variables))),
                          **host)
