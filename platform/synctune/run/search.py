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
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..cluster.workers import HEAD_RESOURCE
from ..data.paths import data_home, dataset_dir
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.ddp import ddp_runtime
from ..engine.trial import TrialConfig
from ..search.algorithm import Algorithm1
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.files import check_name, path_under
from ..spec.model import ModelSpec
from ..strategy.builders import BUILDERS, build_strategy
from ..strategy.schema import Strategy
from .profiles import ensure_profile
from .recording import record_result

__all__ = ["run_search", "search_id_of", "make_search_simulator", "SelectedSimulator", "ensure_profile"]


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

    def run(self, strategy: dict, config: dict, runtime: dict | None = None) -> dict:
        from ..cluster.workers import SlicePending
        from ..engine.trial import failed_result

        plan, trial_config = Strategy.from_dict(strategy), TrialConfig(**config)
        try:
            return self.group.run_trial(plan, trial_config, workload=self.workload, runtime=runtime).to_dict()
        except SlicePending as exc:  # the nodes never came: this trial fails, the search goes on
            return failed_result("failed", str(exc), plan, self.group.cluster, trial_config, "ray",
                                 trial_config.timeout_s).to_dict()

    def confirm(self, arms: list, config: dict, rounds: int, per_round: int, screen_rounds: int = 0) -> dict:
        """Interleaved re-measurement of arms ((strategy dict, runtime or None) pairs, the
        baseline last; several candidates are screened first)."""
        from ..cluster.workers import ConfirmFailed, SlicePending

        try:
            return self.group.run_confirm([(Strategy.from_dict(st), rt) for st, rt in arms], TrialConfig(**config),
                                          workload=self.workload, rounds=rounds, per_round=per_round,
                                          screen_rounds=screen_rounds)
        except (ConfirmFailed, SlicePending) as exc:
            return {"error": str(exc)}

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
    runtime = config.get("runtime")  # a Keras model's trials: the tensorflow runtime
    if "comm_hook" in config:  # a tuned-DDP trial: Optuna's parameters arrive in the config
        params = {k: config[k] for k in DDP_SPACE}
        runtime = ddp_runtime(ddp_config_of(params))
    result = ray.get(holder.run.remote(config["strategy"], config["trial_config"], runtime))
    if "comm_hook" in config:
        result["extra"]["ddp_params"] = params
    tune.report({"mean_s": result["mean_s"] if result["status"] == "ok" else float("nan"),
                 "result_json": json.dumps(result)})


#: The tuned-DDP search space (torch DDP's knobs, as Horovod's autotune tunes its fusion buffer):
#: the comm hook, the bucket size cap (1-256 MiB) and the first bucket's cap.
DDP_SPACE = ("comm_hook", "bucket_cap_mb", "first_bucket_mb")
#: PowerSGD's rank in tuned-DDP trials (the allreduce builder's default).
DDP_POWERSGD_RANK = 4


def tensorflow_projection(model: ModelSpec) -> Callable[[Strategy], Strategy]:
    """What a search over a Keras model proposes: each sampled strategy projected into what
    TensorFlow's MultiWorkerMirroredStrategy executes (:func:`synctune.engine.tensorflow.project_to_tensorflow`)."""
    from ..engine.tensorflow import project_to_tensorflow

    return lambda strategy: project_to_tensorflow(strategy, model)


def horovod_baselines(exp: Experiment, model: ModelSpec, cluster: ClusterSpec,
                      workload: Any = None) -> list[tuple[str, Any]]:
    """The experiment's real-Horovod baselines as (entry, :class:`~synctune.engine.horovod.HorovodConfig`),
    each checked as a trial (Horovod installed, with the binding ``workload`` needs; settings it
    executes) before anything runs."""
    from ..engine.horovod import HOROVOD_DEFAULT, HorovodConfig, horovod_runtime
    from ..engine.trial import check_runtime

    out = []
    where = exp.source or exp.name
    for entry in getattr(exp, "runtime_baselines", ()):
        options = {}
        for item in filter(None, entry.partition(":")[2].split(",")):
            key, _eq, text = item.partition("=")
            options[key.strip()] = text.strip()
        unknown = [k for k in options if k not in HOROVOD_DEFAULT.to_dict()]
        if unknown:
            raise SpecError(f"{where}: baselines: {entry!r}: unknown Horovod setting {unknown[0]!r}; valid: "
                            f"{', '.join(HOROVOD_DEFAULT.to_dict())}")
        try:
            config = HorovodConfig.from_options(options)
            check_runtime(horovod_runtime(config), build_strategy("allreduce", model, cluster), model, cluster,
                          workload)
        except SpecError as exc:
            raise SpecError(f"{where}: baselines: {entry!r}: {exc}") from None
        out.append((entry, config))
    return out


