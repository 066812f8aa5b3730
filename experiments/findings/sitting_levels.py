"""Whether an unseen model's level follows the sitting its rows and profiles were measured in.

The calibrated replay predicts an unseen model (``synctune sim eval --protocol unseen-model``)
from that model's compute profile and its cluster's constants fitted on the other models' rows
(dPRO §4.3's calibration; AutoSync §3.3's transfer). On release v0.3 some models come out at a
level: transformer-small 1.17-1.22 of its measured time on the presets without a quota,
lm-small 0.87-0.90. The hypothesis tested: the release's profiles of those presets
(``*@cpu-w4``) come from another sitting than their rows, and this machine's speed differs
between sittings by more than a profile's own noise, so rows and profiles measured in one
sitting would show no level. (They came from the same sitting as lab-2x2's rows, and rows and
profiles of one sitting today move the levels both ways: findings (q).)

What it does (root: the lab): a sample of each model's release rows on one preset
(``--strategies`` per model, the same strategies for every model's fold) is measured again now,
with ``lab collect``'s rule, after each model's compute profile is measured now the way ``lab
collect`` measures it. Then, per model, the calibrated replay is fitted on the other models'
rows of the sample and predicts that model's, four ways: the release's rows with the release's
profiles (R/R), today's with today's (T/T), and crossed (rows/profiles R/T and T/R). Printed per
model: the level (median predicted / measured), the median absolute error, today's rows over the
release's (the same strategies, paired) and today's profile over the release's (forward +
backward + step).

    python experiments/findings/sitting_levels.py --preset lab-2x2 [--strategies 24] [--seed 0]
        [--release dataset/synctune-v0.3] [--home DIR] [--evaluate-only]

``--home``: the data folder today's rows and profiles go to (a new temporary one by default);
with ``--evaluate-only`` nothing is measured and the rows and profiles already there are read.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ROOT = _common.ROOT
#: ``synctune lab collect``'s measurement rule (its defaults): what v0.3's rows were measured with.
COLLECT_RULE = {"warmup": 5, "iters": 10, "target_ci": 0.03, "max_iters": 200, "max_timed_s": 10.0, "pin_cpus": True}


def sample_rows(release: Path, preset: str, n: int, seed: int) -> dict[str, list[dict]]:
    """``n`` ok engine rows of each model on ``preset``, drawn with ``seed``, in the release's order."""
    from synctune.data import TrialDataset

    table = TrialDataset(release / "data").table(cluster=preset, status="ok").to_pylist()
    by_model: dict[str, list[dict]] = {}
    for row in table:
        if (row.get("runtime") or "engine") == "engine":
            by_model.setdefault(row["model_name"], []).append(row)
    rng = random.Random(seed)
    return {m: sorted(rng.sample(rows, min(n, len(rows))), key=lambda r: r["trial_id"])
            for m, rows in sorted(by_model.items())}


def measure_today(preset: str, samples: dict[str, list[dict]], seed: int) -> None:
    """Each model's profile, then its sampled strategies, measured now in one lab sitting."""
    from synctune.data import TrialDataset
    from synctune.data.paths import dataset_dir
    from synctune.engine.trial import TrialConfig, run_trials_local
    from synctune.run.profiles import ensure_profile
    from synctune.run.recording import record_result
    from synctune.strategy.schema import Strategy
    from synctune.workload.zoo import zoo_workload

    ds = TrialDataset(dataset_dir())
    config = TrialConfig(seed=seed, **COLLECT_RULE)
    with _common.lab(preset) as (cluster, node_net):
        for model, rows in samples.items():
            workload = zoo_workload(model)
            spec = workload.spec()
            ensure_profile(workload, spec, cluster, lambda line: print(line, flush=True), node_net=node_net,
                           pin_cpus=True)
            # The same strategies, on today's calibration of the preset (its links measured now;
            # the devices are the release's).
            strategies = [_on(Strategy.from_json(r["strategy_json"], where=f"{model} {r['trial_id']}"), cluster)
                          for r in rows]
            print(f"{model}@{preset}: {len(strategies)} trials", flush=True)
            results = run_trials_local(strategies, cluster, config, workload=workload, node_net=node_net)
            for row, strategy, result in zip(rows, strategies, results):
                record_result(result, strategy, spec, cluster, dataset=ds, logger=None, origin=row["origin"],
                              search_id=f"sitting-{model}@{preset}", trial_id=row["trial_id"])


