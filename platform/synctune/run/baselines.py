"""The baselines a search measures besides the builders (AutoDist §3.1's hand-optimised
systems, run for real): tuned torch DDP (its bucket sizes and comm hook chosen by Optuna's TPE
through Ray Tune, as Horovod's autotune tunes its fusion buffer), tuned torch FSDP2/HSDP (its
mesh, units, resharding, prefetch and reduce dtype, the same way, only among the
configurations the memory budget admits; issue 34 item 3) and the experiment's real Horovod
entries; and the ledger that keeps the best of each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.ddp import DDPConfig, DDPRuntime
from ..engine.fsdp import FSDP_DEFAULT, UNIT_CHOICES, FSDPConfig, FSDPRuntime
from ..engine.horovod import HOROVOD_DEFAULT, HorovodConfig, HorovodRuntime
from ..engine.runtime import Runtime
from ..engine.runtimes import runtime_from_record
from ..engine.trial import check_runtime
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy

__all__ = ["DDP_SPACE", "DDP_POWERSGD_RANK", "ddp_config_of", "ddp_hooks", "ddp_searcher", "FSDP_SPACE",
           "FSDP_TUNED", "fsdp_layout", "fsdp_layouts", "fsdp_config_of", "fsdp_searcher", "horovod_baselines",
           "BaselineTrial", "BaselineLedger", "RuntimeTuner", "TUNERS"]

#: The tuned-DDP search space (torch DDP's knobs): the comm hook, the bucket size cap (1-256 MiB)
#: and the first bucket's cap.
DDP_SPACE = ("comm_hook", "bucket_cap_mb", "first_bucket_mb")
#: PowerSGD's rank in tuned-DDP trials (the allreduce builder's default).
DDP_POWERSGD_RANK = 4
#: The origin of a tuned-DDP trial's row.
DDP_TUNED = "ddp-tuned"


def ddp_config_of(params: dict) -> DDPConfig:
    """The :class:`~synctune.engine.ddp.DDPConfig` of one tuned-DDP point."""
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


def ddp_searcher(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, done: list[tuple[dict, float]],
                 **context: Any):
    """Ray Tune's Optuna searcher (TPE, seeded) over :data:`DDP_SPACE`, told the points this
    search measured already; the first point of a fresh search is DDP's default. ``context``
    (what the driver gives every tuner, e.g. ``fits``) is not used: DDP's settings do not change
    what a rank holds beyond its buckets."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # progress is ours to show, one line per trial
    hooks = ddp_hooks(model, cluster, exp.search.lossy)
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
                                         n_startup_trials=min(3, exp.baselines.ddp_trials))
    return OptunaSearch(space=space, metric="mean_s", mode="min", sampler=sampler, points_to_evaluate=points,
                        evaluated_rewards=rewards)


#: The tuned-FSDP2 search space: ``layout`` (units, shard group, reshard after forward: one
#: categorical over :func:`fsdp_layouts`, so that only layouts the memory budget admits are in
#: it), ``prefetch`` (1: FSDP2's implicit one unit ahead; 2: explicit lists) and ``reduce_dtype``.
FSDP_SPACE = ("layout", "prefetch", "reduce_dtype")
#: The origin of a tuned-FSDP2 trial's row.
FSDP_TUNED = "fsdp-tuned"
#: The prefetch depths tuned (0 and 1 are the same FSDP2 run: see :mod:`synctune.engine.fsdp`).
_FSDP_PREFETCH = (1, 2)


def fsdp_layout(config: FSDPConfig) -> str:
    """The layout string of ``config``'s units, shard group and resharding, e.g.
    ``blocks/g0/reshard`` (per-block units over every replica, ZeRO-3), ``blocks/g2/keep`` (HSDP
    with shard groups of 2, parameters kept after forward) or ``root/g0/keep`` (one unit; FSDP2
    never reshards the root, so a root layout is always ``keep``)."""
    if not isinstance(config.units, str) or not isinstance(config.reshard_after_forward, bool):
        raise SpecError(f"fsdp layout: only units {' or '.join(UNIT_CHOICES)} with reshard_after_forward true or "
                        f"false have a layout, got units {config.units!r:.60}, reshard_after_forward "
                        f"{config.reshard_after_forward!r}")
    keep = config.units == "root" or not config.reshard_after_forward
    return f"{config.units}/g{config.group}/{'keep' if keep else 'reshard'}"


