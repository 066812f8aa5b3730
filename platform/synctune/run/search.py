"""Running a search: AutoDist Algorithm 1 driven through Ray Tune, one Tune trial per strategy.

A search is prepared once (:func:`~synctune.run.prepare.prepare_search`: every check and all the
I/O before its first trial, in a frozen :class:`~synctune.run.prepare.SearchContext`), then run
by one function per phase, in order, on the same slices, over a :class:`SearchSession` (the
context, the :class:`~synctune.run.recording.SearchRecorder` that owns the dataset, MLflow and
the baselines' ledger, and the slice actors):

1. :func:`tune_baselines`: each runtime that declares a tuning space (torch DDP, FSDP2,
   Megatron-style tensor parallelism with FSDP2 across), its settings drawn by Optuna's TPE
   through Ray Tune;
2. :func:`measure_runtime_baselines`: the experiment's real Horovod baselines;
3. :func:`run_algorithm`: the search algorithm (builder baselines first), ``search.budget``
   trials, owned by Tune's searcher (:class:`~synctune.run.searcher.StrategySearcher`);
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
from dataclasses import asdict
from typing import Any, Callable

from ..cluster.workers import HEAD_RESOURCE
from ..data.confirmation import NOTHING_TO_CONFIRM, Confirmation
from ..data.paths import data_home
from ..engine.measure import TrialResult
from ..engine.runtime import Runtime
from ..engine.runtimes import tuned_runtimes
from ..engine.tuning import NothingToTune
from ..search.algorithm import StrategySearch
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.files import path_under
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .baselines import tuned_searcher
from .confirm import confirmation_arms, confirmation_result
from .prepare import SearchContext, prepare_search, search_algorithm, search_id_of
from .recording import SearchRecorder
from .summary import MemorySummary, SearchSummary, recommend

__all__ = ["run_search", "run_prepared", "search_id_of", "SearchSession", "search_algorithm", "tune_baselines",
           "measure_runtime_baselines", "run_algorithm", "confirm_best", "summarize", "finish"]


class SearchSession:
    """A search while it runs: its :attr:`context`, its :attr:`recorder`, the slice actors its
    trials run on (:attr:`holders`, by :attr:`slice_names`), and who hears of its progress
    (``on_trial(result, summary so far)``, ``say(message)``)."""

    def __init__(self, context: SearchContext, *, on_trial: Callable[[TrialResult, SearchSummary], None] | None,
                 say: Callable[[str], None]) -> None:
        self.context = context
        self.recorder = SearchRecorder(context)
        self.on_trial, self.say = on_trial, say
        self.holders: list = []
        self.slice_names = [f"synctune-slice-{context.search_id}-{i}" for i in range(context.exp.run.slices)]

    @property
    def search_id(self) -> str:
        """The search's id."""
        return self.context.search_id

    def memory_limits(self, strategy: Strategy) -> list[int | None]:
        """Each rank's memory budget in bytes under ``strategy`` (what a trial's measured peak is
        judged against: over it, the trial is ``oom``)."""
        return self.context.memory.limits(strategy)

    def start_slices(self) -> None:
        """One named slice actor per slice, on a sliver of the head node."""
        import ray

        from .slices import SliceActor

        ctx = self.context
        self.holders = [ray.remote(SliceActor).options(name=name, num_cpus=0, resources={HEAD_RESOURCE: 0.001})
                        .remote(ctx.cluster.to_dict(), ctx.exp.run.slice_timeout_s, ctx.node_net, ctx.workload)
                        for name in self.slice_names]

    def notify(self, result: TrialResult) -> None:
        """Tell the caller's ``on_trial`` of a finished trial, with the summary so far."""
        if self.on_trial:
            self.on_trial(result, self.recorder.summary())


def _tune_storage() -> str:
    return str(path_under(data_home(), "tune"))


def tune_baselines(session: SearchSession) -> None:
    """Phase 1: every runtime that declares a tuning space (:func:`~synctune.engine.runtimes.tuned_runtimes`:
    torch DDP, FSDP2, Megatron), in registry order."""
    for cls in tuned_runtimes():
        tune_runtime(session, cls)


