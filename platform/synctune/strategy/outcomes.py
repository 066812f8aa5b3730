"""The figures a search is judged by (AutoDist §3.3, AutoSync §5): the speed-up of the best
strategy over the best hand-optimised baseline, the hit rate (share of searched strategies
faster than that baseline) and the trials it took to reach 1.1x and 1.2x.

One function computes them from trials in the order they ran, for the search summary, the
search dashboard and the dataset dashboard alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

__all__ = ["SearchOutcome", "search_outcome"]


@dataclass(frozen=True)
class SearchOutcome:
    """Figures of trials in run order. Indices are 0-based positions in that order; per-trial
    series have one entry per trial (None where undefined)."""

    num_trials: int
    num_failed: int
    best_index: int | None  # fastest successful trial
    best_runtime_s: float | None
    best_baseline_s: float | None
    speedup: float | None  # best baseline / best runtime
    hit_rate: float | None  # among searched (non-baseline) trials
    trials_to: dict[float, int | None]  # factor -> 1-based trial count when first reached
    own_speedup: list[float | None]
    best_speedup: list[float | None]
    running_hit_rate: list[float | None]


def search_outcome(trials: Iterable[tuple[bool, float | None]], factors: tuple[float, ...] = (1.1, 1.2)
                   ) -> SearchOutcome:
    """The outcome of ``(is_baseline, runtime_s or None when it failed)`` pairs in run order."""
    items = [(bool(b), r if (r is not None and math.isfinite(r) and r > 0) else None) for b, r in trials]
    base_times = [r for b, r in items if b and r is not None]
    base = min(base_times) if base_times else None
    ok = [(i, r) for i, (_b, r) in enumerate(items) if r is not None]
    best_index, best = min(ok, key=lambda t: (t[1], t[0])) if ok else (None, None)
    own, best_so_far, hits_so_far = [], [], []
    fastest = math.inf
    searched = hits = 0
    reached: dict[float, int | None] = {f: None for f in factors}
    for i, (is_base, runtime) in enumerate(items):
        if runtime is not None:
            fastest = min(fastest, runtime)
        if not is_base:
            searched += 1
            hits += bool(runtime is not None and base is not None and runtime < base)
        own.append(base / runtime if (base and runtime) else None)
        best_so_far.append(base / fastest if (base and math.isfinite(fastest)) else None)
        hits_so_far.append(hits / searched if searched else None)
        for f in factors:
            if reached[f] is None and own[-1] is not None and own[-1] >= f:
                reached[f] = i + 1
    return SearchOutcome(
        num_trials=len(items), num_failed=sum(r is None for _b, r in items), best_index=best_index,
        best_runtime_s=best, best_baseline_s=base, speedup=(base / best) if (base and best) else None,
        hit_rate=(hits / searched) if searched else None, trials_to=reached, own_speedup=own,
        best_speedup=best_so_far, running_hit_rate=hits_so_far)
