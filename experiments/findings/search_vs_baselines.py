"""Does the search win? Each algorithm's confirmed best against the best baseline (tuned builders and
tuned torch DDP) and against an oracle, per lab domain (the search issue's evidence; AutoDist
§3.3, AutoSync §5).

Per domain (model @ lab preset, brought up and calibrated here; root needed):
  - the oracle: the best of a large sweep (every tuned builder plus guided and plain random
    strategies, ``--oracle`` in all), then a second stage around its 5 best (every batch split
    from even to speed-proportional where node speeds differ; SFB for the linear weights whose
    factors are fewer bytes), its top 5 re-measured in alternating order, the best median kept;
  - per algorithm and seed: a real search (``run_search``: tuned DDP, Algorithm 1 with tuned
    baselines inside ``--budget``, then the confirmation of its best against the best baseline);
    ``tuned-ddp`` is torch DDP tuned by Optuna alone, with the whole budget (its gap to the
    oracle is its single-trial best's).

Table per domain: the confirmed speed-up over the best baseline with its 95% interval, what the
search recommends (its searched strategy only when confirmed faster, else that baseline), the gap of
the search's best to the oracle's, its best single trial against data-parallel all-reduce (TAG's
baseline) (the two re-measured interleaved on one Ray worker group, the
searches' launcher, 10 rounds of 5 iterations, with its 95% interval; the oracle's own figure is
the local launcher's), trials until a single trial within 5% of the oracle's figure,
hit rate, wall-clock. Searches record their rows in the run's data folder (``--home``, default a
new one, printed first); push it as a dataset release to share it.

    python experiments/findings/search_vs_baselines.py                      # the full table (long)
    python experiments/findings/search_vs_baselines.py --domains ncf-small@lab-2x2 --seeds 0 --oracle 120
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import lab, markdown_table  # noqa: E402

DOMAINS = ("ncf-small@lab-2x2", "cnn-small@lab-2x2", "ncf-small@lab-b12", "cnn-small@lab-b12")
ALGORITHMS = ("autodist", "random-guided", "random", "genetic", "coordinate-descent", "mcts", "tuned-ddp")


def oracle(workload, cluster, node_net, count: int, seed: int, warmup: int, iters: int
           ) -> tuple[float, str, int, object]:
    """(re-measured best mean time, its origin, strategies swept, its strategy)."""
    from synctune.engine.trial import TrialConfig, run_trials_local
    from synctune.search.sampler import GuidedSampler, RandomSampler
    from synctune.strategy import StrategyError, validate
    from synctune.strategy.builders import TUNED_BASELINES, baseline_strategy

    spec = workload.spec()
    pool, seen = [], set()

    def add(strategy, origin):
        if strategy.hash not in seen:
            seen.add(strategy.hash)
            pool.append((strategy, origin))

    for entry in TUNED_BASELINES:
        strategy = baseline_strategy(entry, spec, cluster)
        try:
            validate(strategy, spec, cluster)
        except StrategyError:  # e.g. hierarchical all-reduce on nodes of different sizes: as the search does
            continue
        add(strategy, entry)
    guided, plain = GuidedSampler(spec, cluster, seed=seed + 7919), RandomSampler(spec, cluster, seed=seed + 104729)
    while len(pool) < count:
        add(guided.sample(), "guided")
        if len(pool) < count:
            add(plain.sample(), "random")
    config = TrialConfig(warmup=warmup, iters=iters, seed=seed)
    results = run_trials_local([s for s, _o in pool], cluster, config, workload=workload, node_net=node_net)
    ok = sorted((r.mean_s, i) for i, r in enumerate(results) if r.status == "ok")
    # Second stage: the coordinates random draws rarely get right, swept around the 5 best: every
    # batch split between even and speed-proportional (nodes of different speeds) and SFB for the
    # linear weights whose factors are fewer bytes than their gradient.
    refine = refinements([pool[i][0] for _t, i in ok[:5]], spec, cluster)
    first = len(pool)
    for strategy, origin in refine:
        add(strategy, origin)
    if len(pool) > first:
        more = run_trials_local([s for s, _o in pool[first:]], cluster, config, workload=workload, node_net=node_net)
        results = list(results) + list(more)
        ok = sorted((r.mean_s, i) for i, r in enumerate(results) if r.status == "ok")
    top = [i for _t, i in ok[:5]]
    # Re-measure the top 5 in alternating order (two passes, reversed), keep each one's median.
    again: dict[int, list[float]] = {i: [] for i in top}
    for order in (top, top[::-1], top):
        for i, r in zip(order, run_trials_local([pool[i][0] for i in order], cluster, config, workload=workload,
                                                node_net=node_net)):
            if r.status == "ok":
                again[i].append(r.median_s)
    best = min(top, key=lambda i: statistics.median(again[i]) if again[i] else float("inf"))
    return statistics.median(again[best]), pool[best][1], len(pool), pool[best][0]


def refinements(strategies, spec, cluster) -> list[tuple[object, str]]:
    """Each of ``strategies`` under every batch split of the choice space (where node speeds
    differ) and with SFB for the linear weights where its factors are fewer bytes."""
    from synctune.search.local_search import SPLIT_STEPS
    from synctune.search.sampler import GuidedSampler
    from synctune.strategy import StrategyError, validate

    helper = GuidedSampler(spec, cluster)
    out = []
    for strategy in strategies:
        variants = [(strategy, "")]
        if helper.sfb_cheaper:
            variants.append((helper.with_sfb(strategy), " +sfb"))
        for base, label in variants:
            if label:
                out.append((base, "refined" + label))
            if helper.speeds is not None:
                out += [(helper.split_towards_speed(base, t), f"refined{label} split {t:g}") for t in SPLIT_STEPS]
    valid = []
    for candidate, origin in out:
        try:
            validate(candidate, spec, cluster)
        except StrategyError:
            continue
        valid.append((candidate, origin))
    return valid


def paired_gap(workload, cluster, node_net, arm, oracle_strategy, warmup: int) -> str:
    """The search's best against the oracle's, re-measured interleaved on one Ray worker group
    (the launcher the searches use): how much slower the search's best is, with its 95% interval.
    The oracle's figure alone comes from the local launcher, so a gap against it compares two
    launchers; this one does not."""
    from synctune.cluster.workers import ConfirmFailed, RayWorkerGroup
    from synctune.engine.trial import TrialConfig
    from synctune.spec import SpecError

    try:
        with RayWorkerGroup(cluster, node_net=node_net) as group:
            c = group.run_confirm([arm, (oracle_strategy, None)], TrialConfig(warmup=warmup, seed=0), workload=workload,
                                  rounds=10, per_round=5)
    except (ConfirmFailed, SpecError) as exc:  # e.g. the oracle's best uses a subset of the replicas
        return f"n/a ({str(exc)[:60]})"
    # c["ratio"]: the search's best over the oracle's, as a speed-up; the gap is its inverse.
    return f"{1 / c['ratio'] - 1:+.1%} [{1 / c['high'] - 1:+.1%}, {1 / c['low'] - 1:+.1%}]"


def one_search(workload, cluster, node_net, algorithm: str, seed: int, budget: int, warmup: int, iters: int,
               oracle_s: float, oracle_strategy, incumbent_moves: bool = False) -> list[object]:
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.search import run_search
    from synctune.search import Experiment

    spec = workload.spec()
    ddp_only = algorithm == "tuned-ddp"
    # The tuned-DDP searcher alone: its budget goes to DDP trials (one builder trial beside them).
    exp = Experiment.from_keys(name=f"svb-{spec.name}-{cluster.name}-{algorithm}", model=spec.name,
                               cluster=cluster.name, budget=1 if ddp_only else budget,
                               algorithm="random-guided" if ddp_only else algorithm,
                               simulator="rnn" if algorithm in ("autodist", "genetic") else "analytic", proposals=500,
                               candidates=3, warmup=warmup, iters=iters,
                               baselines=("allreduce",) if ddp_only else ("tuned",),
                               ddp_trials=budget if ddp_only else 8, confirm_rounds=0 if ddp_only else 10,
                               confirm_iters=5, seed=seed, incumbent_moves=incumbent_moves)
    start = time.monotonic()
    summary = run_search(exp, spec, cluster, workload=workload, node_net=node_net)
    wall = time.monotonic() - start
    rows = sorted(TrialDataset(dataset_dir()).records(search_id=f"{exp.name}-seed{seed}"),
                  key=lambda r: (r.created_at, r.record_id))
    from synctune.strategy import Strategy, build_strategy

    if ddp_only:
        ddp = [r for r in rows if r.runtime == "ddp"]
        within = next((n for n, r in enumerate(ddp, 1) if r.status == "ok" and r.mean_s <= 1.05 * oracle_s), None)
        gap = "n/a"
        tuned = summary.runtime_best("ddp")
        if tuned is not None:
            arm = (build_strategy("allreduce", spec, cluster), tuned.runtime)
            gap = paired_gap(workload, cluster, node_net, arm, oracle_strategy, warmup)
        return [f"tuned DDP ({len(ddp)} trials)", seed, len(ddp), "-", "-", "-", "-", "-", gap, within or "-", "-",
                f"{wall:.0f}"]
    trials = [r for r in rows if r.runtime == "engine" and not r.trial_id.startswith("confirm-")]
    # TAG's baseline: data-parallel all-reduce on every device, even split (single trials).
    # (Measured once under the first builder that gives it: often an allreduce:chunk= entry.)
    dp_hash = build_strategy("allreduce", spec, cluster).hash
    dp = next((r.mean_s for r in trials if r.strategy_hash == dp_hash and r.status == "ok"), None)
    over_dp = f"{dp / summary.best_mean_s:.2f}x" if dp and summary.best_mean_s else "n/a"
    within = next((n for n, r in enumerate(trials, 1) if r.status == "ok" and r.mean_s <= 1.05 * oracle_s), None)
    c = summary.confirmed or {}
    confirmed = f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]" if "ratio" in c else "n/a"
    best = c.get("candidate_strategy") or summary.best_strategy
    gap = paired_gap(workload, cluster, node_net, (Strategy.from_dict(best), None), oracle_strategy,
                     warmup) if best else "n/a"
    hits = summary.hit_rate
    # What the user is handed: the searched strategy only when confirmed faster, else the best
    # baseline itself (so a searched strategy confirmed slower costs the user nothing).
    kind = summary.recommended.kind if summary.recommended else "n/a"
    handed = f"search, {c['ratio']:.3f}" if kind == "search" and "ratio" in c else (
        "baseline, 1.000" if kind == "baseline" else kind)
    # Trials the search ran (its budget, tuned baselines included): fewer means it stopped early.
    return [algorithm, seed, len(trials), confirmed, c.get("verdict", "n/a"), handed, c.get("baseline", "n/a"), over_dp,
            gap, within or "-", f"{hits:.0%}" if hits is not None else "n/a", f"{wall:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default=",".join(DOMAINS), help="model@lab-preset, comma-separated")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=30)
    parser.add_argument("--incumbent-moves", action="store_true",
                        help="autodist: each round's last proposal the best measured strategy one move away")
    parser.add_argument("--oracle", type=int, default=300, help="strategies in the oracle sweep")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--home", help="synctune data folder of this run (default: a new one; its dataset keeps "
                                       "every trial, MLflow store included)")
    args = parser.parse_args()
    import os
    import tempfile

    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="synctune-svb-"))
    os.environ["SYNCTUNE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    print(f"data folder: {home} (dataset rows of every search and of the oracle sweeps; MLflow store)", flush=True)

    import ray

    from synctune.workload import resolve_workload

    seeds = [int(s) for s in args.seeds.split(",")]
    tables = []
    for domain in args.domains.split(","):
        model, _at, preset = domain.partition("@")
        workload = resolve_workload(model)
        with lab(preset) as (cluster, node_net):
            t0 = time.monotonic()
            oracle_s, origin, swept, oracle_strategy = oracle(workload, cluster, node_net, args.oracle, 0, args.warmup,
                                                              args.iters)
            print(f"{domain}: oracle {oracle_s * 1e3:.1f} ms ({origin}, best of {swept} strategies, re-measured) "
                  f"in {time.monotonic() - t0:.0f} s", flush=True)
            ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
            try:
                rows = []
                for algorithm in args.algorithms.split(","):
                    for seed in seeds:
                        rows.append(one_search(workload, cluster, node_net, algorithm, seed, args.budget,
                                               args.warmup, args.iters, oracle_s, oracle_strategy,
                                               incumbent_moves=args.incumbent_moves))
                        print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
            finally:
                ray.shutdown()
        tables.append((domain, oracle_s, origin, swept, rows))
    for domain, oracle_s, origin, swept, rows in tables:
        print(f"\n{domain}: oracle {oracle_s * 1e3:.1f} ms ({origin}; best of {swept}, re-measured); budget "
              f"{args.budget} trials (tuned baselines included) + 8 tuned-DDP trials per search")
        print(markdown_table(["algorithm", "seed", "trials", "confirmed speed-up [95%]", "verdict",
                              "recommended, its speed-up", "best baseline",
                              "best vs DP all-reduce (single trials)", "gap to oracle [95%]", "trials to within 5%", "hit rate", "wall s"], rows))


if __name__ == "__main__":
    main()
