"""How far apart two measurements of the same strategy are: the floor under any simulator's error.

Within a dataset release, strategies measured more than once in the same domain (builders that
coincide on a small model, re-measurements) are compared in pairs. With independent noise of
relative size s on each measurement, the median of |x1 - x2| / mean is about sqrt(2) times the
median distance of one measurement from the strategy's true time: a simulator that knew every true
time would still be that far from the rows it is tested on. Pairs of strategies whose true times
differ by less than the noise are ordered by chance: the script also estimates the pairwise
accuracy such a perfect simulator would reach on the release's domains (each domain's measured
times taken as the truth, measured again with that noise). Also printed: the within-trial
coefficient of variation of the timed iterations, and how far apart the medians of a trial's
first and second half are (what more iterations of the same trial average away), beside how far
apart two trials of the same strategy are.

    python experiments/findings/repeat_noise.py [--data dataset/synctune-v0.2/data]

With ``--probe SECONDS`` it times a fixed piece of CPU work instead, on an idle machine, to show
how much the machine's state moves between windows of a minute or less (:func:`probe_drift`).

    python experiments/findings/repeat_noise.py --probe 120

With ``--presets`` it measures instead (root: the lab): on each lab preset, for each model, the
same strategies (the builders, then guided-sampler strategies) are trialled twice in one
process group, the whole list then the whole list again, under each measurement rule: ``fixed``
(v0.2's rows: 2 warm-up and 6 timed iterations) and ``ci`` (the quieter trial: 5 warm-up, at
least 10 timed, then on until the 95% interval of the median is within +-3%, at most 100
iterations or 10 s of them; ``TrialConfig.target_ci``), each also with every worker bound to one
CPU (``pinned``, ``ci-pinned``), and ``ci-pinned-200``, the rule v0.3 is collected with (``lab
collect``'s defaults: room for 200 timed iterations). Printed per preset and rule: the median
and p90 of |x1 - x2| / mean over the pairs, the timed iterations a trial took and its seconds.
The rows are recorded in the data folder (``--home``; search id ``repeat-<rule>-<model>@<preset>``).

    python experiments/findings/repeat_noise.py --presets lab-2x2,lab-4x1,lab-b12,lab-b10c,lab-b11c
        [--models cnn-small,transformer-small] [--strategies 8] [--rules fixed,ci] [--home DIR]

Also printed per preset: the median ratio of a strategy's second measurement to its first (a
drift or a first-run effect shows as a ratio away from 1). ``--speed-probe`` adds, around every
trial, a fixed piece of CPU work timed on rank 0 while the other ranks wait (:func:`speed_probe`),
and prints how far apart the pairs are once each trial's time is divided by its probe's: if the
machine's own speed made the difference between two trials, that quotient would be closer.
``--means-of-two HOME HOME ...`` reads two or more such runs' rows and sets one measurement
against one beside a mean of two (one trial from each run) against another.
``--fresh-groups`` runs every trial in a process group of its own, as the first trial of its
group (the engine's trial lists share one group per run of trials on the same replicas, whose
trials drift faster over the group's life: ``group_drift.py``).
``--cfs-period-ms`` sets the CFS period of the quota presets' cgroups (the lab's is 100 ms, the
kernel's default; a quota is granted per period, so iterations about as long as the period alias
with it).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from synctune.simulator.evaluate import pairwise_accuracy


#: The measurement rules compared (TrialConfig keywords).
RULES = {"fixed": {"warmup": 2, "iters": 6},
         "ci": {"warmup": 5, "iters": 10, "target_ci": 0.03, "max_iters": 100, "max_timed_s": 10.0},
         "pinned": {"warmup": 2, "iters": 6, "pin_cpus": True},
         "ci-pinned": {"warmup": 5, "iters": 10, "target_ci": 0.03, "max_iters": 100, "max_timed_s": 10.0,
                       "pin_cpus": True},
         # Short iterations reach 100 before the interval closes (cnn-small: ~90 on average):
         # the same rule with room for 200 of them, still within 10 s.
         "ci-pinned-200": {"warmup": 5, "iters": 10, "target_ci": 0.03, "max_iters": 200, "max_timed_s": 10.0,
                           "pin_cpus": True}}


def _cpu_work(a, products: int, additions: int) -> float:
    """Seconds for ``products`` products of the matrix ``a`` with itself (numpy or torch), then
    ``additions`` Python additions: the fixed piece of work both probes time."""
    t0 = time.perf_counter()
    for _ in range(products):
        a @ a
    x = 0
    for i in range(additions):
        x += i
    return time.perf_counter() - t0


def speed_probe() -> list[float]:
    """Rank 0's seconds for three runs of a fixed piece of CPU work (20 products of two 256 x 256
    torch matrices, then 50,000 Python additions: some 9 ms), the other ranks waiting in a
    barrier before and after, so that nothing of the trials runs beside it."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    out = []
    if dist.get_rank() == 0:
        a = torch.rand(256, 256, generator=torch.Generator().manual_seed(0))
        out = [_cpu_work(a, 20, 50_000) for _ in range(3)]
    dist.barrier()
    return out


