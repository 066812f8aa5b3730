"""Runtimes side by side: synctune's composed all-reduce vs torch DDP vs real Horovod.

AutoDist §3.1 claims its composed all-reduce matches Horovod. Here the three run on the same
worker processes, model, data and fusion size, each built once by the trial machinery
(``synctune.engine.trial``'s arms):

  engine    synctune's engine running the Horovod-like builder (fusion threshold F),
  ddp       torch DistributedDataParallel, bucket_cap_mb F,
  horovod   real Horovod 0.28.1 (``hvd.DistributedOptimizer``), HOROVOD_FUSION_THRESHOLD F,
            cycle time 1 ms (its default).

After a warm-up, each round times ``--iters`` iterations of each arm, the order rotating between
rounds, and keeps per-arm medians (slowest rank per iteration); ratios come with a 95% interval
over the paired rounds (``paired_ratio``). A lab preset runs it over shaped links. Horovod stays
started for the whole run (it starts once per process), so its background thread, which wakes
every cycle, also runs during the other arms' rounds.

    python benchmarks/runtimes.py [--model bert-tiny] [--cluster local-2x2 --cluster lab-2x2] [--fusion-mb 25]

Needs Horovod (scripts/install-horovod.sh). A lab preset is brought up (and down) by the script.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ARMS = ("engine", "ddp", "horovod")


def _worker(rank: int, world: int, payload: dict) -> dict:
    import torch.distributed as dist

    from synctune.engine.trial import TrialConfig, _Arm, _device, _gather_max
    from synctune.spec import ClusterSpec
    from synctune.strategy import Strategy

    config = TrialConfig(**payload["config"])
    strategy = Strategy.from_dict(payload["strategy"])
    device = _device(ClusterSpec.from_dict(payload["cluster"]), strategy, rank, True)
    arms = {name: _Arm(rank, payload, strategy, payload["runtimes"][name], device) for name in ARMS}
    for arm in arms.values():
        for _ in range(config.warmup):
            arm.iteration()
            arm.take_comm_bytes()
    medians: dict[str, list[float]] = {name: [] for name in ARMS}
    for r in range(payload["rounds"]):
        order = ARMS[r % 3:] + ARMS[:r % 3]
        for name in order:
            times = []
            for _ in range(config.iters):
                dist.barrier()
                t0 = time.perf_counter()
                arms[name].iteration()
                times.append(time.perf_counter() - t0)
                arms[name].take_comm_bytes()
            medians[name].append(statistics.median(_gather_max(times, device)))
    for arm in arms.values():
        arm.close()
    return medians


def measure(model: str, cluster_name: str, *, fusion_mb: float, warmup: int, iters: int, rounds: int,
            node_net=None) -> dict[str, list[float]]:
    """Per-round median iteration times (seconds) of every arm."""
    from synctune.cli._common import resolve_cluster_arg
    from synctune.engine.ddp import DDPConfig, ddp_runtime
    from synctune.engine.horovod import HorovodConfig, horovod_runtime
    from synctune.engine.local import rank_networks, run_local
    from synctune.engine.trial import TrialConfig, check_trial, trial_payload
    from synctune.strategy import build_strategy, parse_builder_options
    from synctune.workload import resolve_workload

    workload = resolve_workload(model)
    cluster = resolve_cluster_arg(cluster_name)
    spec = workload.spec()
    strategy = build_strategy("horovod", spec, cluster, parse_builder_options(
        "horovod", {"fusion_threshold_bytes": str(int(fusion_mb * 2**20))}))
    runtimes = {"engine": None,
                "ddp": ddp_runtime(DDPConfig(bucket_cap_mb=fusion_mb, gradient_as_bucket_view=False)),
                "horovod": horovod_runtime(HorovodConfig(fusion_threshold_mb=fusion_mb))}
    for runtime in runtimes.values():
        check_trial(workload, strategy, cluster, runtime)
    config = TrialConfig(warmup=warmup, iters=iters)
    payload = trial_payload(workload, strategy, cluster, config, spec, runtimes=runtimes, rounds=rounds)
    outs = run_local(_worker, len(strategy.replicas), (payload,), timeout_s=1800,
                     nets=rank_networks(cluster, strategy.replicas, node_net))
    return outs[0]


@contextlib.contextmanager
def _network(preset: str):
    from synctune.spec import cluster_preset
    from synctune.spec.cluster import is_lab_cluster

    if not is_lab_cluster(cluster_preset(preset)):
        yield None
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "findings"))
    from _common import lab

    with lab(preset) as (_cluster, node_net):
        yield node_net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--cluster", action="append", help="preset (repeatable; default local-2x2 and lab-2x2)")
    parser.add_argument("--fusion-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from synctune.engine.horovod import horovod_available
    from synctune.stats import paired_ratio

    why = horovod_available()
    if why:
        sys.exit(f"runtimes: {why}")
    rows = []
    for preset in args.cluster or ["local-2x2", "lab-2x2"]:
        print(f"{preset}: measuring {args.rounds} rounds of {args.iters} iterations per runtime ...", file=sys.stderr)
        with _network(preset) as node_net:
            out = measure(args.model, preset, fusion_mb=args.fusion_mb, warmup=args.warmup, iters=args.iters,
                          rounds=args.rounds, node_net=node_net)
        med = {k: statistics.median(v) * 1e3 for k, v in out.items()}
        cells = [preset] + [f"{med[a]:.1f}" for a in ARMS]
        for a, b in (("horovod", "engine"), ("horovod", "ddp"), ("ddp", "engine")):
            r = paired_ratio(out[a], out[b])
            cells.append(f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]")
        rows.append(cells)
    print(f"model {args.model}, fusion/bucket {args.fusion_mb:g} MiB; median ms per iteration over {args.rounds} "
          f"rounds of {args.iters} interleaved iterations; a ratio X/Y > 1 means Y is faster (95% interval)")
    headers = ["cluster", "engine ms", "ddp ms", "horovod ms", "horovod/engine", "horovod/ddp", "ddp/engine"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
