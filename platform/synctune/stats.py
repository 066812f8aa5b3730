"""Statistics every layer reports, importing nothing of ours (the bottom of the module table).

The figures a search is judged by (AutoDist §3.3, AutoSync §5): the speed-up of the best
strategy over the best hand-optimised baseline, the hit rate (share of searched strategies
faster than that baseline) and the trials it took to reach 1.1x and 1.2x.

One function computes them from trials in the order they ran, for the search summary, the
search dashboard and the dataset dashboard alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

__all__ = ["SearchOutcome", "search_outcome", "PairedRatio", "paired_ratio", "t_quantile", "SequentialRule",
           "median_interval"]


@dataclass(frozen=True)
class SearchOutcome:
    """Figures of trials in run order. Indices are 0-based positions in that order; per-trial
    series have one entry per trial (None where undefined)."""

    num_trials: int
    num_failed: int
    best_index: int | None  # fastest successful trial
    best_mean_s: float | None
    best_baseline_s: float | None
    speedup: float | None  # best baseline / best runtime
    hit_rate: float | None  # among searched (non-baseline) trials
    trials_to: dict[float, int | None]  # factor -> 1-based trial count when first reached
    own_speedup: list[float | None]
    best_speedup: list[float | None]
    running_hit_rate: list[float | None]


def search_outcome(trials: Iterable[tuple[bool, float | None]], factors: tuple[float, ...] = (1.1, 1.2),
                   other_baselines: Iterable[float] = ()) -> SearchOutcome:
    """The outcome of ``(is_baseline, mean_s or None when it failed)`` pairs in run order.
    ``other_baselines`` are baseline times measured outside these trials (tuned torch DDP):
    they count toward the best baseline, not toward the trials."""
    items = [(bool(b), r if (r is not None and math.isfinite(r) and r > 0) else None) for b, r in trials]
    base_times = [r for b, r in items if b and r is not None] + [
        float(r) for r in other_baselines if r is not None and math.isfinite(r) and r > 0]
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
        best_mean_s=best, best_baseline_s=base, speedup=(base / best) if (base and best) else None,
        hit_rate=(hits / searched) if searched else None, trials_to=reached, own_speedup=own,
        best_speedup=best_so_far, running_hit_rate=hits_so_far)


@dataclass(frozen=True)
class PairedRatio:
    """A speed-up measured in paired rounds: per round, the baseline's time over the
    candidate's; ``ratio`` is their geometric mean and ``low``/``high`` its interval at
    ``confidence`` (Student's t on the log ratios, rounds taken as independent pairs)."""

    ratio: float
    low: float
    high: float
    rounds: int
    per_round_ratios: tuple[float, ...]
    confidence: float = 0.95

    @property
    def verdict(self) -> str:
        """``faster``/``slower`` when the interval excludes 1, else ``no difference``."""
        return "faster" if self.low > 1 else ("slower" if self.high < 1 else "no difference")

    @property
    def width(self) -> float:
        """The interval's width relative to the ratio ((high - low) / ratio)."""
        return (self.high - self.low) / self.ratio

    def to_dict(self) -> dict:
        """The ratio as plain data (a confirmation's record), with its verdict; ``rounds`` as
        ``rounds_used``."""
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "rounds_used": self.rounds,
                "per_round_ratios": list(self.per_round_ratios), "verdict": self.verdict,
                "confidence": self.confidence}

    def describe(self) -> str:
        """One line for reports, e.g. ``1.120x [1.050, 1.190] (95%, 20 rounds)``."""
        return (f"{self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}] ({100 * self.confidence:.3g}%, "
                f"{self.rounds} rounds)")


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t with ``dof`` degrees of freedom: the factor of a
    confirmed speed-up's 95% interval (DESIGN.md "Measurement conventions"), for any number of
    rounds. ``scipy.stats.t.ppf``, imported here so the strategy layer stays light."""
    from scipy.stats import t

    return float(t.ppf(p, dof))


def median_interval(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, median, high): the distribution-free interval of a median from order statistics
    (Conover, *Practical Nonparametric Statistics*, §3.2): the k-th smallest and k-th largest
    value, k the largest rank with P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2, so it
    covers the median at ``confidence`` or more whatever the distribution. It assumes nothing of
    the iteration times' shape (they are skewed: a slow iteration now and then). With too few
    values for any interval at that confidence (n < 6 at 95%), low and high are -inf and inf."""
    from scipy.stats import binom

    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"median_interval: confidence must be between 0 and 1, got {confidence!r}")
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    k = int(binom.ppf((1 - confidence) / 2, n, 0.5))
    if k < 1:
        return -math.inf, mid, math.inf
    return xs[k - 1], mid, xs[n - k]


