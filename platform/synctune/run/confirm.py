"""The confirmation of a search's winner (DESIGN.md "confirmed speed-up"): its fastest searched
strategies and the fastest baselines screened together, and the two picks re-measured
interleaved on the same processes until a 95% interval decides
(:class:`~synctune.stats.SequentialRule`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..data.confirmation import Confirmation
from ..engine.composed import ENGINE
from ..engine.measure import TrialResult
from ..engine.runtime import Runtime
from ..search.interface import SearchTrial
from ..spec.cluster import ClusterSpec
from ..strategy.schema import Strategy
from .baselines import BaselineLedger

__all__ = ["Arm", "confirmation_arms", "baseline_arms", "confirmation_result"]


@dataclass(frozen=True)
class Arm:
    """One arm of a confirmation: a strategy, the runtime that runs it, and its name in summaries."""

    strategy: Strategy
    runtime: Runtime
    label: str

    def to_payload(self) -> tuple[dict, dict]:
        """(strategy, runtime) as plain data, as the confirmation's Ray call carries them."""
        return self.strategy.to_dict(), self.runtime.to_dict()


def confirmation_arms(search_trials: list[SearchTrial], ledger: BaselineLedger, skeleton: Strategy,
                      candidates: int = 1, baselines: int = 1,
                      runtime_of: Callable[[Strategy], Runtime] = lambda _s: ENGINE) -> tuple[list[Arm], list[Arm]] | None:
    """(candidate arms, baseline arms): the ``candidates`` searched strategies with the fastest
    single trials (distinct strategies, fastest first), and up to ``baselines`` baselines
    (:func:`baseline_arms`); None if either side is empty. ``runtime_of``: the runtime that runs
    a strategy of the search (FSDP2 for one whose shard units reshard)."""
    finished = [t for t in search_trials if t.ok]
    picks: list[Arm] = []
    seen: set[str] = set()
    for t in sorted((t for t in finished if not t.is_builder), key=lambda t: t.mean_s):
        if len(picks) == candidates:
            break
        if t.strategy.hash not in seen:
            seen.add(t.strategy.hash)
            picks.append(Arm(strategy=t.strategy, runtime=runtime_of(t.strategy), label=f"{t.trial_id} ({t.origin})"))
    bases = baseline_arms([t for t in finished if t.is_builder], ledger, skeleton, baselines, runtime_of)
    if not picks or not bases:
        return None
    return picks, bases


def baseline_arms(builder_trials: list[SearchTrial], ledger: BaselineLedger, skeleton: Strategy, count: int,
                  runtime_of: Callable[[Strategy], Runtime] = lambda _s: ENGINE) -> list[Arm]:
    """The baselines a confirmation screens, fastest single trial first: the fastest of each
    kind (the builders, and each runtime of the ledger: tuned DDP, Horovod), then the next
    fastest of any kind, up to ``count``, each distinct (a builder by its strategy, a runtime by
    its settings); at most one runtime that starts once per process (Horovod), since two cannot
    share the confirmation's processes."""
    found: list[tuple[float, str, str, Arm]] = []  # (time, kind, identity, arm)
    for t in builder_trials:
        found.append((t.mean_s, "builder", t.strategy.hash, Arm(strategy=t.strategy, runtime=runtime_of(t.strategy),
                                                                label=f"builder {t.origin}")))
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


def confirmation_result(confirmation: Confirmation, strategy: Strategy, cluster: ClusterSpec, *,
                        warmup: int) -> TrialResult:
    """A confirmation as a trial result of its candidate (its times: the per-round medians); the
    row keeps the confirmation's plain data, its strategies left out (the row has its own)."""
    times = list(confirmation.a_s)
    data = confirmation.to_dict()
    extra = {k: v for k, v in data.items() if k not in ("candidate_strategy", "baseline_strategy")}
    return TrialResult.from_times(
        times, model=strategy.model["name"], cluster=cluster.name, cluster_scale=cluster.scale,
        strategy_hash=strategy.hash, launcher=confirmation.extra.get("launcher", "ray"),
        backend=confirmation.extra.get("backend", ""), device_kind=confirmation.extra.get("device_kind", ""),
        num_workers=len(strategy.replicas), warmup=warmup, iters=len(times),
        global_batch_size=strategy.global_batch_size, wall_s=confirmation.extra.get("wall_s", 0.0),
        extra={"confirmation": extra})
