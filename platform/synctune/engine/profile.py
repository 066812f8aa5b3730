"""Measuring a workload's compute profile: the replay simulator's compute input (dPRO §4.1).

dPRO replays an iteration from a trace of the real run; synctune's equivalent of that trace for
the computation is one short profiling pass: ``workers`` processes (the trial's contention:
on CPUs they share the cores exactly as a trial's workers do) each run forward, backward and
an optimizer step on their own batch, without any synchronization, and record when each
variable's gradient becomes ready (a post-accumulate-grad hook, the same event the engine's
units wait for). Warm-up iterations are not timed; each timed iteration starts after a barrier
so the workers compete for the machine as they do in a trial. The profile keeps, per figure,
the median over iterations of the slowest worker.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..spec.model import ModelSpec
from ..spec.profile import ComputeProfile

__all__ = ["profile_compute", "profile_worker"]


def profile_worker(rank: int, world: int, payload: dict) -> dict:
    """One worker of :func:`profile_compute` (module level: it is pickled to spawned processes)."""
    import torch
    import torch.distributed as dist

    workload, spec = payload["workload"], ModelSpec.from_dict(payload["model_spec"])
    torch.manual_seed(payload["seed"])
    model = workload.build_model()
    params = dict(model.named_parameters())
    names = [v.name for v in spec.variables]
    index = {name: i for i, name in enumerate(names)}
    optimizer = workload.make_optimizer([params[n] for n in names], name=payload["optimizer"], lr=payload["lr"])
    gen = torch.Generator().manual_seed(payload["seed"] * 100_003 + rank)
    batch = workload.make_batch(payload["batch_size"], rank=rank, generator=gen, device=torch.device("cpu"))
    ready = [0.0] * len(names)
    origin = [0.0]

    def hook_of(i: int):
        def hook(_param) -> None:
            ready[i] = time.perf_counter() - origin[0]
        return hook

    handles = [params[n].register_post_accumulate_grad_hook(hook_of(index[n])) for n in names]
    rows = []
    try:
        for it in range(payload["warmup"] + payload["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            loss = workload.loss(model, batch)
            t1 = time.perf_counter()
            origin[0] = t1
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if it >= payload["warmup"]:
                rows.append((t1 - t0, t2 - t1, t3 - t2, list(ready)))
    finally:
        for h in handles:
            h.remove()
    med = statistics.median
    return {"forward_s": med(r[0] for r in rows), "backward_s": med(r[1] for r in rows),
            "step_s": med(r[2] for r in rows), "ready_s": [med(r[3][i] for r in rows) for i in range(len(names))]}


def profile_compute(workload, *, workers: int, batch_size: int | None = None, device: str = "cpu", warmup: int = 3,
                    iters: int = 10, seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
                    timeout_s: float = 600.0, nets: list[dict[str, str]] | None = None) -> ComputeProfile:
    """Profile ``workload`` with ``workers`` concurrent CPU worker processes (local launcher).

    ``batch_size`` is each worker's batch (default: the model's). Raises
    :class:`~synctune.engine.local.WorkerFailure` when a worker fails.
    """
    from .local import run_local

    if workers < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"profile_compute: workers >= 1, iters >= 1, warmup >= 0 expected, got {workers}, {iters}, "
                         f"{warmup}")
    spec = workload.spec()
    batch = batch_size or spec.batch_size
    payload: dict[str, Any] = {"workload": workload, "model_spec": spec.to_dict(), "batch_size": batch,
                               "warmup": warmup, "iters": iters, "seed": seed, "optimizer": optimizer, "lr": lr}
    outs = run_local(profile_worker, workers, (payload,), timeout_s=timeout_s, nets=nets)
    # The slowest worker sets the pace of a synchronous iteration: take its figures.
    return ComputeProfile(model=spec.name, device=device, workers=workers, batch_size=batch,
                          forward_s=max(o["forward_s"] for o in outs), backward_s=max(o["backward_s"] for o in outs),
                          step_s=max(o["step_s"] for o in outs),
                          ready_s=tuple(max(o["ready_s"][i] for o in outs) for i in range(len(spec.variables))))
