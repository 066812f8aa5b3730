"""How much a search's wall time gains from running its trials concurrently on disjoint slices
(``run: {slices: N}``), on this machine's Ray.

One search of ``--budget`` trials (cnn-small on ``local-1x2``, the analytic simulator, no
baselines or confirmation, ``--iters`` iterations per trial) is run with 1 slice and with 2,
alternating A/B/A/B for ``--rounds`` rounds on one local Ray instance (4 CPUs, room for two
``local-1x2`` slices), each run with its own data folder. Printed: each arm's wall times, their
median, and the median ratio of the 2-slice run to the 1-slice run of the same round with its
95% interval (:func:`synctune.stats.paired_ratio`). On a 2-core machine the two slices share the
cores, so the gain is bounded by what the trials leave idle (start-up, synchronisation).

    python experiments/findings/concurrent_slices.py [--budget 6] [--iters 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, describe_ratio, markdown_table, time_ratio  # noqa: E402

sys.path.insert(0, str(ROOT / "platform"))


def one_search(slices: int, budget: int, iters: int, tag: str) -> float:
    """Wall time (s) of one search with ``slices`` slices in a fresh data folder."""
    from synctune.models import model_spec
    from synctune.run import run_search
    from synctune.search import Experiment
    from synctune.spec import cluster_preset
    from synctune.workload import zoo_workload

    home = tempfile.mkdtemp(prefix=f"synctune-slices-{tag}-")
    os.environ["SYNCTUNE_HOME"] = home
    exp = Experiment.from_keys(name=f"slices-{tag}", model="cnn-small", cluster="local-1x2", budget=budget,
                               algorithm="autodist", simulator="analytic", proposals=50, candidates=2, warmup=1,
                               iters=iters, baselines=[], ddp_trials=0, confirm_rounds=0, slices=slices)
    start = time.monotonic()
    try:
        summary = run_search(exp, model_spec("cnn-small"), cluster_preset("local-1x2"),
                             workload=zoo_workload("cnn-small"))
    finally:
        wall = time.monotonic() - start
        shutil.rmtree(home, ignore_errors=True)
    if summary.trials != budget or summary.failed:
        raise SystemExit(f"search with {slices} slice(s): {summary.trials} trials, {summary.failed} failed")
    return wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=6)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    import ray

    from synctune.cluster.workers import node_type_resource

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             resources={node_type_resource("local-cpu"): 4})
    walls: dict[int, list[float]] = {1: [], 2: []}
    try:
        for r in range(args.rounds):
            for slices in ((1, 2) if r % 2 == 0 else (2, 1)):
                walls[slices].append(one_search(slices, args.budget, args.iters, f"{r}-{slices}"))
                print(f"round {r}: {slices} slice(s) {walls[slices][-1]:.1f} s", flush=True)
    finally:
        ray.shutdown()
    rows = [[f"{n} slice(s)", ", ".join(f"{w:.1f}" for w in walls[n]), f"{statistics.median(walls[n]):.1f}"]
            for n in (1, 2)]
    print(markdown_table(["arm", "search wall times (s)", "median (s)"], rows))
    print(f"2 slices / 1 slice, paired by round: {describe_ratio(time_ratio(walls[2], walls[1]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
