"""A search's confirmation as one frozen record (DESIGN.md "confirmed speed-up"): the best
searched strategy re-measured against the best baseline, interleaved on the same processes, with
its interval, or why there is none.

Its plain-data form (:meth:`Confirmation.to_dict`) is what crosses the process's edges: the
confirmation row's ``extra_json`` in the dataset, the search run's ``confirmation.json`` in
MLflow, the ``confirmed`` entry of a search's result file. Everything else reads attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..stats import PairedRatio, SequentialRule

__all__ = ["Confirmation", "NOTHING_TO_CONFIRM"]

#: How the error of a confirmation that had no arms to re-measure begins.
NOTHING_TO_CONFIRM = "nothing to confirm"


@dataclass(frozen=True, kw_only=True)
class Confirmation:
    """What a search's confirmation measured (``interval`` set), or why it did not (``error``).

    ``interval``: the candidate's speed-up over the baseline (:class:`~synctune.stats.PairedRatio`,
    at each look's level of ``rule``); ``a_s``/``b_s``: per round, the candidate's and the
    baseline's median iteration time; ``rounds`` run of ``per_round`` iterations, ``stopped``
    (``verdict``, ``narrow`` or ``cap``: :meth:`~synctune.stats.SequentialRule.stop_reason`).
    ``candidate``/``baseline``: their names in summaries, with their strategies (plain data, as a
    result file holds them) and the baseline's runtime (``{"kind": name, name: settings}``).
    With a screening: the arms screened (``screened``, ``screened_baselines``), their per-round
    times (``screen_s``) and which were picked. ``retried``: failures after which the whole
    confirmation ran again on fresh workers. ``extra``: anything else the measurement reported
    (launcher, backend, device kind, wall time), kept as it came."""

    error: str | None = None
    interval: PairedRatio | None = None
    a_s: tuple[float, ...] = ()
    b_s: tuple[float, ...] = ()
    rounds: int = 0
    per_round: int = 0
    rule: SequentialRule | None = None
    stopped: str = ""
    candidate: str = ""
    baseline: str = ""
    candidate_hash: str = ""
    candidate_strategy: Mapping[str, Any] | None = None
    baseline_strategy: Mapping[str, Any] | None = None
    baseline_runtime: Mapping[str, Any] | None = None
    screened: tuple[str, ...] = ()
    screened_baselines: tuple[str, ...] = ()
    screen_s: tuple[tuple[float, ...], ...] | None = None
    picked: int = 0
    picked_baseline: int | None = None
    retried: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        """Whether it measured an interval (else :attr:`error` says why not)."""
        return self.interval is not None

    @property
    def verdict(self) -> str:
        """``faster``, ``slower`` or ``no difference`` (empty without an interval)."""
        return self.interval.verdict if self.interval else ""

    @property
    def ratio(self) -> float | None:
        """The speed-up (None without an interval)."""
        return self.interval.ratio if self.interval else None

    @property
    def sequential(self) -> bool:
        """Whether its rule looked more than once (its interval then at each look's level)."""
        return self.rule is not None and self.rule.min_rounds != self.rule.max_rounds

    @property
    def nothing_to_confirm(self) -> bool:
        """Whether it was not attempted for want of arms (no searched strategy, or no baseline,
        finished: :data:`NOTHING_TO_CONFIRM`), rather than attempted and failed."""
        return not self.measured and (self.error or "").startswith(NOTHING_TO_CONFIRM)

    @classmethod
    def failed(cls, error: str) -> "Confirmation":
        """A confirmation that measured nothing, and why."""
        return cls(error=error)

    @classmethod
    def from_figures(cls, figures: Mapping[str, Any], **names: Any) -> "Confirmation":
        """The confirmation of what an interleaved re-measurement returned
        (:func:`synctune.engine.trial.confirm_figures`: its plain data), with the arms' names and
        strategies (``names``: any field of this class)."""
        return cls.from_dict({**figures, **names})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Confirmation":
        """The confirmation of :meth:`to_dict`'s form (a dataset row's, a result file's)."""
        data = dict(data)
        if "ratio" not in data:
            return cls(error=str(data.get("error") or "no result"))
        interval = PairedRatio(ratio=float(data.pop("ratio")), low=float(data.pop("low")),
                               high=float(data.pop("high")), rounds=int(data.pop("rounds_used", data.get("rounds", 0))),
                               per_round_ratios=tuple(data.pop("per_round_ratios", ())),
                               confidence=float(data.pop("confidence", 0.95)))
        data.pop("verdict", None)
        rule = data.pop("rule", None)
        screen = data.pop("screen_s", None)
        out = {"interval": interval, "rule": SequentialRule(**rule) if rule else None,
               "screen_s": tuple(tuple(arm) for arm in screen) if screen is not None else None}
        for name in ("a_s", "b_s", "screened", "screened_baselines", "retried"):
            if name in data:
                out[name] = tuple(data.pop(name) or ())
        for name in ("error", "rounds", "per_round", "stopped", "candidate", "baseline", "candidate_hash",
                     "candidate_strategy", "baseline_strategy", "baseline_runtime", "picked", "picked_baseline"):
            if name in data:
                out[name] = data.pop(name)
        return cls(**out, extra=data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON, flat: the interval's keys (:meth:`~synctune.stats.PairedRatio.to_dict`)
        beside the rounds', the arms' and the screening's, the form dataset rows and result files
        hold."""
        if self.interval is None:
            return {"error": self.error or "no result"}
        out: dict[str, Any] = dict(self.extra)
        out.update(self.interval.to_dict())
        out.update({"a_s": list(self.a_s), "b_s": list(self.b_s), "rounds": self.rounds, "per_round": self.per_round,
                    "stopped": self.stopped, "candidate": self.candidate, "baseline": self.baseline,
                    "candidate_hash": self.candidate_hash, "candidate_strategy": self.candidate_strategy,
                    "baseline_strategy": self.baseline_strategy, "baseline_runtime": self.baseline_runtime})
        if self.rule is not None:
            out["rule"] = self.rule.to_dict()
        if self.screen_s is not None:
            out.update({"screen_s": [list(arm) for arm in self.screen_s], "picked": self.picked,
                        "picked_baseline": self.picked_baseline, "screened": list(self.screened),
                        "screened_baselines": list(self.screened_baselines)})
        if self.retried:
            out["retried"] = list(self.retried)
        if self.error:
            out["error"] = self.error
        return out