def tuned_trials(context: SearchContext, cls: type[Runtime]) -> int:
    """How many trials of ``cls`` a search tunes: the experiment's ``baselines.<name>_trials``,
    where ``auto`` is 8 when the search proposes shard units and 0 otherwise (the Megatron
    baseline's ``auto`` is the experiment's: 8 where its builders list ``megatron``)."""
    wanted = context.exp.baselines.tuned_trials(cls.name)
    return (8 if context.shard_prob else 0) if wanted == "auto" else int(wanted)


def tune_runtime(session: SearchSession, cls: type[Runtime]) -> None:
    """Tune ``cls``'s settings (its trials in all, a resumed search's included) with Optuna's TPE
    through Ray Tune, on the first slice, only among the settings the memory budget admits; each
    trial recorded as it completes, judged against the memory budget."""
    from ray import tune

    from .searcher import RecordTunedTrials
    from .slices import trainable

    s, ctx, tuning = session, session.context, cls.tuning
    budget = tuned_trials(ctx, cls)
    remaining = budget - len(s.recorder.ledger.of(cls.name))
    if remaining <= 0:
        return
    if ctx.memory.nothing_fits():
        s.say(f"tuned {tuning.title} skipped: {ctx.memory.nothing_fits()}")
        return
    if ctx.framework not in cls.frameworks:
        s.say(f"tuned {tuning.title} skipped: {ctx.workload.name} is a Keras model ({cls.name}_trials: {budget} "
              f"ignored)")
        return
    try:
        space = cls.tuning_space(ctx.model, ctx.cluster, lossy=ctx.exp.search.lossy, fits=ctx.runtime_fits)
    except NothingToTune as exc:
        s.say(f"tuned {tuning.title} skipped: {exc.reason} ({ctx.memory.describe()})")
        return
    s.say(f"tuning {tuning.title}: {remaining} trial(s), {tuning.knobs} by Optuna (TPE) through Ray Tune")
    known = [(t.params, t.mean_s) for t in s.recorder.ledger.of(cls.name) if t.params and t.mean_s is not None]
    tune.Tuner(
        # The trainable only forwards to a slice actor: no CPU, a sliver of the head.
        tune.with_resources(trainable, {"CPU": 0, HEAD_RESOURCE: 0.001}),
        param_space={"slice": s.slice_names[0], "strategy": ctx.skeleton.to_dict(), "tuned": cls.name,
                     "trial_config": asdict(ctx.trial_config), "memory_limits": s.memory_limits(ctx.skeleton)},
        tune_config=tune.TuneConfig(search_alg=tuned_searcher(space, seed=ctx.exp.seed, budget=budget, done=known),
                                    num_samples=remaining, max_concurrent_trials=1, reuse_actors=True),
        run_config=tune.RunConfig(name=f"{s.search_id}-{cls.name}", storage_path=_tune_storage(), verbose=0,
                                  callbacks=[RecordTunedTrials(s, cls.name)]),
    ).fit()


def measure_runtime_baselines(session: SearchSession) -> None:
    """Phase 2: each real-Horovod baseline of the experiment not measured yet, one trial each."""
    import ray

    s, ctx = session, session.context
    if not ctx.horovod_entries:
        return
    measured = {t.origin for t in s.recorder.ledger.of(ctx.horovod_entries[0][1].name)}
    if not ctx.runtime_fits(ctx.horovod_entries[0][1]):
        s.say("real Horovod baselines skipped: replicated training does not fit the memory budget")
        return
    for entry, runtime in ctx.horovod_entries:
        if entry in measured:
            continue
        s.say(f"real Horovod baseline {entry}: {runtime.summary()}")
        outcome = TrialResult.from_dict(ray.get(s.holders[0].run.remote(
            ctx.skeleton.to_dict(), asdict(ctx.trial_config), runtime.to_dict())))
        s.recorder.record_baseline(runtime, entry, outcome, prefix="hvd")
        s.notify(outcome)


