"""Where the calibrated replay errs: its signed error per model and strategy class, held out.

``synctune sim eval`` says how far off the replay is per domain and per synchronizer kind mix;
this says which strategies carry the error, finer than the mix, to point at what the replay
(dPRO §4's timeline of units) leaves out. Each domain's trials are split (``--held-out`` of them,
the same split as ``sim eval --protocol held-out --seed``), the replay calibrated on the rest
(:class:`~synctune.simulator.CalibratedReplay`: per domain constants, as ``--train replay``), and
the held-out trials replayed. A strategy is counted in every class it belongs to:

- ``ar-only``, ``ps-only``, ``ps+ar``, ``neither ps nor ar`` (all-gather, SFB or shard only),
  ``+allgather``, ``+sfb``, ``+shard``: the kinds it mixes;
- ``ar groups=1``, ``ar groups=2-4``, ``ar groups>=5``: its all-reduce merge groups (one group
  cannot start before backward ends);
- ``dense ar of a sparse variable``: an embedding whose sparse gradient is all-reduced dense;
- ``hierarchical``, ``compressed``, ``local aggregation``, ``partitioned``: as named;
- ``uneven batch split`` (replicas given different batches, TAG §4.2) and ``replica subset``
  (replicas on fewer devices than the cluster has);
- ``tensor parallel``: modules split across TP groups (a ``tensor_parallel`` plan, Megatron-LM),
  and ``+sp`` where the plan splits the sequence too (sequence parallelism). They are split
  into held-out and training trials with the others, and the calibration fits on the training
  ones too (the cost of a TP collective, ``tp_collective_s``, is theirs alone); ``sim eval``
  scores them apart, never trained on, so its split of a dataset with them differs from this one.

Printed: per model and class, the held-out trials (a strategy measured twice counts twice), the
median signed error
(predicted / measured - 1: negative is under-predicted) and the median absolute error.

    python experiments/findings/replay_errors.py --data DIR [--home HOME] [--held-out 0.3] [--seed 0]
        [--domain MODEL@CLUSTER ...]

``--home`` is the data folder whose ``profiles/`` hold the compute profiles the replay needs
(``SYNCTUNE_HOME`` by default).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def classes(strategy, model, devices: int | None = None) -> list[str]:
    """The classes a strategy belongs to (see the module docstring); ``devices``: the cluster's."""
    sparse = {v.name for v in model.variables if v.sparse}
    kinds, groups, out = set(), set(), []
    if strategy.tensor_parallel is not None:
        out.append("tensor parallel")
        if strategy.tensor_parallel.sequence_parallel:
            out.append("+sp")
    if len(set(strategy.batch_split)) > 1:
        out.append("uneven batch split")
    if devices is not None and len(strategy.replicas) < devices:
        out.append("replica subset")
    for plan in strategy.plans:
        if plan.is_partitioned:
            out.append("partitioned")
        for shard in plan.shards:
            sync = shard.synchronizer
            kinds.add(sync.kind)
            if sync.kind == "allreduce":
                groups.add(sync.group)
                if sync.algorithm == "hierarchical":
                    out.append("hierarchical")
                if plan.variable in sparse:
                    out.append("dense ar of a sparse variable")
            if sync.kind == "ps" and sync.local_aggregation:
                out.append("local aggregation")
            if shard.compressor.kind != "none":
                out.append("compressed")
    base = ("ps+ar" if {"ps", "allreduce"} <= kinds else "ar-only" if "allreduce" in kinds and "ps" not in kinds
            else "ps-only" if "ps" in kinds else "neither ps nor ar")
    out.append(base)
    out += [f"+{k}" for k in ("allgather", "sfb", "shard") if k in kinds]
    if groups:
        out.append("ar groups=1" if len(groups) == 1 else "ar groups=2-4" if len(groups) <= 4 else "ar groups>=5")
    return list(dict.fromkeys(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--home", default=None)
    parser.add_argument("--held-out", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--domain", action="append", default=[])
    args = parser.parse_args()
    if args.home:
        os.environ["SYNCTUNE_HOME"] = str(Path(args.home).resolve())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common
    from synctune.data import TrialDataset, profiles_dir
    from synctune.simulator import CalibratedReplay, ReplaySimulator, domains_from_records, split_domains

    if not 0 < args.held_out < 1:
        print(f"--held-out {args.held_out}: expected a share between 0 and 1", file=sys.stderr)
        return 2
    domains = domains_from_records(TrialDataset(args.data).records(), tensor_parallel=True)
    missing = sorted(set(args.domain) - {d.key for d in domains})
    if missing:
        print(f"{args.data}: no successful trials for domain(s) {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.domain:
        domains = [d for d in domains if d.key in set(args.domain)]
    if not domains:
        print(f"{args.data}: no domain to evaluate", file=sys.stderr)
        return 2
    train, test = split_domains(domains, args.held_out, args.seed)
    sim = CalibratedReplay()
    sim.use_profiles(ReplaySimulator.from_folder(profiles_dir()))
    sim.fit(train)
    signed: dict[tuple[str, str], list[float]] = defaultdict(list)
    for d in test:
        errors = sim.predict_domain(d) / d.times_s - 1
        for strategy, e in zip(d.strategies, errors):
            for c in ["all"] + classes(strategy, d.ctx.model, d.ctx.cluster.num_devices):
                signed[(d.ctx.model.name, c)].append(float(e))
                if len({t.ctx.model.name for t in test}) > 1:
                    signed[("all models", c)].append(float(e))
    if sim.unmeasured_activations:
        print(f"no measured activation sizes for {', '.join(sorted(sim.unmeasured_activations))}: TP collectives "
              f"priced at one position per sample (profile again: synctune sim profile)", file=sys.stderr)
    if sim.fallbacks:
        print(f"no measured compute profile for {', '.join(sorted(sim.fallbacks))}: counted FLOPs stand in",
              file=sys.stderr)
    rows = []
    for (model, c), es in sorted(signed.items(), key=lambda kv: (kv[0][0] == "all models", kv[0])):
        es = np.asarray(es)
        rows.append([model, c, len(es), f"{np.median(es):+.1%}", f"{np.median(np.abs(es)):.1%}"])
    split = sum(int(d.split_mask().sum()) for d in test)
    print(f"{sum(len(d.times_s) for d in test)} held-out trials of {len(test)} domains ({split} of them tensor "
          f"parallel); the replay calibrated on the other {sum(len(d.times_s) for d in train)}")
    print(_common.markdown_table(["model", "class", "held-out trials", "median signed error",
                                  "median |error|"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
