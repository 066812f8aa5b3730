"""The simulators' part of the ``ps`` kind: a parameter server (AutoDist §2.2; AutoSync Eq. 2).

A PS shard's gradient goes to its server, which updates the shard and sends it back. What the
memory model books for it, how the analytic model and the features price it (AutoSync Eq. 2: the
server's load, the slower of its NIC and its per-flow transfers, plus intra-node copies and
overheads), and how the replay runs it as the engine does on gloo
(:class:`~synctune.engine.units.PSUnit`, :class:`~synctune.engine.units.SparsePSUnit`).
"""

from __future__ import annotations

import math

import numpy as np

from ..domain import GBIT, GLOO_KEYS
from .registry import (AnalyticTerms, FeatureKind, FeatureTerms, MemoryContext, MemoryKind, ReplayBatch, ReplayKind,
                       Tally, index_bytes, register_feature_kind, register_memory_kind, register_replay_kind)

__all__: list[str] = []


# ------------------------------------------------------------------------------ memory

def _count(tally: Tally, units: list, ctx: MemoryContext) -> None:
    """A PS shard: its optimizer state on the placement; a dense shard's buffer on every rank, a
    sparse one's row buffers (the server receives every rank's)."""
    for unit in units:
        member, sync = unit.members[0], unit.synchronizer
        var = ctx.model[member.variable]
        numel = math.prod(ctx.shard_shape(member))
        placement = ctx.rank_of[sync.placement]
        if var.sparse:
            ctx.row_buffers(tally, member, [placement])
        else:
            for r in range(tally.world):
                tally.buffers[r] += numel * ctx.item(member)
        tally.own(placement, numel, ctx.item(member))


# ---------------------------------------------------------------------------- features

def _server_loads(a: AnalyticTerms, rows: np.ndarray) -> None:
    """Each server node's load (AutoSync Eq. 2), (strategies, nodes) seconds: the slower of its
    NIC and its per-flow transfers, plus intra-node copies and overheads; the per-strategy
    tables where strategies replicate on subsets."""
    b, ctx, t = a.b, a.ctx, a.t
    c = ctx.constants
    n, w = b.size, ctx.W
    look = b.node[rows].astype(np.int64) * 2 + b.local[rows]
    both = a.wire[rows] + a.message[rows]  # gradient up (encoded), parameters down (plain)
    key = b.sid[rows] * w + b.node[rows]
    if t is not None:
        at = b.sid[rows] * (2 * w) + look
        flow_c, nic_c, intra_c, phi_c = (t[k + "_flat"][at] for k in ("ps_flow", "ps_nic", "ps_intra", "ps_phi"))
        spread = np.maximum(1.0, t["W"] - 1)
    else:
        flow_c, nic_c, intra_c, phi_c = (ctx.ps_flow_flat[look], ctx.ps_nic_flat[look], ctx.ps_intra_flat[look],
                                         ctx.ps_phi_flat[look])
        spread = np.full(n, float(max(1, w - 1)))
    flows = (np.bincount(key, both * flow_c, n * w).reshape(n, w) / spread[:, None]).reshape(-1)
    nic = np.bincount(key, both * nic_c, n * w)
    rest = np.bincount(key, both * intra_c + c.phi * phi_c + c.delta, n * w)
    a.per_server = (np.maximum(flows, nic) + rest).reshape(n, w)


def _predefined(f: FeatureTerms, rows: np.ndarray) -> None:
    """``ps_flow``, ``ps_nic``, ``ps_intra`` (the shard's bytes both ways over each) and
    ``ps_phi`` (its messages): the shard's part of its server's Eq. 2 terms."""
    b, ctx, t = f.b, f.ctx, f.t
    both = f.wire[rows] + f.sent[rows]  # gradient up (encoded), parameters down (plain)
    look = b.sid[rows] * (2 * ctx.W) + b.node[rows] * 2 + b.local[rows].astype(np.int64)
    f.out[rows, f.col["ps_flow"]] = both * t["ps_flow_flat"][look]
    f.out[rows, f.col["ps_nic"]] = both * t["ps_nic_flat"][look]
    f.out[rows, f.col["ps_intra"]] = both * t["ps_intra_flat"][look]
    f.out[rows, f.col["ps_phi"]] = t["ps_phi_flat"][look]


def _raw(f: FeatureTerms, rows: np.ndarray) -> None:
    """The server node's NIC and single-flow bandwidth (per 10 Gbit/s) and its share of the devices."""
    ctx, node = f.ctx, f.b.node[rows]
    f.out[rows, f.col["server_nic"]] = ctx.nic[node] / (10 * GBIT)
    f.out[rows, f.col["server_devices"]] = ctx.r[node] / max(1.0, ctx.N)
    f.out[rows, f.col["server_flow"]] = ctx.flow[node] / (10 * GBIT)


# ------------------------------------------------------------------------------ replay

#: gloo's largest segment of a ring reduce (ReduceOptions::kMaxSegmentSize).
_GLOO_SEGMENT = float(1 << 20)


def _gloo_segments(nbytes: np.ndarray, group: np.ndarray) -> np.ndarray:
    """How many segments gloo's ring reduce cuts ``nbytes`` into over ``group`` ranks
    (gloo/reduce.cc: at least two per rank, at most 1 MiB each, a multiple of the ranks)."""
    group = np.maximum(group, 1.0)
    return np.maximum(2 * group, group * np.ceil(np.ceil(nbytes / _GLOO_SEGMENT) / group))