def run_algorithm(session: SearchSession) -> StrategySearch:
    """Phase 3: the search algorithm's trials (builder baselines first) through Ray Tune, up to
    the experiment's budget, ``slices`` at a time; returns the algorithm as the trials left it."""
    from ray import tune

    from .searcher import StrategySearcher
    from .slices import trainable

    s, ctx = session, session.context
    searcher = StrategySearcher(s)
    algorithm = searcher.algorithm
    remaining = ctx.exp.search.budget - len(algorithm.trials)
    if remaining <= 0 or algorithm.finished:
        return algorithm
    stopped = ctx.memory.nothing_fits()
    if stopped:
        algorithm.stopped, algorithm.exhausted = stopped, True
        s.say(f"search stopped before its first trial: {stopped}")
        return algorithm
    if algorithm.over_budget_baselines:
        s.say(f"builder baselines over the memory budget, not trialled: {', '.join(algorithm.over_budget_baselines)}")
    shard = f", shard units in {ctx.shard_prob:.0%} of the sampled strategies" if ctx.shard_prob else ""
    if ctx.tp_prob:
        shard += f", tensor parallelism in {ctx.tp_prob:.0%} of them"
    s.say(f"searching: {remaining} trial(s) of {ctx.exp.search.algorithm}, builder baselines first{shard}")
    tune.Tuner(
        tune.with_resources(trainable, {"CPU": 0, HEAD_RESOURCE: 0.001}),
        # Reusing the trainables' actors saves a process start per trial (most of a small
        # trial's overhead: benchmarks/trial_overhead.py).
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=remaining,
                                    max_concurrent_trials=ctx.exp.run.slices, reuse_actors=True),
        run_config=tune.RunConfig(name=s.search_id, storage_path=_tune_storage(), verbose=0),
    ).fit()
    if searcher.algorithm.stopped:
        s.say(f"search stopped: {searcher.algorithm.stopped}")
    return searcher.algorithm


def confirm_best(session: SearchSession) -> Confirmation | None:
    """Phase 4: the fastest searched strategies screened, and the pick re-measured against the
    best baseline, interleaved on the same processes; the confirmation becomes a row of its
    candidate (its per-round medians), so reports made from the dataset show it. Returns the
    confirmation (or why there is none), None when the experiment asks for none."""
    import ray

    s, ctx = session, session.context
    confirm = ctx.exp.confirm
    if not confirm.rounds:
        return None
    runs = ctx.executor(ctx.skeleton)
    if not runs.interleavable:
        error = (f"not confirmed: the {runs.name} runtime starts once per process, so two arms cannot be "
                 f"interleaved on the same processes; the figures are single trials")
        s.say(f"confirmation skipped: {error}")
        return Confirmation.failed(error)
    arms = confirmation_arms(s.recorder.trials, s.recorder.ledger, ctx.skeleton, confirm.candidates,
                             confirm.baselines, runtime_of=ctx.executor)
    if arms is None:
        return Confirmation.failed(f"{NOTHING_TO_CONFIRM}: no searched strategy and baseline both finished")
    candidates, baselines = arms
    every = [*candidates, *baselines]
    names, base_names = [a.label for a in candidates], [a.label for a in baselines]
    screen_rounds = confirm.screen_rounds if len(every) > 2 else 0
    screen_max = confirm.screen_max_rounds if screen_rounds else 0
    rule = confirm.rule
    if screen_rounds:
        extent = (f"{screen_rounds} to {screen_max} interleaved rounds of {confirm.iters} iterations each, an arm "
                  f"dropped once shown slower than the fastest of its kind" if screen_max > screen_rounds else
                  f"{screen_rounds} interleaved rounds of {confirm.iters} iterations each, every arm")
        s.say(f"screening the {len(candidates)} fastest searched strategies ({', '.join(names)}) and the "
              f"{len(baselines)} fastest baselines ({', '.join(base_names)}): {extent}")
    s.say(f"confirming {'the picks' if screen_rounds else names[0] + ' against ' + base_names[0]}: "
          f"{rule.min_rounds} to {rule.max_rounds} interleaved rounds of {confirm.iters} iterations each, until the "
          f"interval excludes 1 or is narrower than {rule.width:.0%}")
    try:
        figures = ray.get(s.holders[0].confirm.remote(
            [a.to_payload() for a in every], asdict(ctx.trial_config), rule.to_dict(),
            confirm.iters, screen_rounds, len(candidates), screen_max))
    except Exception as exc:  # noqa: BLE001 - every trial is recorded; the summary must survive
        figures = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    picked = int(figures.get("picked", 0))
    picked_base = int(figures.get("picked_baseline", len(candidates))) - len(candidates)
    candidate, baseline = candidates[picked], baselines[picked_base]
    if screen_rounds and "picked" in figures:
        s.say(f"screening picked {names[picked]} and, among the baselines, {base_names[picked_base]}"
              f"{screening_extent(figures.get('screen_s'), [*names, *base_names])}")
    confirmation = Confirmation.from_figures(
        figures, candidate=candidate.label, baseline=baseline.label, candidate_hash=candidate.strategy.hash,
        candidate_strategy=candidate.strategy.to_dict(), baseline_strategy=baseline.strategy.to_dict(),
        baseline_runtime=baseline.runtime.to_dict(),
        **({"screened": names, "screened_baselines": base_names} if screen_rounds else {}))
    if confirmation.measured:
        s.recorder.record_confirmation(candidate.strategy, confirmation_result(
            confirmation, candidate.strategy, ctx.cluster, warmup=ctx.exp.trial.warmup), candidate.runtime)
    return confirmation