def probed_trials_worker(rank: int, world: int, payload: dict) -> int:
    """The engine's trials worker (:func:`synctune.engine.trial.trials_worker`) with
    :func:`speed_probe` before and after each trial, reported as event ``speed_probe``."""
    import os

    from synctune.engine.local import report
    from synctune.engine.trial import _measure
    from synctune.strategy.schema import Strategy

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    for index, strategy in enumerate(payload["strategies"]):
        before = speed_probe()
        out = _measure(rank, world, payload, Strategy.from_dict(strategy), True, progress=False)
        after = speed_probe()
        if rank == 0:
            report({"event": "speed_probe", "index": payload["first_index"] + index, "seconds": before + after})
            report({"event": "trial_done", "index": payload["first_index"] + index, "out": out})
    return len(payload["strategies"])


@contextlib.contextmanager
def probing(probes: dict[int, float]):
    """While open, every local process group of the engine's trial lists runs
    :func:`probed_trials_worker`; each trial's probe median lands in ``probes`` by index."""
    import synctune.engine.local as local

    plain = local.run_local

    def run_local(fn, world_size, args=(), *, on_progress=None, **kw):
        def progress(rank, msg):
            if msg.get("event") == "speed_probe":
                probes[msg["index"]] = float(np.median(msg["seconds"]))
            elif on_progress is not None:
                on_progress(rank, msg)
        return plain(probed_trials_worker, world_size, args, on_progress=progress, **kw)

    local.run_local = run_local
    try:
        yield probes
    finally:
        local.run_local = plain


def _apart(a, b):
    """How far apart two measurements are, relative to their mean (numbers or pandas Series)."""
    return abs(a - b) / ((a + b) / 2)


def _pair_row(preset: str, model: str, rule: str, a, b, probe_a: float | None, probe_b: float | None,
              wall: float) -> dict:
    row = {"preset": preset, "model": model, "rule": rule,
           "diff": _apart(a.median_s, b.median_s),
           "ratio": b.median_s / a.median_s, "iters": (a.iters + b.iters) / 2, "wall": wall}
    if probe_a and probe_b:
        x, y = a.median_s / probe_a, b.median_s / probe_b
        row |= {"probed_diff": _apart(x, y), "log_ratio": math.log(b.median_s / a.median_s),
                "log_probe_ratio": math.log(probe_b / probe_a)}
    return row


