"""Many strategies of one domain as columns: the one form a batch of strategies takes.

A round scores tens of thousands of proposals and trials a handful (AutoSync §3.2). Building a
:class:`~synctune.strategy.schema.Strategy` object per proposal, hashing and encoding it, costs
milliseconds per strategy on a model of hundreds of variables; a sampler that writes its
decisions straight into arrays (:meth:`synctune.search.GuidedSampler.sample_columns`), and a
simulator that reads them (every function of ``synctune.simulator.features`` takes columns),
make a proposal cost microseconds. Only the strategies a round picks become objects
(:meth:`StrategyColumns.strategy`); strategies that are objects already become columns with
:meth:`StrategyColumns.from_strategies` (the simulator's ``encode``).

Rows are shards, strategy after strategy; within a strategy, variables in the model's order and
each variable's shards in row-major order (as :func:`~synctune.strategy.partition.shard_shapes`).
Codes come from the registries: a row's synchronizer kind is its index in
:data:`~synctune.strategy.schema.SYNCHRONIZER_KINDS` (:data:`KIND_CODES`), its compressor its
index in :data:`~synctune.strategy.compressors.COMPRESSORS` (``CompressorInfo.code``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..spec.checks import LIMITS
from .checkpoint import CHECKPOINT_MODES, checkpoint_blocks
from .compressors import COMPRESSORS
from .partition import shard_shapes
from .errors import StrategyError
from .kinds import _OFF_COLUMNS, KIND_CODES, SYNCHRONIZERS, pattern_codes
from .schema import MAX_PREFETCH, REDUCE_DTYPES, SYNCHRONIZER_KINDS, Compressor, ShardPlan, Strategy, VariablePlan
from .tensor_parallel import TensorParallel, tensor_parallel_from_data

__all__ = ["StrategyColumns", "KIND_CODES", "COLUMN_DTYPES", "COLUMN_BOUNDS"]


def _merge_group_codes() -> np.ndarray:
    """The codes of the kinds whose units are all-reduce merge groups (``group_order``, ``ngroups``)."""
    return np.array([KIND_CODES[k] for k in SYNCHRONIZER_KINDS if SYNCHRONIZERS.get(k).merge_groups], np.int64)


@dataclass
class StrategyColumns:
    """Shards of ``size`` strategies of (``model``, ``cluster``) as flat arrays.

    Per shard: ``sid`` (strategy), ``var`` (variable index in the model), ``axis`` and
    ``nshards`` (the variable's partition: ``nshards`` pieces along ``axis``), ``kind``
    (:data:`KIND_CODES`), ``node`` (a PS shard's server node, whose first device holds it; -1
    otherwise), ``local`` (PS local aggregation), ``group`` (an all-reduce shard's merge group as
    the strategy numbers it; -1 otherwise), ``hier`` (hierarchical all-reduce), ``comp`` and
    ``rank`` (the compressor's registry code and PowerSGD rank, 0 otherwise), ``frac`` (the
    shard's share of its variable's elements), ``ratio`` (the compressor's wire bytes per
    gradient byte), ``group_order`` (the merge group numbered 0.. in the order the strategy's
    groups first appear; -1 off all-reduce). A ``shard`` row (ZeRO / FSDP) keeps its **unit** in
    ``group`` (the unit is to sharding what the merge group is to all-reduce: its members are one
    collective), and in ``shard_group`` its shard-group size (0: every replica; -1 off shard),
    ``reshard``, ``prefetch`` and ``reduce_dtype`` (the index in
    :data:`~synctune.strategy.schema.REDUCE_DTYPES`: 0 fp32, 1 bf16); units are not merge
    groups (``group_order`` stays -1 on them). Per strategy: ``ngroups`` (how many merge groups)
    and ``batch_split`` (size, devices of the cluster): each device's batch, 0 where it holds no
    replica; None where every device holds a replica with the model's batch.

    ``group_order`` and ``ngroups`` are worked out on construction unless the producer wrote
    them (the guided sampler does); whoever changes ``kind`` or ``group`` of columns must
    rebuild them (``dataclasses.replace(cols, group_order=None, ngroups=None)``).

    Columns keep what the search and the simulators read. A strategy made of columns places a
    PS shard on its server node's first device and keeps its replicas in the cluster's device
    order; one made into columns keeps neither another placement device of that node, nor
    a PS staleness bound, nor another replica order (every sampler and builder writes these
    as columns have them)."""

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
    ratio: np.ndarray
    batch_split: np.ndarray | None = None
    group_order: np.ndarray | None = None
    ngroups: np.ndarray | None = None
    #: Shard-plan columns (None from producers that draw no shard plans: filled as off-shard).
    shard_group: np.ndarray | None = None
    reshard: np.ndarray | None = None
    prefetch: np.ndarray | None = None
    reduce_dtype: np.ndarray | None = None
    #: Per strategy, per block of the model (:func:`~synctune.strategy.checkpoint.checkpoint_blocks`,
    #: forward order): 0 none, 1 ``full``, 2 ``selective`` (None: no strategy checkpoints).
    checkpoint: np.ndarray | None = None
    #: Per strategy, its tensor parallelism (all four None: no strategy splits modules), Megatron's
    #: plan on some blocks (:func:`~synctune.strategy.builders.megatron_block_styles`): ``tp_degree`` the
    #: devices of a TP group (0: none), ``tp_blocks`` per block (the columns of :attr:`checkpoint`)
    #: its plan's index in :data:`~synctune.strategy.builders.TP_BLOCK_PLANS` (0 none, 1 pairs,
    #: 2 pairs with sequence parallelism), ``tp_logits`` whether the loss is computed on
    #: vocabulary-split logits, ``tp_embedding`` whether the token embedding is split row-wise.
    tp_degree: np.ndarray | None = None
    tp_blocks: np.ndarray | None = None
    tp_logits: np.ndarray | None = None
    tp_embedding: np.ndarray | None = None

    def __post_init__(self) -> None:
        rows = len(self.sid)
        for name, fill, dtype in _SHARD_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, np.full(rows, fill, dtype))
        if self.group_order is None or self.ngroups is None:
            self.group_order, self.ngroups = _number_groups(self.sid, self.kind, self.group, self.size)
        if any(getattr(self, name) is not None for name in _TP_FIELDS):
            n = self.size
            if self.tp_degree is None:
                self.tp_degree = np.zeros(n, np.int16)
            if self.tp_blocks is None:
                self.tp_blocks = np.zeros((n, len(self.blocks())), np.int8)
            if self.tp_logits is None:
                self.tp_logits = np.zeros(n, bool)
            if self.tp_embedding is None:
                self.tp_embedding = np.zeros(n, bool)

    def splits_modules(self) -> np.ndarray:
        """(size,) bool: whether each strategy has tensor parallelism (a ``tp_degree``)."""
        if self.tp_degree is None:
            return np.zeros(self.size, bool)
        return np.asarray(self.tp_degree) > 0

    def tp_fields(self, lo: int, hi: int) -> dict[str, np.ndarray | None]:
        """The tensor-parallel columns of strategies ``lo`` to ``hi - 1`` (None where no strategy
        of these columns splits modules)."""
        return {name: None if getattr(self, name) is None else getattr(self, name)[lo:hi] for name in _TP_FIELDS}

    @property
    def size(self) -> int:
        """The number of strategies."""
        return len(self.offsets) - 1

    def pattern_mask(self, code: int) -> np.ndarray:
        """Per shard, whether its :attr:`pattern` is ``code`` (the rows one kind's cost terms
        price), worked out once per columns and kept: the simulators ask for each kind's rows in
        several of their terms, once per batch they score."""
        return self._pattern_cached(("mask", code), lambda: self.pattern == code)

    def pattern_rows(self, code: int) -> np.ndarray:
        """The shards whose :attr:`pattern` is ``code``, ascending (:meth:`pattern_mask`'s rows),
        kept likewise."""
        return self._pattern_cached(("rows", code), lambda: np.flatnonzero(self.pattern_mask(code)))

    def _pattern_cached(self, key: tuple, make) -> np.ndarray:
        """``make()``, kept under ``key`` for as long as :attr:`pattern` is the same array."""
        pattern = self.pattern
        cache = self.__dict__.get("_pattern_cache")
        if cache is None or cache[0] is not pattern:
            cache = (pattern, {})
            self.__dict__["_pattern_cache"] = cache
        found = cache[1].get(key)
        if found is None:
            found = cache[1][key] = make()
        return found

    @property
    def pattern(self) -> np.ndarray:
        """Per shard, the code of the kind whose cost terms price it (the simulators read this,
        not ``kind``): its own code, but for a kind that communicates as another kind does
        (:attr:`~synctune.strategy.kinds.Synchronizer.priced_as`). ``kind`` itself where every
        kind prices itself."""
        table = pattern_codes()
        if table is None:
            return self.kind
        cached = self.__dict__.get("_pattern")
        if cached is None or cached[0] is not self.kind:
            cached = (self.kind, np.asarray(table, self.kind.dtype)[self.kind])
            self.__dict__["_pattern"] = cached
        return cached[1]

    def frees_parameters(self) -> np.ndarray:
        """(size,) bool: whether a unit of each strategy frees its parameters after forward (a
        row's ``reshard``: :attr:`~synctune.strategy.schema.Strategy.frees_parameters`)."""
        out = np.zeros(self.size, bool)
        out[self.sid[np.asarray(self.reshard, bool)]] = True
        return out

    # --------------------------------------------------------------------------- replicas
    def splits(self) -> np.ndarray:
        """(size, devices) int64: each device's batch in each strategy (0: no replica there)."""
        if self.batch_split is None:
            return np.full((self.size, self.cluster.num_devices), self.model.batch_size, np.int64)
        return np.asarray(self.batch_split, np.int64)

    def replica_counts(self) -> np.ndarray | None:
        """(size, nodes) replicas per node of each strategy; None when every strategy holds a
        replica on every device (TAG §4.2: idle devices take no part in synchronization)."""
        if self.batch_split is None:
            return None
        held = np.asarray(self.batch_split) > 0
        if held.all():
            return None
        per_node = [node.num_devices for node in self.cluster.nodes]
        owner = np.repeat(np.arange(len(per_node)), per_node)  # devices are listed node by node
        return held.astype(np.float64) @ (owner[:, None] == np.arange(len(per_node))[None, :])

    # ------------------------------------------------------------------------ identities
    def signatures(self) -> np.ndarray:
        """(size, variables) int64: one code per variable of each strategy, equal for two
        strategies exactly when that variable's partition and every shard's decisions are
        equal (what the search's diversity compares, AutoSync §3.2)."""
        n, v = self.size, len(self.model.variables)
        # A row's decisions folded into one integer, then the rows of a variable combined with
        # a position weight (shards of a variable are consecutive rows).
        w = lambda a: np.asarray(a, np.int64)  # noqa: E731  (narrow columns: fold in int64)
        row = (((((w(self.kind) * 64 + (w(self.node) + 1)) * 2 + self.local) * 2 + self.hier) * 8 + w(self.comp)) * 8
               + np.minimum(w(self.rank), 7)) * 64 + w(self.axis)
        row = row * 1_000_003 + w(self.nshards)
        shard = self.shard_group >= 0  # the rows of shard plans (off them, -1)
        if shard.any():  # a shard row's unit and options (other rows fold in as before)
            opts = ((((self.group + 1) * 64 + w(self.shard_group) + 1) * 2 + self.reshard) * 16
                    + w(self.prefetch)) * 4 + w(self.reduce_dtype)
            row = np.where(shard, row * 1_000_033 + opts, row)
        if self.splits_modules().any():  # a variable's split: its strategy's degree and its block's plan
            row = row * 1_000_037 + self._tp_row_codes()
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
        if (self.shard_group >= 0).any():  # shard options; columns without shard rows hash as before
            fields += (self.shard_group + 1, self.reshard, self.prefetch, self.reduce_dtype)
        code = np.zeros(len(self.sid), dtype=m)
        with np.errstate(over="ignore"):
            for f in fields:  # a multiply-xorshift mix of every column of the row, in turn
                code = (code ^ np.asarray(f).astype(m)) * m(0x9E3779B97F4A7C15)
                code ^= code >> m(29)
            if not len(code):
                return np.zeros(self.size, dtype=m)
            out = np.add.reduceat(code, self.offsets[:-1]) if self.size else np.zeros(0, dtype=m)
            out[np.diff(self.offsets) == 0] = 0
            if self.batch_split is not None:  # the split, and with it which devices hold replicas
                for col in self.batch_split.T.astype(m):
                    out = (out ^ col) * m(0xBF58476D1CE4E5B9)
            if self.checkpoint is not None and self.checkpoint.any():  # checkpointed blocks
                for col in self.checkpoint.T.astype(m):
                    out = (out ^ (col + m(0x51))) * m(0x94D049BB133111EB)
            if self.splits_modules().any():  # tensor parallelism: degree, blocks' plans, logits, embedding
                for col in (self.tp_degree, *self.tp_blocks.T, self.tp_logits, self.tp_embedding):
                    out = (out ^ (np.asarray(col).astype(m) + m(0x7F))) * m(0xD6E8FEB86659FD93)
        return out

    def _tp_row_codes(self) -> np.ndarray:
        """Per row, a code of how its variable is split: its strategy's TP degree, the plan of the
        variable's block and the strategy's embedding and logits choices (0 without TP)."""
        block_index = self.__dict__.get("_var_block")
        if block_index is None:
            from .checkpoint import block_of

            at = {b: j for j, b in enumerate(self.blocks())}
            block_index = self.__dict__["_var_block"] = np.array(
                [at.get(block_of(v.name), -1) for v in self.model.variables], np.int64)
        sid = self.sid
        b = block_index[self.var]
        plan = np.where(b >= 0, np.asarray(self.tp_blocks, np.int64)[sid, np.maximum(b, 0)], 0)
        flags = np.asarray(self.tp_logits, np.int64)[sid] * 2 + np.asarray(self.tp_embedding, np.int64)[sid]
        return (np.asarray(self.tp_degree, np.int64)[sid] * 4 + plan) * 4 + flags

    def take(self, lo: int, hi: int) -> "StrategyColumns":
        """Strategies ``lo`` to ``hi - 1`` as columns of their own (views of these rows, the
        strategy ids counted from 0): how a round is scored a chunk at a time, so the
        simulators' per-row temporaries never span the whole round."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        rows = {name: getattr(self, name)[a:b] for name in _ROW_FIELDS}
        rows["sid"] = rows["sid"] - lo
        return StrategyColumns(model=self.model, cluster=self.cluster, offsets=self.offsets[lo:hi + 1] - a,
                               batch_split=None if self.batch_split is None else self.batch_split[lo:hi],
                               checkpoint=None if self.checkpoint is None else self.checkpoint[lo:hi],
                               ngroups=self.ngroups[lo:hi], **self.tp_fields(lo, hi), **rows)

    # ------------------------------------------------------------------- objects and back
    def strategy(self, i: int) -> Strategy:
        """Strategy ``i`` as an object. Equal shard decisions make one (frozen) shard plan, built
        once per set of columns: a strategy of many shards is mostly a few distinct ones."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        variables = self.model.variables
        var, nshards, axis = (getattr(self, n)[lo:hi].tolist() for n in ("var", "nshards", "axis"))
        codes = list(zip(*(getattr(self, n)[lo:hi].tolist() for n in ("kind", "comp", "rank", *_OFF_COLUMNS))))
        made = self.__dict__.setdefault("_shard_plans", {})
        plans = []
        at, end = 0, hi - lo
        while at < end:
            v, k = var[at], nshards[at]
            partition = [1] * len(variables[v].shape)
            if k > 1:
                partition[axis[at]] = k
            shards = []
            for r in range(at, at + k):
                shard = made.get(codes[r])
                if shard is None:
                    shard = made[codes[r]] = self._shard_plan(codes[r])
                shards.append(shard)
            plans.append(VariablePlan(variable=variables[v].name, partition=tuple(partition), shards=tuple(shards)))
            at += k
        if self.batch_split is None:
            strategy = Strategy.over(self.model, self.cluster, plans)
        else:
            row = self.batch_split[i]
            held = [j for j in range(len(row)) if row[j] > 0]
            devices = self.cluster.devices
            strategy = Strategy.over(self.model, self.cluster, plans, replicas=[devices[j] for j in held],
                                     batch_split=[int(row[j]) for j in held])
        if self.checkpoint is not None and self.checkpoint[i].any():
            blocks = self.blocks()
            strategy = dataclasses.replace(strategy, checkpoint=tuple(sorted(
                (blocks[b], CHECKPOINT_MODES[int(m) - 1]) for b, m in enumerate(self.checkpoint[i]) if m)))
        if self.tp_degree is not None and self.tp_degree[i] > 0:
            strategy = dataclasses.replace(strategy, tensor_parallel=self.tensor_parallel(i))
        return strategy

    def tensor_parallel(self, i: int) -> TensorParallel | None:
        """Strategy ``i``'s tensor parallelism made of its columns
        (:func:`~synctune.strategy.builders.megatron_block_styles`), built once per distinct choice."""
        if self.tp_degree is None or self.tp_degree[i] <= 0:
            return None
        key = (int(self.tp_degree[i]), tuple(self.tp_blocks[i].tolist()), bool(self.tp_logits[i]),
               bool(self.tp_embedding[i]))
        made = self.__dict__.setdefault("_tp_plans", {})
        found = made.get(key)
        if found is None:
            from .builders import TP_BLOCK_PLANS, megatron_block_styles

            degree, codes, logits, embedding = key
            blocks = self.blocks()
            styles = megatron_block_styles(self.model, degree, {blocks[b]: TP_BLOCK_PLANS[c] for b, c in enumerate(codes) if c},
                                   loss_parallel=logits, embedding="rowwise" if embedding else "whole")
            found = made[key] = tensor_parallel_from_data({"degree": degree, "modules": styles})
        return found

    def blocks(self) -> list[str]:
        """The model's blocks, in the order of :attr:`checkpoint`'s columns (computed once)."""
        found = self.__dict__.get("_blocks")
        if found is None:
            found = self.__dict__["_blocks"] = checkpoint_blocks(v.name for v in self.model.variables)
        return found

    def _shard_plan(self, code: tuple) -> ShardPlan:
        """The shard plan of one row's (kind, comp, rank, kind-specific columns) codes."""
        kind, comp, rank, *off = code
        servers = [node.devices[0] for node in self.cluster.nodes]
        sync = SYNCHRONIZERS.get(SYNCHRONIZER_KINDS[kind]).from_columns(dict(zip(_OFF_COLUMNS, off)), servers)
        name = COMPRESSORS.names()[comp]
        compressor = Compressor(kind=name, rank=rank) if "rank" in COMPRESSORS.get(name).params else Compressor(kind=name)
        return ShardPlan(synchronizer=sync, compressor=compressor)

    @classmethod
    def from_strategies(cls, model: Any, cluster: Any, strategies: Sequence[Strategy]) -> "StrategyColumns":
        """``strategies`` of (``model``, ``cluster``) as columns (they must validate against it).
        A strategy's ``tensor_parallel`` is held as Megatron's plan per block (the ``tp_*``
        columns); one that is not such a plan is refused, naming the module, rather than read as
        the data-parallel strategy it composes with."""
        tp_of = _tp_columns(model, strategies)
        cols: dict[str, list] = {k: [] for k in _ROW_FIELDS}
        # One bound append per column, taken once: objects become columns shard by shard.
        (a_sid, a_var, a_axis, a_nshards, a_kind, a_node, a_local, a_group, a_hier, a_comp, a_rank, a_frac, a_ratio,
         a_order, a_sgroup, a_reshard, a_prefetch, a_rdtype) = (cols[k].append for k in _ROW_FIELDS)
        offsets, ngroups = [0], []
        var_index = {v.name: i for i, v in enumerate(model.variables)}
        node_of = {d: i for i, node in enumerate(cluster.nodes) for d in node.devices}
        device_index = {d: j for j, d in enumerate(cluster.devices)}
        split = np.zeros((len(strategies), cluster.num_devices), np.int64)
        wire_of: dict[tuple, tuple[int, float]] = {}  # (compressor, rank, shape) -> (code, wire ratio)
        code_of = dict(KIND_CODES)
        for si, s in enumerate(strategies):
            groups: dict[tuple[str, int], int] = {}  # the strategy's merge groups, numbered as they first appear
            for plan in sorted(s.plans, key=lambda p: var_index[p.variable]):
                vi = var_index[plan.variable]
                var = model.variables[vi]
                k = plan.num_shards
                axis = next((a for a, p in enumerate(plan.partition) if p > 1), 0)
                total = max(1, var.num_elements)
                for shard, shape in zip(plan.shards, shard_shapes(var.shape, plan.partition) if k > 1 else [var.shape]):
                    sync, comp = shard.synchronizer, shard.compressor
                    key = (comp.kind, comp.rank, shape)
                    if key not in wire_of:
                        wire_of[key] = (comp.info.code, comp.info.wire_ratio(tuple(shape), comp.rank))
                    code, ratio = wire_of[key]
                    kind_code = code_of[sync.kind]
                    node, local, group, hier, sgroup, reshard, prefetch, rdtype = sync.column_values(node_of)
                    a_sid(si)
                    a_var(vi)
                    a_axis(axis)
                    a_nshards(k)
                    a_kind(kind_code)
                    a_node(node)
                    a_local(local)
                    a_group(group)
                    a_hier(hier)
                    a_comp(code)
                    a_rank(comp.rank or 0)
                    a_frac((math.prod(shape) if shape else 1) / total)
                    a_ratio(ratio)
                    a_order(groups.setdefault((kind_code, group), len(groups)) if sync.merge_groups else -1)
                    a_sgroup(sgroup)
                    a_reshard(reshard)
                    a_prefetch(prefetch)
                    a_rdtype(rdtype)
            offsets.append(len(cols["sid"]))
            ngroups.append(len(groups))
            for d, b in zip(s.replicas, s.batch_split):
                split[si, device_index[d]] = b
        arrays = {k: np.asarray(v, dtype=_ROW_FIELDS[k]) for k, v in cols.items()}
        even = (split == model.batch_size).all()
        checkpoint = None
        if any(s.checkpoint for s in strategies):
            blocks = {b: j for j, b in enumerate(checkpoint_blocks(v.name for v in model.variables))}
            checkpoint = np.zeros((len(strategies), len(blocks)), np.int8)
            for si, s in enumerate(strategies):
                for block, mode in s.checkpoint:
                    checkpoint[si, blocks[block]] = CHECKPOINT_MODES.index(mode) + 1
        return cls(model=model, cluster=cluster, offsets=np.asarray(offsets, np.int64),
                   batch_split=None if even else split, ngroups=np.asarray(ngroups, np.float64),
                   checkpoint=checkpoint, **tp_of, **arrays)


#: The per-strategy tensor-parallel columns (:class:`StrategyColumns`).
_TP_FIELDS = ("tp_degree", "tp_blocks", "tp_logits", "tp_embedding")


def _tp_columns(model: Any, strategies: Sequence[Strategy]) -> dict[str, np.ndarray | None]:
    """The ``tp_*`` columns of ``strategies`` (every one None where none splits modules); a plan
    that is not Megatron's on some blocks is refused
    (:func:`~synctune.strategy.builders.megatron_choices`), naming the strategy and the module."""
    if all(s.tensor_parallel is None for s in strategies):
        return dict.fromkeys(_TP_FIELDS)
    from .builders import TP_BLOCK_PLANS, megatron_choices

    blocks = {b: j for j, b in enumerate(checkpoint_blocks(v.name for v in model.variables))}
    n = len(strategies)
    out = {"tp_degree": np.zeros(n, np.int16), "tp_blocks": np.zeros((n, len(blocks)), np.int8),
           "tp_logits": np.zeros(n, bool), "tp_embedding": np.zeros(n, bool)}
    seen: dict[Any, tuple] = {}
    for si, s in enumerate(strategies):
        tp = s.tensor_parallel
        if tp is None:
            continue
        choice = seen.get(tp)
        if choice is None:
            try:
                plans, logits, embedding = megatron_choices(model, tp)
            except StrategyError as exc:
                raise StrategyError(f"strategy {s.hash[:12]}: {exc}") from None
            outside = next((b for b in plans if b not in blocks), None)
            if outside is not None:
                raise StrategyError(f"strategy {s.hash[:12]}: tensor_parallel: block {outside!r} is not one of the "
                                    f"model's blocks ({', '.join(blocks)}), the columns' block axis; run this "
                                    f"strategy as a trial (synctune trial) instead of searching it")
            choice = seen[tp] = (plans, logits, embedding)
        plans, logits, embedding = choice
        out["tp_degree"][si] = tp.degree
        for block, plan in plans.items():
            out["tp_blocks"][si, blocks[block]] = TP_BLOCK_PLANS.index(plan)
        out["tp_logits"][si] = logits
        out["tp_embedding"][si] = embedding == "rowwise"
    return out


#: The per-shard columns and their dtypes. A round of 30,000 BERT-large proposals holds about
#: ten million rows, so the codes that are small by construction are stored narrow (the memory
#: of a search round); :data:`COLUMN_BOUNDS` says why each fits, a test holds it, and arithmetic
#: that could leave a narrow type (the signatures' folding) widens first. ``sid``, ``var``,
#: ``group`` and ``group_order`` enter products (unit keys, flat indices) and stay int64.
_ROW_FIELDS: dict[str, type] = {
    "sid": np.int64, "var": np.int64, "axis": np.int8, "nshards": np.int16, "kind": np.int8, "node": np.int16,
    "local": bool, "group": np.int64, "hier": bool, "comp": np.int8, "rank": np.int32, "frac": np.float64,
    "ratio": np.float64, "group_order": np.int64, "shard_group": np.int32, "reshard": bool, "prefetch": np.int8,
    "reduce_dtype": np.int8,
}
#: The shard-plan columns: (name, value off shard, dtype).
_SHARD_FIELDS = (("shard_group", -1, np.int32), ("reshard", False, bool), ("prefetch", 0, np.int8),
                 ("reduce_dtype", 0, np.int8))

#: Each narrow column's largest value and where that bound comes from (the smallest is -1 for
#: ``node`` off PS and ``shard_group`` off shard, else 0).
COLUMN_BOUNDS: dict[str, tuple[str, int]] = {
    "axis": ("a tensor's dimensions (torch allows at most 64)", 64),
    "nshards": ("LIMITS['shards'], shards of one variable", LIMITS["shards"]),
    "kind": ("synchronizer kinds", len(SYNCHRONIZER_KINDS)),
    "node": ("LIMITS['nodes'], nodes of a cluster", LIMITS["nodes"]),
    "comp": ("registered compressors (a registry of a few)", 64),
    "rank": ("a compressor's rank (Compressor allows 1 to 2**20)", 1 << 20),
    "shard_group": ("LIMITS['devices'], devices a shard group spans", LIMITS["devices"]),
    "prefetch": ("MAX_PREFETCH", MAX_PREFETCH),
    "reduce_dtype": ("REDUCE_DTYPES", len(REDUCE_DTYPES)),
}
#: The dtype of every per-shard column (what producers allocate).
COLUMN_DTYPES: dict[str, type] = dict(_ROW_FIELDS)


def _number_groups(sid: np.ndarray, kind: np.ndarray, group: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard, its merge group numbered 0.. per strategy in the order the groups first appear
    (-1 off all-reduce), and per strategy how many groups it has."""
    order = np.full(len(sid), -1, np.int64)
    ngroups = np.zeros(n)
    rows = np.flatnonzero(np.isin(kind, _merge_group_codes()))
    if not len(rows):
        return order, ngroups
    # One group per (strategy, kind, id): two merging kinds' groups of one id stay apart.
    key = (sid[rows] * len(SYNCHRONIZER_KINDS) + kind[rows]) * (int(group.max()) + 2) + group[rows]
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    owner = sid[rows][first]
    by_owner = np.lexsort((first, owner))  # groups by strategy, then by first appearance
    rank = np.empty(len(uniq), np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(owner[by_owner])) + 1]
    rank[by_owner] = np.arange(len(uniq)) - np.repeat(starts, np.diff(np.r_[starts, len(uniq)]))
    order[rows] = rank[inverse]
    return order, np.bincount(owner, minlength=n).astype(np.float64)
