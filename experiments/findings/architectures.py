"""Finding (b), AutoDist Fig. 6: PS vs partitioned PS vs all-reduce (and the other builders)
across models and lab presets. Does any synchronization architecture win everywhere?

How it is measured: the dataset (default: the v0.1 release in this repository, made by `synctune
lab collect`; `--data DIR` for another) only chooses the arms. Per domain (model@preset), each
builder's fastest trial and the fastest random strategy are rebuilt from their rows'
`strategy_json` (bound to the cluster measured today: same devices, its calibrated links) and
re-measured as arms of ONE interleaved re-measurement on the domain's lab preset, on the same
worker processes (each arm built and warmed up once, then `--rounds` rounds in which every arm
runs `--per-round` iterations, the order rotating; _common.interleaved_arms). Each cell is the
arm's iteration time in ms (per round, the median iteration, slowest rank; over the rounds, the
geometric mean) and its time relative to the domain's fastest arm, paired by round, with a 95%
Student-t interval on the logs (synctune.stats.paired_ratio); "no difference": the interval
contains 1. "best builder / fastest random" pairs the fastest builder's rounds with the random
strategy's. Intervals are per comparison (not corrected for the several arms), and the fastest
arm is picked from the same rounds, which favours it slightly.

    python experiments/findings/architectures.py [--domains ncf-small@lab-2x2,...] [--rounds 10]

Each lab preset is brought up, calibrated and taken down (root needed). `--cluster local-2x2`
measures every domain on that loopback preset instead (no root; a check of the code path: its
figures say nothing about shaped links).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from _common import ROOT, describe_ratio, interleaved_arms, markdown_table, measured_on

ARCHITECTURES = ["ps", "ps-lb", "partitioned-ps", "allreduce", "horovod", "partitioned-allreduce", "parallax"]


def choose_arms(rows) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Per (model, preset) domain of the dataset's ok lab rows: (arm name, strategy JSON) of each
    builder's fastest trial, then of the fastest random strategy ("random (of N)")."""
    rows = rows[(rows["status"] == "ok") & rows["cluster_name"].str.startswith("lab-")]
    out = {}
    for (model, preset), part in sorted(rows.groupby(["model_name", "cluster_name"])):
        arms = []
        for origin in ARCHITECTURES:
            mine = part[part["origin"] == origin]
            if len(mine):
                arms.append((origin, mine.loc[mine["mean_s"].idxmin(), "strategy_json"]))
        randoms = part[part["origin"] == "random"]
        if arms and len(randoms):
            arms.append((f"random (of {len(randoms)})", randoms.loc[randoms["mean_s"].idxmin(), "strategy_json"]))
            out[(model, preset)] = arms
    return out


