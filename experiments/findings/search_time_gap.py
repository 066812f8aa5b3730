"""How close does each simulator-only search get, given how much search time? AutoDDL's Fig. 7
view (§4.4): per domain and algorithm, the gap between the best strategy found within a time
budget and the best strategy known, under a training-free model (``--simulator``: the replay, from
the data folder's measured compute profiles where there are, or the analytic model).

Algorithms: ``random`` (guided random strategies, AutoDist §2.4's sampler), ``coordinate-descent``
(AutoDDL §4.4, restarts from data parallelism then from guided samples) and ``mcts`` (TAG
§4.2.2, rooted at data parallelism). Each runs once per seed for the longest budget; its trace
gives the best found by each shorter budget. "Best known": the best any run found, including a
long coordinate descent (``--oracle-seconds``); exhaustive search is out of reach on these spaces,
so a gap of 0 means "as good as anything found", not "optimal".

Domains are model@cluster; a lab preset's calibrated spec is used where ``synctune lab calibrate``
saved one in the data folder ($SYNCTUNE_HOME), so compute speeds (and the batch split) count.
Gaps are of *predicted* times: whether the predictions hold on the lab is search_vs_baselines.py's
question.

    python experiments/findings/search_time_gap.py
    python experiments/findings/search_time_gap.py --domains bert-tiny@lab-b10c --seeds 0,1 --budgets 0.5,2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table  # noqa: E402

DOMAINS = ("cnn-small@lab-b10c", "bert-tiny@lab-b10c", "cnn-small@lab-b11c", "bert-tiny@lab-b11c")
ALGORITHMS = ("random", "coordinate-descent", "mcts")


def run(algorithm: str, space, score, seed: int, seconds: float):
    from synctune.search import coordinate_descent, mcts
    from synctune.search.local_search import random_sampling

    rng = random.Random(seed)
    if algorithm == "random":
        return random_sampling(space, score, rng=rng, evaluations=10**9, seconds=seconds)
    if algorithm == "coordinate-descent":
        return coordinate_descent(space, score, [space.data_parallel()], rng=rng, evaluations=10**9, seconds=seconds)
    return mcts(space, score, rng=rng, evaluations=10**9, seconds=seconds)


def best_by(trace, seconds: float) -> float:
    """The best score a run had found ``seconds`` into it (-inf before its first scored batch)."""
    found = [best for _n, t, best in trace if t <= seconds]
    return found[-1] if found else float("-inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default=",".join(DOMAINS), help="model@cluster, comma-separated")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--budgets", default="0.25,0.5,1,2,4,8", help="search seconds, comma-separated")
    parser.add_argument("--oracle-seconds", type=float, default=30.0)
    parser.add_argument("--simulator", choices=("replay", "analytic"), default="replay",
                        help="the training-free model (replay: from the data folder's measured compute profiles, "
                             "else counted FLOPs)")
    args = parser.parse_args()

    from synctune.cli._common import resolve_cluster_arg
    from synctune.models import model_spec
    from synctune.search import ChoiceSpace
    from synctune.data.paths import profiles_dir
    from synctune.simulator import AnalyticSimulator, BoundSimulator, ReplaySimulator

    budgets = [float(b) for b in args.budgets.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    algorithms = args.algorithms.split(",")
    for domain in args.domains.split(","):
        name, _at, preset = domain.partition("@")
        model, cluster = model_spec(name), resolve_cluster_arg(preset)
        speeds = [n.compute_gflops for n in cluster.nodes]
        simulator = ReplaySimulator.from_folder(profiles_dir()) if args.simulator == "replay" else AnalyticSimulator()
        score = BoundSimulator(simulator, model, cluster).score
        space = ChoiceSpace(model, cluster)
        dp = -float(score([space.data_parallel()])[0])
        runs = {(a, s): run(a, space, score, s, max(budgets)) for a in algorithms for s in seeds}
        t0 = time.perf_counter()
        long = run("coordinate-descent", space, score, 10_007, args.oracle_seconds)
        best = max([long.scores[0]] + [r.scores[0] for r in runs.values()])
        rows = []
        for a in algorithms:
            row = [a]
            for b in budgets:
                # Scores are negated predicted times: found time / best time - 1.
                gaps = [best_by(runs[a, s].trace, b) / best - 1 for s in seeds]
                row.append(f"{statistics.median(gaps):+.1%} [{min(gaps):+.1%}, {max(gaps):+.1%}]")
            evals = statistics.median(runs[a, s].evaluations for s in seeds)
            row.append(f"{evals / max(budgets):,.0f}")
            rows.append(row)
        measured = args.simulator == "replay" and not getattr(simulator, "fallbacks", None)
        print(f"\n{domain}, {args.simulator} model{' (measured profile)' if measured else ''} "
              f"({len(model.variables)} variables; node GFLOP/s {speeds}): best known "
              f"{-best * 1e3:.2f} ms predicted, data-parallel all-reduce {dp * 1e3:.2f} ms "
              f"({dp / -best:.2f}x slower); {args.oracle_seconds:g} s oracle run in "
              f"{time.perf_counter() - t0:.0f} s; gap = predicted time of the best found / best known - 1, "
              f"median [min, max] over seeds {args.seeds}")
        print(markdown_table(["algorithm"] + [f"{b:g} s" for b in budgets] + ["strategies scored / s"], rows),
              flush=True)


if __name__ == "__main__":
    main()
