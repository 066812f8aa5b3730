"""Engine overhead: our composed all-reduce vs torch DDP vs the raw collectives, side by side.

On the same worker processes, model, data and bucket size, per-iteration time of
  (a) synctune's engine running the Horovod-like builder (fusion threshold = bucket size),
  (b) torch DistributedDataParallel with bucket_cap_mb = bucket size,
  (c) the raw collectives alone: all-reduce of the same buckets, no compute,
  (d) compute alone: forward + backward + SGD step, no synchronization,
and, where the cluster has several nodes of several devices, hierarchical PS (TF-PS-LB with
local aggregation) with its stages
  (e) chained: the cross-node reduce starts as soon as the node's reduce completed, during backward,
  (f) blocking: the cross-node reduces run one by one inside step (the engine before chaining).
Configurations are interleaved iteration by iteration, so drift on a shared machine hits all alike.
Buffers are broadcast alike: by both (DDP before each forward, the engine after each step) with
several processes, by neither with one. With one process nothing is communicated: (a)/(b) is then
the hooks' overhead only, and the output says so.
Goals: (a)/(b) <= 1.05; (e)/(f) < 1.

    python benchmarks/engine_overhead.py [--model bert-tiny] [--cluster local-1x2] [--bucket-mb 25] [--device cuda]

A lab preset (``--cluster lab-2x2``, after ``synctune lab up lab-2x2``) runs it over shaped links.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time


def _worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from synctune.engine.core import StrategyEngine
    from synctune.models import build_model, make_batch, model_spec
    from synctune.spec import resolve_cluster
    from synctune.strategy import build_strategy

    name = args["model"]
    cluster = resolve_cluster(args["cluster"])
    spec = model_spec(name)
    device = torch.device("cpu")
    if args["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    bucket = int(args["bucket_mb"] * 2**20)
    strategy = build_strategy("horovod", spec, cluster, fusion_threshold_bytes=bucket)
    batch = tuple(t.to(device) for t in make_batch(name, spec.batch_size, generator=torch.Generator().manual_seed(rank)))

    def model():
        torch.manual_seed(0)
        return build_model(name).to(device)

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-3)

    ours_model = model()
    engine = StrategyEngine(ours_model, strategy, spec, cluster, sgd)
    # DDP broadcasts buffers before every forward even with one process, where the engine skips
    # it: the same work on both sides, or the ratio times a broadcast only one side does.
    # torch 2.13 calls the switch forward_sync_buffers; before it, broadcast_buffers did the same.
    switch = "forward_sync_buffers"
    if switch not in inspect.signature(DDP).parameters:
        switch = "broadcast_buffers"
    ddp_model = DDP(model(), bucket_cap_mb=args["bucket_mb"], **{switch: buffers_broadcast(world)})
    if getattr(ddp_model, switch) != (engine.broadcast_buffers and world > 1):
        raise RuntimeError("DDP and the engine broadcast buffers differently: the ratio would time one side's extra work")
    ddp_opt = sgd(ddp_model.parameters())
    alone_model = model()
    alone_opt = sgd(alone_model.parameters())
    sizes: dict[int, int] = {}
    for plan in strategy.plans:
        g = plan.shards[0].synchronizer.group
        sizes[g] = sizes.get(g, 0) + spec[plan.variable].num_elements
    buffers = [torch.zeros(n, device=device) for _g, n in sorted(sizes.items())]

    def engine_step(module, eng):
        def run():
            module(*batch).backward()
            eng.step()
            eng.zero_grad()

        return run

    ours = engine_step(ours_model, engine)

    def ddp():
        ddp_opt.zero_grad()
        ddp_model(*batch).backward()
        ddp_opt.step()

    def raw():
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()

    def compute():
        alone_opt.zero_grad()
        alone_model(*batch).backward()
        alone_opt.step()

    configs = {"synctune": ours, "ddp": ddp, "raw": raw, "compute": compute}
    if len(cluster.nodes) > 1 and any(n.num_devices > 1 for n in cluster.nodes):
        hps = build_strategy("ps-lb", spec, cluster, local_aggregation=True)
        for key, overlap in (("hps_chained", True), ("hps_blocking", False)):
            module = model()
            configs[key] = engine_step(module, StrategyEngine(module, hps, spec, cluster, sgd, overlap=overlap))
    times: dict[str, list[float]] = {k: [] for k in configs}
    for fn in configs.values():
        for _ in range(args["warmup"]):
            fn()
    # Interleaved iteration by iteration: load drift on a shared machine hits every configuration alike.
    for _ in range(args["rounds"] * args["iters"]):
        for key, fn in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    # An iteration ends when the slowest rank is done.
    return {k: [max(g[k][i] for g in gathered) for i in range(len(times[k]))] for k in configs}


def buffers_broadcast(world: int) -> bool:
    """Whether both sides broadcast buffers each iteration: the engine does only across several
    processes, so DDP is configured to match."""
    return world > 1


def measure(model: str, cluster_name: str, *, bucket_mb: float = 25.0, warmup: int = 5, iters: int = 20,
            rounds: int = 3, device: str = "cpu") -> dict[str, list[float]]:
    """Per configuration, the per-iteration times (slowest rank) of the interleaved runs, in
    order: ``rounds`` consecutive blocks of ``iters`` (:func:`round_medians`). A lab cluster's
    workers run in the lab's namespaces (the lab must be up with that preset)."""
    from synctune.engine.local import rank_networks, run_local
    from synctune.spec import resolve_cluster
    from synctune.spec.cluster import is_lab_cluster

    cluster = resolve_cluster(cluster_name)
    nets = None
    if is_lab_cluster(cluster):
        from synctune.lab import lab_attach

        nets = rank_networks(cluster, cluster.devices, lab_attach(cluster))
    args = {"model": model, "cluster": cluster_name, "bucket_mb": bucket_mb, "warmup": warmup, "iters": iters,
            "rounds": rounds, "device": device}
    backend = "gloo"
    if device == "cuda":
        from synctune.engine.trial import GPU_BACKEND

        backend = GPU_BACKEND
    return run_local(_worker, cluster.num_devices, (args,), timeout_s=3600, nets=nets, backend=backend)[0]


