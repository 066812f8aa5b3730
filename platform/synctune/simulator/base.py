"""What every simulator shares (AutoSync §3.1): the measured strategies of one domain, and the
base class behind one interface (``fit``, ``predict``: lower is faster, ``score``: higher is
better, ``save``), with the training-free analytic model T = max(T_comp, T_sync)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.columns import StrategyColumns
from ..strategy.schema import Strategy
from .features import DomainContext, analytic_time, encode

__all__ = ["Domain", "domains_from_records", "Simulator", "AnalyticSimulator"]


@dataclass
class Domain:
    """Measured strategies of one (model, cluster): encoded, with their mean iteration times."""

    ctx: DomainContext
    strategies: list[Strategy]
    times_s: np.ndarray  # mean iteration times, the ground truth f
    batch: StrategyColumns | None = None

    @property
    def key(self) -> str:
        """``model@cluster``."""
        return f"{self.ctx.model.name}@{self.ctx.cluster.name}"

    def encoded(self) -> StrategyColumns:
        """The domain's strategies as columns (encoded once)."""
        if self.batch is None:
            self.batch = encode(self.strategies, self.ctx)
        return self.batch

    def subset(self, idx: Sequence[int]) -> "Domain":
        """The domain with the strategies (and times) at ``idx`` only."""
        return Domain(self.ctx, [self.strategies[i] for i in idx], self.times_s[list(idx)])

    def split_mask(self) -> np.ndarray:
        """Per strategy, whether it splits modules (``tensor_parallel``): such strategies are not
        priced as columns (:meth:`encoded` refuses them); the replay takes them one by one."""
        return np.array([s.tensor_parallel is not None for s in self.strategies], dtype=bool)

    def without_tensor_parallel(self) -> "Domain":
        """The domain without its strategies that split modules (itself where it has none)."""
        mask = self.split_mask()
        return self if not mask.any() else self.subset(np.flatnonzero(~mask).tolist())

    def partitions(self) -> np.ndarray:
        """Per strategy, its number of shards (AutoSync Eq. 3's partition penalty)."""
        return np.diff(self.encoded().offsets).astype(np.float64)


def domains_from_records(records: Iterable[Any], *, tensor_parallel: bool = False) -> list[Domain]:
    """Group dataset records (``TrialRecord`` or row dicts) with status ok into domains. Only
    trials that ran a strategy's own plans count: our engine's, and with ``tensor_parallel`` the
    trials of strategies that split modules (``tp_degree`` above 1: the runtime that executes
    them), which only the replay predicts (:meth:`Domain.split_mask`); a ``ddp`` row's time is
    DDP's, not its strategy's."""
    groups: dict[tuple[str, str], list] = {}
    for r in records:
        row = r if isinstance(r, dict) else r.to_row()
        if row["status"] != "ok" or row["mean_s"] is None or row["mean_s"] != row["mean_s"]:
            continue
        split = tensor_parallel and (row.get("tp_degree") or 1) > 1
        if ((row.get("runtime") or "engine") != "engine" and not split) or str(row.get("trial_id", "")).startswith(
                "confirm-"):
            continue  # a DDP trial times DDP; a confirmation repeats its candidate under another protocol
        groups.setdefault((row["model_hash"], row["cluster_hash"]), []).append(row)
    out = []
    for rows in groups.values():
        model = ModelSpec.from_dict(json.loads(rows[0]["model_spec_json"]), where="record model_spec_json")
        cluster = ClusterSpec.from_dict(json.loads(rows[0]["cluster_spec_json"]), where="record cluster_spec_json")
        strategies = [Strategy.from_json(r["strategy_json"], where=f"record {str(r.get('record_id'))[:80]!r} "
                                                                  f"strategy_json") for r in rows]
        out.append(Domain(DomainContext(model, cluster), strategies, np.array([r["mean_s"] for r in rows])))
    return sorted(out, key=lambda d: d.key)


class Simulator:
    """Base class: subclasses implement ``_predict_batch`` (and ``fit`` when learned)."""

    kind = "base"
    learned = False
    #: Whether predictions are iteration times in seconds (else only their order means something).
    predicts_seconds = False
    #: Whether it learns from a domain's trials by refitting constants (``calibrate``), not weights.
    calibrates = False

    def fit(self, domains: list[Domain], **kwargs: Any) -> "Simulator":
        """Learn from measured domains; a training-free simulator returns itself unchanged."""
        return self

    def _predict_batch(self, batch: StrategyColumns, ctx: DomainContext) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def predict_domain(self, domain: Domain) -> np.ndarray:
        """:meth:`predict` of a domain's strategies (its columns encoded once)."""
        return self._predict_batch(domain.encoded(), domain.ctx)

    def predict(self, strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
        """Runtime-like values (lower is faster): seconds for ``analytic``, ranking units otherwise."""
        ctx = DomainContext(model, cluster)
        return self._predict_batch(encode(strategies, ctx), ctx)

    def score(self, strategies: list[Strategy], model: ModelSpec, cluster: ClusterSpec) -> np.ndarray:
        """Higher is better (AutoDist's simulator score): the negated prediction."""
        return -self.predict(strategies, model, cluster)

    def save(self, path: str | Path) -> None:
        """Write the learned state to ``path`` (a training-free simulator has none: refused)."""
        raise SpecError(f"the {self.kind} simulator has no learned state to save")


class AnalyticSimulator(Simulator):
    """Training-free: T = max(T_comp, T_sync) with default constants, usable before any trial."""

    kind = "analytic"
    predicts_seconds = True

    def _predict_batch(self, batch, ctx):
        return analytic_time(batch, ctx)