def ddp_config_of(params: dict):
    """The :class:`~synctune.engine.ddp.DDPConfig` of one tuned-DDP point."""
    from ..engine.ddp import DDPConfig

    hook = params["comm_hook"]
    cap = float(params["bucket_cap_mb"])
    first = min(float(params["first_bucket_mb"]), cap)
    # torch's PowerSGD hook fails with a separate first-bucket cap (see DDPConfig): it gets none.
    return DDPConfig(bucket_cap_mb=cap, first_bucket_mb=None if hook == "powersgd" or first >= cap else first,
                     comm_hook=hook, powersgd_rank=DDP_POWERSGD_RANK if hook == "powersgd" else None,
                     gradient_as_bucket_view=True)


def ddp_hooks(model: ModelSpec, cluster: ClusterSpec, lossy: bool = True) -> list[str]:
    """The comm hooks a tuned-DDP search tries in a domain: bf16 only on GPUs (torch's hook
    needs NCCL); none but ``none`` for a model with sparse gradients (hooks compress dense
    buckets) or when the experiment says ``lossy: false``."""
    if not lossy or any(v.sparse for v in model.variables):
        return ["none"]
    return ["none", "fp16", "powersgd"] + (["bf16"] if cluster.device_kind == "gpu" else [])


def _ddp_searcher(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, done: list[tuple[dict, float]]):
    """Ray Tune's Optuna searcher (TPE, seeded) over :data:`DDP_SPACE`, told the points this
    search measured already; the first point of a fresh search is DDP's default."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # progress is ours to show, one line per trial
    hooks = ddp_hooks(model, cluster, exp.lossy)
    space = {"comm_hook": optuna.distributions.CategoricalDistribution(hooks),
             "bucket_cap_mb": optuna.distributions.FloatDistribution(1.0, 256.0, log=True),
             "first_bucket_mb": optuna.distributions.FloatDistribution(0.0625, 64.0, log=True)}
    done = [(p, t) for p, t in done if p.get("comm_hook") in hooks]  # an edited experiment narrows the space
    points = [dict(p) for p, _t in done] or [{"comm_hook": "none", "bucket_cap_mb": 25.0, "first_bucket_mb": 1.0}]
    rewards = [t for _p, t in done] or None
    # TPE models the space after 3 trials (Optuna's default waits 10, more than a search's DDP
    # trials); a resumed search draws from a stream of its own, so it does not redraw the points
    # it was told about.
    sampler = optuna.samplers.TPESampler(seed=(exp.seed * 1_000_003 + len(done)) % 2**32,
                                         n_startup_trials=min(3, exp.ddp_trials))
    return OptunaSearch(space=space, metric="mean_s", mode="min", sampler=sampler, points_to_evaluate=points,
                        evaluated_rewards=rewards)


#: Trials of its own a search measures before its replay is calibrated on them (5 constants fitted).
CALIBRATE_AFTER = 8


def make_search_simulator(exp: Experiment, model: ModelSpec, cluster: ClusterSpec):
    """The simulator an experiment asks for, bound to its domain (None for the random variants)."""
    from ..data.paths import profiles_dir
    from ..simulator import AnalyticSimulator, BoundSimulator, CalibratedReplay, ReplaySimulator, load_simulator, \
        make_simulator, profile_key

    if exp.algorithm in ("random", "random-guided"):
        return None
    if exp.simulator == "analytic":
        return BoundSimulator(AnalyticSimulator(), model, cluster)
    replay = ReplaySimulator.from_folder(profiles_dir())
    if exp.simulator == "replay":
        return BoundSimulator(replay, model, cluster)
    # The physical model learned models must beat: the replay where this domain's compute profile
    # was measured (`synctune sim profile`), calibrated on the search's own trials as they come
    # (its communication's CPU costs and compute scale; dPRO §4.3), else the analytic model.
    measured = profile_key(model.name, cluster.device_kind, cluster.num_devices) in replay.profiles
    physical = CalibratedReplay(min_trials=CALIBRATE_AFTER) if measured else AnalyticSimulator()
    if measured:
        physical.use_profiles(replay)
    analytic = BoundSimulator(physical, model, cluster)
    if exp.simulator in ("rnn", "linear", "gat"):
        def make():
            sim = make_simulator(exp.simulator, epochs=60, seed=exp.seed)
            sim.use_profiles(replay)  # its replay features use this domain's measured profile
            return sim

        return SelectedSimulator(analytic, BoundSimulator(make(), model, cluster, make=make), learned_ready=False)
    transferred = load_simulator(exp.simulator)
    transferred.use_profiles(replay)
    return SelectedSimulator(analytic, BoundSimulator(transferred, model, cluster, transfer=True), learned_ready=True)


def _pairwise(pred: np.ndarray, runtimes: np.ndarray) -> tuple[float, int]:
    """(pairs ordered as measured, pairs with different runtimes): higher score = faster."""
    right = total = 0.0
    for i in range(len(runtimes)):
        for j in range(i + 1, len(runtimes)):
            if runtimes[i] == runtimes[j]:
                continue
            total += 1
            faster_i = runtimes[i] < runtimes[j]
            if pred[i] == pred[j]:
                right += 0.5
            elif (pred[i] > pred[j]) == faster_i:
                right += 1
    return right, int(total)


class SelectedSimulator:
    """The physical model (analytic, or the replay calibrated as the search goes: called
    training-free here, it has no learned weights) until the learned one beats it on trials it
    had not seen (AutoDist §2.4: start analytic, switch once the learned model is better).

    At every update (a batch boundary of the search), the trials measured since the previous
    update are held out: both models score them before either learns from them (the learned
    model trains; a calibrated replay refits its constants,
    :class:`~synctune.simulator.CalibratedReplay`),
    and each model's pairwise ranking accuracy on those pairs accumulates. The learned model
    scores proposals only while its accumulated held-out accuracy is above the training-free
    model's on the same pairs (and at least :attr:`MIN_PAIRS` pairs were judged). A transferred
    model (``learned_ready``) is judged from the first batch; one learned from scratch from the
    batch after its first fit. :attr:`history` keeps each judgement."""

    MIN_PAIRS = 6

    def __init__(self, training_free, learned, *, learned_ready: bool) -> None:
        self.training_free, self.learned = training_free, learned
        self.ready = learned_ready
        self.seen = 0
        self.right = {"learned": 0.0, "training_free": 0.0}
        self.pairs = 0
        self.use_learned = False
        self.history: list[dict] = []

    @property
    def predicts_seconds(self) -> bool:
        """Whether the model scoring now predicts seconds (the training-free ones do; a learned
        ranker does not)."""
        return bool(getattr(self.learned if self.use_learned else self.training_free, "predicts_seconds", False))

    def score(self, strategies):
        return (self.learned if self.use_learned else self.training_free).score(strategies)

    def score_columns(self, columns):
        return (self.learned if self.use_learned else self.training_free).score_columns(columns)

    def fit(self, strategies, runtimes) -> None:
        runtimes = np.asarray(runtimes, dtype=float)
        new = slice(self.seen, len(strategies))
        if self.ready and len(strategies) > self.seen:
            held = strategies[new]
            learned_right, pairs = _pairwise(np.asarray(self.learned.score(held), float), runtimes[new])
            free_right, _ = _pairwise(np.asarray(self.training_free.score(held), float), runtimes[new])
            self.right["learned"] += learned_right
            self.right["training_free"] += free_right
            self.pairs += pairs
        self.learned.fit(strategies, runtimes)
        # A calibrated replay refits its constants too, after it was judged on these trials.
        self.training_free.fit(strategies, runtimes)
        self.ready = True
        self.seen = len(strategies)
        acc = {k: (v / self.pairs if self.pairs else None) for k, v in self.right.items()}
        self.use_learned = self.pairs >= self.MIN_PAIRS and acc["learned"] > acc["training_free"]
        self.history.append({"trials": self.seen, "held_out_pairs": self.pairs, "learned_accuracy": acc["learned"],
                             "training_free_accuracy": acc["training_free"],
                             "scoring": "learned" if self.use_learned else "training-free"})


def run_search(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, *, workload, resume: bool = False,
               tracking_uri: str | None = None, on_trial: Callable[[dict, dict], None] | None = None,
               node_net: dict | None = None, on_phase: Callable[[str], None] | None = None) -> dict:
    """Run (or resume) the search of ``exp`` for ``workload``; returns the summary. Ray must be
    initialized. ``node_net`` (a lab's network) runs each node's workers in that node's namespace.

    Three phases on the same slices: tuned torch DDP (``exp.ddp_trials`` trials, Optuna through
    Tune), then Algorithm 1 (builder baselines first, ``exp.budget`` trials), then the
    confirmation of the best searched strategy against the best baseline (builders and DDP),
    interleaved on the same processes. ``on_phase(message)`` announces each phase."""
    import ray
    from ray import tune
    from ray.tune.search import Searcher

    # Tune's console tables would interleave with the search's own progress (verbose=0 silences
    # only its older reporter).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    search_id = search_id_of(exp)
    if node_net and exp.slices > 1:
        raise SpecError(f"{exp.source or exp.name}: slices: a lab has one set of links, so its trials run one at a "
                        f"time (slices: 1), got {exp.slices}")
    ds = TrialDataset(dataset_dir())
    done = ds.records(model=model.name, cluster=cluster.name, search_id=search_id)
    if done and not resume:
        raise SpecError(f"search {search_id!r} already has {len(done)} recorded trial(s) in {ds.root}; "
                        f"pass --resume to continue it, or change the experiment's name or seed")
    done = sorted(done, key=lambda r: (r.created_at, r.record_id))
    ddp_done = [r for r in done if r.runtime == "ddp"]
    hvd_entries = horovod_baselines(exp, model, cluster, workload)
    keras = getattr(workload, "framework", "torch") == "tensorflow"
    project = tensorflow_projection(model) if keras else None
    # Hashes are recomputed from the strategies (a row of an older strategy schema stores the
    # hash of its old form): the search must recognise a strategy it measured in any schema.
    state = {"trials": [{"trial_id": r.trial_id, "strategy": json.loads(r.strategy_json),
                         "origin": r.origin, "predicted": r.predicted_time_s,
                         "runtime": r.mean_s if r.status == "ok" else None}
                        for r in done if r.runtime in ("engine", "tensorflow")
                        and not r.trial_id.startswith("confirm-")]}
    say = on_phase or (lambda _message: None)
    if exp.algorithm not in ("random", "random-guided") and exp.simulator != "analytic" and not keras:
        ensure_profile(workload, model, cluster, say)
    algo = Algorithm1.from_state(state, model, cluster, exp, make_search_simulator(exp, model, cluster), project)
    logger = MlflowLogger(exp.name, tracking_uri)
    parent = logger.start_search(search_id, {"experiment": exp.source or exp.name, "model": model.name,
                                             "cluster": cluster.name, "algorithm": exp.algorithm,
                                             "simulator": exp.simulator, "budget": exp.budget, "seed": exp.seed,
                                             "workload": workload.source, "ddp_trials": exp.ddp_trials,
                                             "confirm_rounds": exp.confirm_rounds})
    trial_config = asdict(TrialConfig(warmup=exp.warmup, iters=exp.iters, seed=exp.seed, timeout_s=exp.timeout_s))
    on_head = {HEAD_RESOURCE: 0.001}
    slice_names = [f"synctune-slice-{search_id}-{i}" for i in range(exp.slices)]
    holders = [ray.remote(_Slice).options(name=name, num_cpus=0, resources=on_head).remote(
        cluster.to_dict(), exp.timeout_s, dict(node_net) if node_net else None, workload) for name in slice_names]
    free_slices = list(slice_names)
    proposals: dict[str, Any] = {}
    # Tuned DDP: (Optuna parameters, runtime or None, DDPConfig dict) per measured trial.
    ddp_trials: list[dict] = [{"params": json.loads(r.extra_json).get("ddp_params"), "trial_id": r.trial_id,
                               "config": json.loads(r.runtime_json or "{}"),
                               "runtime": r.mean_s if r.status == "ok" else None} for r in ddp_done]
    # Real Horovod baselines, by entry: {"trial_id", "entry", "config", "runtime"}.
    hvd_trials: list[dict] = [{"trial_id": r.trial_id, "entry": r.origin, "config": json.loads(r.runtime_json or "{}"),
                               "runtime": r.mean_s if r.status == "ok" else None}
                              for r in done if r.runtime == "horovod"]
    skeleton = build_strategy("allreduce", model, cluster)  # DDP's replicas and (even) batch split

    def ddp_best() -> dict | None:
        ok = [t for t in ddp_trials if t["runtime"] is not None]
        return min(ok, key=lambda t: t["runtime"]) if ok else None

    def hvd_best() -> dict | None:
        ok = [t for t in hvd_trials if t["runtime"] is not None]
        return min(ok, key=lambda t: t["runtime"]) if ok else None

    def runtime_best() -> dict | None:
        """The fastest baseline run by another runtime (tuned DDP or real Horovod), with its kind."""
        found = [{**t, "kind": kind} for kind, t in (("ddp", ddp_best()), ("horovod", hvd_best())) if t]
        return min(found, key=lambda t: t["runtime"]) if found else None

    def summary_now() -> dict:
        best, hvd = ddp_best(), hvd_best()
        others = tuple(t["runtime"] for t in (best, hvd) if t)
        return {**algo.summary(other_baselines=others), "ddp_trials": len(ddp_trials),
                "ddp_best_s": best["runtime"] if best else None, "horovod_trials": len(hvd_trials),
                "horovod_best_s": hvd["runtime"] if hvd else None}

    def record(proposal, result: dict, **extra: Any) -> None:
        best_base = summary_now()["best_baseline_s"]
        mean = result.get("mean_s") if result.get("status") == "ok" else None
        # The dataset row lands before the searcher learns of the trial: --resume relies on it.
        record_result(result, proposal.strategy, model, cluster, dataset=ds, logger=logger, origin=proposal.origin,
                      search_id=search_id, trial_id=proposal.trial_id, predicted_time_s=proposal.predicted,
                      experiment=exp.name, parent_run_id=parent, workload_source=workload.source,
                      speedup_over_best_baseline=best_base / mean if (best_base and mean) else None, **extra)

    class _Searcher(Searcher):
        """Ask/tell by Tune trial id; its state is Algorithm 1's plain-JSON state."""

        def __init__(self):
            super().__init__(metric="mean_s", mode="min")

        def save(self, checkpoint_path: str) -> None:
            Path(checkpoint_path).write_text(json.dumps(algo.state()))

        def restore(self, checkpoint_path: str) -> None:
            nonlocal algo
            algo = Algorithm1.from_state(json.loads(Path(checkpoint_path).read_text()), model, cluster, exp,
                                         make_search_simulator(exp, model, cluster), project)

        def suggest(self, trial_id: str):
            if algo.finished:
                return Searcher.FINISHED
            proposal = algo.ask() if free_slices else None
            if proposal is None:
                # Nothing new to try (every proposal measured already) ends the search; otherwise
                # Tune asks again once a running trial completes.
                return Searcher.FINISHED if algo.finished and not proposals else None
            proposals[trial_id] = (proposal, free_slices.pop(0))
            config = {"slice": proposals[trial_id][1], "strategy": proposal.strategy.to_dict(),
                      "trial_config": trial_config}
            if keras:
                from ..engine.tensorflow import tensorflow_runtime

                config["runtime"] = tensorflow_runtime(proposal.strategy, model)
            return config

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            proposal, slice_name = proposals.pop(trial_id)
            free_slices.append(slice_name)
            outcome = _outcome(result)
            if keras:
                from ..engine.tensorflow import tensorflow_runtime

                runtime = tensorflow_runtime(proposal.strategy, model)
                record(proposal, outcome, runtime="tensorflow",
                       runtime_json=json.dumps(runtime["tensorflow"], sort_keys=True))
            else:
                record(proposal, outcome)
            algo.tell(proposal.trial_id, outcome.get("mean_s") if outcome["status"] == "ok" else None)
            _notify(search_id, outcome, summary_now())

    class _RecordDDP(tune.Callback):
        """Records each tuned-DDP trial as it completes (before Optuna's study moves on)."""

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            self._record(trial)

        def on_trial_error(self, iteration, trials, trial, **info) -> None:
            self._record(trial)

        def _record(self, trial) -> None:
            outcome = _outcome(trial.last_result)
            params = {k: trial.config[k] for k in DDP_SPACE}
            config = ddp_config_of(params)
            trial_id = f"ddp-{len(ddp_trials)}"
            record(_Recorded(trial_id, skeleton), outcome, runtime="ddp",
                   runtime_json=json.dumps(config.to_dict(), sort_keys=True))
            ddp_trials.append({"params": params, "trial_id": trial_id, "config": config.to_dict(),
                               "runtime": outcome.get("mean_s") if outcome["status"] == "ok" else None})
            _notify(search_id, outcome, summary_now())

    start = time.monotonic()
    if on_trial:
        _CALLBACKS[search_id] = on_trial
    storage = str(path_under(data_home(), "tune"))
    confirmation: dict | None = None
    try:
        ddp_remaining = exp.ddp_trials - len(ddp_trials)
        if ddp_remaining > 0 and keras:
            say(f"tuned torch DDP skipped: {workload.name} is a Keras model (ddp_trials: {exp.ddp_trials} ignored)")
        elif ddp_remaining > 0:
            say(f"tuning torch DDP: {ddp_remaining} trial(s), bucket size, first bucket and comm hook by Optuna "
                f"(TPE) through Ray Tune")
            known = [(t["params"], t["runtime"]) for t in ddp_trials if t["params"] and t["runtime"] is not None]
            tune.Tuner(
                tune.with_resources(_trainable, {"CPU": 0, **on_head}),
                param_space={"slice": slice_names[0], "strategy": skeleton.to_dict(), "trial_config": trial_config},
                tune_config=tune.TuneConfig(search_alg=_ddp_searcher(exp, model, cluster, known),
                                            num_samples=ddp_remaining, max_concurrent_trials=1, reuse_actors=True),
                run_config=tune.RunConfig(name=f"{search_id}-ddp", storage_path=storage, verbose=0,
                                          callbacks=[_RecordDDP()]),
            ).fit()
        measured = {t["entry"] for t in hvd_trials}
        for entry, config in hvd_entries:
            if entry in measured:
                continue
            say(f"real Horovod baseline {entry}: {config.summary()}")
            from ..engine.horovod import horovod_runtime

            outcome = ray.get(holders[0].run.remote(skeleton.to_dict(), trial_config, horovod_runtime(config)))
            trial_id = f"hvd-{len(hvd_trials)}"
            record(_Recorded(trial_id, skeleton, origin=entry), outcome, runtime="horovod",
                   runtime_json=json.dumps(config.to_dict(), sort_keys=True))
            hvd_trials.append({"trial_id": trial_id, "entry": entry, "config": config.to_dict(),
                               "runtime": outcome.get("mean_s") if outcome["status"] == "ok" else None})
            _notify(search_id, outcome, summary_now())
        remaining = exp.budget - len(algo.trials)
        if remaining > 0 and not algo.finished:
            say(f"searching: {remaining} trial(s) of {exp.algorithm}, builder baselines first")
            tuner = tune.Tuner(
                # The trainable only forwards to a slice actor: no CPU, a sliver of the head.
                tune.with_resources(_trainable, {"CPU": 0, **on_head}),
                # Reusing the trainables' actors saves a process start per trial (most of a
                # small trial's overhead: benchmarks/trial_overhead.py).
                tune_config=tune.TuneConfig(search_alg=_Searcher(), num_samples=remaining,
                                            max_concurrent_trials=exp.slices, reuse_actors=True),
                run_config=tune.RunConfig(name=search_id, storage_path=storage, verbose=0),
            )
            tuner.fit()
        if exp.confirm_rounds and keras:
            confirmation = {"error": "not confirmed: TensorFlow starts once per process, so two arms cannot be "
                                     "interleaved on the same processes; the figures are single trials"}
            say(f"confirmation skipped: {confirmation['error']}")
        elif exp.confirm_rounds:
            arms = _confirmation_arms(algo, runtime_best(), skeleton, exp.confirm_candidates)
            if arms is None:
                confirmation = {"error": "nothing to confirm: no searched strategy and baseline both finished"}
            else:
                (candidates, b), names = arms
                screen_rounds = max(2, exp.confirm_rounds // 2) if len(candidates) > 1 else 0
                if screen_rounds:
                    say(f"screening the {len(candidates)} fastest searched strategies ({', '.join(names[:-1])}) with the "
                        f"best baseline ({names[-1]}): {screen_rounds} interleaved rounds of {exp.confirm_iters} "
                        f"iterations each")
                say(f"confirming {'the pick' if screen_rounds else names[0]} against the best baseline ({names[-1]}): "
                    f"{exp.confirm_rounds} interleaved rounds of {exp.confirm_iters} iterations each")
                try:
                    confirmation = ray.get(holders[0].confirm.remote(
                        [(c[0].to_dict(), c[1]) for c in candidates] + [(b[0].to_dict(), b[1])], trial_config,
                        exp.confirm_rounds, exp.confirm_iters, screen_rounds))
                except Exception as exc:  # noqa: BLE001 - every trial is recorded; the summary must survive
                    confirmation = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                picked = int(confirmation.get("picked", 0))
                a = candidates[picked]
                if screen_rounds:
                    confirmation["screened"] = names[:-1]
                    if "picked" in confirmation:
                        say(f"screening picked {names[picked]}")
                confirmation.update({"candidate": names[picked], "baseline": names[-1], "candidate_hash": a[0].hash,
                                     "candidate_strategy": a[0].to_dict(), "baseline_strategy": b[0].to_dict(),
                                     "baseline_ddp": b[1]["ddp"] if b[1] and b[1]["kind"] == "ddp" else None,
                                     "baseline_horovod": b[1]["horovod"] if b[1] and b[1]["kind"] == "horovod"
                                     else None})
                if "ratio" in confirmation:
                    # The confirmation is part of the search's memory: a row (the candidate's
                    # per-round medians, the whole confirmation in its extra), so reports made
                    # from the dataset show it.
                    record(_Recorded(f"confirm-{sum(r.trial_id.startswith('confirm-') for r in done)}", a[0],
                                        origin="confirmation"), _confirmation_result(confirmation, a[0], cluster, exp))
    finally:
        _CALLBACKS.pop(search_id, None)
        _release(holders)
    summary = summary_now()
    best_ddp = ddp_best()
    best_hvd = hvd_best()
    summary.update({"search_id": search_id, "wall_s": time.monotonic() - start, "mlflow_parent_run": parent,
                    "ddp_trials": len(ddp_trials), "ddp_best_s": best_ddp["runtime"] if best_ddp else None,
                    "ddp_best_config": best_ddp["config"] if best_ddp else None,
                    "horovod_trials": len(hvd_trials), "horovod_best_s": best_hvd["runtime"] if best_hvd else None,
                    "horovod_best_config": best_hvd["config"] if best_hvd else None,
                    "best_builder_baseline_s": algo.summary()["best_baseline_s"],
                    "confirmed": confirmation,
                    "simulator_selection": list(getattr(algo.simulator, "history", [])),
                    "training_free_simulator": getattr(getattr(algo.simulator, "training_free", algo.simulator),
                                                       "kind", None),
                    **_best_builder(algo)})
    summary["recommended"] = _recommendation(summary, runtime_best(), skeleton)
    metrics = {k.replace(".", "_"): summary.get(k) for k in (
        "speedup_over_best_baseline", "hit_rate", "best_runtime_s", "best_baseline_s", "trials", "failed",
        "trials_to_1.1x", "trials_to_1.2x", "ddp_best_s", "horovod_best_s", "best_builder_baseline_s")}
    if confirmation and "ratio" in confirmation:
        metrics.update({"confirmed_speedup": confirmation["ratio"], "confirmed_speedup_low": confirmation["low"],
                        "confirmed_speedup_high": confirmation["high"]})
    logger.log_metrics(parent, metrics, final_status="FINISHED")
    if summary["best_strategy"]:
        logger.log_text(parent, json.dumps(summary["best_strategy"], indent=1, sort_keys=True), "best_strategy.json")
    if confirmation:
        logger.log_text(parent, json.dumps(confirmation, indent=1, sort_keys=True), "confirmation.json")
    if summary["simulator_selection"]:
        logger.log_text(parent, json.dumps(summary["simulator_selection"], indent=1), "simulator_selection.json")
    # Each trial's row is its own Parquet file (committed the moment it is measured, so a killed
    # search loses nothing); a search leaves its partition as one file again, since reads slow
    # with the file count (2,244 rows: 4.2 s as one file each, 0.12 s compacted).
    try:
        ds.compact(model=model.name, cluster=cluster.name)
    except Exception as exc:  # noqa: BLE001 - the rows are all there as they were (the new file is
        # written before the old ones go; pyarrow's errors on an unreadable file are not OSErrors):
        # only reading them is slower, and the summary must survive
        say(f"the dataset's {model.name}/{cluster.name} partition was left uncompacted ({exc}); "
            f"`synctune dataset compact` does it later")
    return summary


@dataclass(frozen=True)
class _Recorded:
    """What recording needs of a row that is not a proposal of the searcher: a tuned-DDP trial
    (its strategy gives only replicas and batch split) or a confirmation."""

    trial_id: str
    strategy: Strategy
    origin: str = "ddp-tuned"
    predicted: float | None = None


def _runtime_name(best: dict) -> str:
    """How a tuned-DDP or Horovod baseline is named in summaries."""
    if best["kind"] == "horovod":
        from ..engine.horovod import HorovodConfig

        return f"Horovod ({best['entry']}): {HorovodConfig.from_dict(best['config']).summary()}"
    from ..engine.ddp import DDPConfig

    return f"tuned DDP: {DDPConfig.from_dict(best['config']).summary()}"


def _runtime_recommendation(best: dict, skeleton: Strategy, why: str) -> dict:
    return {"kind": "baseline", "name": _runtime_name(best), "strategy": skeleton.to_dict(),
            "ddp": best["config"] if best["kind"] == "ddp" else None,
            "horovod": best["config"] if best["kind"] == "horovod" else None, "why": why}


def _recommendation(summary: dict, runtime_best: dict | None, skeleton: Strategy) -> dict | None:
    """What the search recommends: the best searched strategy when the confirmation found it
    faster than the best baseline; else that baseline; without a confirmation, the fastest
    single trial (engine, tuned DDP or real Horovod). ``{"kind": "search"|"baseline", "name",
    "strategy", "ddp": DDPConfig dict or None, "horovod": HorovodConfig dict or None, "why"}``."""
    confirmed = summary.get("confirmed") or {}
    if "ratio" in confirmed:
        if confirmed["verdict"] == "faster":
            return {"kind": "search", "name": confirmed["candidate"], "strategy": confirmed["candidate_strategy"],
                    "ddp": None, "horovod": None, "why": "confirmed faster than the best baseline"}
        return {"kind": "baseline", "name": confirmed["baseline"], "strategy": confirmed["baseline_strategy"],
                "ddp": confirmed["baseline_ddp"], "horovod": confirmed.get("baseline_horovod"),
                "why": f"the best searched strategy was not confirmed faster ({confirmed['verdict']})"}
    if confirmed:  # attempted and failed: nothing searched is confirmed, so the best baseline
        base = summary.get("best_builder_baseline_s")
        why = f"the confirmation did not finish ({confirmed.get('error', '')[:120]})"
        if runtime_best is not None and (base is None or runtime_best["runtime"] < base):
            return _runtime_recommendation(runtime_best, skeleton, why)
        if base is not None and summary.get("best_baseline_strategy"):
            return {"kind": "baseline", "name": summary["best_baseline_origin"],
                    "strategy": summary["best_baseline_strategy"], "ddp": None, "horovod": None, "why": why}
    best = summary.get("best_runtime_s")
    if runtime_best is not None and (best is None or runtime_best["runtime"] < best):
        return _runtime_recommendation(runtime_best, skeleton, "fastest single trial (unconfirmed)")
    if summary.get("best_strategy") is None:
        return None
    origin = summary.get("best_origin") or ""
    return {"kind": "baseline" if origin.partition(":")[0] in BUILDERS else "search", "name": origin,
            "strategy": summary["best_strategy"], "ddp": None, "horovod": None,
            "why": "fastest single trial (unconfirmed)"}


def _best_builder(algo: Algorithm1) -> dict:
    builders = [t for t in algo.trials if t["trial_id"].startswith("baseline-") and t["runtime"] is not None]
    if not builders:
        return {"best_baseline_strategy": None, "best_baseline_origin": None}
    best = min(builders, key=lambda t: t["runtime"])
    return {"best_baseline_strategy": best["strategy"], "best_baseline_origin": best["origin"]}


def _confirmation_result(confirmation: dict, strategy: Strategy, cluster: ClusterSpec, exp: Experiment) -> dict:
    """A confirmation as a trial result of its candidate (times: per-round medians)."""
    import statistics

    times = confirmation["a_s"]
    extra = {k: v for k, v in confirmation.items() if k not in ("candidate_strategy", "baseline_strategy")}
    return {"status": "ok", "model": strategy.model["name"], "cluster": cluster.name, "cluster_scale": cluster.scale,
            "strategy_hash": strategy.hash, "launcher": confirmation.get("launcher", "ray"),
            "backend": confirmation.get("backend", ""), "device_kind": confirmation.get("device_kind", ""),
            "num_workers": len(strategy.replicas), "warmup": exp.warmup, "iters": len(times),
            "global_batch_size": strategy.global_batch_size, "iteration_times_s": list(times),
            "mean_s": statistics.fmean(times), "median_s": statistics.median(times),
            "std_s": statistics.pstdev(times), "samples_per_s": strategy.global_batch_size / statistics.fmean(times),
            "wall_s": confirmation.get("wall_s", 0.0), "extra": {"confirmation": extra}}


def _outcome(result: dict | None) -> dict:
    if result and "result_json" in result:
        return json.loads(result["result_json"])
    return {"status": "failed", "error": "the Tune trial raised before reporting", "launcher": "ray"}


def _confirmation_arms(algo: Algorithm1, runtime_best: dict | None, skeleton: Strategy, candidates: int = 1):
    """((candidate arms, baseline arm), names): the ``candidates`` searched strategies with the
    fastest single trials (distinct strategies, fastest first) and the fastest baseline
    (builder, tuned DDP or real Horovod) by its single trial, the baseline's name last; None if
    either is missing. An arm is (strategy, runtime or None); a runtime arm's dict also carries
    its ``kind`` and configuration under ``ddp`` or ``horovod``."""
    searched = [t for t in algo.trials if not t["trial_id"].startswith("baseline-") and t["runtime"] is not None]
    builders = [t for t in algo.trials if t["trial_id"].startswith("baseline-") and t["runtime"] is not None]
    if not searched or not (builders or runtime_best):
        return None
    picks, seen = [], set()
    for t in sorted(searched, key=lambda t: t["runtime"]):
        if len(picks) == candidates:
            break
        strategy = Strategy.from_dict(t["strategy"])
        if strategy.hash not in seen:
            seen.add(strategy.hash)
            picks.append(((strategy, None), f"{t['trial_id']} ({t['origin']})"))
    base = min(builders, key=lambda t: t["runtime"]) if builders else None
    if runtime_best is not None and (base is None or runtime_best["runtime"] < base["runtime"]):
        if runtime_best["kind"] == "horovod":
            from ..engine.horovod import HorovodConfig, horovod_runtime

            runtime = horovod_runtime(HorovodConfig.from_dict(runtime_best["config"]))
        else:
            from ..engine.ddp import DDPConfig

            runtime = ddp_runtime(DDPConfig.from_dict(runtime_best["config"]))
        baseline = ((skeleton, runtime), _runtime_name(runtime_best))
    else:
        baseline = ((Strategy.from_dict(base["strategy"]), None), f"builder {base['origin']}")
    return ([p[0] for p in picks], baseline[0]), [p[1] for p in picks] + [baseline[1]]


def _release(holders: list) -> None:
    """Tear down every slice (actors and placement groups), even if one of them hangs."""
    import ray

    refs = [h.shutdown.remote() for h in holders]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=60)
    finally:
        for h in holders:
            ray.kill(h)