def measure(args) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _common
    from synctune.data import TrialDataset
    from synctune.data.paths import dataset_dir
    from synctune.engine.trial import TrialConfig, run_trials_local
    from synctune.run.collect import collection_plan
    from synctune.run.recording import record_result
    from synctune.workload.zoo import zoo_workload

    _common.use_data_folder(args.home, "repeat-noise-")
    if args.cfs_period_ms is not None:
        import synctune.lab.cpu as lab_cpu

        # Read by make_node_cgroups when the lab comes up; the quotas keep their shares of it.
        lab_cpu.PERIOD_US = int(round(args.cfs_period_ms * 1000))
    ds = TrialDataset(dataset_dir())
    rows = []
    for preset in args.presets.split(","):
        with _common.lab(preset) as (cluster, node_net):
            for model in args.models.split(","):
                workload = zoo_workload(model)
                spec = workload.spec()
                plan = collection_plan(spec, cluster, num_random=0, num_guided=args.strategies, seed=args.seed)
                # Strategies on every replica only: one process group runs the whole list twice.
                plan = [p for p in plan if len(p[2].replicas) == cluster.num_devices][:args.strategies]
                for rule in args.rules.split(","):
                    config = TrialConfig(seed=args.seed, **RULES[rule])
                    t0 = time.perf_counter()
                    trials = [p[2] for p in plan] * 2
                    with probing({}) if args.speed_probe else contextlib.nullcontext({}) as probes:
                        if args.fresh_groups:  # each trial the first of a process group of its own
                            results = [run_trials_local([s], cluster, config, workload=workload,
                                                        node_net=node_net)[0] for s in trials]
                        else:
                            results = run_trials_local(trials, cluster, config, workload=workload,
                                                       node_net=node_net)
                    wall = time.perf_counter() - t0
                    for i, r in enumerate(results):
                        trial_id, origin, strategy = plan[i % len(plan)]
                        record_result(r, strategy, spec, cluster, dataset=ds, logger=None, origin=origin,
                                      search_id=f"repeat-{rule}-{model}@{preset}",
                                      trial_id=f"{trial_id}-pass{i // len(plan)}")
                    k = len(plan)
                    for i, (a, b) in enumerate(zip(results[:k], results[k:])):
                        if a.ok and b.ok:
                            rows.append(_pair_row(preset, model, rule, a, b, probes.get(i), probes.get(i + k),
                                                  wall / len(results)))
                    done = pd.DataFrame([r for r in rows if r["preset"] == preset and r["model"] == model
                                         and r["rule"] == rule])
                    print(f"{model}@{preset} {rule}: {len(done)} pairs, median diff {done['diff'].median():.1%}, "
                          f"{done['iters'].mean():.0f} iterations, {wall / len(results):.1f} s per trial", flush=True)
    t = pd.DataFrame(rows)
    table = t.groupby(["preset", "rule"]).agg(pairs=("diff", "size"), median=("diff", "median"),
                                              p90=("diff", lambda d: d.quantile(0.9)), ratio=("ratio", "median"),
                                              iterations=("iters", "mean"), seconds=("wall", "mean")).reset_index()
    print()
    print(_common.markdown_table(
        ["preset", "rule", "pairs", "median of abs(x1 - x2) / mean", "p90", "x2 / x1 (median)",
         "timed iterations per trial (mean)", "s per trial (mean)"],
        [[r.preset, r.rule, r.pairs, f"{r.median:.1%}", f"{r.p90:.1%}", f"{r.ratio:.3f}", f"{r.iterations:.0f}",
          f"{r.seconds:.1f}"] for r in table.itertuples()]))
    if "probed_diff" in t:
        _print_probed(t.dropna(subset=["probed_diff"]))
    for rule, g in t.groupby("rule"):
        per = g.groupby("preset")["diff"].median()
        print(f"{rule}: median over all pairs {g['diff'].median():.1%}; presets at or under 5%: "
              f"{int((per <= 0.05).sum())} of {len(per)} (worst {per.max():.1%}, {per.idxmax()})")


