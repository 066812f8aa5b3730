"""The two filters between a round's proposals and its trials: the simulator's fidelity level
(AutoDist §2.4 "Filtering") and greedy selection trading score against diversity (AutoSync §3.2,
after AutoTVM)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy

__all__ = ["fidelity_level", "select_diverse"]


def fidelity_level(scores: np.ndarray, times_s: np.ndarray, target: float) -> float:
    """The highest score below which the simulator ranks measured trials with at least ``target``
    pairwise accuracy (AutoDist §2.4 "Filtering"); -inf when it cannot vouch for any.

    Trials sorted by score: for each prefix of three or more, the share of its pairs with
    different times that the score orders right (higher score, lower time; tied scores count
    half)."""
    order = np.argsort(scores, kind="stable")
    s, t = np.asarray(scores, float)[order], np.asarray(times_s, float)[order]
    level = -np.inf
    agree = total = 0.0
    for j in range(1, len(s)):
        d_t = np.sign(t[:j] - t[j])  # earlier (lower-scored) vs the new one
        d_s = np.sign(s[:j] - s[j])
        valid = d_t != 0
        total += valid.sum()
        agree += ((d_t == -d_s) & (d_s != 0) & valid).sum() + 0.5 * ((d_s == 0) & valid).sum()
        if j >= 2 and total and agree / total >= target:
            level = float(s[j])
    return level


class _Index:
    """Positions of variables and nodes of devices in one domain (for strategy signatures)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        self.var_index = {v.name: i for i, v in enumerate(model.variables)}
        self.num_vars = len(model.variables)
        self.node_of_device = {d: i for i, n in enumerate(cluster.nodes) for d in n.devices}


def _signature(strategy: Strategy, index: _Index) -> np.ndarray:
    """Per-variable decision codes used to compare strategies: the partition and, for every
    shard, its synchronizer kind, server node, local aggregation, all-reduce algorithm and
    compressor (two variables are alike only if all their shards are)."""
    codes = np.zeros(index.num_vars, dtype=np.int64)
    for plan in strategy.plans:
        parts: list[Any] = [tuple(plan.partition)]
        for shard in plan.shards:
            sync = shard.synchronizer
            parts.append((sync.kind, index.node_of_device.get(getattr(sync, "placement", None), -1),
                          bool(getattr(sync, "local_aggregation", False)), getattr(sync, "algorithm", ""),
                          shard.compressor.label))
        digest = hashlib.blake2b(repr(parts).encode(), digest_size=7).digest()
        codes[index.var_index[plan.variable]] = int.from_bytes(digest, "big")
    return codes


def select_diverse(strategies: list[Strategy] | None, scores: np.ndarray, k: int, index: _Index | None,
                   weight: float = 0.5, *, signatures: np.ndarray | None = None,
                   accept: Callable[[int], bool] | None = None) -> list[int]:
    """Greedy selection of ``k`` indices maximising normalised score minus ``weight`` times the
    largest similarity to those already chosen (AutoSync §3.2, after AutoTVM). Similarity is
    the share of variables decided alike, from ``strategies`` or from their ``signatures``
    (one code per variable, :meth:`~synctune.strategy.columns.StrategyColumns.signatures`).
    A candidate ``accept`` refuses (one already measured) is passed over as if never drawn:
    it takes no place and pushes no other candidate away."""
    if signatures is None and not strategies or signatures is not None and not len(signatures):
        return []
    sig = signatures if signatures is not None else np.stack([_signature(s, index) for s in strategies])
    span = scores.max() - scores.min()
    norm = (scores - scores.min()) / span if span > 0 else np.zeros_like(scores)
    chosen: list[int] = []
    out = np.zeros(len(sig), dtype=bool)  # chosen or refused
    best_sim = np.zeros(len(sig))
    while len(chosen) < k and not out.all():
        value = np.where(out, -np.inf, norm - weight * best_sim)
        nxt = int(np.argmax(value))
        out[nxt] = True
        if accept is not None and not accept(nxt):
            continue
        chosen.append(nxt)
        best_sim = np.maximum(best_sim, (sig == sig[nxt]).mean(axis=1))
    return chosen
