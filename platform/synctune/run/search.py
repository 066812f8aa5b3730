"""Running a search: AutoDist Algorithm 1 driven through Ray Tune, one Tune trial per strategy.

A search is a :class:`SearchSession` (the domain, the workload, the dataset, the MLflow logger,
the slices, the search algorithm and its simulator, the baselines' ledger) and one function
per phase, run in order on the same slices:

1. :func:`tune_runtime`: tuned torch DDP (Optuna's TPE through Ray Tune);
2. :func:`measure_runtime_baselines`: the experiment's real Horovod baselines;
3. :func:`run_algorithm`: the search algorithm (builder baselines first), ``search.budget`` trials;
4. :func:`confirm_best`: the best searched strategies screened and confirmed against the best
   baseline, interleaved on the same processes;
5. :func:`summarize` and :func:`finish`: the :class:`~synctune.run.summary.SearchSummary`, its
   MLflow metrics, the dataset partition compacted.

Each Tune trial hands its strategy to a named slice actor (:mod:`synctune.run.slices`) that
owns a worker group for the experiment's cluster; ``run.slices`` (an experiment key) slices run
trials concurrently. Results come back to the driver, which records each one (an MLflow child
run of the search's parent run, and a dataset row) *before* telling the search algorithm.

The driver side (Tune's trial actors and the slice actors) asks only for a sliver of the head
node's own resource, so it never takes CPUs or GPUs a worker slice needs; the slices'
placement groups are the only demand the autoscaler sees. Slices are released when the search
ends, however it ends.

The dataset is the search's memory: ``resume`` rebuilds the search algorithm from the rows of
this search id, in the order they were recorded, so an interrupted search continues exactly as
it would have, without re-running finished trials, and ends with exactly ``search.budget`` rows.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Callable

from ..cluster.workers import HEAD_RESOURCE
from ..data.paths import data_home, dataset_dir
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.composed import ENGINE
from ..engine.measure import TrialConfig, TrialResult
from ..engine.runtime import Runtime
from ..engine.fsdp import FSDPConfig
from ..engine.runtimes import executor_for, runtime_class, runtime_from_record, strategy_runtime_class
from ..search.algorithm import StrategySearch
from ..search.experiment import Experiment
from ..simulator.bound import RuntimeResidual
from ..simulator.memory import GIB, MemoryBudget, runs_on_fsdp
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.files import check_name, path_under
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy
from ..strategy.schema import Strategy
from .baselines import TUNERS, BaselineLedger, BaselineTrial, RuntimeTuner, horovod_baselines
from .confirm import confirmation_arms, confirmation_result, is_builder_trial, trial_mean_s
from .profiles import ensure_profile
from .recording import record_result
from .simulators import SelectedSimulator, make_search_simulator
from .summary import SearchSummary, recommend

__all__ = ["run_search", "search_id_of", "SearchSession", "make_search_simulator", "SelectedSimulator",
           "ensure_profile", "horovod_baselines", "tensorflow_projection"]


def search_id_of(exp: Experiment) -> str:
    """The stable id of an experiment's search (what ``--resume`` finds again); it names files."""
    return check_name(f"{exp.name}-seed{exp.seed}", f"{exp.source or 'experiment'}: search id")


def tensorflow_projection(model: ModelSpec) -> Callable[[Strategy], Strategy]:
    """What a search over a Keras model proposes: each sampled strategy projected into what
    TensorFlow's MultiWorkerMirroredStrategy executes (:func:`synctune.engine.tensorflow.project_to_tensorflow`)."""
    from ..engine.tensorflow import project_to_tensorflow

    return lambda strategy: project_to_tensorflow(strategy, model)


def is_search_row(record: Any) -> bool:
    """Whether a row is one of the search algorithm's own trials (its strategy run by the engine,
    TensorFlow, or FSDP2 from the strategy's shard plans), not a baseline runtime's nor a
    confirmation."""
    if record.trial_id.startswith("confirm-"):
        return False
    if runtime_class(record.runtime).runs_strategy:
        return True
    return record.runtime == "fsdp" and json.loads(record.runtime_json or "{}").get("from_strategy") is True


