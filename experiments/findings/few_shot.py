"""An unseen model after a few of its own trials: what a search on a new model meets.

``synctune sim eval --protocol unseen-model`` scores the calibrated replay on a model it has
never seen a trial of (AutoSync §3.3's transfer): zero-shot. A search does not stay there: it
recalibrates its replay on its own trials after every batch (dPRO §4.3's calibration from the
job's own measurements; :meth:`CalibratedReplay.calibrate`, which needs at least 10 trials of
the domain). This scores each unseen-model fold's test domains three ways on the same trials:
with none of the domain's trials, and after 10 and 20 of them (drawn with ``--seed``), every
domain's first 20 drawn trials held back from the scoring so the three rows score the same
trials. Printed: per number of the domain's own trials, the pooled median absolute error, its
p90 and the mean pairwise ranking accuracy over domains.

    python experiments/findings/few_shot.py [--data dataset/synctune-v0.3/data]
        [--home dataset/synctune-v0.3] [--seed 0]

``--home``: the folder whose ``profiles/`` hold the compute profiles (a release's folder, or a
data home; ``SYNCTUNE_HOME`` by default).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

SHOTS = (0, 10, 20)


def main() -> None:
    from synctune.data import TrialDataset
    from synctune.simulator import CalibratedReplay, ReplaySimulator, domains_from_records, protocol_folds
    from synctune.simulator.evaluate import pairwise_accuracy

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(_common.ROOT / "dataset" / "synctune-v0.3" / "data"))
    parser.add_argument("--home", default=os.environ.get("SYNCTUNE_HOME"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.home:
        parser.error("--home: the folder whose profiles/ the replay uses (or set SYNCTUNE_HOME)")
    replay = ReplaySimulator.from_folder(Path(args.home) / "profiles")
    domains = domains_from_records(TrialDataset(args.data).records())
    rng = np.random.default_rng(args.seed)
    errors = {k: [] for k in SHOTS}
    ranks = {k: [] for k in SHOTS}
    for fold, train, test in protocol_folds(domains, "unseen-model"):
        sim = CalibratedReplay()
        sim.use_profiles(replay)
        sim.fit(train)
        for d in test:
            order = rng.permutation(len(d.times_s))
            scored = d.subset(sorted(order[max(SHOTS):]))
            for k in SHOTS:
                sim.per_domain.pop(d.key, None)  # the zero-shot constants (the cluster's) again
                if k:
                    sim.calibrate(d.subset(sorted(order[:k])))
                pred = np.asarray(sim.predict_domain(scored), float)
                errors[k].extend(np.abs(pred - scored.times_s) / scored.times_s)
                ranks[k].append(pairwise_accuracy(pred, scored.times_s))
            sim.per_domain.pop(d.key, None)
        print(f"{fold}: {len(test)} domains", flush=True)
    rows = [[k, len(errors[k]), f"{np.median(errors[k]):.1%}", f"{np.percentile(errors[k], 90):.1%}",
             f"{np.mean(ranks[k]):.3f}"] for k in SHOTS]
    print()
    print(_common.markdown_table(["the domain's own trials", "trials scored", "|err| median", "|err| p90",
                                  "pairwise acc (mean over domains)"], rows))


if __name__ == "__main__":
    main()