def screening_extent(screen_s: list | None, labels: list[str]) -> str:
    """What a screening's per-arm times say of its course, for the line naming its picks: the
    rounds it took and the arms it stopped timing as slower (a sequential screening times those
    for fewer rounds)."""
    if not screen_s:
        return ""
    rounds = max(len(times) for times in screen_s)
    dropped = [f"{label} after {len(times)}" for label, times in zip(labels, screen_s) if len(times) < rounds]
    return (f" after {rounds} round(s)" + (f"; shown slower and no longer timed: {', '.join(dropped)}" if dropped
                                           else ""))


def summarize(session: SearchSession, confirmation: Confirmation | None, algorithm: StrategySearch) -> SearchSummary:
    """Phase 5: the final summary, with what the search recommends."""
    from dataclasses import replace

    from ..strategy.explain import differences_from_ddp

    ctx = session.context
    simulator = algorithm.simulator
    summary = session.recorder.summary(
        confirmed=confirmation, simulator_selection=simulator.history if simulator is not None else (),
        training_free_simulator=simulator.training_free.kind if simulator is not None else None)
    recommended = recommend(summary, ctx.skeleton)
    if recommended is not None and recommended.runtime.runs_strategy:
        # A searched strategy runs where its trials ran: FSDP2 when its units reshard.
        recommended = replace(recommended, runtime=ctx.executor(recommended.strategy))
    if recommended is not None and recommended.kind == "search":
        recommended = replace(recommended, differs=differences_from_ddp(recommended.strategy, ctx.model,
                                                                        ctx.cluster.num_devices))
    memory = memory_summary(session, recommended, algorithm.over_budget_baselines)
    return replace(summary, recommended=recommended, memory=replace(memory, stopped=algorithm.stopped))


def memory_summary(session: SearchSession, recommended: Any, over_budget_builders: list[str]) -> MemorySummary:
    """What the recommendation costs in memory per rank, predicted (the memory model, on the
    strategy whose memory its runtime's ranks hold) and measured (its last trial's probe), the
    budget, and the trials the budget cost (``oom``) or spared (builders not trialled)."""
    ctx = session.context
    out = MemorySummary(budget=ctx.memory.describe(), limit_bytes=tuple(ctx.memory.limits(ctx.skeleton)),
                        oom_trials=sum(1 for r in ctx.dataset.records(model=ctx.model.name, cluster=ctx.cluster.name,
                                                                      search_id=ctx.search_id) if r.status == "oom"),
                        over_budget_builders=tuple(over_budget_builders), shard_share=ctx.shard_prob)
    if recommended is None:
        return out
    from dataclasses import replace

    runtime = recommended.runtime
    held = runtime.plans_of(recommended.strategy, lambda: ctx.module, ctx.model)
    measured = session.recorder.measured_peaks.get((runtime.executed(recommended.strategy, ctx.model).hash,
                                                    runtime.config_json()))
    return replace(out, predicted_peak_bytes=tuple(ctx.memory.peaks(held, fsdp=runtime.fsdp_layout)),
                   measured_peak_bytes=tuple(measured) if measured is not None else None)


