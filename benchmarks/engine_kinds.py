"""Engine kinds: the engine's ZeRO-2 shard units vs torch FSDP2 on the same units, and PS alone.

On the same worker processes, model and data, per-iteration time of
  shard   synctune's engine (``StrategyEngine``) running the ``shard`` builder with ``reshard:
          false`` (ZeRO-2: gradients reduce-scattered, each rank steps its shard, parameters
          all-gathered after the step),
  fsdp2   torch FSDP2 running the same strategy's shard plans (the ``fsdp-plans`` runtime:
          the same units, shard group and reshard setting, so the same communication),
  ps      the engine running the ``ps-lb`` builder (TF-PS-LB), timed for itself: it is compared
          with another synctune tree's by running this script against that tree (below).
Each arm is built once per process (``synctune.engine.trial``'s arms) and warmed up; then every
iteration runs each arm once, in an order drawn afresh each iteration from a seeded generator
(the same on every rank), with a barrier before each timed iteration, so drift on a shared
machine hits every arm alike and no arm always runs after the same other one. An iteration's
time is its slowest rank's (gathered after the loop). Printed: per arm the median and mean ms
and the spread of the round medians; shard/fsdp2 as the ratio of medians and the median of the
per-iteration ratios with a 95% bootstrap interval (``engine_overhead.paired_ratio``).

    python benchmarks/engine_kinds.py [--model cnn-small] [--cluster local-2x2] [--iters 20] [--rounds 3]
        [--warmup 5] [--arms shard,fsdp2,ps] [--depth 2]

``--model`` is a zoo model or a workload file (``path/to/file.py:factory``), as ``synctune trial
--model`` takes it. A lab preset (``--cluster lab-2x2``, after ``synctune lab up lab-2x2``) runs
it over shaped links.

PS before and after a change: the script is this tree's, the synctune it imports is whichever
is first on the path, and the header prints which (``synctune from ...``). With the older tree
checked out beside this one (detached, no branch), from this tree's root:

    git worktree add ../synctune-before 6924dde
    PYTHONPATH=../synctune-before/platform python benchmarks/engine_kinds.py --arms ps
    python benchmarks/engine_kinds.py --arms ps
    git worktree remove --force ../synctune-before

The ``ps`` arm uses only what both trees have (the ``ps-lb`` builder, the trial's arms, the
local launcher). Runs of the two trees are not interleaved: compare them on an otherwise idle
machine, ideally alternating the two commands a few times.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

#: Every arm, in the table's order.
ARMS = ("shard", "fsdp2", "ps")

_LABELS = {"shard": "shard (engine, ZeRO-2)", "fsdp2": "fsdp2 (torch FSDP2, same units)",
           "ps": "ps (engine, ps-lb)"}


def _worker(rank: int, world: int, payload: dict) -> dict:
    """One rank: build every arm once, warm each up, time them interleaved iteration by
    iteration; returns per arm the slowest rank's time of each iteration (seconds), and which
    synctune and torch this process imported."""
    import torch
    import torch.distributed as dist

    import synctune
    from synctune.engine.measure import device_done, gather_max
    from synctune.engine.trial import TrialConfig, _Arm, _device, trial_payload
    from synctune.spec import resolve_cluster
    from synctune.strategy import Strategy
    from synctune.workload.source import model_source

    # The workload is resolved again here (a workload file's factory need not pickle).
    workload = model_source(payload["model"], root=payload["root"]).workload()
    cluster = resolve_cluster(payload["cluster"])
    config = TrialConfig(warmup=payload["warmup"], iters=payload["iters"])
    spec = workload.spec()
    names = payload["arms"]
    strategies = {name: Strategy.from_dict(payload["strategies"][name]) for name in names}
    device = _device(cluster, strategies[names[0]], rank, True)
    arms = {}
    for name in names:
        base = trial_payload(workload, strategies[name], cluster, config, spec)
        arms[name] = _Arm(rank, base, strategies[name], payload["runtimes"][name], device)
    for name in names:
        for _ in range(payload["warmup"]):
            arms[name].iteration()
            arms[name].take_comm_bytes()
    times: dict[str, list[float]] = {name: [] for name in names}
    # The same seed on every rank: every rank draws the same order, so the barriers pair up.
    rng = random.Random(payload["seed"])
    for _ in range(payload["rounds"] * payload["iters"]):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            arms[name].iteration()
            device_done(device)
            times[name].append(time.perf_counter() - t0)
            # Outside the timed span: the byte count is bookkeeping, not training.
            arms[name].take_comm_bytes()
    # After the loop, so no gather sits between two timed iterations; every rank calls it for
    # the arms in the same order.
    slowest = {name: gather_max(times[name], device) for name in names}
    for arm in arms.values():
        arm.close()
    return {"times": slowest, "synctune": str(synctune.__file__), "torch": str(torch.__version__)}


def build_arms(model: str, cluster_name: str, arms: list[str], root: str, depth: int = 2
               ) -> tuple[dict, dict, object]:
    """The strategy (plain data) and runtime (plain data; None: the engine) of each arm in
    ``arms`` for ``model`` on ``cluster_name`` (shard units one per module at ``depth``), each
    checked before any worker starts, and the cluster. Raises the project's errors (SpecError, StrategyError) for what cannot run."""
    from synctune.engine.trial import check_trial
    from synctune.spec import resolve_cluster
    from synctune.strategy import build_strategy
    from synctune.workload.source import model_source

    workload = model_source(model, root=root).workload()
    cluster = resolve_cluster(cluster_name)
    spec = workload.spec()
    strategies, runtimes = {}, {}
    if "shard" in arms or "fsdp2" in arms:
        # ZeRO-2: gradients reduce-scattered, parameters all-gathered after the step, kept whole
        # between forward and backward.
        zero2 = build_strategy("shard", spec, cluster, reshard=False, depth=depth)
    for name in arms:
        runtime = None
        if name == "shard":
            strategy = zero2
        elif name == "fsdp2":
            # Imported only for this arm: the ps arm must run on trees that predate it.
            from synctune.engine.fsdp_plans import FSDP_PLANS

            strategy, runtime = zero2, FSDP_PLANS
        else:
            strategy = build_strategy("ps-lb", spec, cluster)
        check_trial(workload, strategy, cluster, runtime)
        if tuple(strategy.replicas) != tuple(cluster.devices):
            raise ValueError(f"arm {name}: the strategy's replicas {strategy.replicas} are not the cluster's devices")
        strategies[name] = strategy.to_dict()
        runtimes[name] = None if runtime is None else runtime.to_dict()
    return strategies, runtimes, cluster


