"""The engine against torch DDP doing the same all-reduce, as a goal table: several models (a
library model among them), on loopback and on a lab preset, each measured in several runs.

Each run of each (model, place) is one ``benchmarks/engine_overhead.py`` measurement: the engine
running the Horovod-like builder, torch DDP with the same bucket size, the raw collectives,
compute alone and, on clusters of several multi-device nodes, hierarchical PS with chained and
with blocking stages, on the same processes, interleaved iteration by iteration (in an
order drawn afresh each iteration), ``--rounds`` rounds of ``--iters`` iterations. A run's ratio pairs the rounds (round r of
the engine with round r of DDP: the geometric mean of the per-round ratios with a 95% Student-t
interval, :func:`synctune.stats.paired_ratio`); the runs are separate processes, one after
another, the models and places interleaved within a run so that drift between runs weighs on
all alike. The last columns pool every round of every run.

Goals: engine / DDP <= 1.00 with the pooled interval's upper end <= 1.02; chained / blocking
<= 0.95 where the cluster has several nodes of several devices, beside its floor (compute alone /
blocking: overlap hides communication, never compute).

    python experiments/findings/engine_vs_ddp.py [--model cnn-small --model ...] [--preset lab-2x2]
        [--cluster local-2x2] [--runs 3] [--rounds 6] [--iters 5] [--twins]

``--twins`` adds A/A controls: each side again on an instance of its own in the same processes,
the same work, and a table of twin / original. What they move a ratio by is what placement alone
(where each instance's memory landed) does: the resolution of the goal's 2% on this machine.

Models are zoo names or workload files (``experiments/workloads/hf_gpt2.py:workload``, a Hugging
Face GPT-2 built from a config). A lab preset needs root (the lab is brought up for each run and
down after it); ``--no-lab`` measures the loopback places only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _common import describe_ratio, load_benchmark, markdown_table, measured_on, time_ratio

MODELS = ("cnn-small", "bert-tiny", "transformer-small", "experiments/workloads/hf_gpt2.py:workload")


def _short(model: str) -> str:
    return model.rsplit("/", 1)[-1].split(":")[0].removesuffix(".py") if ":" in model else model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help=f"zoo model or workload (repeatable; default {', '.join(MODELS)})")
    parser.add_argument("--preset", action="append", help="lab preset (repeatable; default lab-2x2)")
    parser.add_argument("--cluster", action="append", help="loopback preset (repeatable; default local-2x2)")
    parser.add_argument("--no-lab", action="store_true", help="measure the loopback presets only")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=5, help="interleaved iterations per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--twins", action="store_true",
                        help="add A/A controls: each side again on an instance of its own, and their table")
    args = parser.parse_args()
    if args.rounds < 2 or args.iters < 1 or args.runs < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 2 (an interval needs two rounds), --iters and --runs at least 1, "
                     "--warmup at least 0")
    from synctune.engine.local import WorkerFailure
    from synctune.spec.errors import SpecError
    from synctune.workload.source import model_source

    models = args.model or list(MODELS)
    for m in models:
        try:
            model_source(m).workload()
        except SpecError as exc:
            parser.exit(2, f"engine_vs_ddp: --model {m}: {exc}\n")
    places = [(c, c) for c in (args.cluster or ["local-2x2"])]
    if not args.no_lab:
        places += [(p, None) for p in (args.preset or ["lab-2x2"])]
    bench = load_benchmark("engine_overhead")
    # (model, place) -> per run: per configuration, the per-round medians
    runs: dict[tuple[str, str], list[dict[str, list[float]]]] = {}
    cpus: dict[tuple[str, str], list[dict[str, list[float]]]] = {}  # the same, CPU of every rank's process
    faulted: dict[tuple[str, str], list[dict[str, list[int]]]] = {}  # per run, page faults per iteration
    readiness: dict[tuple[str, str], list[dict | None]] = {}  # per run, when rank 0's gradients are ready
    failed = False
    for run in range(args.runs):
        for place, stand_in in places:
            print(f"run {run + 1}/{args.runs}, {place}: measuring {len(models)} models ...", file=sys.stderr)
            try:
                with measured_on(place, stand_in) as (cluster, _net):
                    for m in models:
                        out, cpu, faults, _, ready = bench.measure_with_breakdown(
                            m, cluster.name, bucket_mb=args.bucket_mb, warmup=args.warmup, iters=args.iters,
                            rounds=args.rounds, twins=args.twins)
                        runs.setdefault((m, place), []).append(bench.round_medians(out, args.rounds))
                        cpus.setdefault((m, place), []).append(bench.round_medians(cpu, args.rounds))
                        faulted.setdefault((m, place), []).append(faults)
                        readiness.setdefault((m, place), []).append(ready)
            except SpecError as exc:
                parser.exit(2, f"engine_vs_ddp: {place}: {exc}\n")
            except WorkerFailure as failure:
                print(f"{place}: the measurement failed: {failure}", file=sys.stderr)
                failed = True
    rows, hier, twins = [], [], []
    for (m, place), per_run in runs.items():
        if args.twins:
            cells = []
            for twin, key in (("synctune_twin", "synctune"), ("ddp_twin", "ddp")):
                each = [time_ratio(r[twin], r[key]) for r in per_run]
                pooled = time_ratio([t for r in per_run for t in r[twin]], [t for r in per_run for t in r[key]])
                spread = max(abs(e.ratio - 1) for e in each)
                cells += [", ".join(f"{e.ratio:.2f}" for e in each), describe_ratio(pooled), f"{spread:.1%}"]
            twins.append([_short(m), place] + cells)
        each = [time_ratio(r["synctune"], r["ddp"]) for r in per_run]
        pooled = time_ratio([t for r in per_run for t in r["synctune"]], [t for r in per_run for t in r["ddp"]])
        if pooled.ratio > 1.0:
            verdict = f"missed: {pooled.ratio - 1:+.1%}"
        elif pooled.high > 1.02:
            verdict = f"missed: upper end {pooled.high:.3f}"
        else:
            verdict = "met"
        ms = [statistics.geometric_mean(r[k]) * 1e3 for r in per_run for k in ("synctune", "ddp")]
        spent = cpus[(m, place)]
        cpu = time_ratio([t for r in spent for t in r["synctune"]], [t for r in spent for t in r["ddp"]])
        rows.append([_short(m), place, f"{statistics.median(ms[0::2]):.1f}", f"{statistics.median(ms[1::2]):.1f}"]
                    + [describe_ratio(r) for r in each]
                    + [f"{statistics.median(r.ratio for r in each):.3f}", describe_ratio(pooled),
                       verdict, describe_ratio(cpu)]
                    + [" / ".join(f"{statistics.median(f for r in faulted[(m, place)] for f in r[k]):g}"
                                  for k in ("synctune", "ddp"))])
        if "hps_chained" in per_run[0]:
            each = [time_ratio(r["hps_chained"], r["hps_blocking"]) for r in per_run]
            pooled = time_ratio([t for r in per_run for t in r["hps_chained"]],
                                [t for r in per_run for t in r["hps_blocking"]])
            # Chained stages still compute everything: compute alone / blocking is the lowest
            # the ratio can go, whatever the overlap.
            floor = time_ratio([t for r in per_run for t in r["compute"]],
                               [t for r in per_run for t in r["hps_blocking"]])
            shares = [bench.readiness_shares(ready) for ready in readiness[(m, place)]]
            verdict = "met" if pooled.ratio <= 0.95 else f"missed: {pooled.ratio:.3f}"
            if pooled.ratio > 0.95 and floor.ratio > 0.95:
                verdict += " (out of reach: floor above 0.95)"
            hier.append([_short(m), place] + [describe_ratio(r) for r in each]
                        + [describe_ratio(pooled), describe_ratio(floor),
                           f"{statistics.median(late for late, _big in shares):.0%}",
                           f"{statistics.median(big for _late, big in shares):.0%}", verdict])
    n = args.runs
    print(f"engine (Horovod-like builder) / torch DDP, bucket {args.bucket_mb:g} MiB: per run the rounds' paired "
          f"ratio [95%] ({args.rounds} rounds of {args.iters} interleaved iterations), the median of the {n} runs, "
          f"every round of every run pooled; ms: median over runs of the geometric mean of the round medians; CPU: "
          f"the CPU time every rank's process (all its threads) spent on an iteration, engine / DDP, pooled; page "
          f"faults: the minor page faults of every rank's process in an iteration, median")
    print(markdown_table(["model", "place", "engine ms", "DDP ms"] + [f"run {i + 1}" for i in range(n)]
                         + ["median of runs", "pooled", "goal <= 1.00, upper <= 1.02", "CPU, pooled",
                            "page faults, engine / DDP"], rows))
    if twins:
        print()
        print("A/A controls, the same runs: each side again on an instance of its own in the same processes (identical "
              "work), twin / original; per run, pooled [95%], and the largest distance from 1 of a run")
        print(markdown_table(["model", "place", "engine twin / engine, runs", "pooled", "largest",
                              "DDP twin / DDP, runs", "pooled", "largest"], twins))
    if hier:
        print()
        print("hierarchical PS, chained stages / blocking stages, the same runs")
        print("floor: compute alone / blocking stages, pooled, the lowest chained / blocking can reach (chained "
              "stages overlap communication with backward but still compute everything); late bytes: the share of "
              "the gradient bytes ready in the last tenth of backward, and largest: the largest gradient's share "
              "(rank 0, medians of the runs): chained stages gain by starting cross-node stages during backward "
              "and by running several gradients' stages at once, which bytes ready late and in one gradient deny")
        print(markdown_table(["model", "place"] + [f"run {i + 1}" for i in range(n)]
                             + ["pooled", "floor", "late bytes", "largest", "goal <= 0.95"], hier))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
