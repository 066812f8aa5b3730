"""Shared by the findings scripts: bringing a lab preset up for the duration of a block, and
measuring several strategies as arms of one interleaved re-measurement, each relative to the
fastest with a paired 95% interval."""

from __future__ import annotations

import contextlib
import importlib
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def use_data_folder(home: str | None, prefix: str) -> Path:
    """Point synctune at a data folder of the run's own (``home``, or a new temporary one named
    ``prefix``...) and its MLflow store, and say where it is: the searches' rows stay together."""
    import os
    import tempfile

    folder = Path(home) if home else Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["SYNCTUNE_HOME"] = str(folder)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    print(f"data folder: {folder} (dataset rows of every search; MLflow store)", flush=True)
    return folder


@contextlib.contextmanager
def lab(preset: str):
    """The lab up with ``preset`` (replacing whatever was up), calibrated; down afterwards.
    Yields (calibrated cluster spec, node network)."""
    from synctune.cli._common import node_network, resolve_cluster_arg
    from synctune.lab import lab_down, lab_status, lab_up
    from synctune.run import calibrate_lab
    from synctune.spec import cluster_preset

    nominal = cluster_preset(preset)
    try:
        lab_up(nominal)
        calibrate_lab(nominal, lab_status()["state"])
        cluster = resolve_cluster_arg(preset)
        yield cluster, node_network(cluster)
    finally:
        lab_down()


def stand_in_error(stand_in: str, option: str = "--stand-in") -> str | None:
    """Why ``stand_in`` cannot stand in for a lab preset (an unknown cluster, or a lab preset
    itself), in one line naming the script's ``option``; None when it can."""
    from synctune.spec import resolve_cluster
    from synctune.spec.cluster import is_lab_cluster
    from synctune.spec.errors import SpecError

    try:
        lab_preset = is_lab_cluster(resolve_cluster(stand_in))
    except SpecError as exc:
        return f"{option}: {str(exc).splitlines()[0]}"
    if lab_preset:
        return (f"{option} {stand_in}: a lab preset; a stand-in runs over loopback (e.g. local-2x2), and lab presets "
                f"are named where the script takes its domains")
    return None


@contextlib.contextmanager
def measured_on(preset: str, stand_in: str | None = None, option: str = "--cluster"):
    """Where a script measures ``preset``'s figures: the lab up with it (:func:`lab`, root
    needed), or, with ``stand_in``, that non-lab cluster preset over loopback (no root, no shaped
    links: it checks the code path, its figures say nothing about the lab's). ``option``: the
    script's option that names the stand-in, for the refusal of one that cannot
    (:func:`stand_in_error`). Yields (cluster spec, node network or None)."""
    if stand_in is None:
        with lab(preset) as got:
            yield got
        return
    from synctune.spec import resolve_cluster
    from synctune.spec.errors import SpecError

    why = stand_in_error(stand_in, option)
    if why is not None:
        raise SpecError(why)
    yield resolve_cluster(stand_in), None


def time_ratio(times_s: list[float], reference_s: list[float]):
    """The time of one arm relative to another's (above 1: slower), paired by round, with its 95%
    interval (:func:`synctune.stats.paired_ratio`, whose "speed-up of candidate over baseline"
    is this time ratio when the arm is the baseline)."""
    from synctune.stats import paired_ratio

    return paired_ratio(times_s, reference_s)


@dataclass(frozen=True)
class ArmTimes:
    """Every arm's per-round median iteration time (s, slowest rank) from one interleaved
    re-measurement on one set of processes, and ``best``: the arm with the smallest geometric
    mean over the rounds (so that every other arm's paired time ratio to it is at least 1)."""

    times_s: list[list[float]]
    best: int

    def mean_ms(self, arm: int) -> float:
        """The arm's geometric mean over the rounds of its per-round median, in ms (the ratio of
        two arms' means is their paired time ratio's point estimate)."""
        return statistics.geometric_mean(self.times_s[arm]) * 1e3

    def relative(self, arm: int, reference: int | None = None):
        """``arm``'s time relative to ``reference``'s (default: the best arm), paired by round,
        with its 95% interval (:func:`time_ratio`)."""
        return time_ratio(self.times_s[arm], self.times_s[self.best if reference is None else reference])

    def cell(self, arm: int) -> str:
        """``ms, time relative to the best [95%]`` for a table (:meth:`mean_ms`); the best arm says
        so, and a ratio whose interval contains 1 says "no difference"."""
        if arm == self.best:
            return f"{self.mean_ms(arm):.1f}, 1 (best)"
        return f"{self.mean_ms(arm):.1f}, {describe_ratio(self.relative(arm))}"


def describe_ratio(r) -> str:
    """``ratio [low, high]``, followed by ``(no difference)`` when the interval contains 1."""
    return f"{r.ratio:.2f} [{r.low:.2f}, {r.high:.2f}]" + (" (no difference)" if r.low <= 1 <= r.high else "")


def interleaved_arms(strategies: list, cluster, *, workload, node_net=None, rounds: int = 10, per_round: int = 5,
                     warmup: int = 3, optimizer: str = "sgd") -> ArmTimes:
    """Measure ``strategies`` (same replicas) as arms of one interleaved re-measurement on one
    set of local worker processes: every arm built and warmed up once, then ``rounds`` rounds in
    each of which every arm runs ``per_round`` iterations, the order rotating between rounds, so
    a drift of the machine weighs on every arm alike (the screening of
    :func:`synctune.engine.trial.run_confirm_local`). An arm is a strategy (run by the engine) or
    a ``(strategy, runtime)`` pair; ``optimizer``: what each arm's iterations step (``sgd``,
    ``adam``). Raises :class:`~synctune.engine.local.WorkerFailure` if a
    worker fails."""
    from synctune.engine.trial import TrialConfig, run_confirm_local

    if len(strategies) < 2:
        raise ValueError(f"interleaved_arms compares at least 2 arms, got {len(strategies)}")
    if rounds < 2:
        raise ValueError(f"interleaved_arms needs at least 2 rounds for an interval, got {rounds}")
    arms = [s if isinstance(s, tuple) else (s, None) for s in strategies]
    config = TrialConfig(warmup=warmup, iters=per_round, optimizer=optimizer)
    if len(arms) == 2:
        # Two arms: no screening, the confirmation's own rounds (A B, B A, ...) are the rounds.
        out = run_confirm_local(arms, cluster, config, workload=workload, rounds=rounds, per_round=per_round,
                                node_net=node_net)
        times = [out["a_s"], out["b_s"]]
    else:
        # The screening times every arm each round; the two rounds of its picks that follow are
        # the confirmation's minimum and are not used here.
        out = run_confirm_local(arms, cluster, config, workload=workload, rounds=2, per_round=per_round,
                                screen_rounds=rounds, candidates=len(arms) - 1, node_net=node_net)
        times = out["screen_s"]
    if len(times) != len(strategies) or any(len(t) != rounds for t in times):
        raise RuntimeError(f"interleaved_arms: expected {rounds} rounds of {len(strategies)} arms, got "
                           f"{[len(t) for t in times]}")
    best = min(range(len(times)), key=lambda i: sum(math.log(t) for t in times[i]))
    return ArmTimes(times_s=[list(t) for t in times], best=best)


def load_benchmark(name: str):
    """A module of benchmarks/ (a folder of scripts, not a package), imported by name so that
    worker processes (spawned: they re-import by name, with this sys.path) find it too."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (what the dataset collection notes and the findings paste)."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
