"""Does the search win? Each algorithm's confirmed best against the best baseline (tuned builders and
tuned torch DDP, screened) and against an oracle, per lab domain (the search issue's evidence;
AutoDist §3.3, AutoSync §5).

Per domain (model @ lab preset, brought up and calibrated here; root needed):
  - per algorithm and seed: a real search (``run_search``: tuned DDP, Algorithm 1 with tuned
    baselines inside ``--budget``, then the confirmation: the 3 fastest searched strategies and
    the 3 fastest baselines screened together, the two picks re-measured interleaved until the
    sequential rule's interval decides, 10 to 40 rounds); ``tuned-ddp`` is torch DDP tuned by
    Optuna alone, with the whole budget;
  - then the oracle (:func:`oracle`), by a procedure of its own: every tuned builder, ``--oracle``
    strategies of the domain's coarse space (``_oracle.py``: synchronizer per variable class x
    merge chunk x compressor x replicas and batch split, swept whole and topped up with
    per-variable draws), and the strategies the searches found, as single trials; their 5
    fastest and the fastest tuned-DDP settings the searches measured re-measured interleaved (10
    rounds, every arm each round), the best kept.

Table per domain: the confirmed speed-up over the screened best baseline with its 95% interval
and the rounds it took, what the search recommends (its searched strategy only when confirmed
faster, else that baseline), the gap of that recommendation to the oracle (the two re-measured
interleaved on one Ray worker group, the searches' launcher, until the sequential rule decides;
"no difference: best known" where the interval holds 0), its best single trial against
data-parallel all-reduce (TAG's baseline; single trials, unconfirmed), trials until a single
trial within 5% of the oracle's re-measured median, hit rate, wall-clock. Searches record their
rows in the run's data folder (``--home``, default a new one, printed first); push it as a
dataset release to share it.

    python experiments/findings/search_vs_baselines.py --algorithms autodist      # the full table (long)
    python experiments/findings/search_vs_baselines.py --domains ncf-small@lab-2x2 --seeds 0 --oracle 120
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import lab, markdown_table, use_data_folder  # noqa: E402

DOMAINS = ("ncf-small@lab-2x2", "cnn-small@lab-2x2", "ncf-small@lab-b12", "cnn-small@lab-b12")
ALGORITHMS = ("autodist", "random-guided", "random", "genetic", "coordinate-descent", "mcts", "tuned-ddp")


def oracle(workload, cluster, node_net, count: int, warmup: int, iters: int, found: list, ddp: list, *,
           top: int = 5, rounds: int = 10) -> dict:
    """The best strategy known for the domain, by a procedure of its own (:mod:`_oracle`): every
    tuned builder, ``count`` strategies of the coarse space, and the strategies the searches
    found (``found``: (strategy, origin)) as single trials on the local launcher; then their
    ``top`` fastest and the tuned-DDP settings the searches measured (``ddp``: (runtime, origin,
    single-trial seconds), the fastest kept) re-measured interleaved on one Ray worker group, the
    searches' launcher (``rounds`` rounds, every arm each round, the order rotating); the oracle
    is the arm with the smallest median time relative to each round's mean.

    Returns the oracle's arm, its origin and per-round median seconds, every re-measured arm's
    origin and median, and how many strategies were swept."""
    from _oracle import coarse_sweep

    from synctune.cluster.workers import RayWorkerGroup
    from synctune.engine.trial import TrialConfig, relative_scores, run_trials_local
    from synctune.strategy import StrategyError, build_strategy, validate
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
        add(strategy, f"builder {entry}")
    for strategy, origin in found:
        add(strategy, origin)
    for strategy, origin in coarse_sweep(spec, cluster, count, seed=0):
        add(strategy, origin)
    config = TrialConfig(warmup=warmup, iters=iters, seed=0)
    results = run_trials_local([s for s, _o in pool], cluster, config, workload=workload, node_net=node_net)
    ok = sorted((r.mean_s, i) for i, r in enumerate(results) if r.status == "ok")
    arms = [(pool[i][0], None, pool[i][1]) for _t, i in ok[:top]]
    if ddp:
        runtime, origin, _t = min(ddp, key=lambda d: d[2])
        arms.append((build_strategy("allreduce", spec, cluster), runtime, origin))
    with RayWorkerGroup(cluster, node_net=node_net) as group:
        out = group.run_confirm([(s, r) for s, r, _o in arms], TrialConfig(warmup=warmup, seed=0), workload=workload,
                                rounds=2, per_round=5, screen_rounds=rounds, candidates=len(arms) - 1)
    screen = out["screen_s"]
    score = relative_scores(screen)
    best = min(range(len(arms)), key=score.__getitem__)
    return {"arm": arms[best][:2], "origin": arms[best][2], "times_s": screen[best],
            "median_s": statistics.median(screen[best]), "swept": len(pool),
            "arms": [(o, statistics.median(t)) for (_s, _r, o), t in zip(arms, screen)]}


def paired_gap(workload, cluster, node_net, arm, oracle_arm, warmup: int) -> str:
    """What the user is handed against the oracle, re-measured interleaved on one Ray worker
    group (the launcher the searches use) until the sequential rule decides (10 to 40 rounds of
    5 iterations): how much slower it is, with its 95% interval; "is the oracle" when it is the
    same strategy and runtime."""
    from synctune.cluster.workers import ConfirmFailed, RayWorkerGroup
    from synctune.engine.runtimes import as_runtime
    from synctune.engine.trial import TrialConfig
    from synctune.spec import SpecError
    from synctune.stats import SequentialRule

    if arm[0].hash == oracle_arm[0].hash and as_runtime(arm[1]) == as_runtime(oracle_arm[1]):
        return "0 (is the oracle)"
    try:
        with RayWorkerGroup(cluster, node_net=node_net) as group:
            c = group.run_confirm([arm, oracle_arm], TrialConfig(warmup=warmup, seed=0), workload=workload,
                                  rule=SequentialRule(min_rounds=10, max_rounds=40), per_round=5)
    except (ConfirmFailed, SpecError) as exc:
        return f"n/a ({str(exc)[:60]})"
    # c["ratio"]: the handed strategy over the oracle's, as a speed-up; the gap is its inverse.
    gap = f"{1 / c['ratio'] - 1:+.1%} [{1 / c['high'] - 1:+.1%}, {1 / c['low'] - 1:+.1%}]"
    return gap + (" (no difference: best known)" if c["verdict"] == "no difference" else
                  " (faster than the oracle)" if c["verdict"] == "faster" else "")


def one_search(workload, cluster, node_net, algorithm: str, seed: int, budget: int, warmup: int, iters: int,
               incumbent_moves: bool = False) -> dict:
    """One real search of ``algorithm``; what the table needs of it once the oracle is known."""
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.search import run_search
    from synctune.search import Experiment
    from synctune.strategy import Strategy, build_strategy

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
    skeleton = build_strategy("allreduce", spec, cluster)
    ddp = [(t.runtime, f"tuned DDP ({algorithm} seed {seed}): {t.runtime.summary()}", t.mean_s)
           for t in summary.baselines if t.runtime.name == "ddp" and t.mean_s is not None]
    out = {"algorithm": algorithm, "seed": seed, "summary": summary, "wall": wall, "ddp": ddp, "found": []}
    if ddp_only:
        best = summary.runtime_best("ddp")
        out.update(trials=[r for r in rows if r.runtime == "ddp"],
                   handed=(skeleton, best.runtime) if best else None)
        return out
    trials = [r for r in rows if r.runtime == "engine" and not r.trial_id.startswith("confirm-")]
    searched = sorted((r for r in trials if r.status == "ok" and not r.trial_id.startswith("baseline-")),
                      key=lambda r: r.mean_s)
    out["found"] = [(Strategy.from_json(r.strategy_json), f"{algorithm} seed {seed}: {r.trial_id} ({r.origin})")
                    for r in searched[:3]]
    rec = summary.recommended
    out.update(trials=trials, handed=(rec.strategy, rec.runtime) if rec else None)
    return out


def table_row(run: dict, oracle_found: dict, workload, cluster, node_net, warmup: int) -> list[object]:
    """One search's row of the table, its gap measured against the oracle."""
    from synctune.strategy import build_strategy

    summary, oracle_s = run["summary"], oracle_found["median_s"]
    within = next((n for n, r in enumerate(run["trials"], 1) if r.status == "ok" and r.mean_s <= 1.05 * oracle_s),
                  None)
    gap = paired_gap(workload, cluster, node_net, run["handed"], oracle_found["arm"], warmup) if run["handed"] else "n/a"
    if run["algorithm"] == "tuned-ddp":
        return [f"tuned DDP ({len(run['trials'])} trials)", run["seed"], len(run["trials"]), "-", "-", "-", "-", "-",
                gap, within or "-", "-", f"{run['wall']:.0f}"]
    spec = workload.spec()
    # TAG's baseline: data-parallel all-reduce on every device, even split (single trials).
    dp_hash = build_strategy("allreduce", spec, cluster).hash
    dp = next((r.mean_s for r in run["trials"] if r.strategy_hash == dp_hash and r.status == "ok"), None)
    over_dp = f"{dp / summary.best_mean_s:.2f}x" if dp and summary.best_mean_s else "n/a"
    c = summary.confirmed
    measured = c is not None and c.measured
    confirmed = (f"{c.interval.ratio:.3f} [{c.interval.low:.3f}, {c.interval.high:.3f}] ({c.rounds} rounds)"
                 if measured else "n/a")
    hits = summary.hit_rate
    # What the user is handed: the searched strategy only when confirmed faster, else the best
    # baseline itself (so a searched strategy confirmed slower costs the user nothing).
    kind = summary.recommended.kind if summary.recommended else "n/a"
    handed = f"search, {c.interval.ratio:.3f}" if kind == "search" and measured else (
        "baseline, 1.000" if kind == "baseline" else kind)
    return [run["algorithm"], run["seed"], len(run["trials"]), confirmed, c.verdict if measured else "n/a", handed,
            c.baseline if measured else "n/a", over_dp, gap, within or "-", f"{hits:.0%}" if hits is not None else "n/a",
            f"{run['wall']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default=",".join(DOMAINS), help="model@lab-preset, comma-separated")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=30)
    parser.add_argument("--incumbent-moves", action="store_true",
                        help="autodist: each round's last proposal the best measured strategy one move away")
    parser.add_argument("--oracle", type=int, default=300, help="strategies of the coarse space in the oracle sweep")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--home", help="synctune data folder of this run (default: a new one; its dataset keeps "
                                       "every trial, MLflow store included)")
    args = parser.parse_args()
    use_data_folder(args.home, "synctune-svb-")

    import ray

    from synctune.workload import resolve_workload

    seeds = [int(s) for s in args.seeds.split(",")]
    tables = []
    for domain in args.domains.split(","):
        model, _at, preset = domain.partition("@")
        workload = resolve_workload(model)
        with lab(preset) as (cluster, node_net):
            ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
            try:
                runs = []
                for algorithm in args.algorithms.split(","):
                    for seed in seeds:
                        runs.append(one_search(workload, cluster, node_net, algorithm, seed, args.budget,
                                               args.warmup, args.iters, incumbent_moves=args.incumbent_moves))
                        print(f"  {algorithm} seed {seed}: done in {runs[-1]['wall']:.0f} s", flush=True)
                t0 = time.monotonic()
                found = oracle(workload, cluster, node_net, args.oracle, args.warmup, args.iters,
                               [f for r in runs for f in r["found"]], [d for r in runs for d in r["ddp"]])
                print(f"{domain}: oracle {found['median_s'] * 1e3:.1f} ms ({found['origin']}; {found['swept']} "
                      f"strategies swept, top re-measured interleaved) in {time.monotonic() - t0:.0f} s", flush=True)
                rows = []
                for run in runs:
                    rows.append(table_row(run, found, workload, cluster, node_net, args.warmup))
                    print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
            finally:
                ray.shutdown()
        tables.append((domain, found, rows))
    for domain, found, rows in tables:
        print(f"\n{domain}: oracle {found['median_s'] * 1e3:.1f} ms ({found['origin']}; best of {found['swept']} "
              f"swept, every tuned baseline and the searches' finds, top re-measured interleaved); budget "
              f"{args.budget} trials (tuned baselines included) + 8 tuned-DDP trials per search")
        print("  re-measured: " + "; ".join(f"{o} {t * 1e3:.1f} ms" for o, t in found["arms"]))
        print(markdown_table(["algorithm", "seed", "trials", "confirmed speed-up [95%]", "verdict",
                              "recommended, its speed-up", "best baseline (screened)",
                              "best vs DP all-reduce (single trials)", "gap of the recommendation to the oracle [95%]",
                              "trials to within 5%", "hit rate", "wall s"], rows))


if __name__ == "__main__":
    main()
