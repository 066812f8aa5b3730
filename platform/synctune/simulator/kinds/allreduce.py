"""The simulators' part of the ``allreduce`` kind: a ring all-reduce per merge group (AutoDist §2.2).

Shards of one merge group are one collective (the engine's bucket): flat, a ring over every
replica, ``2(N-1)(alpha + bytes/(N beta))`` in AutoDDL's alpha-beta model; or hierarchical
(Horovod's mode: reduce-scatter inside each node, all-reduce across the nodes, all-gather inside
each node). What the memory model books for a group, how the analytic model and the features price
its members (AutoSync §3.1's ring analogue of Eq. 2: the group's messages shared among its
members) and how the replay runs a group (:class:`~synctune.engine.units.AllReduceUnit`,
:class:`~synctune.engine.units.HierarchicalAllReduceUnit`). A sparse gradient on all-reduce is
dense on the wire (the engine densifies it).
"""

from __future__ import annotations

import math

import numpy as np

from .registry import (AnalyticTerms, FeatureKind, FeatureTerms, MemoryContext, MemoryKind, ReplayBatch, ReplayKind,
                       Tally, register_feature_kind, register_memory_kind, register_replay_kind)

__all__: list[str] = []


# ------------------------------------------------------------------------------ memory

def _count(tally: Tally, units: list, ctx: MemoryContext) -> None:
    """Every member's optimizer state on every rank, and each merge group's bucket (hierarchical:
    padded to a multiple of the node's ranks, plus the piece this rank all-reduces across nodes)."""
    for unit in units:
        used = 0
        for member in unit.members:
            ctx.everyone_owns(tally, member)
            used += math.prod(ctx.shard_shape(member)) * ctx.item(member)
        item = ctx.item(unit.members[0])
        for r in range(tally.world):
            if unit.synchronizer.algorithm == "hierarchical":
                local = sum(1 for n in ctx.nodes if n == ctx.nodes[r])
                padded = used + (-used) % (local * item)
                tally.buffers[r] += padded + padded // local
            else:
                tally.buffers[r] += used


# ---------------------------------------------------------------------------- features

def _collective(nn, ring, c):
    """A ring all-reduce's seconds per byte, 2(N-1)/N over the ring's slowest flow, and a kernel
    latency (delta) per shard; the ring's 2(N-1) message overheads are paid once per group."""
    return 2 * (nn - 1) / nn / ring, c.delta


def _hierarchical(b, rows: np.ndarray) -> np.ndarray | None:
    """The rows of ``rows`` on a hierarchical all-reduce, or None when no row of ``b`` is (the cheaper path)."""
    return rows[b.hier[rows]] if b.hier.any() else None


def _adjust(a: AnalyticTerms, rows: np.ndarray) -> None:
    """A hierarchical group's seconds per byte are its stages' (the cluster's ``hier_per_byte``)."""
    h = _hierarchical(a.b, rows)
    if h is not None:
        a.per_byte[h] = a.t["hier_per_byte"][a.b.sid[h]] if a.t is not None else a.ctx.hier_per_byte


def _totals(a: AnalyticTerms, rows: np.ndarray) -> None:
    """A hierarchical group pays its stages' messages, 2(r-1) + 2(W-1), not the flat ring's."""
    b, c = a.b, a.ctx.constants
    h = _hierarchical(b, rows)
    if h is None:
        return
    width = int(b.group_order.max()) + 1
    owner = np.unique(b.sid[h] * width + b.group_order[h]) // width
    hier_groups = np.bincount(owner, minlength=b.size)
    a.t_ar = a.t_ar + c.phi * hier_groups * ((a.t["hier_msgs"] if a.t is not None else a.ctx.hier_msgs) - a.ring_msgs)


