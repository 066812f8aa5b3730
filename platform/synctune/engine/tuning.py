"""What a runtime offers to be tuned as a baseline (DESIGN.md "runtime"): the settings a search
tries for it, its first point, and how summaries name its trials.

A search measures the systems users run today with their settings tuned (AutoDist §3.1's
hand-optimised baselines, tuned as Horovod's autotune tunes its fusion buffer): torch DDP's
buckets and comm hook, FSDP2's mesh, units, resharding, prefetch and reduce dtype, Megatron-style
tensor parallelism's degree, sequence parallelism, resharding and checkpointing. Each runtime
that can be tuned declares it here, in its own module (:attr:`Runtime.tuning` and
:meth:`Runtime.tuning_space`); the search's Tune glue draws from any :class:`TuningSpace` with
Optuna's TPE without knowing which runtime it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..spec.errors import SpecError

__all__ = ["Categorical", "LogUniform", "Tuning", "TuningSpace", "NothingToTune"]


class NothingToTune(SpecError):
    """A runtime has nothing to tune in a domain (a model it cannot run, a memory budget none of
    its settings fit); ``reason`` says why, in words a progress line can take."""

    def __init__(self, runtime: str, reason: str) -> None:
        super().__init__(f"tuned {runtime}: nothing to tune: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Categorical:
    """A setting drawn from ``choices`` (plain values: they are Optuna's and Tune's config)."""

    choices: tuple

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is one of the choices (a bool is not an int here)."""
        return any(value == c and type(value) is type(c) for c in self.choices)


@dataclass(frozen=True)
class LogUniform:
    """A positive number drawn log-uniformly from [``low``, ``high``]."""

    low: float
    high: float

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is a number within the bounds."""
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """How a tunable runtime's tuned trials are named and read: ``params`` (the names of a tuned
    point's settings, what a Tune trial's config carries), ``origin`` (their dataset rows' origin),
    ``label`` (a summary's name for one, e.g. ``tuned DDP``), ``title`` (progress lines: ``tuned
    torch DDP``) and ``knobs`` (what is tuned, in words)."""

    params: tuple[str, ...]
    origin: str
    label: str
    title: str
    knobs: str


@dataclass(frozen=True, kw_only=True)
class TuningSpace:
    """The settings of one runtime a search tunes in one domain: ``params`` (name to
    :class:`Categorical` or :class:`LogUniform`), ``first`` (the point a fresh search measures
    first: the runtime as users start with it, where the memory budget admits it), ``admits``
    (whether the memory budget admits a point; None: every point) and ``fallbacks`` (for a drawn
    point it does not admit, the points to try in its place, nearest first: TPE's draw is recorded
    as failed, never as a time it did not measure), ``defaults`` (what a setting added to the
    space after a point was recorded reads as in that point: the runtime's behaviour before the
    setting existed, so a resumed search is still told it). The runtime a point configures is
    the runtime class's :meth:`~synctune.engine.runtime.Runtime.from_tuned`."""

    params: Mapping[str, Categorical | LogUniform]
    first: Mapping[str, Any]
    admits: Callable[[Mapping[str, Any]], bool] | None = None
    fallbacks: Callable[[Mapping[str, Any]], list[dict]] = field(default=lambda point: [])
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def completed(self, point: Mapping[str, Any]) -> dict:
        """``point`` with :attr:`defaults` for the settings it lacks (a point recorded before them)."""
        return {**self.defaults, **point}

    def holds(self, point: Mapping[str, Any]) -> bool:
        """Whether ``point`` lies in this space (a resumed search's earlier point may not, once the
        experiment or the budget changed: it is then not told to the tuner)."""
        return set(point) >= set(self.params) and all(p.holds(point[k]) for k, p in self.params.items())
