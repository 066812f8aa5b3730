"""Metrics of a simulator on measured strategies (AutoSync §5): pairwise ranking accuracy (the
papers' metric), Kendall's tau, and top-k recall of the truly fastest strategies; and, for
simulators that predict seconds, the absolute error |predicted - measured| / measured (median
and 90th percentile; dPRO §7.2 reports replay error this way); per domain, and across domains (train on one,
evaluate on another without target data, §3.3)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..strategy.schema import SYNCHRONIZER_KINDS, Strategy
from .models import Domain, Simulator

__all__ = ["pairwise_accuracy", "pairwise_counts", "kendall_tau", "top_k_recall", "relative_errors", "evaluate", "split_domains",
           "PROTOCOLS", "protocol_folds", "kind_mix", "by_kind_mix"]

#: How `synctune sim eval` separates training from test data: a held-out share of every domain,
#: or whole domains never seen in training (AutoSync §3.3's transfer): an unseen model, an unseen
#: cluster, or both at once.
PROTOCOLS = ("held-out", "unseen-model", "unseen-cluster", "unseen-both")


def pairwise_counts(pred: np.ndarray, truth: np.ndarray) -> tuple[float, int]:
    """(pairs the prediction orders as the truth does, a tied prediction counting half; pairs
    with different true times): what :func:`pairwise_accuracy` divides, for callers that
    accumulate it over batches. ``pred`` is runtime-like (lower is faster), as ``truth``."""
    pred, truth = np.asarray(pred, dtype=float), np.asarray(truth, dtype=float)
    d_true = np.sign(truth[:, None] - truth[None, :])
    d_pred = np.sign(pred[:, None] - pred[None, :])
    valid = np.triu(d_true != 0, 1)
    agree = (d_true == d_pred)[valid].sum() + 0.5 * (d_pred == 0)[valid].sum()
    return float(agree), int(valid.sum())


def pairwise_accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    """Share of pairs with different true times that the prediction orders the same way
    (a tied prediction counts half); nan when every true time is the same."""
    right, pairs = pairwise_counts(pred, truth)
    return right / pairs if pairs else float("nan")


def kendall_tau(pred: np.ndarray, truth: np.ndarray) -> float:
    """Kendall's tau-b (scipy's, ties adjusted) between the predicted and the true times, from -1
    (reversed order) to 1 (the same order); nan below two strategies."""
    from scipy.stats import kendalltau

    if len(pred) < 2:
        return float("nan")
    return float(kendalltau(pred, truth).statistic)


def top_k_recall(pred: np.ndarray, truth: np.ndarray, k: int = 5) -> float:
    """Of the k truly fastest strategies, the share among the k predicted fastest."""
    k = min(k, len(truth))
    if k == 0:
        return float("nan")
    return len(set(np.argsort(truth)[:k]) & set(np.argsort(pred)[:k])) / k


def relative_errors(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """|predicted - measured| / measured, per strategy."""
    return np.abs(np.asarray(pred, float) - truth) / truth


def evaluate(sim: Simulator, domains: list[Domain], k: int = 5) -> list[dict[str, Any]]:
    """Metrics per domain; ``errors`` (the relative errors) only for a simulator that predicts
    seconds (``abs_err_median`` and ``abs_err_p90`` are None otherwise); ``pred``, ``truth`` and
    ``mixes`` (each strategy's :func:`kind_mix`) for :func:`by_kind_mix`."""
    out = []
    for d in domains:
        pred = sim.predict_domain(d)
        errors = relative_errors(pred, d.times_s) if sim.predicts_seconds else None
        out.append({"domain": d.key, "n": len(d.strategies), "pairwise_accuracy": pairwise_accuracy(pred, d.times_s),
                    "kendall_tau": kendall_tau(pred, d.times_s), f"top{k}_recall": top_k_recall(pred, d.times_s, k),
                    "abs_err_median": float(np.median(errors)) if errors is not None else None,
                    "abs_err_p90": float(np.percentile(errors, 90)) if errors is not None else None,
                    "errors": errors, "pred": np.asarray(pred, float), "truth": np.asarray(d.times_s, float),
                    "mixes": [kind_mix(s) for s in d.strategies]})
    return out


def kind_mix(strategy: Strategy) -> str:
    """The synchronizer kinds a strategy uses, in registry order, e.g. ``allreduce+allgather+shard``."""
    used = {shard.synchronizer.kind for _plan, _i, shard in strategy.iter_shards()}
    return "+".join(kind for kind in SYNCHRONIZER_KINDS if kind in used)


#: The pseudo-mix of :func:`by_kind_mix` gathering every strategy with a shard plan.
ANY_SHARD = "any-shard"


def by_kind_mix(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics of :func:`evaluate`'s ``results`` per synchronizer kind mix, pooled over domains
    (pairs never cross domains): ``n`` strategies of the mix, ``pairs`` and ``pairwise_accuracy``
    over the pairs (same domain, different true times) with at least one strategy of the mix
    (what ranking it among the others needs), ``abs_err_median`` / ``abs_err_p90`` over the mix's
    strategies (None unless the simulator predicts seconds). Beside the mixes, :data:`ANY_SHARD`
    pools every strategy with a shard plan, whatever it is mixed with."""
    acc: dict[str, list] = {}
    for r in results:
        pred, truth, mixes = r["pred"], r["truth"], r["mixes"]
        labels = [[m] + ([ANY_SHARD] if "shard" in m.split("+") else []) for m in mixes]
        d_true = np.sign(truth[:, None] - truth[None, :])
        d_pred = np.sign(pred[:, None] - pred[None, :])
        valid = np.triu(d_true != 0, 1)
        score = (d_true == d_pred) + 0.5 * (d_pred == 0)
        for mix in sorted({x for ls in labels for x in ls}):
            member = np.array([mix in ls for ls in labels])
            pairs = valid & (member[:, None] | member[None, :])
            entry = acc.setdefault(mix, [0, 0.0, 0, []])
            entry[0] += int(member.sum())
            entry[1] += float(score[pairs].sum())
            entry[2] += int(pairs.sum())
            if r["errors"] is not None:
                entry[3].append(r["errors"][member])
    out = []
    for mix, (n, right, pairs, errors) in acc.items():
        pooled = np.concatenate(errors) if errors else None
        out.append({"mix": mix, "n": n, "pairs": pairs, "pairwise_accuracy": right / pairs if pairs else float("nan"),
                    "abs_err_median": float(np.median(pooled)) if pooled is not None and len(pooled) else None,
                    "abs_err_p90": float(np.percentile(pooled, 90)) if pooled is not None and len(pooled) else None})
    return sorted(out, key=lambda o: (o["mix"] == ANY_SHARD, o["mix"]))


def split_domains(domains: list[Domain], held_out: float = 0.3, seed: int = 0) -> tuple[list[Domain], list[Domain]]:
    """Per domain, a random ``held_out`` share of the distinct strategies for testing, the rest
    for training. A strategy measured more than once (builders that coincide on a small model,
    a re-measurement) lands on one side with every measurement of it: a held-out test never
    scores what training saw."""
    rng = random.Random(seed)
    train, test = [], []
    for d in domains:
        hashes = sorted({s.hash for s in d.strategies})
        rng.shuffle(hashes)
        cut = max(1, int(round(len(hashes) * held_out)))
        out = set(hashes[:cut])
        test.append(d.subset([i for i, s in enumerate(d.strategies) if s.hash in out]))
        train.append(d.subset([i for i, s in enumerate(d.strategies) if s.hash not in out]))
    return train, test


def protocol_folds(domains: list[Domain], protocol: str, *, held_out: float = 0.3, seed: int = 0
                   ) -> list[tuple[str, list[Domain], list[Domain]]]:
    """``(fold name, training domains, test domains)`` of ``protocol`` (:data:`PROTOCOLS`):

    - ``held-out``: one fold, a random ``held_out`` share of each domain tested (:func:`split_domains`);
    - ``unseen-model``: one fold per model, its domains tested, trained on every other model's;
    - ``unseen-cluster``: the same per cluster;
    - ``unseen-both``: one fold per model, tested on its domain with one of its clusters (taken
      in turn, so the models meet different ones where they can), trained only on domains that
      share neither the model nor the cluster.

    Folds with nothing to train on or nothing to test are left out."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "held-out":
        train, test = split_domains(domains, held_out, seed)
        return [("held-out", train, test)]
    models = sorted({d.ctx.model.name for d in domains})
    clusters = sorted({d.ctx.cluster.name for d in domains})
    folds = []
    if protocol == "unseen-model":
        for m in models:
            folds.append((m, [d for d in domains if d.ctx.model.name != m], [d for d in domains if d.ctx.model.name == m]))
    elif protocol == "unseen-cluster":
        for c in clusters:
            folds.append((c, [d for d in domains if d.ctx.cluster.name != c],
                          [d for d in domains if d.ctx.cluster.name == c]))
    else:
        for i, m in enumerate(models):
            own = sorted({d.ctx.cluster.name for d in domains if d.ctx.model.name == m})
            c = own[i % len(own)]
            folds.append((f"{m}@{c}", [d for d in domains if d.ctx.model.name != m and d.ctx.cluster.name != c],
                          [d for d in domains if d.ctx.model.name == m and d.ctx.cluster.name == c]))
    return [f for f in folds if f[1] and f[2]]
