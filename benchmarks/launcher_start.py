"""How the local launcher starts its workers: forked from a fork server that imported torch once,
against a fresh interpreter per worker (``SYNCTUNE_WORKER_START=spawn``), side by side.

Per round, both ways in turn (the order alternating by round):
  start      ``run_local`` of a function that returns at once, on 2 and on 4 workers: the time
             from the call to the results, which is the workers' start-up;
  iteration  a trial (``run_trial_local``, the all-reduce builder, 5 warm-up and 30 timed
             iterations) of a zoo model on a loopback preset: its median iteration time, so a
             forked worker is seen to train as fast as a fresh one.

Goals: a forked start at most a third of a fresh one; no measured difference in the iteration
(the paired ratio's 95% interval contains 1). The fork server starts before the first round
(not counted).

    python benchmarks/launcher_start.py [--model cnn-small] [--cluster local-2x2] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "findings"))

WAYS = {"fork server": "auto", "fresh interpreter": "spawn"}


def _returns(rank: int, world: int) -> int:
    return rank


def _start_s(workers: int) -> float:
    from synctune.engine.local import run_local

    began = time.perf_counter()
    run_local(_returns, workers, (), timeout_s=300, threads=1)
    return time.perf_counter() - began


def _iteration_s(strategy, cluster, workload, config) -> float:
    from synctune.engine.trial import run_trial_local

    result = run_trial_local(strategy, cluster, config, workload=workload)
    if result.status != "ok":
        raise SystemExit(f"launcher_start: the trial failed: {result.error}")
    return result.median_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn-small")
    parser.add_argument("--cluster", default="local-2x2", help="a loopback preset (lab nodes always start fresh)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (a paired ratio needs two rounds)")
    if os.path.exists("/dev/nvidiactl"):
        print("an NVIDIA device is here: the launcher starts every worker fresh on this machine, nothing to compare")
        return

    from _common import markdown_table, time_ratio

    from synctune.engine.trial import TrialConfig
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    cluster = cluster_preset(args.cluster)
    workload = zoo_workload(args.model)
    strategy = build_strategy("allreduce", workload.spec(), cluster)
    config = TrialConfig(warmup=5, iters=30)
    _start_s(2)  # the fork server starts here, once
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
        for way in order:
            os.environ["SYNCTUNE_WORKER_START"] = WAYS[way]
            for workers in (2, 4):
                times.setdefault((way, f"start, {workers} workers"), []).append(_start_s(workers))
            times.setdefault((way, "iteration"), []).append(_iteration_s(strategy, cluster, workload, config))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    os.environ.pop("SYNCTUNE_WORKER_START", None)

    rows = []
    for what in ("start, 2 workers", "start, 4 workers", "iteration"):
        fork, fresh = times[("fork server", what)], times[("fresh interpreter", what)]
        r = time_ratio(fork, fresh)
        unit, scale = ("s", 1) if what.startswith("start") else ("ms", 1e3)
        rows.append([what, f"{statistics.median(fork) * scale:.2f} {unit}", f"{statistics.median(fresh) * scale:.2f} {unit}",
                     f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]"])
    print(f"{args.model} on {args.cluster}, {args.rounds} rounds, medians; fork / fresh paired by round (95%)")
    print(markdown_table(["measured", "fork server", "fresh interpreter", "fork / fresh"], rows))


if __name__ == "__main__":
    main()
