"""Running a search: AutoDist Algorithm 1 driven through Ray Tune, one Tune trial per strategy.

The Tune searcher wraps :class:`synctune.search.Algorithm1` (ask/tell by trial id). Each Tune
trial hands its strategy to a named "slice" actor that owns a :class:`RayWorkerGroup` for
the experiment's cluster, so the process group is started once per slice for the whole
search, not once per trial. ``slices`` (an experiment key) slices run trials concurrently,
each on its own nodes; the searcher gives each new trial a free slice. Results come back to
the driver, which records each one (an MLflow child run of the search's parent run, and a
dataset row) *before* telling the searcher.

The driver side (Tune's trial actors and the slice actors) asks only for a sliver of the
head node's own resource, so it never takes CPUs or GPUs a worker slice needs; the slices'
placement groups are the only demand the autoscaler sees. Slices are released when the
search ends, however it ends.

The dataset is the search's memory: ``resume`` rebuilds the searcher from the rows of this
search id, in the order they were recorded, so an interrupted search continues exactly as it
would have, without re-running finished trials, and ends with exactly ``budget`` rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from ..cluster.workers import HEAD_RESOURCE
from ..data.paths import data_home, dataset_dir
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.trial import TrialConfig
from ..search.algorithm import Algorithm1
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.files import check_name, path_under
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .recording import record_result

__all__ = ["run_search", "search_id_of", "make_search_simulator"]


# Tune pickles its searcher (it checkpoints the experiment); callers' callbacks need not be
# picklable, so the searcher finds them here by search id instead of holding them.
_CALLBACKS: dict[str, Callable[[dict, dict], None]] = {}


def _notify(search_id: str, outcome: dict, summary: dict) -> None:
    # Module-level, so pickling the searcher pickles a reference to it, not _CALLBACKS.
    callback = _CALLBACKS.get(search_id)
    if callback:
        callback(outcome, summary)


def search_id_of(exp: Experiment) -> str:
    """The stable id of an experiment's search (what ``--resume`` finds again); it names files."""
    return check_name(f"{exp.name}-seed{exp.seed}", f"{exp.source or 'experiment'}: search id")


