"""The simulators' part of the ``sfb`` kind: sufficient-factor broadcasting (TAG §2.3, §4.2.3).

An SFB shard is a linear layer's whole weight: the replicas all-gather its input activations and
output gradients, ``2·N·(H_in + H_out)`` values for a batch of N rows, padded to the largest
replica batch, instead of the gradient, and every replica rebuilds the same gradient from them
before the step. The analytic model and the features price it as an all-gather of the factors
(two chained gathers: the row counts, then the factors) plus the rebuild; the replay runs it as the
engine's :class:`~synctune.engine.units.SFBUnit`; the memory model books the optimizer state on
every rank (the factors are activations-sized temporaries).
"""

from __future__ import annotations

import numpy as np

from .registry import (FeatureKind, FeatureTerms, MemoryContext, MemoryKind, ReplayBatch, ReplayKind, Tally,
                       register_feature_kind, register_memory_kind, register_replay_kind)

__all__: list[str] = []


def _count(tally: Tally, units: list, ctx: MemoryContext) -> None:
    """Optimizer state on every rank (the factors are activations-sized temporaries)."""
    for unit in units:
        ctx.everyone_owns(tally, unit.members[0])


def _factors(b, ctx, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per SFB row, the bytes of its factors (padded to the largest replica batch of its strategy)
    and the seconds the rebuild of its gradient from the strategy's global batch takes, at the
    slowest replica's nominal speed."""
    split = b.splits()
    v, s = b.var[rows], b.sid[rows]
    factor_rows = ctx.factor_rows[v]
    nbytes = split.max(1).astype(np.float64)[s] * factor_rows * ctx.factor_width[v]
    rebuild = 2.0 * split.sum(1).astype(np.float64)[s] * factor_rows * ctx.var_elems[v] / ctx.device_flops
    return nbytes, rebuild


def _message(b, ctx, rows: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """An SFB shard sends its factors, and its gradient is rebuilt after they are in."""
    nbytes[rows], rebuild = _factors(b, ctx, rows)
    return rebuild


def _collective(nn, ring, c):
    """An all-gather of the factors, (N-1) over the ring's slowest flow, and two gathers' messages
    (the row counts, then the factors): 2(N-1) overheads."""
    return (nn - 1) / ring, 2 * c.phi * (nn - 1)


def _predefined(f: FeatureTerms, rows: np.ndarray) -> None:
    """``ag_transfer``, the shard's bytes over the ring N-1 times, plus the rebuild of the gradient,
    and ``ag_phi``, two gathers' N-1 messages."""
    sid = f.b.sid[rows]
    n, ring = f.t["N"][sid], f.t["ring_bw"][sid]
    f.out[rows, f.col["ag_transfer"]] = (n - 1) * f.wire[rows] / ring + _factors(f.b, f.ctx, rows)[1]
    f.out[rows, f.col["ag_phi"]] = 2.0 * (n - 1)


def _durations(rb: ReplayBatch, rows: np.ndarray, units: np.ndarray, state: None) -> None:
    """Two chained gathers (row counts, then factors), then every replica rebuilds the gradient
    (at the speed the profile measured, ``rebuild_scale``)."""
    unn, ring, ubytes, alpha = rb.unn, rb.ring, rb.ubytes, rb.alpha
    fb = units[unn[units] > 1]
    rb.dur[fb] = (unn[fb] - 1) * (2 * alpha + ubytes[fb] / ring[fb])
    rb.dur += np.bincount(rb.unit_of[rows], weights=rb.rebuild[rows] * rb.dom.rebuild_scale, minlength=len(rb.usid))


register_memory_kind("sfb", MemoryKind(count=_count))
register_feature_kind("sfb", FeatureKind(one_hot="is_sfb", family="ag", counts_message=True, collective=_collective,
                                         message=_message, predefined=_predefined))
register_replay_kind("sfb", ReplayKind(durations=_durations))
