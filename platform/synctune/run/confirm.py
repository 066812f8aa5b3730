"""The confirmation of a search's winner (DESIGN.md "confirmed speed-up"): its fastest searched
strategies screened and the pick re-measured against the best baseline, interleaved on the same
processes, with a 95% interval."""

from __future__ import annotations

from typing import Any

from ..engine.composed import ENGINE
from ..engine.measure import TrialResult
from ..engine.runtime import Runtime
from ..spec.cluster import ClusterSpec
from ..strategy.schema import Strategy
from .baselines import BaselineLedger

__all__ = ["Arm", "confirmation_arms", "confirmation_result", "is_builder_trial", "trial_mean_s"]

#: One arm of a confirmation: a strategy, the runtime that runs it, and its name in summaries.
Arm = tuple[Strategy, Runtime, str]


def trial_mean_s(trial: dict) -> float | None:
    """A search trial's measured mean iteration time (None if it did not finish)."""
    return trial["mean_s"]


def is_builder_trial(trial: dict) -> bool:
    """Whether a search trial is one of the builder baselines it measures first."""
    return trial["trial_id"].startswith("baseline-")


def confirmation_arms(search_trials: list[dict], ledger: BaselineLedger, skeleton: Strategy,
                      candidates: int = 1) -> tuple[list[Arm], Arm] | None:
    """(candidate arms, the baseline arm): the ``candidates`` searched strategies with the
    fastest single trials (distinct strategies, fastest first) and the fastest baseline (builder,
    or a runtime's baseline on ``skeleton``'s replicas) by its single trial; None if either is
    missing."""
    finished = [t for t in search_trials if trial_mean_s(t) is not None]
    searched = [t for t in finished if not is_builder_trial(t)]
    builders = [t for t in finished if is_builder_trial(t)]
    other = ledger.best()
    if not searched or not (builders or other):
        return None
    picks: list[Arm] = []
    seen: set[str] = set()
    for t in sorted(searched, key=trial_mean_s):
        if len(picks) == candidates:
            break
        strategy = Strategy.from_dict(t["strategy"])
        if strategy.hash not in seen:
            seen.add(strategy.hash)
            picks.append((strategy, ENGINE, f"{t['trial_id']} ({t['origin']})"))
    base = min(builders, key=trial_mean_s) if builders else None
    if other is not None and (base is None or other.mean_s < trial_mean_s(base)):
        return picks, (skeleton, other.runtime, other.label)
    return picks, (Strategy.from_dict(base["strategy"]), ENGINE, f"builder {base['origin']}")


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
