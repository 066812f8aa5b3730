"""Finding (a), AutoDist §3.1: does a composed all-reduce strategy cost anything against
torch DDP, and how far are both from the raw collectives? On lab presets, over shaped links.

How it is measured: same processes, model, data and bucket size; the configurations run
interleaved iteration by iteration (benchmarks/engine_overhead.py's ``measure``), ``--rounds``
rounds of ``--iters`` such iterations. Times are per round the median iteration (slowest rank),
over the rounds their geometric mean (ms). Ratios pair the rounds (round r of synctune with round
r of DDP; for the last column, with the larger of round r's raw-collectives and compute-only
medians): the geometric mean of the per-round ratios with a 95% Student-t interval on their logs
(synctune.stats.paired_ratio).

    python experiments/findings/allreduce_vs_ddp.py [--preset lab-2x2 --preset lab-4x1] [--model bert-tiny]

``--cluster local-1x2`` measures on that loopback preset instead of the lab (no root; a check of
the code path, its figures say nothing about shaped links).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import describe_ratio, load_benchmark, markdown_table, measured_on, time_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="lab preset (repeatable; default lab-2x2, lab-4x1)")
    parser.add_argument("--cluster", help="measure on this non-lab preset instead of the lab (e.g. local-1x2)")
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5, help="interleaved iterations per round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.rounds < 2 or args.iters < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 2 (an interval needs two rounds), --iters at least 1, "
                     "--warmup at least 0")
    from synctune.engine.local import WorkerFailure
    from synctune.models import model_spec
    from synctune.spec.errors import SpecError

    try:
        model_spec(args.model)
    except SpecError as exc:
        parser.exit(2, f"allreduce_vs_ddp: {exc}\n")
    bench = load_benchmark("engine_overhead")
    presets = [args.cluster] if args.cluster else (args.preset or ["lab-2x2", "lab-4x1"])
    rows, failed = [], False
    for preset in presets:
        print(f"{preset}: measuring ...", file=sys.stderr)
        try:
            with measured_on(preset, args.cluster) as (cluster, _net):
                out = bench.measure(args.model, cluster.name, bucket_mb=args.bucket_mb, warmup=args.warmup,
                                    iters=args.iters, rounds=args.rounds)
        except SpecError as exc:
            parser.exit(2, f"allreduce_vs_ddp: {preset}: {exc}\n")
        except WorkerFailure as failure:
            print(f"{preset}: the measurement failed: {failure}", file=sys.stderr)
            rows.append([preset] + ["failed"] * 6)
            failed = True
            continue
        per_round = bench.round_medians(out, args.rounds)
        ms = {k: statistics.geometric_mean(v) * 1e3 for k, v in per_round.items()}
        floor = [max(r, c) for r, c in zip(per_round["raw"], per_round["compute"])]
        rows.append([preset, f"{ms['synctune']:.1f}", f"{ms['ddp']:.1f}", f"{ms['raw']:.1f}", f"{ms['compute']:.1f}",
                     describe_ratio(time_ratio(per_round["synctune"], per_round["ddp"])),
                     describe_ratio(time_ratio(per_round["synctune"], floor))])
    print(f"model {args.model}, bucket {args.bucket_mb:g} MiB, ms per iteration (geometric mean over {args.rounds} "
          f"rounds of the round's median; {args.iters} interleaved iterations per round) and paired ratios [95%]")
    print(markdown_table(["preset", "synctune all-reduce", "torch DDP", "raw collectives", "compute only",
                          "synctune / DDP", "synctune / max(raw, compute)"], rows))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
