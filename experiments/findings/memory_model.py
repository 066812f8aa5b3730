"""Finding: the simulator's memory model against each rank's measured peak,
per strategy, for two models: replicated (all-reduce, PS, Parallax) and sharded (ZeRO-2, the
engine's ``shard``; ZeRO-3 / HSDP predicted only where the engine refuses them).

How it is measured: every strategy runs as a trial (``--warmup`` + ``--iters`` iterations,
local worker processes), after which each rank runs one instrumented iteration
(synctune.engine.memory): the persistent parts are enumerated tensor storages (parameters,
module buffers, the batch, optimizer state, the engine units' buffers) and the iteration's peak
is the allocator's (CPU: torch.profiler's memory events; CUDA: max_memory_allocated). The
prediction (synctune.simulator.memory.predict_memory) counts params, gradients, optimizer state
and the units' buffers from the model spec and the strategy alone; the strategy-independent rest
(activations, the batch, module buffers, the iteration's temporaries) is one figure per (model,
per-rank batch), taken from the all-reduce trial of the same run (``ref``: its rows are
predicted from their own figure, so their error only tests the buffer and state counting).

    python experiments/findings/memory_model.py [--preset lab-2x2] [--model bert-tiny --model transformer-small]
    python experiments/findings/memory_model.py --cluster local-2x2   # loopback stand-in, no root

The second table is the goal: per model, how much less each rank holds under the sharded
strategy than under the replicated one, measured and predicted (the difference within 10%).

Shard strategies the engine does not accept yet (before its ShardUnit lands, or ZeRO-3, which
it refuses) are shown as "not run" with the predicted figure only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

#: model -> the optimizer its trials use (ncf-small's sparse embedding gradients rule Adam out).
OPTIMIZER = {"ncf-small": "sgd", "ncf-dense": "adam"}


def _sharded(strategy, spec, *, reshard=False, group=0, per_variable_units=True):
    """``strategy`` with every variable the shard synchronizer takes (dense, unpartitioned,
    float32, not a scalar) sharded, one unit per variable (or one for all)."""
    from synctune.strategy.schema import ShardPlan, ShardSynchronizer

    plans, unit = [], 0
    for plan in strategy.plans:
        var = spec[plan.variable]
        if var.sparse or var.dtype != "float32" or len(var.shape) == 0 or any(p != 1 for p in plan.partition):
            plans.append(plan)
            continue
        sync = ShardSynchronizer(unit=unit if per_variable_units else 0, group=group, reshard=reshard)
        unit += 1
        plans.append(dataclasses.replace(plan, shards=(ShardPlan(synchronizer=sync),)))
    return dataclasses.replace(strategy, plans=tuple(plans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="lab-2x2", help="lab preset to measure on (root; default lab-2x2)")
    parser.add_argument("--cluster", default=None, help="a non-lab preset to run on instead of the lab "
                        "(loopback stand-in: checks the code path without root)")
    parser.add_argument("--model", action="append", help="zoo model (repeatable; default bert-tiny, "
                        "transformer-small, both with Adam)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    from _common import measured_on

    with measured_on(args.preset, args.cluster) as (cluster, net):
        _measure(args, cluster, net)


def _measure(args, cluster, net) -> None:
    from synctune.data.record import TrialRecord
    from synctune.engine.trial import TrialConfig, run_trial_local
    from synctune.models import model_spec
    from synctune.simulator.memory import activation_figures, memory_errors, predict_memory
    from synctune.spec.errors import SpecError
    from synctune.strategy import build_strategy
    from synctune.strategy.schema import StrategyError
    from synctune.workload import zoo_workload

    savings = [["model", "replicated measured", "sharded measured", "saved measured", "saved predicted",
                "predicted / measured saving"]]
    rows = [["model", "strategy", "rank", "predicted MiB", "measured MiB", "error", "params", "grads", "opt state",
             "comm buffers", "rest (ref)"]]
    errors: dict[str, list[float]] = {}
    for model in args.model or ["bert-tiny", "transformer-small"]:
        spec = model_spec(model)
        workload = zoo_workload(model)
        optimizer = OPTIMIZER.get(model, "adam")
        config = TrialConfig(warmup=args.warmup, iters=args.iters, optimizer=optimizer)
        base = build_strategy("allreduce", spec, cluster)
        arms = [("allreduce", base), ("ps", build_strategy("ps", spec, cluster)),
                ("parallax", build_strategy("parallax", spec, cluster)),
                ("shard (ZeRO-2)", _sharded(base, spec)),
                ("shard (ZeRO-3)", _sharded(base, spec, reshard=True))]
        records, not_run = [], []
        for name, strategy in arms:
            try:
                result = run_trial_local(strategy, cluster, config, workload=workload, node_net=net)
            except (SpecError, StrategyError) as exc:
                not_run.append((name, strategy, str(exc).splitlines()[0][:90]))
                continue
            if not result.ok:
                not_run.append((name, strategy, f"{result.status}: {result.error[:90]}"))
                continue
            records.append((name, TrialRecord.from_trial(result.to_dict(), strategy, spec, cluster, origin=name)))
        by_id = {rec.record_id: name for name, rec in records}
        peaks: dict[str, tuple[float, float]] = {}
        for row in memory_errors([rec for _n, rec in records]):
            name = by_id[row["record_id"]]
            m, pr = peaks.get(name, (0.0, 0.0))
            peaks[name] = (max(m, row["measured_bytes"]), max(pr, row["predicted_bytes"]))
            rec_name = by_id[row["record_id"]]
            p = row["predicted"]
            errors.setdefault(rec_name, []).append(row["error"])
            rows.append([model, rec_name + (" (ref)" if rec_name == "allreduce" else ""), str(row["rank"]),
                         f"{row['predicted_bytes'] / 2**20:.2f}", f"{row['measured_bytes'] / 2**20:.2f}",
                         f"{row['error']:.1%}"] + [f"{p[k] / 2**20:.2f}" for k in (
                             "params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffers_bytes",
                             "activations_bytes")])
        if "allreduce" in peaks and "shard (ZeRO-2)" in peaks:
            (rm, rp), (sm, sp) = peaks["allreduce"], peaks["shard (ZeRO-2)"]
            savings.append([model, f"{rm / 2**20:.2f}", f"{sm / 2**20:.2f}", f"{(rm - sm) / 2**20:.2f}",
                            f"{(rp - sp) / 2**20:.2f}", f"{(rp - sp) / (rm - sm):.3f}" if rm > sm else "-"])
        reference = activation_figures([rec for _n, rec in records])
        for name, strategy, why in not_run:
            rest = [reference.get((spec.hash, b), 0) for b in strategy.batch_split]
            for p in predict_memory(strategy, spec, cluster, optimizer_state_multiplier=optimizer,
                                    activation_bytes=rest):
                rows.append([model, f"{name}: not run ({why})", str(p.rank), f"{p.peak_bytes / 2**20:.2f}", "-", "-"]
                            + [f"{getattr(p, k) / 2**20:.2f}" for k in (
                                "params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffers_bytes",
                                "activations_bytes")])
    print(f"cluster {cluster.name}{' (lab)' if net else ' (loopback stand-in)'}; MiB per rank; rest = activations, batch, module buffers and temporaries "
          f"(from the all-reduce trial of the same model)")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for r in rows[1:]:
        print("| " + " | ".join(r) + " |")
    print()
    every = [e for v in errors.values() for e in v]
    others = [e for k, v in errors.items() if k != "allreduce" for e in v]
    if every:
        print(f"median |predicted - measured| / measured: {statistics.median(every):.1%} over {len(every)} ranks; "
              f"without the reference rows: {statistics.median(others):.1%}" if others else "")
    print()
    print("largest rank's peak, replicated (all-reduce) vs sharded (ZeRO-2), MiB")
    for r in savings:
        print("| " + " | ".join(r) + " |")
        if r is savings[0]:
            print("|" + " --- |" * len(r))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
