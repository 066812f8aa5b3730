"""The confirmation of a search's winner (DESIGN.md "confirmed speed-up"): its fastest searched
strategies and the fastest baselines screened together, and the two picks re-measured
interleaved on the same processes until a 95% interval decides
(:class:`~synctune.stats.SequentialRule`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..engine.composed import ENGINE
from ..engine.measure import TrialResult
from ..engine.runtime import Runtime
from ..spec.cluster import ClusterSpec
from ..strategy.schema import Strategy
from .baselines import BaselineLedger

__all__ = ["Arm", "confirmation_arms", "baseline_arms", "confirmation_result", "is_builder_trial", "trial_mean_s"]

@dataclass(frozen=True)
class Arm:
    """One arm of a confirmation: a strategy, the runtime that runs it, and its name in summaries."""

    strategy: Strategy
    runtime: Runtime
    label: str

    def to_payload(self) -> tuple[dict, dict]:
        """(strategy, runtime) as plain data, as the confirmation's Ray call carries them."""
        return self.strategy.to_dict(), self.runtime.to_dict()


def trial_mean_s(trial: dict) -> float | None:
    """A search trial's measured mean iteration time (None if it did not finish)."""
    return trial["mean_s"]


def is_builder_trial(trial: dict) -> bool:
    """Whether a search trial is one of the builder baselines it measures first."""
    return trial["trial_id"].startswith("baseline-")


def confirmation_arms(search_trials: list[dict], ledger: BaselineLedger, skeleton: Strategy,
                      candidates: int = 1, baselines: int = 1,
                      runtime_of: Callable[[Strategy], Runtime] = lambda _s: ENGINE) -> tuple[list[Arm], list[Arm]] | None:
    """(candidate arms, baseline arms): the ``candidates`` searched strategies with the fastest
    single trials (distinct strategies, fastest first), and up to ``baselines`` baselines
    (:func:`baseline_arms`); None if either side is empty. ``runtime_of``: the runtime that runs
    a strategy of the search (FSDP2 for one whose shard units reshard)."""
    finished = [t for t in search_trials if trial_mean_s(t) is not None]
    searched = [t for t in finished if not is_builder_trial(t)]
    picks: list[Arm] = []
    seen: set[str] = set()
    for t in sorted(searched, key=trial_mean_s):
        if len(picks) == candidates:
            break
        strategy = Strategy.from_dict(t["strategy"])
        if strategy.hash not in seen:
            seen.add(strategy.hash)
            picks.append(Arm(strategy=strategy, runtime=runtime_of(strategy), label=f"{t['trial_id']} ({t['origin']})"))
    bases = baseline_arms([t for t in finished if is_builder_trial(t)], ledger, skeleton, baselines, runtime_of)
    if not picks or not bases:
        return None
    return picks, bases


def baseline_arms(builder_trials: list[dict], ledger: BaselineLedger, skeleton: Strategy, count: int,
                  runtime_of: Callable[[Strategy], Runtime] = lambda _s: ENGINE) -> list[Arm]:
    """The baselines a confirmation screens, fastest single trial first: the fastest of each
    kind (the builders, and each runtime of the ledger: tuned DDP, Horovod), then the next
    fastest of any kind, up to ``count``, each distinct (a builder by its strategy, a runtime by
    its settings); at most one runtime that starts once per process (Horovod), since two cannot
    share the confirmation's processes."""
    found: list[tuple[float, str, str, Arm]] = []  # (time, kind, identity, arm)
    for t in builder_trials:
        strategy = Strategy.from_dict(t["strategy"])
        found.append((trial_mean_s(t), "builder", strategy.hash, Arm(strategy=strategy, runtime=runtime_of(strategy),
                                                                     label=f"builder {t['origin']}")))
    for t in ledger.trials:
        if t.mean_s is not None:
            found.append((t.mean_s, t.runtime.name, t.runtime.config_json(),
                          Arm(strategy=skeleton, runtime=t.runtime, label=t.label)))
    found.sort(key=lambda f: f[0])
    kinds: set[str] = set()
    firsts = []  # the fastest of each kind first, then the rest, each in time order
    for i, f in enumerate(found):
        if f[1] not in kinds:
            kinds.add(f[1])
            firsts.append(i)
    order = firsts + [i for i in range(len(found)) if i not in firsts]
    arms: list[Arm] = []
    seen: set[str] = set()
    once = False
    for _time, _kind, identity, arm in (found[i] for i in order):
        if len(arms) == count:
            break
        if identity in seen or (once and arm.runtime.once_per_process):
            continue
        seen.add(identity)
        once = once or arm.runtime.once_per_process
        arms.append(arm)
    return arms


def confirmation_result(confirmation: dict[str, Any], strategy: Strategy, cluster: ClusterSpec, *,
                        warmup: int) -> TrialResult:
    """A confirmation as a trial result of its candidate (its times: the per-round medians)."""
    times = confirmation["a_s"]
    extra = {k: v for k, v in confirmation.items() if k not in ("candidate_strategy", "baseline_strategy")}
    return TrialResult.from_times(
        list(times), model=strategy.model["name"], cluster=cluster.name, cluster_scale=cluster.scale,
        strategy_hash=strategy.hash, launcher=confirmation.get("launcher", "ray"),
        backend=confirmation.get("backend", ""), device_kind=confirmation.get("device_kind", ""),
        num_workers=len(strategy.replicas), warmup=warmup, iters=len(times),
        global_batch_size=strategy.global_batch_size, wall_s=confirmation.get("wall_s", 0.0),
        extra={"confirmation": extra})
