"""Finding (b), AutoDist Fig. 6: PS vs partitioned PS vs all-reduce (and the other builders)
across models and lab presets. Does any synchronization architecture win everywhere?

Reads the dataset (default: the v0.1 release in this repository, made by `synctune lab
collect`); rerun the measurements with `synctune lab collect --data DIR` and pass `--data DIR`.

    python experiments/findings/architectures.py [--data dataset/synctune-v0.1/data]
"""

from __future__ import annotations

import argparse

from _common import ROOT, markdown_table

ARCHITECTURES = ["ps", "ps-lb", "partitioned-ps", "allreduce", "horovod", "partitioned-allreduce", "parallax"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "dataset" / "synctune-v0.1" / "data"))
    args = parser.parse_args()
    from synctune.data import TrialDataset

    rows = TrialDataset(args.data).read()
    rows = rows[(rows["status"] == "ok") & rows["cluster_name"].str.startswith("lab-")]
    table, winners = [], {}
    for (model, cluster), part in sorted(rows.groupby(["model_name", "cluster_name"])):
        means = {a: part.loc[part["origin"] == a, "mean_s"].min() * 1e3 for a in ARCHITECTURES
                 if (part["origin"] == a).any()}
        if not means:
            continue
        best = min(means, key=means.get)
        random_best = part.loc[part["origin"] == "random", "mean_s"].min() * 1e3
        winners[(model, cluster)] = best
        table.append([model, cluster] + [f"**{means[a]:.1f}**" if a == best else
                                         (f"{means[a]:.1f}" if a in means else "-") for a in ARCHITECTURES]
                     + [f"{random_best:.1f}", f"{means[best] / random_best:.2f}"])
    print("mean iteration time (ms) of each builder per domain; bold: the fastest builder")
    print(markdown_table(["model", "preset"] + ARCHITECTURES + ["best random", "best builder / best random"],
                         table))
    counts = {}
    for w in winners.values():
        counts[w] = counts.get(w, 0) + 1
    print()
    print("fastest builder per domain: " + ", ".join(f"{k} {v}/{len(winners)}" for k, v in
                                                     sorted(counts.items(), key=lambda kv: -kv[1])))
    print("one architecture wins everywhere" if len(counts) == 1 else
          "no architecture wins everywhere: the best one depends on the model and the cluster")


if __name__ == "__main__":
    main()
