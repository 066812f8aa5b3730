"""The baselines a search measures besides the builders (AutoDist §3.1's hand-optimised
systems, run for real): tuned torch DDP (its bucket sizes and comm hook chosen by Optuna's TPE
through Ray Tune, as Horovod's autotune tunes its fusion buffer) and the experiment's real
Horovod entries; and the ledger that keeps the best of each."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.ddp import DDPConfig, DDPRuntime
from ..engine.horovod import HOROVOD_DEFAULT, HorovodConfig, HorovodRuntime
from ..engine.runtime import Runtime
from ..engine.runtimes import runtime_from_record
from ..engine.trial import check_runtime
from ..search.experiment import Experiment
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy

__all__ = ["DDP_SPACE", "DDP_POWERSGD_RANK", "ddp_config_of", "ddp_hooks", "ddp_searcher", "horovod_baselines",
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


def ddp_searcher(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, done: list[tuple[dict, float]]):
    """Ray Tune's Optuna searcher (TPE, seeded) over :data:`DDP_SPACE`, told the points this
    search measured already; the first point of a fresh search is DDP's default."""
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


@dataclass(frozen=True)
class RuntimeTuner:
    """How a search tunes a runtime's settings before its own trials (Optuna's TPE through Ray
    Tune): the runtime's name, the parameters of its space, the origin of its rows, the runtime of
    a point, and the Tune searcher seeded with the points measured already."""

    runtime: str
    space: tuple[str, ...]
    origin: str
    runtime_of: Callable[[dict], Runtime]
    searcher: Callable[[Experiment, ModelSpec, ClusterSpec, list[tuple[dict, float]]], Any]
    #: How progress names it, the knobs it tunes, and how summaries name its trials.
    title: str
    knobs: str
    label: str


#: The runtimes a search tunes, by name.
TUNERS: dict[str, RuntimeTuner] = {
    "ddp": RuntimeTuner(runtime="ddp", space=DDP_SPACE, origin=DDP_TUNED,
                        runtime_of=lambda params: DDPRuntime(ddp_config_of(params)), searcher=ddp_searcher,
                        title="torch DDP", knobs="bucket size, first bucket and comm hook", label="tuned DDP"),
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
