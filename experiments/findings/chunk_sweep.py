"""Finding (c), AutoDist Fig. 7: the all-reduce merge-group size ("chunk": adjacent variables
fused into one collective) against iteration time, over shaped links.

    python experiments/findings/chunk_sweep.py [--preset lab-2x2 --preset lab-4x1] [--model bert-tiny]
"""

from __future__ import annotations

import argparse
import sys

from _common import lab, markdown_table

CHUNKS = [1, 2, 4, 8, 16, 32, 64]  # bert-tiny has 46 variables: 64 already makes one group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="lab preset (repeatable; default lab-2x2, lab-4x1)")
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    from synctune.engine.trial import TrialConfig, run_trials_local
    from synctune.workload import zoo_workload
    from synctune.models import model_spec
    from synctune.strategy import build_strategy

    spec = model_spec(args.model)
    presets = args.preset or ["lab-2x2", "lab-4x1"]
    results = {}
    groups = {}
    for preset in presets:
        print(f"{preset}: {len(CHUNKS)} trials ...", file=sys.stderr)
        with lab(preset) as (cluster, net):
            strategies = [build_strategy("allreduce", spec, cluster, chunk=c) for c in CHUNKS]
            groups = {c: s.stats()["num_merge_groups"] for c, s in zip(CHUNKS, strategies)}
            out = run_trials_local(strategies, cluster, TrialConfig(warmup=args.warmup, iters=args.iters),
                                   workload=zoo_workload(args.model), node_net=net)
        results[preset] = [r.median_s * 1e3 if r.status == "ok" else None for r in out]
    rows = []
    for i, chunk in enumerate(CHUNKS):
        row = [chunk, groups[chunk]]
        for preset in presets:
            t = results[preset][i]
            best = min(x for x in results[preset] if x is not None)
            row.append(f"{t:.1f} ({t / best:.2f}x)" if t is not None else "failed")
        rows.append(row)
    print(f"{args.model} ({len(spec.variables)} variables), AllReduce(chunk): median ms per iteration "
          f"(relative to the best chunk of that preset)")
    print(markdown_table(["chunk", "merge groups"] + presets, rows))


if __name__ == "__main__":
    main()