class _Slice:
    """Actor body holding one worker group (wrapped with ray.remote lazily)."""

    def __init__(self, cluster: dict, startup_timeout_s: float, node_net: dict | None, workload) -> None:
        from ..cluster.workers import RayWorkerGroup

        self.workload = workload
        self.group = RayWorkerGroup(ClusterSpec.from_dict(cluster), startup_timeout_s=startup_timeout_s,
                                    node_net=node_net)

    def run(self, strategy: dict, config: dict) -> dict:
        from ..cluster.workers import SlicePending
        from ..engine.trial import failed_result

        plan, trial_config = Strategy.from_dict(strategy), TrialConfig(**config)
        try:
            return self.group.run_trial(plan, trial_config, workload=self.workload).to_dict()
        except SlicePending as exc:  # the nodes never came: this trial fails, the search goes on
            return failed_result("failed", str(exc), plan, self.group.cluster, trial_config, "ray",
                                 trial_config.timeout_s).to_dict()

    def where(self) -> str:
        """The Ray node this slice actor runs on (the head: it takes no worker resources)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        self.group.shutdown()


def _trainable(config: dict) -> None:
    import ray
    from ray import tune

    holder = ray.get_actor(config["slice"])
    result = ray.get(holder.run.remote(config["strategy"], config["trial_config"]))
    tune.report({"mean_s": result["mean_s"] if result["status"] == "ok" else float("nan"),
                 "result_json": json.dumps(result)})


def make_search_simulator(exp: Experiment, model: ModelSpec, cluster: ClusterSpec):
    """The simulator an experiment asks for, bound to its domain (None for the random variants)."""
    from ..simulator import AnalyticSimulator, BoundSimulator, load_simulator, make_simulator

    if exp.algorithm in ("random", "random-guided"):
        return None
    if exp.simulator == "analytic":
        return BoundSimulator(AnalyticSimulator(), model, cluster)
    if exp.simulator in ("rnn", "linear", "gat"):
        def make():
            return make_simulator(exp.simulator, epochs=60, seed=exp.seed)

        # Until it has learned from this search's trials, the untrained ranker cannot score:
        # the analytic model stands in (AutoDist starts training-free).
        return _LearnedFromScratch(BoundSimulator(AnalyticSimulator(), model, cluster),
                                   BoundSimulator(make(), model, cluster, make=make))
    return BoundSimulator(load_simulator(exp.simulator), model, cluster, transfer=True)


class _LearnedFromScratch:
    """Scores with the analytic model until the learned one has been fitted once."""

    def __init__(self, analytic, learned) -> None:
        self.analytic, self.learned, self.fitted = analytic, learned, False

    def score(self, strategies):
        return (self.learned if self.fitted else self.analytic).score(strategies)

    def fit(self, strategies, runtimes) -> None:
        self.learned.fit(strategies, runtimes)
        self.fitted = True


def run_search(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, *, workload, resume: bool = False,
               tracking_uri: str | None = None, on_trial: Callable[[dict, dict], None] | None = None,
               node_net: dict | None = None) -> dict:
    """Run (or resume) the search of ``exp`` for ``workload``; returns the summary. Ray must be
    initialized. ``node_net`` (a lab's network) runs each node's workers in that node's namespace."""
    import ray
    from ray import tune
    from ray.tune.search import Searcher

    search_id = search_id_of(exp)
    if node_net and exp.slices > 1:
        raise SpecError(f"{exp.source or exp.name}: slices: a lab has one set of links, so its trials run one at a "
                        f"time (slices: 1), got {exp.slices}")
    ds = TrialDataset(dataset_dir())
    done = ds.records(model=model.name, cluster=cluster.name, search_id=search_id)
    if done and not resume:
        raise SpecError(f"search {search_id!r} already has {len(done)} recorded trial(s) in {ds.root}; "
                        f"pass --resume to continue it, or change the experiment's name or seed")
    # Hashes are recomputed from the strategies (a row of an older strategy schema stores the
    # hash of its old form): the search must recognise a strategy it measured in any schema.
    state = {"trials": [{"trial_id": r.trial_id, "strategy": json.loads(r.strategy_json),
                         "origin": r.origin, "predicted": r.predicted_time_s,
                         "runtime": r.mean_s if r.status == "ok" else None}
                        for r in sorted(done, key=lambda r: (r.created_at, r.record_id))]}
    algo = Algorithm1.from_state(state, model, cluster, exp, make_search_simulator(exp, model, cluster))
    logger = MlflowLogger(exp.name, tracking_uri)
    parent = logger.start_search(search_id, {"experiment": exp.source or exp.name, "model": model.name,
                                             "cluster": cluster.name, "algorithm": exp.algorithm,
                                             "simulator": exp.simulator, "budget": exp.budget, "seed": exp.seed,
                                             "workload": workload.source})
    trial_config = asdict(TrialConfig(warmup=exp.warmup, iters=exp.iters, seed=exp.seed, timeout_s=exp.timeout_s))
    on_head = {HEAD_RESOURCE: 0.001}
    slice_names = [f"synctune-slice-{search_id}-{i}" for i in range(exp.slices)]
    holders = [ray.remote(_Slice).options(name=name, num_cpus=0, resources=on_head).remote(
        cluster.to_dict(), exp.timeout_s, dict(node_net) if node_net else None, workload) for name in slice_names]
    free_slices = list(slice_names)
    proposals: dict[str, Any] = {}

    def record(proposal, result: dict) -> None:
        best_base = algo.summary()["best_baseline_s"]
        mean = result.get("mean_s") if result.get("status") == "ok" else None
        # The dataset row lands before the searcher learns of the trial: --resume relies on it.
        record_result(result, proposal.strategy, model, cluster, dataset=ds, logger=logger, origin=proposal.origin,
                      search_id=search_id, trial_id=proposal.trial_id, predicted_time_s=proposal.predicted,
                      experiment=exp.name, parent_run_id=parent, workload_source=workload.source,
                      speedup_over_best_baseline=best_base / mean if (best_base and mean) else None)

    class _Searcher(Searcher):
        """Ask/tell by Tune trial id; its state is Algorithm 1's plain-JSON state."""

        def __init__(self):
            super().__init__(metric="mean_s", mode="min")

        def save(self, checkpoint_path: str) -> None:
            Path(checkpoint_path).write_text(json.dumps(algo.state()))

        def restore(self, checkpoint_path: str) -> None:
            nonlocal algo
            algo = Algorithm1.from_state(json.loads(Path(checkpoint_path).read_text()), model, cluster, exp,
                                         make_search_simulator(exp, model, cluster))

        def suggest(self, trial_id: str):
            if algo.finished:
                return Searcher.FINISHED
            proposal = algo.ask() if free_slices else None
            if proposal is None:
                # Nothing new to try (every proposal measured already) ends the search; otherwise
                # Tune asks again once a running trial completes.
                return Searcher.FINISHED if algo.finished and not proposals else None
            proposals[trial_id] = (proposal, free_slices.pop(0))
            return {"slice": proposals[trial_id][1], "strategy": proposal.strategy.to_dict(),
                    "trial_config": trial_config}

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            proposal, slice_name = proposals.pop(trial_id)
            free_slices.append(slice_name)
            if result and "result_json" in result:
                outcome = json.loads(result["result_json"])
            else:
                outcome = {"status": "failed", "error": "the Tune trial raised before reporting", "launcher": "ray"}
            record(proposal, outcome)
            algo.tell(proposal.trial_id, outcome.get("mean_s") if outcome["status"] == "ok" else None)
            _notify(search_id, outcome, algo.summary())

    remaining = exp.budget - len(algo.trials)
    start = time.monotonic()
    if on_trial:
        _CALLBACKS[search_id] = on_trial
    try:
        if remaining > 0 and not algo.finished:
            tuner = tune.Tuner(
                # The trainable only forwards to a slice actor: no CPU, a sliver of the head.
                tune.with_resources(_trainable, {"CPU": 0, **on_head}),
                tune_config=tune.TuneConfig(search_alg=_Searcher(), num_samples=remaining,
                                            max_concurrent_trials=exp.slices),
                run_config=tune.RunConfig(name=search_id, storage_path=str(path_under(data_home(), "tune")),
                                          verbose=0),
            )
            tuner.fit()
    finally:
        _CALLBACKS.pop(search_id, None)
        _release(holders)
    summary = algo.summary()
    summary.update({"search_id": search_id, "wall_s": time.monotonic() - start, "mlflow_parent_run": parent})
    logger.log_metrics(parent, {k.replace(".", "_"): summary.get(k) for k in (
        "speedup_over_best_baseline", "hit_rate", "best_runtime_s", "best_baseline_s", "trials", "failed",
        "trials_to_1.1x", "trials_to_1.2x")}, final_status="FINISHED")
    if summary["best_strategy"]:
        logger.log_text(parent, json.dumps(summary["best_strategy"], indent=1, sort_keys=True), "best_strategy.json")
    return summary


def _release(holders: list) -> None:
    """Tear down every slice (actors and placement groups), even if one of them hangs."""
    import ray

    refs = [h.shutdown.remote() for h in holders]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=60)
    finally:
        for h in holders:
            ray.kill(h)