def measure(model: str, cluster_name: str, arms: list[str], *, warmup: int, iters: int, rounds: int,
            seed: int = 0, built: tuple | None = None) -> dict:
    """Time ``arms`` (names from :data:`ARMS`) on local worker processes, one per device of the
    cluster (over a lab's shaped links for a lab preset): ``{"times": {arm: [seconds per
    iteration, slowest rank]}, "synctune": path, "torch": version}`` (the workers' imports).
    ``built``: what :func:`build_arms` returned for these arguments (built here without it)."""
    from synctune.engine.local import rank_networks, run_local
    from synctune.engine.trial import _backend_for
    from synctune.spec.cluster import is_lab_cluster
    from synctune.strategy import Strategy

    root = os.getcwd()
    strategies, runtimes, cluster = built or build_arms(model, cluster_name, arms, root)
    nets = None
    if is_lab_cluster(cluster):
        from synctune.lab import lab_attach

        nets = rank_networks(cluster, cluster.devices, lab_attach(cluster))
    payload = {"model": model, "root": root, "cluster": cluster_name, "arms": list(arms), "strategies": strategies,
               "runtimes": runtimes, "warmup": warmup, "iters": iters, "rounds": rounds, "seed": seed}
    backend = _backend_for(cluster, Strategy.from_dict(strategies[arms[0]]))
    return run_local(_worker, cluster.num_devices, (payload,), timeout_s=3600, nets=nets, backend=backend)[0]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 0, got {text!r}")
    return value


def _arm_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(ARMS)}, got {text!r}")
    return [n for n in ARMS if n in names]  # the table's order, each once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn-small",
                        help="a zoo model, or a workload: path/to/file.py:factory")
    parser.add_argument("--cluster", default="local-2x2", help="a cluster preset or .yaml file (lab-* over a lab)")
    parser.add_argument("--iters", type=_positive, default=20, help="iterations of each arm per round")
    parser.add_argument("--rounds", type=_positive, default=3)
    parser.add_argument("--warmup", type=_non_negative, default=5, help="untimed iterations of each arm first")
    parser.add_argument("--arms", type=_arm_list, default=list(ARMS), help=f"comma list of {','.join(ARMS)}")
    parser.add_argument("--depth", type=_positive, default=2,
                        help="shard units: one per module at this depth (3 for a Hugging Face GPT-2's transformer.h.N)")
    args = parser.parse_args()

    # Run as a script, this folder is on the path (sfb.py reads it the same way).
    from engine_overhead import paired_ratio

    from synctune.spec.errors import SpecError
    from synctune.strategy import StrategyError

    # What cannot run (an unknown model or cluster, a model FSDP2 cannot wrap) is refused as
    # bad input, before any worker starts.
    try:
        built = build_arms(args.model, args.cluster, args.arms, os.getcwd(), args.depth)
    except (SpecError, StrategyError, ValueError) as exc:
        parser.error(str(exc))
    out = measure(args.model, args.cluster, args.arms, warmup=args.warmup, iters=args.iters, rounds=args.rounds,
                  built=built)

    import synctune
    import torch

    times = out["times"]
    world = built[2].num_devices
    n = args.rounds * args.iters
    print(f"model {args.model}, cluster {args.cluster} ({world} processes), torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.iters} = {n} interleaved iterations of each arm, {args.warmup} warm-up")
    print(f"synctune from {synctune.__file__}")
    if out["synctune"] != synctune.__file__ or out["torch"] != str(torch.__version__):
        print(f"warning: the workers imported synctune from {out['synctune']}, torch {out['torch']}")
    print(f"{'arm':<34}{'median ms':>11}{'mean ms':>11}{'round medians ms':>20}")
    for name in args.arms:
        t = times[name]
        per_round = [statistics.median(t[r * args.iters:(r + 1) * args.iters]) * 1e3 for r in range(args.rounds)]
        spread = f"{min(per_round):.2f}..{max(per_round):.2f}"
        print(f"{_LABELS[name]:<34}{statistics.median(t) * 1e3:>11.3f}{statistics.fmean(t) * 1e3:>11.3f}"
              f"{spread:>20}")
    if "shard" in times and "fsdp2" in times:
        r, lo, hi = paired_ratio(times["shard"], times["fsdp2"])
        ratio = statistics.median(times["shard"]) / statistics.median(times["fsdp2"])
        print(f"shard/fsdp2 = {ratio:.3f}   paired per iteration {r:.3f} [95% {lo:.3f}, {hi:.3f}]   "
              f"(< 1: the engine is faster)")


if __name__ == "__main__":
    main()