def _print_probed(t: pd.DataFrame) -> None:
    """The pairs as measured beside the pairs divided by their trials' speed probes."""
    import _common

    rows = []
    for (preset, model), g in t.groupby(["preset", "model"]):
        r = np.corrcoef(g.log_ratio, g.log_probe_ratio)[0, 1] if len(g) > 2 else np.nan
        rows.append([preset, model, len(g), f"{g['diff'].median():.1%}", f"{g.probed_diff.median():.1%}",
                     f"{g.log_ratio.std():.3f}", f"{g.log_probe_ratio.std():.3f}", f"{r:.2f}"])
    print()
    print(_common.markdown_table(
        ["preset", "model", "pairs", "median abs(x1 - x2) / mean", "the same of x / probe",
         "sd of log(x2 / x1)", "sd of log(probe2 / probe1)", "correlation"], rows))


def probe_drift(seconds: float, windows: int = 6) -> None:
    """How much one fixed piece of CPU work moves with nothing of ours running (40 products of two
    300 x 300 matrices on numpy's threads, then a loop of 200,000 Python additions), timed every
    half second for ``seconds``, and the median of each of ``windows`` consecutive windows. Run it
    on an idle machine: its spread says how much the machine's state moves from minute to minute.
    It is not a speed a trial runs at: a probe beside every trial (``--speed-probe``) moves
    otherwise and divides none of the pairs' difference away (docs/results/dataset-collection.md)."""
    a = np.random.default_rng(0).random((300, 300))
    out = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        out.append(_cpu_work(a, 40, 200_000))
        time.sleep(0.5)
    x = np.asarray(out) * 1e3
    medians = [float(np.median(w)) for w in np.array_split(x, windows)]
    print(f"CPU probe, {len(x)} runs over {seconds:.0f} s: window medians (ms) "
          + " ".join(f"{m:.1f}" for m in medians)
          + f"; spread {(max(medians) - min(medians)) / np.median(medians):.1%} of their median")


def _repeat_pairs(folder: str) -> pd.DataFrame:
    """A ``--presets`` run's rows (its ``--home``): per (model, preset, strategy) its first and
    second measurement (columns "0", "1"), matched by trial id (a strategy's hash moves with the
    calibrated cluster, its builder or sampler name does not)."""
    t = ds.dataset(f"{folder}/dataset", format="parquet", partitioning="hive").to_table(
        columns=["trial_id", "model_name", "cluster_name", "median_s", "status"]).to_pandas()
    t = t[(t.status == "ok") & t.trial_id.str.contains("-pass")]
    parts = t.trial_id.str.rsplit("-pass", n=1)
    t["strategy"], t["pass"] = parts.str[0], parts.str[1]
    return t.pivot_table(index=["model_name", "cluster_name", "strategy"], columns="pass", values="median_s")


def means_of_two(folders: list[str]) -> None:
    """For each two ``--presets`` runs of the same strategies (same presets, models and seed), how
    far apart two measurements are against how far apart two means of two are, each mean of one
    trial from either run (different process groups, different hours): what measuring every
    strategy twice would leave, from rows already measured."""
    runs = {f: _repeat_pairs(f) for f in folders}
    for a, b in itertools.combinations(folders, 2):
        j = pd.merge(runs[a], runs[b], left_index=True, right_index=True, suffixes=("a", "b")).dropna()
        one = pd.concat([_apart(j["0a"], j["1a"]), _apart(j["0b"], j["1b"])])
        two = _apart((j["0a"] + j["1b"]) / 2, (j["1a"] + j["0b"]) / 2)
        print(f"{a} + {b}: {len(j)} strategies; one trial against one: median {one.median():.1%}; "
              f"a mean of two (one from each run) against another: median {two.median():.1%}")