def round_medians(out: dict[str, list[float]], rounds: int) -> dict[str, list[float]]:
    """Per configuration, the median of each round's iterations (what :func:`measure` returned,
    split into ``rounds`` equal consecutive blocks): the per-round figures that pair round by
    round across configurations, as the iterations of one round ran interleaved."""
    out_rounds = {}
    for key, times in out.items():
        if rounds < 1 or len(times) % rounds:
            raise ValueError(f"round_medians: {len(times)} iterations of {key!r} do not split into {rounds} rounds")
        n = len(times) // rounds
        out_rounds[key] = [statistics.median(times[r * n:(r + 1) * n]) for r in range(rounds)]
    return out_rounds


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of the per-iteration ratios a_i / b_i (iterations are interleaved, so pairs share the
    machine's state) with a 95% bootstrap interval of that median."""
    import random

    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--cluster", default="local-1x2")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: models on the GPUs (ranks share them round-robin), NCCL for CUDA tensors")
    args = parser.parse_args()

    from synctune.spec import resolve_cluster

    world = resolve_cluster(args.cluster).num_devices
    out = measure(args.model, args.cluster, bucket_mb=args.bucket_mb, warmup=args.warmup, iters=args.iters,
                  rounds=args.rounds, device=args.device)
    import torch

    med = {k: statistics.median(v) for k, v in out.items()}
    device = f"cuda {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu"
    print(f"model {args.model}, cluster {args.cluster} ({world} processes, {device}), torch {torch.__version__}, "
          f"bucket {args.bucket_mb:g} MiB, {args.rounds * args.iters} interleaved iterations of each configuration")
    print(f"buffers broadcast each iteration: {'by both' if buffers_broadcast(world) else 'by neither'}")
    what = "hook overhead, no communication" if world == 1 else "synchronization"
    if world == 1:
        print("world size 1: hook overhead, no communication (nothing crosses a process boundary)")
    print(f"{'configuration':<34}{'median ms':>12}{'mean ms':>12}")
    labels = {"synctune": "(a) synctune all-reduce (horovod)", "ddp": "(b) torch DDP",
              "raw": "(c) raw collectives only", "compute": "(d) compute only (no sync)",
              "hps_chained": "(e) hierarchical PS, chained", "hps_blocking": "(f) hierarchical PS, blocking"}
    for key, label in labels.items():
        if key not in out:
            continue
        print(f"{label:<34}{med[key] * 1e3:>12.3f}{statistics.fmean(out[key]) * 1e3:>12.3f}")
    r, lo, hi = paired_ratio(out["synctune"], out["ddp"])
    print(f"ratio (a)/(b) = {med['synctune'] / med['ddp']:.3f}   paired per iteration {r:.3f} [95% {lo:.3f}, {hi:.3f}]"
          f"   (goal <= 1.05; {what})")
    print(f"ratio (a)/(c) = {med['synctune'] / med['raw']:.3f}   ratio (b)/(c) = {med['ddp'] / med['raw']:.3f}")
    print(f"sync overhead over compute: (a) {med['synctune'] - med['compute']:.4f} s, "
          f"(b) {med['ddp'] - med['compute']:.4f} s")
    if "hps_chained" in med:
        r, lo, hi = paired_ratio(out["hps_chained"], out["hps_blocking"])
        print(f"ratio (e)/(f) = {med['hps_chained'] / med['hps_blocking']:.3f}   paired per iteration {r:.3f} "
              f"[95% {lo:.3f}, {hi:.3f}]   (goal < 1: chained stages overlap backward)")


if __name__ == "__main__":
    main()
