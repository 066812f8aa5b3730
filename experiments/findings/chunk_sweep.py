"""Finding (c), AutoDist Fig. 7: the all-reduce merge-group size ("chunk": adjacent variables
fused into one collective) against iteration time, over shaped links.

How it is measured: per preset, every chunk's AllReduce(chunk) strategy is an arm of ONE
interleaved re-measurement on the same worker processes (each arm built and warmed up once, then
``--rounds`` rounds in which every arm runs ``--per-round`` iterations, the order rotating from
round to round; _common.interleaved_arms). Each cell is the arm's iteration time in ms (per
round, the median iteration, slowest rank; over the rounds, the geometric mean) and its time
relative to the best chunk (the smallest of those times): the geometric mean of the per-round
ratios, with a 95% Student-t interval on their logs (synctune.stats.paired_ratio); "no
difference": the interval contains 1. The intervals are per comparison (not corrected for the
several chunks), and the best chunk is picked from the same rounds, which favours it slightly.

    python experiments/findings/chunk_sweep.py [--preset lab-2x2 --preset lab-4x1] [--model bert-tiny]

``--cluster local-1x2`` measures on that loopback preset instead of the lab (no root; a check of
the code path, its figures say nothing about shaped links).
"""

from __future__ import annotations

import argparse
import sys

from _common import interleaved_arms, markdown_table, measured_on

CHUNKS = [1, 2, 4, 8, 16, 32, 64]  # bert-tiny has 46 variables: 64 already makes one group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="lab preset (repeatable; default lab-2x2, lab-4x1)")
    parser.add_argument("--cluster", help="measure on this non-lab preset instead of the lab (e.g. local-1x2)")
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--chunks", default=",".join(map(str, CHUNKS)), help="comma-separated chunk sizes")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5, help="iterations of each arm per round")
    args = parser.parse_args()
    try:
        chunks = sorted({int(c) for c in args.chunks.split(",")})
    except ValueError:
        parser.error(f"--chunks: expected comma-separated integers, got {args.chunks!r}")
    if len(chunks) < 2 or chunks[0] < 1:
        parser.error(f"--chunks: expected at least two positive chunk sizes, got {args.chunks!r}")
    if args.rounds < 2 or args.per_round < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 2 (an interval needs two rounds), --per-round at least 1, "
                     "--warmup at least 0")
    from synctune.engine.local import WorkerFailure
    from synctune.models import model_spec
    from synctune.spec.errors import SpecError
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    try:
        spec = model_spec(args.model)
    except SpecError as exc:
        parser.exit(2, f"chunk_sweep: {exc}\n")
    presets = [args.cluster] if args.cluster else (args.preset or ["lab-2x2", "lab-4x1"])
    measured, groups = {}, {}
    for preset in presets:
        print(f"{preset}: {len(chunks)} arms, {args.rounds} interleaved rounds ...", file=sys.stderr)
        try:
            with measured_on(preset, args.cluster) as (cluster, net):
                strategies = [build_strategy("allreduce", spec, cluster, chunk=c) for c in chunks]
                groups = {c: s.stats()["num_merge_groups"] for c, s in zip(chunks, strategies)}
                measured[preset] = interleaved_arms(strategies, cluster, workload=zoo_workload(args.model),
                                                    node_net=net, rounds=args.rounds, per_round=args.per_round,
                                                    warmup=args.warmup)
        except SpecError as exc:
            parser.exit(2, f"chunk_sweep: {exc}\n")
        except WorkerFailure as failure:
            print(f"{preset}: the measurement failed: {failure}", file=sys.stderr)
    rows = [[chunk, groups.get(chunk, "-")] + [measured[p].cell(i) if p in measured else "failed" for p in presets]
            for i, chunk in enumerate(chunks)]
    print(f"{args.model} ({len(spec.variables)} variables), AllReduce(chunk): ms per iteration (geometric mean of "
          f"per-round medians), and time relative to the best chunk of that preset [95%], paired over "
          f"{args.rounds} interleaved rounds of {args.per_round} iterations")
    print(markdown_table(["chunk", "merge groups"] + presets, rows))
    if len(measured) < len(presets):
        sys.exit(1)


if __name__ == "__main__":
    main()
