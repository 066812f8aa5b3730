"""Finding (a), AutoDist §3.1: does a composed all-reduce strategy cost anything against
torch DDP, and how far are both from the raw collectives? On lab presets, over shaped links.

Same processes, model, data and bucket size; configurations interleaved iteration by
iteration (benchmarks/engine_overhead.py does the measuring).

    python experiments/findings/allreduce_vs_ddp.py [--preset lab-2x2 --preset lab-4x1] [--model bert-tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import lab, load_benchmark, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="lab preset (repeatable; default lab-2x2, lab-4x1)")
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    bench = load_benchmark("engine_overhead")
    rows = []
    for preset in args.preset or ["lab-2x2", "lab-4x1"]:
        print(f"{preset}: measuring ...", file=sys.stderr)
        with lab(preset):
            out = bench.measure(args.model, preset, bucket_mb=args.bucket_mb, warmup=3, iters=args.iters,
                                rounds=args.rounds)
        med = {k: statistics.median(v) * 1e3 for k, v in out.items()}
        rows.append([preset, f"{med['synctune']:.1f}", f"{med['ddp']:.1f}", f"{med['raw']:.1f}",
                     f"{med['compute']:.1f}", f"{med['synctune'] / med['ddp']:.3f}",
                     f"{med['synctune'] / max(med['raw'], med['compute']):.3f}"])
    print(f"model {args.model}, bucket {args.bucket_mb:g} MiB, median ms per iteration "
          f"({args.rounds * args.iters} interleaved iterations each)")
    print(markdown_table(["preset", "synctune all-reduce", "torch DDP", "raw collectives", "compute only",
                          "synctune / DDP", "synctune / max(raw, compute)"], rows))


if __name__ == "__main__":
    main()