def _shards(rb: ReplayBatch, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per PS row, the seconds its push and its pull (the parameter bytes sent back to every
    replica) take, the part of the push inside the nodes (a dense shard with local aggregation,
    version 3; else 0), and whether it runs that part on process groups of its own, as the engine
    runs them on gloo (:meth:`~synctune.simulator.domain.DomainContext._gloo_ps_tables`): a dense
    shard's push is ``dist.reduce`` (a ring reduce-scatter in segments, one message each, then
    every rank's chunk to the server), a sparse one's ``dist.gather`` of its rows straight to the
    server (its server's NIC and flows, AutoSync Eq. 2, one message per sender); the pull is a
    binomial-tree ``dist.broadcast`` (one message a round)."""
    b, ctx, t, k, alpha = rb.b, rb.ctx, rb.t, rb.k, rb.alpha
    sid, node, local = b.sid[rows], b.node[rows], b.local[rows]
    wire, sent = rb.wire[rows], (rb.plain * rb.sparse_part)[rows]
    look = node * 2 + local.astype(np.int64) + sid * (2 * ctx.W)
    # A sparse shard (rows touched, density < 1) is gathered, not reduced.
    w = np.maximum(1.0, t["W"] - 1)[sid]
    per_byte = np.maximum(t["ps_flow_flat"][look] / w, t["ps_nic_flat"][look]) + t["ps_intra_flat"][look]
    r_server = np.asarray(t["r"])[sid, np.maximum(node, 0)]
    msgs = t["ps_phi_flat"][look] + np.where(local, r_server - 1, 0)
    gathered = wire * per_byte + msgs * alpha
    none = np.zeros(len(rows), dtype=bool)
    if k.replay_version < 2:  # every shard through the server's NIC and flows, both ways
        return gathered, sent * per_byte + (t["N"][sid] - 1) * alpha + k.unit_s, np.zeros(len(rows)), none
    # The (strategies, nodes, 2) tables read in place: a round's domain tables are broadcast views.
    g = {key: t[key][sid, node, local.astype(np.int64)] for key in GLOO_KEYS}
    dense = np.zeros(len(rows))
    phases = []
    for ring, group in ((g["gloo_ring_a"], g["gloo_n_a"]), (g["gloo_ring_b"], g["gloo_n_b"])):
        segments = _gloo_segments(wire, group)
        steps = np.where(group > 1, segments - 2, 0.0)
        phases.append(wire * steps / segments * ring + steps * alpha)
        dense += phases[-1]
    dense += wire * g["gloo_gather"] + np.where(g["gloo_gather"] > 0, alpha, 0.0)
    sparse = ctx.var_sparse[b.var[rows]]
    pull_bytes, pull_msgs, in_node, own_groups = sent, 1.0, np.zeros(len(rows)), none
    if k.replay_version >= 3:
        # SparsePSUnit: the row counts all-gathered first (gloo's ring: N - 1 messages, a few
        # bytes), then the rows' int64 indices gathered beside the rows, and after the step the
        # count broadcast (blocking), then the indices and the rows.
        index = np.where(sparse, index_bytes(ctx, b.var[rows], sent), 0.0)
        gathered = gathered + index * per_byte + msgs * alpha + (t["N"][sid] - 1) * alpha
        pull_bytes = np.where(sparse, sent + index, sent)
        pull_msgs = np.where(sparse, 3.0, 1.0)
        # With local aggregation the reduce inside the nodes is a stage of its own, on the nodes'
        # process groups (the rest, on the node roots' group, follows it).
        own_groups = ~sparse & local.astype(bool)
        in_node = np.where(own_groups, phases[0], 0.0)
    push = np.where(sparse, gathered, dense)
    pull = pull_bytes * g["gloo_bcast"] + pull_msgs * g["gloo_bcast_rounds"] * alpha + k.unit_s
    if k.replay_version >= 5:
        # Each broadcast's rounds cost a rank the PS CPU cost, as the push's steps do.
        pull = pull + k.ps_unit_s * pull_msgs * g["gloo_bcast_rounds"]
    return push, pull, in_node, own_groups


def _durations(rb: ReplayBatch, rows: np.ndarray, units: np.ndarray, state: None) -> None:
    """A PS shard's push on the link queue (its stage inside the nodes on the nodes' own process
    groups), and its broadcast after the step, one shard after the other."""
    push, pull, in_node, own_groups = _shards(rb, rows)
    u, of = len(rb.usid), rb.unit_of[rows]
    rb.dur += np.bincount(of, weights=push, minlength=u)
    rb.after_step["ps"] = np.bincount(rb.b.sid[rows], weights=pull, minlength=rb.b.size)
    rb.in_node += np.bincount(of, weights=in_node, minlength=u)
    rb.roots[of] = own_groups


register_memory_kind("ps", MemoryKind(count=_count))
register_feature_kind("ps", FeatureKind(one_hot="is_ps", family="ps", totals=_server_loads, predefined=_predefined,
                                        raw=_raw))
register_replay_kind("ps", ReplayKind(step_cost="ps_unit_s", counted_as="ps", durations=_durations))