def _predefined(f: FeatureTerms, rows: np.ndarray) -> None:
    """``ar_transfer``, the shard's bytes over the ring (or over a hierarchical group's stages),
    and ``ar_phi``, its share of its group's messages."""
    b, t = f.b, f.t
    sid = b.sid[rows]
    n, ring = t["N"][sid], t["ring_bw"][sid]
    col = f.col["ar_transfer"]
    f.out[rows, col] = 2 * (n - 1) / n * f.wire[rows] / ring
    hier = b.hier[rows] if b.hier.any() else None
    if hier is not None:
        h = rows[hier]
        f.out[h, col] = f.wire[h] * t["hier_per_byte"][b.sid[h]]
    # A merge group pays the ring's 2(N-1) message overheads once: share it among members.
    group = b.group_order
    key = sid * (group.max() + 1) + group[rows]
    _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
    msgs = 2 * (n - 1) if hier is None else np.where(hier, t["hier_msgs"][sid], 2 * (n - 1))
    f.out[rows, f.col["ar_phi"]] = msgs / counts[inv]


def _raw(f: FeatureTerms, rows: np.ndarray) -> None:
    """The shard's merge group: its members over the variables, its bytes over the model's, and
    its position among the strategy's groups (``group_order``, backward order), in [0, 1)."""
    b, ctx = f.b, f.ctx
    group = b.group_order
    width = group.max() + 1
    key = b.sid[rows] * width + group[rows]
    _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
    gbytes = np.bincount(inv, weights=f.wire[rows])
    f.out[rows, f.col["group_members"]] = counts[inv] / ctx.num_vars
    f.out[rows, f.col["group_bytes"]] = gbytes[inv] / ctx.model_bytes
    f.out[rows, f.col["group_order"]] = group[rows] / np.maximum(1.0, b.ngroups[b.sid[rows]])


# ------------------------------------------------------------------------------ replay

def _durations(rb: ReplayBatch, rows: np.ndarray, units: np.ndarray, state: None) -> None:
    """A flat group: a ring of 2(N-1) steps, each paying alpha per chained stage of its compressor.
    A hierarchical group, as the engine's HierarchicalAllReduceUnit runs it on r replicas on each
    of W nodes: its stages' messages and bytes; it launches a reduce per piece inside the node (r
    reduces, r - 1 peers each), the all-reduce of the rank's piece across the nodes (W - 1), then an
    all-gather inside the node (r - 1), not one ring over N - 1 peers (version 5 on)."""
    b, t, k, alpha = rb.b, rb.t, rb.k, rb.alpha
    unn, ring, ubytes, usid = rb.unn, rb.ring, rb.ubytes, rb.usid
    ar = units[unn[units] > 1]
    rb.dur[ar] = 2 * (unn[ar] - 1) * (alpha * rb.stages[ar] + ubytes[ar] / (unn[ar] * ring[ar]))
    if not b.hier.any():
        return
    hr = np.zeros(len(usid), dtype=bool)
    hr[rb.unit_of] = b.hier
    mine = np.zeros(len(usid), dtype=bool)
    mine[units] = True
    hr &= mine
    if k.replay_version >= 5:
        r, w = np.asarray(t["r"])[usid[hr]].max(1), t["W"][usid[hr]]
        inside = np.maximum(r - 1, 0)
        rb.launches[hr] = np.where(r > 1, r + 1, 0) + (w > 1)
        rb.steps[hr] = r * inside + np.maximum(w - 1, 0) + inside
    rb.dur[hr] = t["hier_msgs"][usid[hr]] * alpha + ubytes[hr] * t["hier_per_byte"][usid[hr]]


register_memory_kind("allreduce", MemoryKind(count=_count, reference=True))
register_feature_kind("allreduce", FeatureKind(one_hot="is_ar", family="ar", collective=_collective, adjust=_adjust,
                                               totals=_totals, predefined=_predefined, raw=_raw))
register_replay_kind("allreduce", ReplayKind(densifies=True, step_cost="ar_unit_s", counted_as="ar",
                                             durations=_durations))
