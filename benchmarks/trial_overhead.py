"""Per-trial overhead: where a trial's time goes outside its timed iterations, on a warm worker group.

A search pays, per trial, more than the iterations it times. This benchmark runs N small trials
(builder strategies in turn) three ways and splits each trial's wall-clock into parts:

  group   ``RayWorkerGroup.run_trial`` on a warm group: the worker's setup (model, engine, batch),
          its iterations (warm-up included), gathering the result, and the rest (checking the
          strategy, shipping the payload, Ray's round trips);
  record  recording one result: the MLflow child run and the Parquet row (``record_result``);
  search  a whole ``run_search`` of N trials (Ray Tune, slice actor, recording, the searcher):
          its wall-clock per trial minus the trial's iterations.

Goal (the search issue): at most 0.5 s per trial outside the iterations on a warm group.

    python benchmarks/trial_overhead.py [--model bert-tiny] [--cluster local-1x2] [--trials 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--cluster", default="local-1x2")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="synctune-overhead-"))
    os.environ["SYNCTUNE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)

    import ray

    from synctune.cluster.workers import RayWorkerGroup
    from synctune.data import MlflowLogger, TrialDataset, dataset_dir
    from synctune.engine.trial import TrialConfig
    from synctune.run.recording import record_result
    from synctune.spec import resolve_cluster
    from synctune.strategy.builders import TUNED_BASELINES, baseline_strategy
    from synctune.workload import resolve_workload

    workload = resolve_workload(args.model)
    spec = workload.spec()
    cluster = resolve_cluster(args.cluster)
    config = TrialConfig(warmup=args.warmup, iters=args.iters)
    strategies = [baseline_strategy(b, spec, cluster) for b in TUNED_BASELINES]
    ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
    rows = {"group": [], "record": [], "search": []}
    try:
        with RayWorkerGroup(cluster) as group:
            start = time.perf_counter()
            group.run_trial(strategies[0], config, workload=workload)  # start the group: not counted
            print(f"group start + first trial: {time.perf_counter() - start:.2f} s (paid once per slice)")
            results = []
            for i in range(args.trials):
                t0 = time.perf_counter()
                result = group.run_trial(strategies[i % len(strategies)], config, workload=workload)
                wall = time.perf_counter() - t0
                phases = result.extra["phases_s"]
                rows["group"].append({"wall": wall, **phases, "rest": wall - sum(phases.values()),
                                      "timed": sum(result.iteration_times_s)})
                results.append((strategies[i % len(strategies)], result))
        ds = TrialDataset(dataset_dir())
        logger = MlflowLogger("overhead")
        parent = logger.start_search("overhead-record", {"model": spec.name})
        for i, (strategy, result) in enumerate(results):
            t0 = time.perf_counter()
            record_result(result, strategy, spec, cluster, dataset=ds, logger=logger, origin="overhead",
                          search_id="overhead-record", trial_id=f"t{i}", parent_run_id=parent,
                          workload_source=workload.source)
            rows["record"].append({"wall": time.perf_counter() - t0})
        rows["search"], once = search_cycles(workload, spec, cluster, args)
    finally:
        ray.shutdown()

    g = rows["group"]
    print(f"\n{args.model} on {args.cluster}, {args.trials} trials of {args.warmup}+{args.iters} iterations "
          f"(medians per trial, seconds)")
    print(f"{'path':<8} {'wall':>7} {'iters':>7} {'setup':>7} {'gather':>7} {'rest':>7} {'outside iters':>14}")
    print(f"{'group':<8} {_median([r['wall'] for r in g]):>7.3f} {_median([r['iterations'] for r in g]):>7.3f} "
          f"{_median([r['setup'] for r in g]):>7.3f} {_median([r['gather'] for r in g]):>7.3f} "
          f"{_median([r['rest'] for r in g]):>7.3f} {_median([r['wall'] - r['iterations'] for r in g]):>14.3f}")
    rec = _median([r["wall"] for r in rows["record"]])
    print(f"{'record':<8} {rec:>7.3f} {'':>7} {'':>7} {'':>7} {'':>7} {rec:>14.3f}")
    s = rows["search"]
    print(f"{'search':<8} {_median([r['wall'] for r in s]):>7.3f} {_median([r['iterations'] for r in s]):>7.3f} "
          f"{'':>7} {'':>7} {'':>7} {_median([r['wall'] - r['iterations'] for r in s]):>14.3f}")
    print(f"\nsearch: {once:.2f} s outside the warm cycles (Ray Tune, the slice's start, the first trial), once")
    print("\ngoal: outside iters <= 0.5 s per trial on a warm group (search row)")


def search_cycles(workload, spec, cluster, args) -> tuple[list[dict], float]:
    """A search of ``args.trials`` trials through Ray Tune (the tuned baselines first): its warm
    cycles, from one trial's end to the next one's, and its seconds outside them (the slice's
    start-up, paid once)."""
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.search import run_search
    from synctune.search import Experiment

    zoo = workload.source.startswith("zoo:")
    exp = Experiment.from_keys(name="overhead", model=spec.name if zoo else "", workload="" if zoo else workload.source,
                               cluster=cluster.name, budget=args.trials, simulator="analytic", proposals=50,
                               candidates=4, warmup=args.warmup, iters=args.iters, baselines=("tuned",),
                               ddp_trials=0, confirm_rounds=0)
    summary = run_search(exp, spec, cluster, workload=workload)
    trials = sorted(TrialDataset(dataset_dir()).records(search_id="overhead-seed0"),
                    key=lambda r: json.loads(r.extra_json)["finished_at"])
    cycles = []
    for before, after in zip(trials, trials[1:]):
        cycle = json.loads(after.extra_json)["finished_at"] - json.loads(before.extra_json)["finished_at"]
        cycles.append({"wall": cycle, "iterations": json_phase(after, "iterations")})
    return cycles, summary.wall_s - sum(r["wall"] for r in cycles)


def json_phase(record, key: str) -> float:
    return float(json.loads(record.extra_json).get("phases_s", {}).get(key, 0.0))


if __name__ == "__main__":
    main()
