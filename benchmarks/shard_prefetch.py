"""Sharded data parallelism on one set of processes: what FSDP2's all-gather prefetching gains
when parameters are resharded after forward, what resharding itself costs, and the engine's
ZeRO-2 ``shard`` units beside FSDP2's and beside replicated all-reduce.

Arms, every one measured in each round, the order rotating (one interleaved run, DESIGN.md
"confirmed speed-up"; ratios paired by round with 95% intervals):

- ``fsdp2 reshard, prefetch 1``: torch FSDP2, ``fully_shard`` per block, ``reshard_after_forward
  =True``, its default implicit prefetch of one unit (torch 2.13 cannot switch prefetching off);
- ``fsdp2 reshard, prefetch 2``: the same with explicit forward and backward prefetch of two units;
- ``fsdp2 no reshard``: ``reshard_after_forward=False`` (parameters stay gathered between forward
  and backward, ZeRO-2's memory, one all-gather per unit per step);
- ``engine shard (ZeRO-2)``: synctune's ``shard`` units, one per block (the ``shard`` builder);
- ``engine all-reduce``: the replicated all-reduce builder.

    python benchmarks/shard_prefetch.py [--model transformer-small] [--cluster lab-2x2] [--rounds 10]

A lab preset is brought up (and down) by the script (root); a local preset runs over loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "findings"))


@contextlib.contextmanager
def _network(preset: str):
    from synctune.spec import cluster_preset
    from synctune.spec.cluster import is_lab_cluster

    if not is_lab_cluster(cluster_preset(preset)):
        yield None
        return
    from _common import lab

    with lab(preset) as (_cluster, node_net):
        yield node_net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer-small")
    parser.add_argument("--cluster", default="lab-2x2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=5, help="iterations per arm per round")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    from _common import interleaved_arms
    from synctune.engine.fsdp import FSDPConfig, FSDPRuntime
    from synctune.spec import cluster_preset
    from synctune.stats import paired_ratio
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    cluster = cluster_preset(args.cluster)
    workload = zoo_workload(args.model)
    spec = workload.spec()
    base = build_strategy("allreduce", spec, cluster)
    arms = [
        ("fsdp2 reshard, prefetch 1", (base, FSDPRuntime(FSDPConfig(reshard_after_forward=True, prefetch=1)))),
        ("fsdp2 reshard, prefetch 2", (base, FSDPRuntime(FSDPConfig(reshard_after_forward=True, prefetch=2)))),
        ("fsdp2 no reshard", (base, FSDPRuntime(FSDPConfig(reshard_after_forward=False)))),
        ("engine shard (ZeRO-2)", build_strategy("shard", spec, cluster)),
        ("engine all-reduce", base),
    ]
    with _network(args.cluster) as net:
        times = interleaved_arms([a for _n, a in arms], cluster, workload=workload, node_net=net,
                                 rounds=args.rounds, per_round=args.iters, warmup=args.warmup)
    print(f"{args.model} on {cluster.name}{' (lab)' if net else ' (loopback)'}: {args.rounds} rounds x "
          f"{args.iters} iterations per arm, every arm each round; time / time of the first arm "
          f"(< 1: faster), 95% interval")
    print("| arm | median of round medians (ms) | time ratio to 'fsdp2 reshard, prefetch 1' |")
    print("| --- | --- | --- |")
    ref = times.times_s[0]
    for i, (name, _arm) in enumerate(arms):
        t = times.times_s[i]
        ratio = "1" if i == 0 else (lambda r: f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]")(paired_ratio(t, ref))
        print(f"| {name} | {statistics.median(t) * 1e3:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