def _halves_apart(times) -> float:
    """How far apart the medians of a trial's first and second half of timed iterations are
    (relative to their mean; NaN under 4 iterations): the noise a longer trial averages away,
    against which the difference between two trials says how much comes from outside a trial."""
    x = np.asarray(times, dtype=float)
    if len(x) < 4:
        return np.nan
    a, b = np.median(x[:len(x) // 2]), np.median(x[len(x) // 2:])
    return _apart(a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="dataset/synctune-v0.2/data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--presets", default="", help="measure on these lab presets (root) instead of reading --data")
    parser.add_argument("--models", default="cnn-small,transformer-small")
    parser.add_argument("--strategies", type=int, default=8, help="strategies per domain, each measured twice")
    parser.add_argument("--rules", default="fixed,ci")
    parser.add_argument("--home", default=None, help="data folder for the rows (default: a new temporary one)")
    parser.add_argument("--fresh-groups", action="store_true",
                        help="with --presets: every trial in a process group of its own (no drift over a group's life)")
    parser.add_argument("--means-of-two", nargs="+", metavar="HOME", default=None,
                        help="instead, from two or more --presets runs' data folders (--home): one trial against "
                             "one, beside a mean of two trials against another")
    parser.add_argument("--cfs-period-ms", type=float, default=None,
                        help="with --presets: the lab's CFS period for the quota presets' cgroups (default: "
                             "the lab's, 100 ms); 1 to 1000")
    parser.add_argument("--speed-probe", action="store_true",
                        help="with --presets: time a fixed CPU probe on rank 0 around every trial")
    parser.add_argument("--probe", type=float, default=0.0,
                        help="instead, time a fixed CPU probe for this many seconds (an idle machine's own drift)")
    args = parser.parse_args()
    if args.probe:
        if args.probe < 10:
            parser.error(f"--probe: at least 10 seconds (six windows of a few runs each), got {args.probe}")
        probe_drift(args.probe)
        return
    if args.means_of_two:
        if len(args.means_of_two) < 2:
            parser.error(f"--means-of-two: at least two data folders, got {len(args.means_of_two)}")
        for folder in args.means_of_two:
            if not (Path(folder) / "dataset").is_dir():
                parser.error(f"--means-of-two: {folder} has no dataset/ folder (a --presets run's --home)")
        means_of_two(args.means_of_two)
        return
    if args.presets:
        if args.cfs_period_ms is not None and not 1 <= args.cfs_period_ms <= 1000:
            parser.error(f"--cfs-period-ms: 1 to 1000 (the kernel's bounds), got {args.cfs_period_ms:g}")
        if args.fresh_groups and args.speed_probe:
            parser.error("--fresh-groups and --speed-probe: one at a time (a probe is keyed by its trial's place in "
                         "one group)")
        measure(args)
        return
    t = ds.dataset(args.data, format="parquet", partitioning="hive").to_table(
        columns=["model_name", "cluster_name", "strategy_hash", "median_s", "status", "iteration_times_s"]).to_pandas()
    t = t[t.status == "ok"]
    pairs = []
    for (model, cluster, _), g in t.groupby(["model_name", "cluster_name", "strategy_hash"]):
        for a, b in itertools.combinations(g.median_s.to_numpy(), 2):
            pairs.append((cluster, _apart(a, b)))
    p = pd.DataFrame(pairs, columns=["cluster", "diff"])
    print(f"{len(t)} ok rows; {len(p)} pairs of measurements of the same strategy in the same domain")
    print(f"|x1 - x2| / mean: median {p['diff'].median():.1%}, p90 {p['diff'].quantile(0.9):.1%}")
    noise = p["diff"].median() / np.sqrt(2)
    print(f"one measurement's median distance from the true time (the floor of a median error): ~{noise:.1%}")
    print(p.groupby("cluster")["diff"].agg(["count", "median"]).rename(columns={"median": "median diff"})
          .to_string(float_format=lambda x: f"{x:.1%}"))
    cv = t.iteration_times_s.apply(lambda x: np.std(x) / np.mean(x) if len(x) > 1 else np.nan)
    print(f"within a trial, the iterations' coefficient of variation: median {cv.median():.1%}")
    halves = t.iteration_times_s.apply(_halves_apart).dropna()
    print(f"within a trial, the median of its first half of timed iterations against its second half's: "
          f"median {halves.median():.1%} apart ({len(halves)} trials), where two trials of one strategy are "
          f"{p['diff'].median():.1%} apart: {p['diff'].median() / halves.median():.1f} times as far")
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
