"""The simulators' part of the ``allgather`` kind: a sparse gradient's rows gathered by every replica.

Every replica all-gathers the (indices, values) of the rows each replica's batch touched and sums
them itself (what torch DDP does with a sparse gradient): a ring all-gather, ``(N-1)(alpha +
bytes/beta)`` in AutoDDL's alpha-beta model. What the memory model books for it, how the analytic
model and the features price it (AutoSync §3.1's all-gather analogue of Eq. 2) and how the replay
runs it (:class:`~synctune.engine.units.SparseAllGatherUnit`).
"""

from __future__ import annotations

import numpy as np

from .registry import (FeatureKind, FeatureTerms, MemoryContext, MemoryKind, ReplayBatch, ReplayKind, Tally,
                       index_bytes, register_feature_kind, register_memory_kind, register_replay_kind)

__all__: list[str] = []


def _count(tally: Tally, units: list, ctx: MemoryContext) -> None:
    """Optimizer state on every rank; a sparse shard's row buffers, every rank receiving every rank's."""
    for unit in units:
        member = unit.members[0]
        if ctx.model[member.variable].sparse:
            ctx.row_buffers(tally, member, range(tally.world))
        ctx.everyone_owns(tally, member)


def _collective(nn, ring, c):
    """A ring all-gather's seconds per byte, (N-1) over the ring's slowest flow, and its N-1
    messages' overheads (phi each)."""
    return (nn - 1) / ring, c.phi * (nn - 1)


def _predefined(f: FeatureTerms, rows: np.ndarray) -> None:
    """``ag_transfer``, the shard's bytes over the ring N-1 times, and ``ag_phi``, its N-1 messages."""
    sid = f.b.sid[rows]
    n, ring = f.t["N"][sid], f.t["ring_bw"][sid]
    f.out[rows, f.col["ag_transfer"]] = (n - 1) * f.wire[rows] / ring
    f.out[rows, f.col["ag_phi"]] = n - 1


def _durations(rb: ReplayBatch, rows: np.ndarray, units: np.ndarray, state: None) -> None:
    """The engine's sparse all-gather (SparseAllGatherUnit): the row counts all-gathered first,
    then the rows' int64 indices and the rows, each a ring all-gather of N - 1 messages (version 3
    on; before, the rows alone)."""
    unn, ring, ubytes, alpha = rb.unn, rb.ring, rb.ubytes, rb.alpha
    ag = units[unn[units] > 1]
    if rb.k.replay_version >= 3:
        b = rb.b
        index = np.bincount(rb.unit_of[rows], weights=index_bytes(
            rb.ctx, b.var[rows], (rb.plain * rb.sparse_part)[rows]), minlength=len(rb.usid))
        rb.dur[ag] = (unn[ag] - 1) * (3 * alpha + (ubytes[ag] + index[ag]) / ring[ag])
    else:
        rb.dur[ag] = (unn[ag] - 1) * (alpha + ubytes[ag] / ring[ag])


register_memory_kind("allgather", MemoryKind(count=_count, reference=True))
register_feature_kind("allgather", FeatureKind(one_hot="is_ag", family="ag", collective=_collective,
                                               predefined=_predefined))
register_replay_kind("allgather", ReplayKind(step_cost="ag_unit_s", counted_as="ag", durations=_durations))