def rebuild(text: str, spec, cluster):
    """The strategy of a dataset row, bound to ``cluster`` (the dataset's rows name the
    calibrated spec of their day); refused when it was built for another version of the model."""
    from synctune.spec.errors import SpecError
    from synctune.strategy import Strategy

    strategy = Strategy.from_json(text, "dataset row: strategy_json")
    if strategy.model["hash"] != spec.hash:
        raise SpecError(f"dataset row: strategy_json: built for model {strategy.model['name']!r} with hash "
                        f"{strategy.model['hash'][:12]}, this synctune's {spec.name!r} has {spec.hash[:12]}")
    return dataclasses.replace(strategy, cluster={"name": cluster.name, "hash": cluster.hash})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "dataset" / "synctune-v0.1" / "data"))
    parser.add_argument("--domains", help="comma-separated model@preset (default: every lab domain of the data)")
    parser.add_argument("--cluster", help="measure on this non-lab preset instead of the lab (e.g. local-2x2)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5, help="iterations of each arm per round")
    args = parser.parse_args()
    if args.rounds < 2 or args.per_round < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 2 (an interval needs two rounds), --per-round at least 1, "
                     "--warmup at least 0")
    from synctune.data import TrialDataset
    from synctune.engine.local import WorkerFailure
    from synctune.spec.errors import SpecError
    from synctune.workload import zoo_workload

    if not Path(args.data).exists():
        parser.exit(2, f"architectures: --data {args.data}: no such file or folder\n")
    try:
        domains = choose_arms(TrialDataset(args.data).read())
    except (SpecError, OSError) as exc:
        parser.exit(2, f"architectures: --data {args.data}: {exc}\n")
    if args.domains:
        wanted = [tuple(d.strip().split("@", 1)) for d in args.domains.split(",") if d.strip()]
        unknown = [w for w in wanted if w not in domains]
        if unknown:
            parser.exit(2, f"architectures: --domains: {'@'.join(unknown[0])} has no builder and random trials in "
                           f"{args.data} (there: {', '.join('@'.join(d) for d in domains)})\n")
        domains = {d: domains[d] for d in wanted}
    if not domains:
        parser.exit(2, f"architectures: --data {args.data}: no lab domain with builder and random trials\n")
    measured, failed = {}, []
    for preset in dict.fromkeys(p for _m, p in domains):
        try:
            with measured_on(preset, args.cluster) as (cluster, net):
                for (model, p), arms in domains.items():
                    if p != preset:
                        continue
                    print(f"{model}@{preset}: {len(arms)} arms, {args.rounds} interleaved rounds ...", file=sys.stderr)
                    workload = zoo_workload(model)
                    strategies = [rebuild(text, workload.spec(), cluster) for _name, text in arms]
                    try:
                        measured[(model, p)] = interleaved_arms(strategies, cluster, workload=workload, node_net=net,
                                                                rounds=args.rounds, per_round=args.per_round,
                                                                warmup=args.warmup)
                    except WorkerFailure as failure:
                        print(f"{model}@{preset}: the measurement failed: {failure}", file=sys.stderr)
                        failed.append((model, p))
        except SpecError as exc:
            parser.exit(2, f"architectures: {preset}: {exc}\n")
    table, winners, clear = [], {}, 0
    for (model, preset), arms in domains.items():
        names = [name for name, _text in arms]
        got = measured.get((model, preset))
        if got is None:
            table.append([model, preset] + ["failed"] * (len(ARCHITECTURES) + 3))
            continue
        builders = [i for i, n in enumerate(names) if n in ARCHITECTURES]
        ranked = sorted(builders, key=got.mean_ms)
        best, rand = ranked[0], len(names) - 1
        winners[(model, preset)] = names[best]
        cells = {n: (f"**{got.cell(i)}**" if i == best else got.cell(i)) for i, n in enumerate(names)}
        runner_up = describe_ratio(got.relative(ranked[1], best)) if len(ranked) > 1 else "-"
        clear += len(ranked) > 1 and got.relative(ranked[1], best).low > 1
        table.append([model, preset] + [cells.get(a, "-") for a in ARCHITECTURES]
                     + [f"{names[rand]}: {cells[names[rand]]}", f"{names[ranked[1]]}: {runner_up}"
                        if len(ranked) > 1 else "-", describe_ratio(got.relative(best, rand))])
    print(f"per domain: ms per iteration (geometric mean of per-round medians) and time relative to the domain's "
          f"fastest arm [95%], paired over {args.rounds} interleaved rounds of {args.per_round} iterations; "
          f"bold: the fastest builder")
    print(markdown_table(["model", "preset"] + ARCHITECTURES
                         + ["fastest random", "next builder / best builder", "best builder / fastest random"], table))
    counts = {}
    for w in winners.values():
        counts[w] = counts.get(w, 0) + 1
    if winners:
        print()
        print("fastest builder per domain (point estimates; see the next builder's interval): "
              + ", ".join(f"{k} {v}/{len(winners)}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
        print(f"the fastest builder's lead over the next builder excludes 1 in {clear} of {len(winners)} domains")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