def finish(session: SearchSession, summary: SearchSummary) -> None:
    """Close the search's MLflow run with its metrics and artifacts, and compact its partition."""
    ctx = session.context
    logger, parent = ctx.logger, ctx.parent_run
    missing = session.recorder.log_unlogged()
    if missing:
        session.say(f"{missing} trial(s) of this search have no MLflow run (MLflow at {logger.tracking_uri} is "
                    f"unreachable); their rows are in the dataset, and `synctune mlflow sync` logs them")
    logger.log_metrics(parent, summary.metrics(), final_status="FINISHED")
    if summary.best_strategy is not None:
        logger.log_text(parent, json.dumps(summary.best_strategy.to_dict(), indent=1, sort_keys=True),
                        "best_strategy.json")
    if summary.confirmed is not None:
        logger.log_text(parent, json.dumps(summary.confirmed.to_dict(), indent=1, sort_keys=True), "confirmation.json")
    if summary.simulator_selection:
        logger.log_text(parent, json.dumps(list(summary.simulator_selection), indent=1), "simulator_selection.json")
    # Each trial's row is its own Parquet file (committed the moment it is measured, so a killed
    # search loses nothing); a search leaves its partition as one file again, since reads slow
    # with the file count.
    try:
        ctx.dataset.compact(model=ctx.model.name, cluster=ctx.cluster.name)
    except Exception as exc:  # noqa: BLE001 - the rows are all there as they were (the new file is
        # written before the old ones go; pyarrow's errors on an unreadable file are not OSErrors):
        # only reading them is slower, and the summary must survive
        session.say(f"the dataset's {ctx.model.name}/{ctx.cluster.name} partition was left uncompacted ({exc}); "
                    f"`synctune dataset compact` does it later")


def run_prepared(context: SearchContext, *,
                 on_trial: Callable[[TrialResult, SearchSummary], None] | None = None,
                 on_phase: Callable[[str], None] | None = None) -> SearchSummary:
    """Run the search ``context`` prepared (:func:`~synctune.run.prepare.prepare_search`); returns
    its summary. Ray must be initialized. ``on_trial(result, summary so far)`` hears of each
    recorded trial; ``on_phase(message)`` announces each phase."""
    from .slices import release_slices

    # Tune's console tables would interleave with the search's own progress (verbose=0 silences
    # only its older reporter).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    from ..cluster.workers import check_slice_feasible

    # A slice the Ray cluster can never form is refused before any trial is spent on it.
    check_slice_feasible(context.cluster)
    session = SearchSession(context, on_trial=on_trial, say=on_phase or (lambda _message: None))
    try:
        session.start_slices()
        tune_baselines(session)
        measure_runtime_baselines(session)
        algorithm = run_algorithm(session)
        confirmation = confirm_best(session)
    finally:
        release_slices(session.holders)
    summary = summarize(session, confirmation, algorithm)
    finish(session, summary)
    return summary


def run_search(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, *, workload, resume: bool = False,
               tracking_uri: str | None = None, on_trial: Callable[[TrialResult, SearchSummary], None] | None = None,
               node_net: dict | None = None, on_phase: Callable[[str], None] | None = None) -> SearchSummary:
    """Prepare (:func:`~synctune.run.prepare.prepare_search`) and run (:func:`run_prepared`) the
    search of ``exp`` for ``workload`` (whose spec is ``model``) on ``cluster``; ``node_net`` (a
    lab's network) runs each node's workers in that node's namespace. Ray must be initialized."""
    context = prepare_search(exp, workload, cluster, model=model, resume=resume, tracking_uri=tracking_uri,
                             node_net=node_net, say=on_phase or (lambda _message: None))
    return run_prepared(context, on_trial=on_trial, on_phase=on_phase)
