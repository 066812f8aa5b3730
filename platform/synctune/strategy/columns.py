"""Many strategies of one domain as columns: the form a search round's proposals take.

A round scores tens of thousands of proposals and trials a handful (AutoSync §3.2). Building a
:class:`~synctune.strategy.schema.Strategy` object per proposal, hashing and encoding it, costs
milliseconds per strategy on a model of hundreds of variables; a sampler that writes its
decisions straight into arrays (:meth:`synctune.search.GuidedSampler.sample_columns`), and a
simulator that reads them (``synctune.simulator.encode_columns``), make a proposal cost
microseconds. Only the strategies a round picks become objects (:meth:`StrategyColumns.strategy`).

Rows are shards, strategy after strategy; within a strategy, variables in the model's order and
each variable's shards in row-major order (as :func:`~synctune.strategy.partition.shard_shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .schema import (
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardPlan,
    Strategy,
    VariablePlan,
)

__all__ = ["StrategyColumns", "KIND_CODES", "COMPRESSOR_KINDS"]

#: Synchronizer kind of a row (the simulator's codes).
KIND_CODES = {"ps": 0, "allreduce": 1, "allgather": 2, "sfb": 3}
#: Compressor kind of a row, by index.
COMPRESSOR_KINDS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class StrategyColumns:
    """Shards of ``size`` strategies of (``model``, ``cluster``) as flat arrays.

    Per shard: ``sid`` (strategy), ``var`` (variable index in the model), ``axis`` and
    ``nshards`` (the variable's partition: ``nshards`` pieces along ``axis``), ``kind``
    (:data:`KIND_CODES`), ``node`` (a PS shard's server node, whose first device holds it; -1
    otherwise), ``local`` (PS local aggregation), ``group`` (an all-reduce shard's merge group as
    the strategy numbers it; -1 otherwise), ``hier`` (hierarchical all-reduce), ``comp`` and
    ``rank`` (:data:`COMPRESSOR_KINDS` index and PowerSGD rank, 0 otherwise), ``frac`` (the
    shard's share of its variable's elements), ``comp_code`` and ``ratio`` (the compressor's
    simulator code and wire bytes per gradient byte). Per strategy: ``batch_split`` (size,
    replicas) or None where every replica takes the model's batch. Every strategy replicates on
    every device.

    Optionally, what the simulator's encoder would make of the merge groups, written by a
    producer that has it at hand (the guided sampler does): ``group_order`` (per shard, its
    group numbered 0.. in the order the strategy's groups first appear; -1 off all-reduce) and
    ``ngroups`` (per strategy, how many groups). Absent, the encoder works them out. Whoever
    changes ``kind`` or ``group`` of such columns must clear both (the encoder trusts them)."""

    model: Any
    cluster: Any
    offsets: np.ndarray
    sid: np.ndarray
    var: np.ndarray
    axis: np.ndarray
    nshards: np.ndarray
    kind: np.ndarray
    node: np.ndarray
    local: np.ndarray
    group: np.ndarray
    hier: np.ndarray
    comp: np.ndarray
    rank: np.ndarray
    frac: np.ndarray
    comp_code: np.ndarray
    ratio: np.ndarray
    batch_split: np.ndarray | None = None
    group_order: np.ndarray | None = None
    ngroups: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.offsets) - 1

    def signatures(self) -> np.ndarray:
        """(size, variables) int64: one code per variable of each strategy, equal for two
        strategies exactly when that variable's partition and every shard's decisions are
        equal (what the search's diversity compares, AutoSync §3.2)."""
        n, v = self.size, len(self.model.variables)
        # A row's decisions folded into one integer, then the rows of a variable combined with
        # a position weight (shards of a variable are consecutive rows).
        row = (((((self.kind * 64 + (self.node + 1)) * 2 + self.local) * 2 + self.hier) * 8 + self.comp) * 8
               + np.minimum(self.rank, 7)) * 64 + self.axis
        row = row * 1_000_003 + self.nshards
        first = np.r_[0, np.flatnonzero(np.diff(self.sid * v + self.var)) + 1]
        position = np.arange(len(self.sid)) - np.repeat(first, np.diff(np.r_[first, len(self.sid)]))
        mixed = (row * 0x9E3779B1 + position * 0x85EBCA77) & ((1 << 62) - 1)
        out = np.zeros((n, v), dtype=np.int64)
        np.add.at(out, (self.sid, self.var), mixed)
        return out

    def digests(self) -> np.ndarray:
        """(size,) one code per strategy: equal strategies have equal codes, different ones
        differ but for a 64-bit collision (a duplicate check before anything becomes an object;
        the Strategy hash stays the identity)."""
        m = np.uint64
        fields = (self.var, self.axis, self.nshards, self.kind, self.node + 1, self.local, self.group + 1, self.hier,
                  self.comp, self.rank, np.arange(len(self.sid)) - np.repeat(self.offsets[:-1], np.diff(self.offsets)))
        code = np.zeros(len(self.sid), dtype=m)
        with np.errstate(over="ignore"):
            for f in fields:  # a multiply-xorshift mix of every column of the row, in turn
                code = (code ^ np.asarray(f).astype(m)) * m(0x9E3779B97F4A7C15)
                code ^= code >> m(29)
            if not len(code):
                return np.zeros(self.size, dtype=m)
            out = np.add.reduceat(code, self.offsets[:-1]) if self.size else np.zeros(0, dtype=m)
            out[np.diff(self.offsets) == 0] = 0
            if self.batch_split is not None:
                for col in self.batch_split.T.astype(m):
                    out = (out ^ col) * m(0xBF58476D1CE4E5B9)
        return out

    def strategy(self, i: int) -> Strategy:
        """Strategy ``i`` as an object."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        servers = [node.devices[0] for node in self.cluster.nodes]
        variables = self.model.variables
        plans = []
        at = lo
        while at < hi:
            v = int(self.var[at])
            k = int(self.nshards[at])
            partition = [1] * len(variables[v].shape)
            if k > 1:
                partition[int(self.axis[at])] = k
            shards = []
            for r in range(at, at + k):
                kind = int(self.kind[r])
                if kind == 0:
                    sync = PSSynchronizer(placement=servers[int(self.node[r])], local_aggregation=bool(self.local[r]))
                elif kind == 1:
                    sync = AllReduceSynchronizer(group=int(self.group[r]),
                                                 algorithm="hierarchical" if self.hier[r] else "flat")
                elif kind == 2:
                    sync = AllGatherSynchronizer()
                else:
                    sync = SFBSynchronizer()
                comp = COMPRESSOR_KINDS[int(self.comp[r])]
                compressor = Compressor(kind=comp, rank=int(self.rank[r])) if comp == "powersgd" else \
                    Compressor(kind=comp)
                shards.append(ShardPlan(synchronizer=sync, compressor=compressor))
            plans.append(VariablePlan(variable=variables[v].name, partition=tuple(partition), shards=tuple(shards)))
            at += k
        split = None if self.batch_split is None else tuple(int(x) for x in self.batch_split[i])
        return Strategy.over(self.model, self.cluster, plans, batch_split=split)
