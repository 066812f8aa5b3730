"""Metrics of a simulator on measured strategies (AutoSync §5): pairwise ranking accuracy (the
papers' metric), Kendall's tau, and top-k recall of the truly fastest strategies; per domain,
and across domains (train on one, evaluate on another without target data, §3.3)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from .models import Domain, Simulator

__all__ = ["pairwise_accuracy", "kendall_tau", "top_k_recall", "evaluate", "split_domains"]


def pairwise_accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    """Share of pairs with different true runtimes that the prediction orders the same way
    (a tied prediction counts half)."""
    d_true = np.sign(truth[:, None] - truth[None, :])
    d_pred = np.sign(pred[:, None] - pred[None, :])
    valid = np.triu(d_true != 0, 1)
    if not valid.any():
        return float("nan")
    agree = (d_true == d_pred)[valid].sum() + 0.5 * (d_pred == 0)[valid].sum()
    return float(agree / valid.sum())


def kendall_tau(pred: np.ndarray, truth: np.ndarray) -> float:
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


def evaluate(sim: Simulator, domains: list[Domain], k: int = 5) -> list[dict[str, Any]]:
    """Metrics per domain."""
    out = []
    for d in domains:
        pred = sim.predict_domain(d)
        out.append({"domain": d.key, "n": len(d.strategies), "pairwise_accuracy": pairwise_accuracy(pred, d.runtimes),
                    "kendall_tau": kendall_tau(pred, d.runtimes), f"top{k}_recall": top_k_recall(pred, d.runtimes, k)})
    return out


def split_domains(domains: list[Domain], held_out: float = 0.3, seed: int = 0) -> tuple[list[Domain], list[Domain]]:
    """Per domain, a random ``held_out`` share of the strategies for testing, the rest for training."""
    rng = random.Random(seed)
    train, test = [], []
    for d in domains:
        idx = list(range(len(d.strategies)))
        rng.shuffle(idx)
        cut = max(1, int(round(len(idx) * held_out)))
        test.append(d.subset(sorted(idx[:cut])))
        train.append(d.subset(sorted(idx[cut:])))
    return train, test
