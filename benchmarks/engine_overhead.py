"""Engine overhead: our composed all-reduce vs torch DDP vs the raw collectives, side by side.

On the same worker processes, model, data and bucket size, per-iteration time of
  (a) synctune's engine running the Horovod-like builder (fusion threshold = bucket size),
  (b) torch DistributedDataParallel with bucket_cap_mb = bucket size,
  (c) the raw collectives alone: all-reduce of the same buckets, no compute,
  (d) compute alone: forward + backward + SGD step, no synchronization.
Configurations are interleaved iteration by iteration, so drift on a shared machine hits all alike.
Goal (issue "Execution engine"): (a)/(b) <= 1.05.

    python benchmarks/engine_overhead.py [--model bert-tiny] [--cluster local-1x2] [--bucket-mb 25]

A lab preset (``--cluster lab-2x2``, after ``synctune lab up lab-2x2``) runs it over shaped links.
"""

from __future__ import annotations

import argparse
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
    bucket = int(args["bucket_mb"] * 2**20)
    strategy = build_strategy("horovod", spec, cluster, fusion_threshold_bytes=bucket)
    batch = make_batch(name, spec.batch_size, generator=torch.Generator().manual_seed(rank))

    torch.manual_seed(0)
    ours_model = build_model(name)
    engine = StrategyEngine(ours_model, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=1e-3))
    torch.manual_seed(0)
    ddp_model = DDP(build_model(name), bucket_cap_mb=args["bucket_mb"])
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    alone_model = build_model(name)
    alone_opt = torch.optim.SGD(alone_model.parameters(), lr=1e-3)
    sizes: dict[int, int] = {}
    for plan in strategy.plans:
        g = plan.shards[0].synchronizer.group
        sizes[g] = sizes.get(g, 0) + spec[plan.variable].num_elements
    buffers = [torch.zeros(n) for _g, n in sorted(sizes.items())]

    def ours():
        ours_model(*batch).backward()
        engine.step()
        engine.zero_grad()

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
            times[key].append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    # An iteration ends when the slowest rank is done.
    return {k: [max(g[k][i] for g in gathered) for i in range(len(times[k]))] for k in configs}


def measure(model: str, cluster_name: str, *, bucket_mb: float = 25.0, warmup: int = 5, iters: int = 20,
            rounds: int = 3) -> dict[str, list[float]]:
    """Per configuration, the per-iteration times (slowest rank) of the interleaved runs. A lab
    cluster's workers run in the lab's namespaces (the lab must be up with that preset)."""
    from synctune.engine.local import rank_networks, run_local
    from synctune.spec import resolve_cluster
    from synctune.spec.cluster import is_lab_cluster

    cluster = resolve_cluster(cluster_name)
    nets = None
    if is_lab_cluster(cluster):
        from synctune.lab import lab_attach

        nets = rank_networks(cluster, cluster.devices, lab_attach(cluster))
    args = {"model": model, "cluster": cluster_name, "bucket_mb": bucket_mb, "warmup": warmup, "iters": iters,
            "rounds": rounds}
    return run_local(_worker, cluster.num_devices, (args,), timeout_s=3600, nets=nets)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--cluster", default="local-1x2")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from synctune.spec import resolve_cluster

    world = resolve_cluster(args.cluster).num_devices
    out = measure(args.model, args.cluster, bucket_mb=args.bucket_mb, warmup=args.warmup, iters=args.iters,
                  rounds=args.rounds)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"model {args.model}, cluster {args.cluster} ({world} gloo processes), bucket {args.bucket_mb:g} MiB, "
          f"{args.rounds * args.iters} interleaved iterations of each configuration")
    print(f"{'configuration':<34}{'median ms':>10}{'mean ms':>10}")
    labels = {"synctune": "(a) synctune all-reduce (horovod)", "ddp": "(b) torch DDP",
              "raw": "(c) raw collectives only", "compute": "(d) compute only (no sync)"}
    for key, label in labels.items():
        print(f"{label:<34}{med[key] * 1e3:>10.1f}{statistics.fmean(out[key]) * 1e3:>10.1f}")
    print(f"ratio (a)/(b) = {med['synctune'] / med['ddp']:.3f}   (goal <= 1.05)")
    print(f"ratio (a)/(c) = {med['synctune'] / med['raw']:.3f}   ratio (b)/(c) = {med['ddp'] / med['raw']:.3f}")
    print(f"sync overhead over compute: (a) {med['synctune'] - med['compute']:.4f} s, "
          f"(b) {med['ddp'] - med['compute']:.4f} s")


if __name__ == "__main__":
    main()
