"""How far apart two measurements of the same strategy are: the floor under any simulator's error.

Within a dataset release, strategies measured more than once in the same domain (builders that
coincide on a small model, re-measurements) are compared in pairs. With independent noise of
relative size s on each measurement, the median of |x1 - x2| / mean is about sqrt(2) times the
median distance of one measurement from the strategy's true time: a simulator that knew every true
time would still be that far from the rows it is tested on. Pairs of strategies whose true times
differ by less than the noise are ordered by chance: the script also estimates the pairwise
accuracy such a perfect simulator would reach on the release's domains (each domain's measured
times taken as the truth, measured again with that noise). Also printed: the within-trial
coefficient of variation of the timed iterations.

    python experiments/findings/repeat_noise.py [--data dataset/synctune-v0.2/data]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from synctune.simulator.evaluate import pairwise_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="dataset/synctune-v0.2/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t = ds.dataset(args.data, format="parquet", partitioning="hive").to_table(
        columns=["model_name", "cluster_name", "strategy_hash", "median_s", "status", "iteration_times_s"]).to_pandas()
    t = t[t.status == "ok"]
    pairs = []
    for (model, cluster, _), g in t.groupby(["model_name", "cluster_name", "strategy_hash"]):
        for a, b in itertools.combinations(g.median_s.to_numpy(), 2):
            pairs.append((cluster, abs(a - b) / ((a + b) / 2)))
    p = pd.DataFrame(pairs, columns=["cluster", "diff"])
    print(f"{len(t)} ok rows; {len(p)} pairs of measurements of the same strategy in the same domain")
    print(f"|x1 - x2| / mean: median {p['diff'].median():.1%}, p90 {p['diff'].quantile(0.9):.1%}")
    noise = p["diff"].median() / np.sqrt(2)
    print(f"one measurement's median distance from the true time (the floor of a median error): ~{noise:.1%}")
    print(p.groupby("cluster")["diff"].agg(["count", "median"]).rename(columns={"median": "median diff"})
          .to_string(float_format=lambda x: f"{x:.1%}"))
    cv = t.iteration_times_s.apply(lambda x: np.std(x) / np.mean(x) if len(x) > 1 else np.nan)
    print(f"within a trial, the iterations' coefficient of variation: median {cv.median():.1%}")
    rng = np.random.default_rng(args.seed)
    # A perfect simulator's pairwise accuracy, for a few noise levels (a normal relative error).
    for sigma in (noise * 0.5, noise, p["diff"].median()):
        accs = []
        for _ in range(10):
            # the true times as the prediction, a noisy measurement of them as the truth
            per = [pairwise_accuracy(g.median_s.to_numpy(), g.median_s.to_numpy() * (1 + rng.normal(0, sigma, len(g))))
                   for _, g in t.groupby(["model_name", "cluster_name"]) if len(g) > 1]
            accs.append(np.nanmean(per))
        print(f"noise {sigma:.1%}: a simulator that knew every true time ranks pairs at ~{np.mean(accs):.3f}")


if __name__ == "__main__":
    main()
