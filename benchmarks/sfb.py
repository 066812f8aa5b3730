"""Sufficient-factor broadcasting vs all-reduce: measured per-iteration time, side by side, with
the simulators' predictions.

On the same worker processes, model and data, per-iteration time of
  (a) the all-reduce builder (one fused bucket per 25 MiB),
  (b) the same strategy with SFB (TAG §2.3, §4.2.3) for the linear weights whose factors are
      fewer bytes than their gradient (N b rows (H_in + H_out) < 2 H_in H_out), the rule the
      guided sampler proposes it by,
iterations interleaved, medians and the paired ratio (b)/(a) with a 95% bootstrap interval;
then the ratio the analytic model and the replay predict (training-free, no profile: compute
from counted FLOPs). The default workload, the experiments' ``mlp-wide``
(``experiments/workloads/wide_mlp.py``), is a 3-layer MLP with 4096-wide layers and a batch of 8
per replica (where SFB should win: the factors are about 1/100 of the gradient); ``--model`` also
takes a zoo model or another workload import path.

    python benchmarks/sfb.py [--model NAME|PATH:FACTORY] [--cluster local-2x2] [--batch 8]

A lab preset (``--cluster lab-2x2``, after ``synctune lab up lab-2x2``) runs over shaped links.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


#: The default workload: the experiments' wide MLP (``experiments/workloads/wide_mlp.py``).
WIDE_MLP = str(Path(__file__).resolve().parents[1] / "experiments" / "workloads" / "wide_mlp.py") + ":workload"


def strategies(model: str, cluster_name: str, batch: int):
    """(all-reduce strategy, the same with SFB where its factors are fewer bytes, spec, those
    variables) of workload ``model`` (a zoo name or an import path), ``batch`` per replica."""
    import dataclasses

    from synctune.search.sampler import GuidedSampler
    from synctune.spec import resolve_cluster
    from synctune.strategy import build_strategy, validate
    from synctune.workload import resolve_workload

    cluster = resolve_cluster(cluster_name)
    spec = dataclasses.replace(resolve_workload(model).spec(), batch_size=batch)
    base = build_strategy("allreduce", spec, cluster)
    base = dataclasses.replace(base, batch_split=(batch,) * cluster.num_devices)
    helper = GuidedSampler(spec, cluster)
    sfb = helper.with_sfb(base)
    validate(sfb, spec, cluster)
    return base, sfb, spec, sorted(helper.sfb_cheaper)


def _worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from synctune.engine.core import StrategyEngine
    from synctune.spec import resolve_cluster

    from synctune.workload import resolve_workload

    cluster = resolve_cluster(args["cluster"])
    base, sfb, spec, _ = strategies(args["model"], args["cluster"], args["batch"])
    workload = resolve_workload(args["model"])
    batch = workload.make_batch(args["batch"], rank=rank, generator=torch.Generator().manual_seed(rank), device="cpu")
    configs = {}
    for key, strategy in (("allreduce", base), ("sfb", sfb)):
        torch.manual_seed(0)
        module = workload.build_model()
        engine = StrategyEngine(module, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=1e-3))

        def run(module=module, engine=engine):
            workload.loss(module, batch).backward()
            engine.step()
            engine.zero_grad()

        configs[key] = run
    for fn in configs.values():
        for _ in range(args["warmup"]):
            fn()
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(args["rounds"] * args["iters"]):
        for key, fn in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    return {k: [max(g[k][i] for g in gathered) for i in range(len(times[k]))] for k in configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=WIDE_MLP, help="a zoo model or a workload import path (default: the "
                        "experiments' wide MLP)")
    parser.add_argument("--cluster", default="local-2x2")
    parser.add_argument("--batch", type=int, default=8, help="samples per replica")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from engine_overhead import paired_ratio

    from synctune.engine.local import rank_networks, run_local
    from synctune.simulator import ReplaySimulator
    from synctune.simulator.features import DomainContext, analytic_time, encode
    from synctune.spec import resolve_cluster
    from synctune.spec.cluster import is_lab_cluster

    cluster = resolve_cluster(args.cluster)
    base, sfb, spec, cheaper = strategies(args.model, args.cluster, args.batch)
    nets = None
    if is_lab_cluster(cluster):
        from synctune.lab import lab_attach

        nets = rank_networks(cluster, cluster.devices, lab_attach(cluster))
    opts = {"model": args.model, "cluster": args.cluster, "batch": args.batch, "warmup": args.warmup,
            "iters": args.iters, "rounds": args.rounds}
    out = run_local(_worker, cluster.num_devices, (opts,), timeout_s=3600, nets=nets)[0]
    ctx = DomainContext(spec, cluster)
    t_a = analytic_time(encode([base, sfb], ctx), ctx)
    t_r = ReplaySimulator().predict([base, sfb], spec, cluster)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"model {spec.name} ({spec.num_bytes / 2**20:.1f} MiB of gradients), cluster {args.cluster} "
          f"({cluster.num_devices} processes), batch {args.batch} per replica, {args.rounds * args.iters} interleaved "
          f"iterations of each")
    print(f"SFB for: {', '.join(cheaper) or 'no variable (no linear weight has fewer factor bytes)'}")
    print(f"{'configuration':<28}{'median ms':>10}{'analytic ms':>13}{'replay ms':>11}")
    for i, (key, label) in enumerate((("allreduce", "(a) all-reduce"), ("sfb", "(b) SFB where cheaper"))):
        print(f"{label:<28}{med[key] * 1e3:>10.1f}{t_a[i] * 1e3:>13.1f}{t_r[i] * 1e3:>11.1f}")
    r, lo, hi = paired_ratio(out["sfb"], out["allreduce"])
    print(f"measured (b)/(a) = {r:.3f} [95% {lo:.3f}, {hi:.3f}] (paired per iteration)   "
          f"predicted: analytic {t_a[1] / t_a[0]:.3f}, replay {t_r[1] / t_r[0]:.3f}")


if __name__ == "__main__":
    main()