def _layout_config(layout: str, prefetch: int = 1, reduce_dtype: str = "fp32") -> FSDPConfig:
    parts = layout.split("/") if isinstance(layout, str) else []
    ok = (len(parts) == 3 and parts[0] in UNIT_CHOICES and parts[1][:1] == "g" and parts[1][1:].isascii()
          and parts[1][1:].isdigit() and len(parts[1]) <= 8 and parts[2] in ("reshard", "keep"))
    if not ok:
        raise SpecError(f"tuned fsdp: layout: expected UNITS/gGROUP/reshard|keep (units {', '.join(UNIT_CHOICES)}), "
                        f"got {str(layout)[:60]!r}")
    return FSDPConfig(units=parts[0], group=int(parts[1][1:]), reshard_after_forward=parts[2] == "reshard",
                      prefetch=prefetch, reduce_dtype=reduce_dtype)


def fsdp_config_of(params: dict) -> FSDPConfig:
    """The :class:`~synctune.engine.fsdp.FSDPConfig` of one tuned-FSDP2 point."""
    prefetch = params["prefetch"]
    if prefetch not in _FSDP_PREFETCH or isinstance(prefetch, bool):
        raise SpecError(f"tuned fsdp: prefetch: expected one of {_FSDP_PREFETCH}, got {prefetch!r}")
    return _layout_config(params["layout"], int(prefetch), params["reduce_dtype"])


def _fsdp_groups(cluster: ClusterSpec) -> list[int]:
    """The shard groups tuned: 0 (every replica), and HSDP over the nodes (shard inside a node,
    all-reduce across) where there are several nodes of the same two or more devices."""
    sizes = {n.num_devices for n in cluster.nodes}
    per_node = next(iter(sizes))
    return [0] + ([per_node] if len(cluster.nodes) > 1 and len(sizes) == 1 and per_node >= 2 else [])


def fsdp_layouts(model: ModelSpec, cluster: ClusterSpec,
                 fits: Callable[[FSDPConfig], bool] | None = None) -> list[str]:
    """The layouts a tuned-FSDP2 search tries in a domain: units ``blocks`` (resharded or kept)
    and ``root``, on each shard group of :func:`_fsdp_groups`, those whose configuration at
    prefetch 1 and an fp32 reduce (the least memory of the layout's points) ``fits`` accepts
    (all when None); none for a model with sparse gradients (FSDP2 cannot run it)."""
    if any(v.sparse for v in model.variables):
        return []
    configs = [FSDPConfig(units=units, group=group, reshard_after_forward=reshard, prefetch=1)
               for units in UNIT_CHOICES for group in _fsdp_groups(cluster)
               for reshard in ((True, False) if units != "root" else (False,))]
    return [fsdp_layout(c) for c in configs if fits is None or fits(c)]


def _fsdp_default_point(layouts: list[str]) -> dict:
    """FSDP2 as users start with it where it fits, else the first layout that fits."""
    default = fsdp_layout(FSDP_DEFAULT)
    return {"layout": default if default in layouts else layouts[0], "prefetch": 1, "reduce_dtype": "fp32"}


def fsdp_searcher(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, done: list[tuple[dict, float]],
                  **context: Any):
    """Ray Tune's Optuna searcher (TPE, seeded as :func:`ddp_searcher`'s) over :data:`FSDP_SPACE`,
    told the points this search measured already; the first point of a fresh search is FSDP2's
    default (:data:`~synctune.engine.fsdp.FSDP_DEFAULT`) where it fits, else the first fitting
    layout at prefetch 1 and fp32. ``context["fits"]`` (an ``FSDPConfig`` predicate, the memory
    budget's) narrows the layouts; a drawn point whose prefetch or reduce dtype would not fit is
    marked failed to Optuna (never a time it did not measure) and the same layout at the nearest
    fitting settings is suggested in its place. Refuses a domain with no layout to try."""
    import optuna

    fits = context.get("fits")
    layouts = fsdp_layouts(model, cluster, fits)
    if not layouts:
        why = ("the model has sparse gradients, which FSDP2 cannot reduce-scatter"
               if any(v.sparse for v in model.variables) else "no FSDP2 layout fits the memory budget")
        raise SpecError(f"tuned fsdp: nothing to tune: {why}; leave tuned FSDP2 out of this search")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dtypes = ["fp32", "bf16"] if exp.search.lossy else ["fp32"]
    space = {"layout": optuna.distributions.CategoricalDistribution(layouts),
             "prefetch": optuna.distributions.CategoricalDistribution(list(_FSDP_PREFETCH)),
             "reduce_dtype": optuna.distributions.CategoricalDistribution(dtypes)}
    # An edited experiment (another budget, lossy off) narrows the space: points outside it are dropped.
    done = [(p, t) for p, t in done if p.get("layout") in layouts and p.get("prefetch") in _FSDP_PREFETCH
            and p.get("reduce_dtype") in dtypes]
    points = [dict(p) for p, _t in done] or [_fsdp_default_point(layouts)]
    rewards = [t for _p, t in done] or None
    budget = exp.baselines.fsdp_trials if isinstance(exp.baselines.fsdp_trials, int) else 8  # auto: 8 where it runs
    sampler = optuna.samplers.TPESampler(seed=(exp.seed * 1_000_003 + len(done)) % 2**32,
                                         n_startup_trials=max(1, min(3, budget)))
    return _fitting_search_class()(fits=fits, space=space, metric="mean_s", mode="min", sampler=sampler,
                                   points_to_evaluate=points, evaluated_rewards=rewards)