def _on(strategy, cluster):
    """``strategy`` bound to ``cluster``, a calibration of the preset it was built for."""
    from synctune.strategy.schema import Strategy

    data = strategy.to_dict()
    data["cluster"] = {"name": cluster.name, "hash": cluster.hash}
    return Strategy.from_dict(data, where="strategy")


def levels(rows: list[dict], profiles: Path) -> dict[str, tuple[float, float, int]]:
    """Per model: (median predicted / measured, median |error|, trials) of the calibrated replay
    fitted on the other models' ``rows`` (``sim eval``'s unseen-model folds), replaying with the
    profiles in ``profiles``."""
    from synctune.simulator import CalibratedReplay, ReplaySimulator, domains_from_records, protocol_folds

    replay = ReplaySimulator.from_folder(profiles)
    out = {}
    for model, train, (test,) in protocol_folds(domains_from_records(rows), "unseen-model"):  # one preset
        sim = CalibratedReplay()
        sim.use_profiles(replay)
        sim.fit(train)
        ratio = np.asarray(sim.predict_domain(test), float) / test.times_s
        out[model] = (float(np.median(ratio)), float(np.median(np.abs(ratio - 1))), len(ratio))
    return out


def _profile_totals(today: Path, release: Path, model: str) -> tuple[float, float]:
    """Forward + backward + step of today's profile of ``model`` and of the release's of the same
    (model, device, workers)."""
    import json

    (path,) = today.glob(f"{model}@*.json")  # a home of this script holds one preset's profiles
    totals = []
    for folder in (today, release):
        data = json.loads((folder / path.name).read_text())
        totals.append(data["forward_s"] + data["backward_s"] + data["step_s"])
    return totals[0], totals[1]


def report(samples: dict[str, list[dict]], release: Path, home: Path, preset: str) -> None:
    from synctune.data import TrialDataset

    today = [r for r in TrialDataset(home / "dataset").table(cluster=preset, status="ok").to_pylist()
             if r["search_id"].startswith("sitting-")]
    ids = {(r["model_name"], r["trial_id"]) for r in today}
    then = [r for rows in samples.values() for r in rows if (r["model_name"], r["trial_id"]) in ids]
    if not then:
        raise SystemExit(f"{home}: no rows of this script for {preset}; run it without --evaluate-only first")
    folders = {"R": release / "profiles", "T": home / "profiles"}
    got = {(rows_of, prof): levels(rows, folders[prof]) for rows_of, rows in (("R", then), ("T", today))
           for prof in ("R", "T")}
    measured = {(r["model_name"], r["trial_id"]): r["mean_s"] for r in then}
    header = ["model", "trials", "rows T / R (median)", "profile T / R"] + [
        f"level, error: rows {a}, profiles {b}" for a, b in got]
    lines = []
    for model in sorted(got[("R", "R")]):
        paired = [r["mean_s"] / measured[(model, r["trial_id"])] for r in today if r["model_name"] == model]
        cells = [f"{lv:.3f}, {err:.1%}" for lv, err, _n in (got[k][model] for k in got)]
        t_total, r_total = _profile_totals(folders["T"], folders["R"], model)
        lines.append([model, got[("T", "T")][model][2], f"{np.median(paired):.3f}", f"{t_total / r_total:.3f}",
                      *cells])
    lines.append(["all (median of the models' errors)", "", "", "", *(
        f"{np.median([v[1] for v in got[k].values()]):.1%}" for k in got)])
    print(_common.markdown_table(header, lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="lab-2x2")
    parser.add_argument("--strategies", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--release", default=str(ROOT / "dataset" / "synctune-v0.3"))
    parser.add_argument("--home", default=None)
    parser.add_argument("--evaluate-only", action="store_true")
    args = parser.parse_args()
    if args.evaluate_only and not args.home:
        parser.error("--evaluate-only reads --home: give the folder of an earlier run")
    home = _common.use_data_folder(args.home, "sitting-levels-")
    release = Path(args.release)
    samples = sample_rows(release, args.preset, args.strategies, args.seed)
    if not args.evaluate_only:
        measure_today(args.preset, samples, args.seed)
    report(samples, release, home, args.preset)


if __name__ == "__main__":
    main()