def _search_state(records: list) -> dict[str, Any]:
    """The search algorithm's state from its rows: its own trials (:func:`is_search_row`), in
    the order recorded, each with the memory it measured. Hashes are recomputed from the
    strategies (a row of an older strategy schema stores the hash of its old form)."""
    return {"trials": [{"trial_id": r.trial_id, "strategy": json.loads(r.strategy_json), "origin": r.origin,
                        "predicted": r.predicted_time_s, "mean_s": r.mean_s if r.status == "ok" else None,
                        **({"memory": r.memory_breakdown} if r.memory_breakdown else {})}
                       for r in records if is_search_row(r)]}


def memory_budget(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any) -> MemoryBudget:
    """The search's memory budget (DESIGN.md "memory budget"), its activation figures measured in
    this process at the batch sizes a rank trains with (the model's, and half of it, for a line
    through the uneven splits); a model that cannot be built here (a Keras one) starts with none."""
    budget = MemoryBudget(model, cluster, gib=exp.search.memory_gib, headroom=exp.search.memory_headroom,
                          optimizer=exp.trial.optimizer)
    if getattr(workload, "framework", "torch") == "torch":
        from ..engine.memory import single_process_activations

        for batch, figure in single_process_activations(
                workload, {model.batch_size, max(1, model.batch_size // 2)}, optimizer=exp.trial.optimizer,
                seed=exp.seed).items():
            budget.probe.add(batch, figure)
    return budget


def proposal_runtime_name(strategy: Strategy) -> str:
    """The name of the runtime a searched strategy runs on (:func:`executor_for`): ``fsdp``
    where its units reshard, else ``engine``."""
    return executor_for(strategy).name


class SearchFilter:
    """What the search algorithm may propose in this session (its
    :class:`~synctune.search.interface.MemoryCheck`): strategies the memory budget fits that a
    runtime can run. A strategy whose units reshard runs on FSDP2, which needs every plan
    ``shard``, one shard group and units at module boundaries; the samplers' moves can make one
    that validates and that neither runtime runs (a resharded unit beside an all-reduce), and it
    is never proposed. Checked on the session's module (:meth:`SearchSession.module`)."""

    def __init__(self, budget: MemoryBudget, module: Callable[[], Any], model: ModelSpec, workload: Any) -> None:
        self.budget, self.module, self.model, self.workload = budget, module, model, workload

    def _fsdp_runs(self, strategy: Strategy) -> bool:
        from ..engine.fsdp import plans_refusal

        return plans_refusal(strategy, self.budget.cluster, self.module(), self.model, self.workload) is None

    def fits(self, strategy: Strategy) -> bool:
        if runs_on_fsdp(strategy) and not self._fsdp_runs(strategy):
            return False
        return self.budget.fits(strategy)

    def fit(self, strategies: list, breakdowns: list) -> None:
        self.budget.fit(strategies, breakdowns)

    def state(self) -> dict:
        return self.budget.state()

    def restore(self, state: dict) -> None:
        self.budget.restore(state)


def check_budget(budget: MemoryBudget, where: str) -> None:
    """Refuse, before any trial, a budget that nothing fits: one line with the smallest predicted
    peak (of the most frugal strategies the builders make) and the fix."""
    peak, name, fits = budget.smallest()
    limits = [x for x in budget.limits(build_strategy("allreduce", budget.model, budget.cluster)) if x is not None]
    if limits and not fits:
        raise SpecError(f"{where}: search.memory_gib: nothing fits {budget.describe()} ({min(limits) / GIB:.3f} GiB "
                        f"per rank): the smallest predicted peak is {peak / GIB:.3f} GiB per rank ({name}); raise "
                        f"search.memory_gib, lower search.memory_headroom, or train a smaller batch")


def prepare_memory(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any) -> tuple[MemoryBudget, float]:
    """The search's memory budget (:func:`memory_budget`) and its share of sharded proposals
    (:func:`shard_rate`), refusing before any trial a budget nothing fits and a search that
    would score shard units with a simulator that never saw any."""
    where = exp.source or exp.name
    budget = memory_budget(exp, model, cluster, workload)
    check_budget(budget, where)
    skeleton = build_strategy("allreduce", model, cluster)
    rate = shard_rate(exp, budget, skeleton)
    if exp.search.shard is False and not budget.fits(skeleton):
        raise SpecError(f"{where}: search.shard: false, but replicated training does not fit the memory budget "
                        f"(predicted {max(budget.peaks(skeleton)) / GIB:.3f} GiB per rank; {budget.describe()}); "
                        f"set search.shard: auto, or raise search.memory_gib")
    if rate and exp.search.uses_simulator and exp.search.simulator == "pretrained" and not _pretrained_scores_shard():
        why = "; replicated training does not fit the budget" if not budget.fits(skeleton) else ""
        raise SpecError(f"{where}: search.simulator: the shipped pretrained simulator was trained before the shard "
                        f"synchronizer, and this search proposes shard units (search.shard: "
                        f"{str(exp.search.shard).lower()}{why}); use simulator: replay (or analytic, or rnn)")
    return budget, rate


def _pretrained_scores_shard() -> bool:
    """Whether the shipped simulator was trained with the shard synchronizer among its inputs (the
    one trained on release v0.3 was; an installation's older file would refuse shard units only
    when scoring them, mid-search)."""
    from ..simulator import load_simulator

    return "shard" in (load_simulator("pretrained").config.get("synchronizers") or [])


def shard_rate(exp: Experiment, budget: MemoryBudget, skeleton: Strategy) -> float:
    """The share of sampled strategies that shard units: every one where replicated training does
    not fit (``search.shard: auto``; the others would not fit either), half with ``shard: true``,
    none with ``false`` or where replicated training fits under ``auto``."""
    if exp.search.shard is False:
        return 0.0
    if not budget.fits(skeleton):
        return 1.0
    return 0.5 if exp.search.shard is True else 0.0


class SearchSession:
    """One search's state while it runs: what it searches (``exp``, ``model``, ``cluster``,
    ``workload``), where it records (``dataset``, ``logger`` and the parent run), where its trials
    run (the slice actors), the search algorithm (``algo``) and the baselines' ``ledger``."""

    def __init__(self, exp: Experiment, model: ModelSpec, cluster: ClusterSpec, *, workload, resume: bool,
                 tracking_uri: str | None, node_net: dict | None, on_trial, say: Callable[[str], None],
                 memory: tuple[MemoryBudget, float] | None = None) -> None:
        self.exp, self.model, self.cluster, self.workload = exp, model, cluster, workload
        self.search_id, self.node_net, self.on_trial, self.say = search_id_of(exp), node_net, on_trial, say
        if node_net and exp.run.slices > 1:
            slices = exp.run.key("slices")
            raise SpecError(f"{exp.source or exp.name}: {slices}: a lab has one set of links, so its trials run one "
                            f"at a time ({slices}: 1), got {exp.run.slices}")
        self.dataset = TrialDataset(dataset_dir())
        done = self.dataset.records(model=model.name, cluster=cluster.name, search_id=self.search_id)
        if done and not resume:
            raise SpecError(f"search {self.search_id!r} already has {len(done)} recorded trial(s) in "
                            f"{self.dataset.root}; pass --resume to continue it, or change the experiment's name or "
                            f"seed")
        self.done = sorted(done, key=lambda r: (r.created_at, r.record_id))
        self.ledger = BaselineLedger([BaselineTrial.from_record(r) for r in self.done
                                      if not is_search_row(r) and not r.trial_id.startswith("confirm-")])
        self.horovod_entries = horovod_baselines(exp, model, cluster, workload)
        self.framework = getattr(workload, "framework", "torch")
        self.strategy_runtime = strategy_runtime_class(self.framework)
        self.project = tensorflow_projection(model) if self.framework == "tensorflow" else None
        self.skeleton = build_strategy("allreduce", model, cluster)  # the runtimes' replicas and (even) batch split
        self.memory, self.shard_prob = memory or prepare_memory(exp, model, cluster, workload)
        self._module: Any = None
        if exp.search.uses_simulator and exp.search.simulator != "analytic" and self.framework == "torch":
            ensure_profile(workload, model, cluster, say)
        self.algo = self.new_algorithm(_search_state(self.done))
        self.trial_config = TrialConfig(warmup=exp.trial.warmup, iters=exp.trial.iters, seed=exp.seed,
                                        timeout_s=exp.trial.timeout_s, optimizer=exp.trial.optimizer,
                                        target_ci=exp.trial.target_ci, max_iters=exp.trial.max_iters,
                                        max_timed_s=exp.trial.max_timed_s)
        #: Per (strategy hash, runtime settings), each rank's measured peak of the last trial that
        #: measured one (the summary's memory per rank, measured beside predicted).
        self.measured_peaks: dict[tuple[str, str], list[int | None]] = {}
        for r in self.done:
            breakdown = r.memory_breakdown
            if breakdown:
                self.measured_peaks[(Strategy.from_json(r.strategy_json).hash,
                                     runtime_from_record(r.runtime, r.runtime_json).config_json())] = [
                    m.get("peak_bytes") for m in breakdown]
        self.holders: list = []
        self.slice_names = [f"synctune-slice-{self.search_id}-{i}" for i in range(exp.run.slices)]
        self.started = time.monotonic()
        self.logger = MlflowLogger(exp.name, tracking_uri)
        self.parent = self.logger.start_search(self.search_id, {
            "experiment": exp.source or exp.name, "model": model.name, "cluster": cluster.name,
            "algorithm": exp.search.algorithm, "simulator": exp.search.simulator, "budget": exp.search.budget,
            "seed": exp.seed, "workload": workload.source, "ddp_trials": exp.baselines.ddp_trials,
            "confirm_rounds": exp.confirm.rounds})

    def new_algorithm(self, state: dict) -> StrategySearch:
        """The search algorithm rebuilt from ``state`` (plain JSON), with a fresh simulator."""
        simulator = make_search_simulator(self.exp, self.model, self.cluster)
        if (self.shard_prob and simulator is not None and simulator.predicts_seconds
                and not hasattr(simulator, "training_free")):
            # Proposals run on two runtimes (the engine, FSDP2 where units reshard): the replay's
            # seconds are scaled per runtime by what the trials measured.
            simulator = RuntimeResidual(simulator, proposal_runtime_name)
        return StrategySearch.from_state(state, self.model, self.cluster, self.exp, simulator, self.project,
                                         memory=SearchFilter(self.memory, self.module, self.model, self.workload),
                                         shard_prob=self.shard_prob)

    def module(self) -> Any:
        """The workload's model on the meta device (built for real where an op has no meta
        kernel), built once: what FSDP2's units are worked out on, for the memory model and the
        proposal filter."""
        if self._module is None:
            from ..engine.fsdp import meta_model

            self._module = meta_model(self.workload)
            if self._module is None:
                self._module = self.workload.build_model()
        return self._module

    def proposal_runtime(self, strategy: Strategy) -> Runtime:
        """The runtime that runs a searched strategy (:func:`executor_for`): the engine
        (TensorFlow for a Keras model); FSDP2 for one whose shard units reshard after forward,
        which the engine does not execute."""
        return executor_for(strategy, self.model, self.framework)

    def memory_limits(self, strategy: Strategy) -> list[int | None]:
        """Each rank's memory budget in bytes under ``strategy`` (what a trial's measured peak is
        judged against: over it, the trial is ``oom``)."""
        return self.memory.limits(strategy)

    def start_slices(self) -> None:
        """One named slice actor per slice, on a sliver of the head node."""
        import ray

        from .slices import SliceActor

        self.holders = [ray.remote(SliceActor).options(name=name, num_cpus=0, resources={HEAD_RESOURCE: 0.001})
                        .remote(self.cluster.to_dict(), self.exp.trial.timeout_s,
                                dict(self.node_net) if self.node_net else None, self.workload)
                        for name in self.slice_names]

    def record(self, trial_id: str, strategy: Strategy, origin: str, result: TrialResult, *,
               runtime: Runtime | None = None, predicted: float | None = None) -> None:
        """Record one trial (MLflow, then its dataset row) before anyone is told of it."""
        best_base = self.summary().best_baseline_s
        mean = result.measured_s
        peaks = ((result.extra or {}).get("memory") or {}).get("peak_bytes")
        if peaks:
            self.measured_peaks[(strategy.hash, (runtime or ENGINE).config_json())] = list(peaks)
        record_result(result, strategy, self.model, self.cluster, dataset=self.dataset, logger=self.logger,
                      origin=origin, runtime=runtime, search_id=self.search_id, trial_id=trial_id,
                      predicted_time_s=predicted, experiment=self.exp.name, parent_run_id=self.parent,
                      workload_source=self.workload.source,
                      speedup_over_best_baseline=best_base / mean if (best_base and mean) else None)

    def notify(self, result: TrialResult) -> None:
        """Tell the caller's ``on_trial`` of a finished trial, with the summary so far."""
        if self.on_trial:
            self.on_trial(result, self.summary())

    def summary(self, confirmation: dict | None = None) -> SearchSummary:
        """The search's figures now (the confirmation's, when given)."""
        stats = self.algo.summary(other_baselines=self.ledger.best_times_s())
        builders = [t for t in self.algo.trials if is_builder_trial(t) and trial_mean_s(t) is not None]
        builder = min(builders, key=trial_mean_s) if builders else None
        sim = self.algo.simulator
        return SearchSummary(
            search_id=self.search_id, trials=stats["trials"], failed=stats["failed"],
            best_mean_s=stats["best_mean_s"], best_origin=stats["best_origin"],
            best_strategy=stats["best_strategy"], best_baseline_s=stats["best_baseline_s"],
            speedup_over_best_baseline=stats["speedup_over_best_baseline"], hit_rate=stats["hit_rate"],
            trials_to_1_1x=stats["trials_to_1.1x"], trials_to_1_2x=stats["trials_to_1.2x"],
            best_builder_baseline_s=trial_mean_s(builder) if builder else None,
            best_baseline_strategy=builder["strategy"] if builder else None,
            best_baseline_origin=builder["origin"] if builder else None, baselines=tuple(self.ledger.trials),
            wall_s=time.monotonic() - self.started, mlflow_parent_run=self.parent, confirmed=confirmation,
            simulator_selection=tuple(getattr(sim, "history", [])),
            training_free_simulator=getattr(getattr(sim, "training_free", sim), "kind", None))


def _tune_storage() -> str:
    return str(path_under(data_home(), "tune"))


def tune_runtime(session: SearchSession, tuner: RuntimeTuner, budget: int, **context: Any) -> None:
    """Phase 1: tune a runtime's settings (``budget`` trials in all, a resumed search's included)
    with Optuna's TPE through Ray Tune, on the first slice; each trial recorded as it completes,
    judged against the memory budget. ``context`` goes to the tuner's searcher (``fits``: which
    of its configurations the memory model says fit)."""
    from ray import tune

    from .searcher import RecordTunedTrials
    from .slices import trainable

    s = session
    remaining = budget - len(s.ledger.of(tuner.runtime))
    if remaining <= 0:
        return
    if s.framework not in runtime_class(tuner.runtime).frameworks:
        s.say(f"tuned {tuner.title} skipped: {s.workload.name} is a Keras model ({tuner.runtime}_trials: {budget} "
              f"ignored)")
        return
    s.say(f"tuning {tuner.title}: {remaining} trial(s), {tuner.knobs} by Optuna (TPE) through Ray Tune")
    known = [(t.params, t.mean_s) for t in s.ledger.of(tuner.runtime) if t.params and t.mean_s is not None]
    tune.Tuner(
        # The trainable only forwards to a slice actor: no CPU, a sliver of the head.
        tune.with_resources(trainable, {"CPU": 0, HEAD_RESOURCE: 0.001}),
        param_space={"slice": s.slice_names[0], "strategy": s.skeleton.to_dict(), "tuned": tuner.runtime,
                     "trial_config": asdict(s.trial_config), "memory_limits": s.memory_limits(s.skeleton)},
        tune_config=tune.TuneConfig(search_alg=tuner.searcher(s.exp, s.model, s.cluster, known, **context),
                                    num_samples=remaining, max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name=f"{s.search_id}-{tuner.runtime}", storage_path=_tune_storage(), verbose=0,
                                  callbacks=[RecordTunedTrials(s, tuner.runtime)]),
    ).fit()


def tune_ddp(session: SearchSession) -> None:
    """Phase 1a: tuned torch DDP, where replicated training fits the memory budget."""
    s = session
    if s.exp.baselines.ddp_trials and not s.memory.fits(s.skeleton):
        s.say(f"tuned torch DDP skipped: replicated training does not fit the memory budget (predicted "
              f"{max(s.memory.peaks(s.skeleton)) / GIB:.3f} GiB per rank; {s.memory.describe()})")
        return
    tune_runtime(s, TUNERS["ddp"], s.exp.baselines.ddp_trials)


def fsdp_trials(session: SearchSession) -> int:
    """The tuned-FSDP2 trials this search runs: ``baselines.fsdp_trials``, where ``auto`` is 8
    when the search proposes shard units and 0 otherwise."""
    wanted = session.exp.baselines.fsdp_trials
    return (8 if session.shard_prob else 0) if wanted == "auto" else int(wanted)


def fsdp_fits(session: SearchSession) -> Callable[[FSDPConfig], bool]:
    """Whether the memory model says an FSDP2 configuration fits: predicted on the all-shard
    strategy FSDP2 runs under it (:func:`~synctune.engine.fsdp.strategy_of_config`), on the
    session's module (:meth:`SearchSession.module`)."""
    from ..engine.fsdp import strategy_of_config

    def fits(config: FSDPConfig) -> bool:
        return session.memory.fits(strategy_of_config(session.module(), config, session.skeleton, session.model),
                                   runtime="fsdp")

    return fits


def tune_fsdp(session: SearchSession) -> None:
    """Phase 1b: FSDP2 with its defaults and tuned (mesh, units, reshard, prefetch, reduce dtype),
    Optuna's TPE through Ray Tune, over the configurations the memory model says fit."""
    from .baselines import fsdp_layouts

    s = session
    budget = fsdp_trials(s)
    if not budget:
        return
    if s.framework != "torch" or any(v.sparse for v in s.model.variables):
        s.say(f"tuned torch FSDP2 skipped: FSDP2 runs dense torch models only ({s.model.name})")
        return
    fits = fsdp_fits(s)
    if not fsdp_layouts(s.model, s.cluster, fits):
        s.say(f"tuned torch FSDP2 skipped: no FSDP2 configuration fits the memory budget ({s.memory.describe()})")
        return
    tune_runtime(s, TUNERS["fsdp"], budget, fits=fits)


def measure_runtime_baselines(session: SearchSession) -> None:
    """Phase 2: each real-Horovod baseline of the experiment not measured yet, one trial each."""
    import ray

    s = session
    measured = {t.origin for t in s.ledger.of("horovod")}
    if s.horovod_entries and not s.memory.fits(s.skeleton):
        s.say("real Horovod baselines skipped: replicated training does not fit the memory budget")
        return
    for entry, runtime in s.horovod_entries:
        if entry in measured:
            continue
        s.say(f"real Horovod baseline {entry}: {runtime.summary()}")
        outcome = TrialResult.from_dict(ray.get(s.holders[0].run.remote(
            s.skeleton.to_dict(), asdict(s.trial_config), runtime.to_dict())))
        trial_id = f"hvd-{len(s.ledger.of('horovod'))}"
        s.record(trial_id, s.skeleton, entry, outcome, runtime=runtime)
        s.ledger.add(BaselineTrial(trial_id=trial_id, runtime=runtime, origin=entry, mean_s=outcome.measured_s))
        s.notify(outcome)


def run_algorithm(session: SearchSession) -> None:
    """Phase 3: the search algorithm's trials (builder baselines first) through Ray Tune, up to
    the experiment's budget, ``slices`` at a time."""
    from ray import tune

    from .searcher import StrategySearcher
    from .slices import trainable

    s = session
    remaining = s.exp.search.budget - len(s.algo.trials)
    if remaining <= 0 or s.algo.finished:
        return
    if s.algo.over_budget_baselines:
        s.say(f"builder baselines over the memory budget, not trialled: {', '.join(s.algo.over_budget_baselines)}")
    shard = f", shard units in {s.shard_prob:.0%} of the sampled strategies" if s.shard_prob else ""
    s.say(f"searching: {remaining} trial(s) of {s.exp.search.algorithm}, builder baselines first{shard}")
    tune.Tuner(
        tune.with_resources(trainable, {"CPU": 0, HEAD_RESOURCE: 0.001}),
        # Reusing the trainables' actors saves a process start per trial (most of a small
        # trial's overhead: benchmarks/trial_overhead.py).
        tune_config=tune.TuneConfig(search_alg=StrategySearcher(s), num_samples=remaining,
                                    max_concurrent_trials=s.exp.run.slices, reuse_actors=True),
        run_config=tune.RunConfig(name=s.search_id, storage_path=_tune_storage(), verbose=0),
    ).fit()


def confirm_best(session: SearchSession) -> dict | None:
    """Phase 4: the fastest searched strategies screened, and the pick re-measured against the
    best baseline, interleaved on the same processes; the confirmation becomes a row of its
    candidate (its per-round medians), so reports made from the dataset show it. Returns the
    confirmation's figures (or its error), None when the experiment asks for none."""
    import ray

    s, confirm = session, session.exp.confirm
    if not confirm.rounds:
        return None
    if not s.strategy_runtime.interleavable:
        confirmation = {"error": f"not confirmed: the {s.strategy_runtime.name} runtime starts once per process, so "
                                 f"two arms cannot be interleaved on the same processes; the figures are single "
                                 f"trials"}
        s.say(f"confirmation skipped: {confirmation['error']}")
        return confirmation
    arms = confirmation_arms(s.algo.trials, s.ledger, s.skeleton, confirm.candidates, confirm.baselines,
                             runtime_of=s.proposal_runtime)
    if arms is None:
        return {"error": "nothing to confirm: no searched strategy and baseline both finished"}
    candidates, baselines = arms
    every = [*candidates, *baselines]
    names, base_names = [a.label for a in candidates], [a.label for a in baselines]
    screen_rounds = confirm.screen_rounds if len(every) > 2 else 0
    rule = confirm.rule
    if screen_rounds:
        s.say(f"screening the {len(candidates)} fastest searched strategies ({', '.join(names)}) and the "
              f"{len(baselines)} fastest baselines ({', '.join(base_names)}): {screen_rounds} interleaved rounds of "
              f"{confirm.iters} iterations each, every arm")
    s.say(f"confirming {'the picks' if screen_rounds else names[0] + ' against ' + base_names[0]}: "
          f"{rule.min_rounds} to {rule.max_rounds} interleaved rounds of {confirm.iters} iterations each, until the "
          f"interval excludes 1 or is narrower than {rule.width:.0%}")
    try:
        confirmation = ray.get(s.holders[0].confirm.remote(
            [a.to_payload() for a in every], asdict(s.trial_config), rule.to_dict(),
            confirm.iters, screen_rounds, len(candidates)))
    except Exception as exc:  # noqa: BLE001 - every trial is recorded; the summary must survive
        confirmation = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    picked = int(confirmation.get("picked", 0))
    picked_base = int(confirmation.get("picked_baseline", len(candidates))) - len(candidates)
    strategy, baseline = candidates[picked].strategy, baselines[picked_base]
    if screen_rounds:
        confirmation.update({"screened": names, "screened_baselines": base_names})
        if "picked" in confirmation:
            s.say(f"screening picked {names[picked]} and, among the baselines, {base_names[picked_base]}")
    confirmation.update({"candidate": names[picked], "baseline": baseline.label, "candidate_hash": strategy.hash,
                         "candidate_strategy": strategy.to_dict(), "baseline_strategy": baseline.strategy.to_dict(),
                         "baseline_runtime": baseline.runtime.to_dict()})
    if "ratio" in confirmation:
        index = sum(r.trial_id.startswith("confirm-") for r in s.done)
        s.record(f"confirm-{index}", strategy, "confirmation",
                 confirmation_result(confirmation, strategy, s.cluster, warmup=s.exp.trial.warmup),
                 runtime=candidates[picked].runtime)
    return confirmation


def summarize(session: SearchSession, confirmation: dict | None) -> SearchSummary:
    """Phase 5: the final summary, with what the search recommends."""
    from dataclasses import replace

    from ..strategy.explain import differences_from_ddp

    summary = session.summary(confirmation)
    recommended = recommend(summary, session.skeleton.to_dict())
    if recommended is not None and recommended.runtime.name == "engine":
        # A searched strategy runs where its trials ran: FSDP2 when its units reshard.
        recommended = replace(recommended, runtime=session.proposal_runtime(Strategy.from_dict(recommended.strategy)))
    if recommended is not None and recommended.kind == "search":
        recommended = replace(recommended, differs=differences_from_ddp(
            Strategy.from_dict(recommended.strategy), session.model, session.cluster.num_devices))
    return replace(summary, recommended=recommended, memory=memory_summary(session, recommended))


def memory_summary(session: SearchSession, recommended: Any) -> dict[str, Any]:
    """What the recommendation costs in memory per rank, predicted (the memory model, on the
    all-shard strategy an FSDP2 configuration runs) and measured (its last trial's probe), the
    budget, and the trials the budget cost (``oom``) or spared (builders not trialled)."""
    s = session
    out: dict[str, Any] = {"budget": s.memory.describe(), "limit_bytes": s.memory.limits(s.skeleton),
                           "oom_trials": sum(1 for r in s.dataset.records(model=s.model.name, cluster=s.cluster.name,
                                                                          search_id=s.search_id) if r.status == "oom"),
                           "over_budget_builders": list(s.algo.over_budget_baselines),
                           "shard_share": s.shard_prob}
    if recommended is None:
        return out
    strategy = Strategy.from_dict(recommended.strategy)
    predicted = strategy
    runtime = recommended.runtime
    if runtime.name == "fsdp" and not runtime.config.from_strategy:
        from ..engine.fsdp import strategy_of_config

        predicted = strategy_of_config(s.module(), runtime.config, strategy, s.model)
    out["predicted_peak_bytes"] = s.memory.peaks(predicted, "fsdp" if runtime.name == "fsdp" else "engine")
    out["measured_peak_bytes"] = s.measured_peaks.get((strategy.hash, runtime.config_json()))
    return out


def finish(session: SearchSession, summary: SearchSummary) -> None:
    """Close the search's MLflow run with its metrics and artifacts, and compact its partition."""
    s = session
    s.logger.log_metrics(s.parent, summary.metrics(), final_status="FINISHED")
    if summary.best_strategy:
        s.logger.log_text(s.parent, json.dumps(summary.best_strategy, indent=1, sort_keys=True), "best_strategy.json")
    if summary.confirmed:
        s.logger.log_text(s.parent, json.dumps(summary.confirmed, indent=1, sort_keys=True), "confirmation.json")
    if summary.simulator_selection:
        s.logger.log_text(s.parent, json.dumps(list(summary.simulator_selection), indent=1),
                          "simulator_selection.json")
    # Each trial's row is its own Parquet file (committed the moment it is measured, so a killed
    # search loses nothing); a search leaves its partition as one file again, since reads slow
    # with the file count (2,244 rows: 4.2 s as one file each, 0.12 s compacted).
    try:
        s.dataset.compact(model=s.model.name, cluster=s.cluster.name)
    except Exception as exc:  # noqa: BLE001 - the rows are all there as they were (the new file is
        # written before the old ones go; pyarrow's errors on an unreadable file are not OSErrors):
        # only reading them is slower, and the summary must survive
        s.say(f"the dataset's {s.model.name}/{s.cluster.name} partition was left uncompacted ({exc}); "
              f"`synctune dataset compact` does it later")


def run_search(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, *, workload, resume: bool = False,
               tracking_uri: str | None = None, on_trial: Callable[[TrialResult, SearchSummary], None] | None = None,
               node_net: dict | None = None, on_phase: Callable[[str], None] | None = None,
               memory: tuple[MemoryBudget, float] | None = None) -> SearchSummary:
    """Run (or resume) the search of ``exp`` for ``workload``; returns its summary. Ray must be
    initialized. ``node_net`` (a lab's network) runs each node's workers in that node's
    namespace. ``on_trial(result, summary so far)`` hears of each recorded trial;
    ``on_phase(message)`` announces each phase. ``memory``: the budget and shard share
    :func:`prepare_memory` made already (the CLI checks the budget before Ray starts)."""
    from .slices import release_slices

    # Tune's console tables would interleave with the search's own progress (verbose=0 silences
    # only its older reporter).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    session = SearchSession(exp, model, cluster, workload=workload, resume=resume, tracking_uri=tracking_uri,
                            node_net=node_net, on_trial=on_trial, say=on_phase or (lambda _message: None),
                            memory=memory)
    try:
        session.start_slices()
        tune_ddp(session)
        tune_fsdp(session)
        measure_runtime_baselines(session)
        run_algorithm(session)
        confirmation = confirm_best(session)
    finally:
        release_slices(session.holders)
    summary = summarize(session, confirmation)
    finish(session, summary)
    return summary