def _fitting_search_class():
    """Ray Tune's ``OptunaSearch`` that suggests only points ``fits`` accepts (built on first
    use: Ray is imported only by the commands that tune)."""
    global _FITTING_SEARCH
    if _FITTING_SEARCH is not None:
        return _FITTING_SEARCH
    from optuna.trial import TrialState
    from ray.tune.search.optuna import OptunaSearch

    class FittingOptunaSearch(OptunaSearch):
        def __init__(self, *, fits: Callable[[FSDPConfig], bool] | None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._fits = fits

        def suggest(self, trial_id: str) -> dict | None:
            point = super().suggest(trial_id)
            if point is None or self._fits is None or self._fits(fsdp_config_of(point)):
                return point
            # The layout fits at prefetch 1 and fp32 (fsdp_layouts): the nearest of its points that
            # fits replaces the draw, which Optuna records as failed, so TPE learns no time for it.
            self._ot_study.tell(self._ot_trials.pop(trial_id), None, state=TrialState.FAIL)
            options = [(p, d) for p in dict.fromkeys((point["prefetch"], 1)) for d in
                       dict.fromkeys((point["reduce_dtype"], "fp32"))]
            prefetch, dtype = next(((p, d) for p, d in options if self._fits(fsdp_config_of(
                {"layout": point["layout"], "prefetch": p, "reduce_dtype": d}))), (1, "fp32"))
            self._ot_study.enqueue_trial({"layout": point["layout"], "prefetch": prefetch, "reduce_dtype": dtype})
            return super().suggest(trial_id)

        def __getstate__(self) -> dict:
            # Tune pickles its searcher when the Tuner is made (tuner.pkl); the predicate holds
            # the live session's memory model and need not travel with it.
            return {**self.__dict__, "_fits": None}

        def save(self, checkpoint_path: str) -> None:
            # The predicate is the session's (a closure over its memory model): not part of the state.
            fits, self._fits = self._fits, None
            try:
                super().save(checkpoint_path)
            finally:
                self._fits = fits

    _FITTING_SEARCH = FittingOptunaSearch
    return _FITTING_SEARCH


_FITTING_SEARCH = None


@dataclass(frozen=True)
class RuntimeTuner:
    """How a search tunes a runtime's settings before its own trials (Optuna's TPE through Ray
    Tune): the runtime's name, the parameters of its space, the origin of its rows, the runtime of
    a point, and the Tune searcher seeded with the points measured already."""

    runtime: str
    space: tuple[str, ...]
    origin: str
    runtime_of: Callable[[dict], Runtime]
    #: ``searcher(exp, model, cluster, done, **context)``: every tuner is called the same way;
    #: ``context`` may hold ``fits`` (an :class:`~synctune.engine.fsdp.FSDPConfig` predicate of
    #: the memory budget), which a tuner whose settings change memory honours.
    searcher: Callable[..., Any]
    #: How progress names it, the knobs it tunes, and how summaries name its trials.
    title: str
    knobs: str
    label: str


#: The runtimes a search tunes, by name.
TUNERS: dict[str, RuntimeTuner] = {
    "ddp": RuntimeTuner(runtime="ddp", space=DDP_SPACE, origin=DDP_TUNED,
                        runtime_of=lambda params: DDPRuntime(ddp_config_of(params)), searcher=ddp_searcher,
                        title="torch DDP", knobs="bucket size, first bucket and comm hook", label="tuned DDP"),
    "fsdp": RuntimeTuner(runtime="fsdp", space=FSDP_SPACE, origin=FSDP_TUNED,
                         runtime_of=lambda params: FSDPRuntime(fsdp_config_of(params)), searcher=fsdp_searcher,
                         title="torch FSDP2",
                         knobs="mesh (HSDP group), units, reshard after forward, prefetch and reduce dtype",
                         label="tuned FSDP2"),
}


def horovod_baselines(exp: Experiment, model: ModelSpec, cluster: ClusterSpec,
                      workload: Any = None) -> list[tuple[str, HorovodRuntime]]:
    """The experiment's real-Horovod baselines as (entry, runtime), each checked as a trial
    (Horovod installed, with the binding ``workload`` needs; settings it executes) before
    anything runs."""
    out = []
    where = exp.source or exp.name
    label = exp.baselines.key("horovod")  # as the file wrote it: baselines or baselines.horovod
    for entry in exp.baselines.horovod:
        options = {}
        for item in filter(None, entry.partition(":")[2].split(",")):
            key, _eq, text = item.partition("=")
            options[key.strip()] = text.strip()
        unknown = [k for k in options if k not in HOROVOD_DEFAULT.to_dict()]
        if unknown:
            raise SpecError(f"{where}: {label}: {entry!r}: unknown Horovod setting {unknown[0]!r}; valid: "
                            f"{', '.join(HOROVOD_DEFAULT.to_dict())}")
        try:
            runtime = HorovodRuntime(HorovodConfig.from_options(options))
            check_runtime(runtime, build_strategy("allreduce", model, cluster), model, cluster, workload)
        except SpecError as exc:
            raise SpecError(f"{where}: {label}: {entry!r}: {exc}") from None
        out.append((entry, runtime))
    return out


@dataclass(frozen=True, kw_only=True)
class BaselineTrial:
    """One measured trial of a baseline run by another runtime than the engine (tuned DDP, real
    Horovod): ``mean_s`` None when it did not finish; ``params`` the tuner's point, if tuned."""

    trial_id: str
    runtime: Runtime
    origin: str
    mean_s: float | None
    params: dict | None = None

    @property
    def label(self) -> str:
        """How summaries name it, e.g. ``tuned DDP: ddp bucket 25 MiB, hook none``."""
        tuner = next((t for t in TUNERS.values() if t.origin == self.origin), None)
        kind = tuner.label if tuner else f"{self.runtime.name.capitalize()} ({self.origin})"
        return f"{kind}: {self.runtime.summary()}"

    @classmethod
    def from_record(cls, record: Any) -> "BaselineTrial":
        """The baseline trial of a dataset row (a resumed search's memory)."""
        extra = json.loads(record.extra_json or "{}")
        return cls(trial_id=record.trial_id, runtime=runtime_from_record(record.runtime, record.runtime_json),
                   origin=record.origin, mean_s=record.mean_s if record.status == "ok" else None,
                   params=extra.get(f"{record.runtime}_params"))


class BaselineLedger:
    """The baselines run by other runtimes, by runtime name, in the order they were measured;
    the best of each and of all (by their single trials: the confirmation screens them)."""

    def __init__(self, trials: list[BaselineTrial] | tuple = ()) -> None:
        self.trials: list[BaselineTrial] = list(trials)

    def add(self, trial: BaselineTrial) -> None:
        self.trials.append(trial)

    def of(self, runtime: str) -> list[BaselineTrial]:
        """The trials run by ``runtime``."""
        return [t for t in self.trials if t.runtime.name == runtime]

    def best(self, runtime: str | None = None) -> BaselineTrial | None:
        """The fastest finished trial of ``runtime`` (of every runtime when None)."""
        ok = [t for t in (self.trials if runtime is None else self.of(runtime)) if t.mean_s is not None]
        return min(ok, key=lambda t: t.mean_s) if ok else None

    def runtimes(self) -> list[str]:
        """The runtimes measured, in the order first measured."""
        return list(dict.fromkeys(t.runtime.name for t in self.trials))

    def best_times_s(self) -> tuple[float, ...]:
        """The best time of each runtime (what the search's figures count as baselines)."""
        return tuple(b.mean_s for b in map(self.best, self.runtimes()) if b is not None)