def paired_ratio(baseline_s: Iterable[float], candidate_s: Iterable[float], confidence: float = 0.95
                 ) -> PairedRatio:
    """The speed-up of a candidate over a baseline from times measured in paired rounds (round
    i's baseline time with round i's candidate time), with its interval at ``confidence``;
    needs at least 2 rounds of positive times."""
    pairs = [(float(b), float(c)) for b, c in zip(baseline_s, candidate_s)]
    if len(pairs) < 2 or not all(b > 0 and c > 0 and math.isfinite(b) and math.isfinite(c) for b, c in pairs):
        raise ValueError(f"paired_ratio needs at least 2 rounds of positive finite times, got {pairs!r:.200}")
    if not 0 < confidence < 1:
        raise ValueError(f"paired_ratio: confidence must be between 0 and 1, got {confidence!r}")
    logs = [math.log(b / c) for b, c in pairs]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * sd / math.sqrt(n)
    return PairedRatio(ratio=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), rounds=n,
                       per_round_ratios=tuple(b / c for b, c in pairs), confidence=confidence)


@dataclass(frozen=True)
class SequentialRule:
    """When a confirmation stops adding rounds: it looks at its paired rounds after
    ``min_rounds``, then every ``step`` rounds up to ``max_rounds``, and stops at the first look
    whose interval excludes 1 (a verdict) or is narrower than ``width`` (relative: a tie, or a
    ratio known well enough), or at the cap.

    Looking several times and stopping when the interval excludes 1 would make a fixed 95%
    interval exclude 1 more often than 5% of the time when the arms do not differ. Each look's
    interval is therefore at level ``1 - alpha / looks`` (Bonferroni over the looks the rule can
    make): the chance that *any* look's interval misses the true ratio is at most ``alpha``, so
    the interval reported at whichever look stops covers the true ratio with probability at
    least ``1 - alpha``, and a "faster" or "slower" verdict between arms that do not differ
    comes at most ``alpha`` of the time (rounds taken as independent, log ratios normal, as for
    :func:`paired_ratio`). Bonferroni is conservative (a group-sequential bound such as
    Pocock's is tighter); it asks nothing of the looks' correlation. ``min_rounds ==
    max_rounds`` is the fixed design: one look, a plain ``1 - alpha`` interval."""

    min_rounds: int
    max_rounds: int
    step: int = 5
    width: float = 0.10
    alpha: float = 0.05

    def __post_init__(self) -> None:
        if not (2 <= self.min_rounds <= self.max_rounds and self.step >= 1 and self.width >= 0
                and 0 < self.alpha < 1):
            raise ValueError(f"SequentialRule: need 2 <= min_rounds <= max_rounds, step >= 1, width >= 0 and "
                             f"0 < alpha < 1, got {self}")

    @classmethod
    def fixed(cls, rounds: int) -> "SequentialRule":
        """Exactly ``rounds`` rounds, one look at 95%."""
        return cls(min_rounds=rounds, max_rounds=rounds)

    @property
    def looks(self) -> tuple[int, ...]:
        """The round counts at which the rule looks (the cap always among them)."""
        points = list(range(self.min_rounds, self.max_rounds + 1, self.step))
        return tuple(points if points[-1] == self.max_rounds else [*points, self.max_rounds])

    @property
    def confidence(self) -> float:
        """The level of each look's interval."""
        return 1 - self.alpha / len(self.looks)

    def interval(self, baseline_s: Iterable[float], candidate_s: Iterable[float]) -> PairedRatio:
        """The paired ratio of the rounds so far at the rule's per-look level."""
        return paired_ratio(baseline_s, candidate_s, self.confidence)

    def stop_reason(self, baseline_s: list[float], candidate_s: list[float]) -> str | None:
        """Why the confirmation stops after these rounds (``verdict``, ``narrow`` or ``cap``),
        or None to go on."""
        n = min(len(baseline_s), len(candidate_s))
        if n not in self.looks:
            return None
        if n >= self.max_rounds:
            return "cap"
        found = self.interval(baseline_s[:n], candidate_s[:n])
        if found.verdict != "no difference":
            return "verdict"
        return "narrow" if found.width <= self.width else None

    def to_dict(self) -> dict:
        """The rule as plain data, the keyword arguments that build it again (``SequentialRule(**d)``)."""
        return {"min_rounds": self.min_rounds, "max_rounds": self.max_rounds, "step": self.step,
                "width": self.width, "alpha": self.alpha}
