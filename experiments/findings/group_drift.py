"""Does a strategy measured again later in the same process group come out faster? (What keeps
the quieter trial's repeat noise above 5% on some presets: docs/results/dataset-collection.md, "Toward v0.3".)

On a lab preset (root), one model's builders are trialled in one process group pass after pass
(the whole list, then again, ``--passes`` times; the quieter trial, workers pinned), and each
pass's median iteration time is printed beside the previous one's. With ``--sysctl KEY=VALUE``
(repeatable) those kernel settings are written into every node's network namespace first
(e.g. ``net.ipv4.tcp_slow_start_after_idle=0``), to test what the drift comes from.

    python experiments/findings/group_drift.py [--preset lab-b12] [--model transformer-small]
        [--builders ps,ps-lb,partitioned-ps,ps-hierarchical,allreduce] [--passes 3] [--sysctl K=V ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import lab, markdown_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="lab-b12")
    parser.add_argument("--model", default="transformer-small")
    parser.add_argument("--builders", default="ps,ps-lb,partitioned-ps,ps-hierarchical,allreduce")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from synctune.engine.trial import TrialConfig, run_trials_local
    from synctune.strategy import build_strategy
    from synctune.workload.zoo import zoo_workload

    workload = zoo_workload(args.model)
    spec = workload.spec()
    config = TrialConfig(warmup=5, iters=10, target_ci=0.03, max_iters=100, max_timed_s=10.0, pin_cpus=True)
    names = [b for b in args.builders.split(",") if b]
    with lab(args.preset) as (cluster, net):
        for setting in args.sysctl:
            for node in net.values():
                subprocess.run(["ip", "netns", "exec", node["netns"], "sysctl", "-qw", setting], check=True)
        strategies = [build_strategy(b, spec, cluster) for b in names]
        t0 = time.perf_counter()
        results = run_trials_local(strategies * args.passes, cluster, config, workload=workload, node_net=net)
        wall = time.perf_counter() - t0
    k = len(names)
    rows = []
    for i, name in enumerate(names):
        ms = [results[i + j * k].median_s * 1e3 if results[i + j * k].ok else float("nan") for j in range(args.passes)]
        rows.append([name] + [f"{m:.1f}" for m in ms] + [f"{ms[j + 1] / ms[j]:.2f}" for j in range(args.passes - 1)])
    print(f"{args.model}@{args.preset}, one process group, {args.passes} passes"
          + (f", {', '.join(args.sysctl)} in every node namespace" if args.sysctl else "") + f"; {wall:.0f} s")
    print(markdown_table(["builder"] + [f"pass {j + 1} ms" for j in range(args.passes)]
                         + [f"pass {j + 2} / pass {j + 1}" for j in range(args.passes - 1)], rows))


if __name__ == "__main__":
    main()
