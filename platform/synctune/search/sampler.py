"""Samplers of composed strategies (AutoDist §2.4 "strategy sampler").

:class:`RandomSampler` draws from the whole representation with no knowledge constraints: per
variable a random partition (sometimes), per shard a synchronizer (PS on a node's server, or
all-reduce; all-gather too for sparse gradients), PS local aggregation at random, and merge
groups over adjacent variables. It is the "plain random" ablation of the papers and the source
of varied training data for the simulator.

:class:`GuidedSampler` draws under the papers' knowledge constraints, always as strategy columns
(:meth:`GuidedSampler.sample_columns`; its objects are made of columns): the built-in kinds in a
compiled kernel, then replica subsets and batch splits on nodes of different speeds, then each
registered kind's own draw (:data:`synctune.search.kinds.SEARCH_KINDS`), sharded data
parallelism among them (ZeRO / FSDP2, DESIGN.md "shard": :mod:`synctune.search.shard_draw`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.builders import tp_batch_split, without_tensor_parallel
from ..strategy.columns import COLUMN_DTYPES, StrategyColumns
from ..strategy.compressors import COMPRESSORS, lossy_compressors
from ..strategy.kinds import renumber_units
from ..strategy.partition import shard_shapes
from ..strategy.schema import (
    SPARSE_GROUP_BASE,
    SYNCHRONIZER_KINDS,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardPlan,
    Strategy,
    StrategyError,
    VariablePlan,
)
from ..strategy.validate import validate
from .checkpoint_draw import draw_checkpointing
from .draw import DrawContext
from .kinds import SEARCH_KINDS, kernel_codes
from .shard_draw import SHARD_MODES, draw_shard_units, hsdp_size, module_at, shard_layout, shardable
from .tp_draw import draw_tensor_parallel, grow_split

__all__ = ["RandomSampler", "GuidedSampler", "SHARD_MODES", "canonical_groups", "hsdp_size", "module_at",
           "shardable"]

_RANKS = (1, 2, 4)  # the PowerSGD ranks a strategy draws from (fitted to each shard)
_UNCOMPRESSED = Compressor()  # frozen: one object serves every shard that sends its gradient as it is
#: The synchronizer kinds some lossy compressor can wrap: the kind axis of the column tables.
_COMPRESSIBLE = tuple(kind for kind in SYNCHRONIZER_KINDS if lossy_compressors(kind))
#: The kind :attr:`GuidedSampler.shard_prob` is the draw rate of.
_SHARD = "shard"


def canonical_groups(strategy: Strategy) -> Strategy:
    """``strategy`` with its dense merge groups numbered by first appearance in plan (backward)
    order, its sparse ones from :data:`SPARSE_GROUP_BASE`, and its ``shard`` units from 0 by first
    appearance (:func:`synctune.strategy.kinds.renumber_units`): two strategies that group the
    same shards the same way get the same hash, so neither is measured twice."""
    return renumber_units(strategy)


@dataclass
class RandomSampler:
    """Uniform-ish random strategies; ``seed`` makes the sequence reproducible."""

    model: ModelSpec
    cluster: ClusterSpec
    seed: int = 0
    partition_prob: float = 0.3
    max_shards: int = 4
    ps_prob: float = 0.5
    new_group_prob: float = 0.2

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.servers = [node.devices[0] for node in self.cluster.nodes]

    def sample(self) -> Strategy:
        """One random valid strategy."""
        rng = self.rng
        plans = []
        group = 0
        sparse_group_offset = SPARSE_GROUP_BASE  # sparse and dense gradients never share a merge group
        for var in self.model.variables:
            partition = [1] * len(var.shape)
            axes = [a for a, d in enumerate(var.shape) if d > 1 and (a == 0 or not var.sparse)]
            if axes and rng.random() < self.partition_prob:
                axis = rng.choice(axes)
                partition[axis] = rng.randint(2, min(self.max_shards, var.shape[axis]))
            shards = []
            for _ in range(math.prod(partition)):
                roll = rng.random()
                if var.sparse and roll < (1 - self.ps_prob) / 2:
                    sync = AllGatherSynchronizer()
                elif roll < self.ps_prob:
                    # Local aggregation is drawn for every PS shard (the stream stays the same) and kept for
                    # dense gradients only: the engine gathers sparse rows to the server directly.
                    server = rng.choice(self.servers)
                    local = rng.random() < 0.5
                    sync = PSSynchronizer(placement=server, local_aggregation=local and not var.sparse)
                else:
                    if rng.random() < self.new_group_prob:
                        group += 1
                    sync = AllReduceSynchronizer(group=group + (sparse_group_offset if var.sparse else 0))
                shards.append(ShardPlan(synchronizer=sync))
            plans.append(VariablePlan(variable=var.name, partition=tuple(partition), shards=tuple(shards)))
        return Strategy.over(self.model, self.cluster, plans)

    def sample_many(self, n: int) -> list[Strategy]:
        """``n`` strategies of :meth:`sample`, in draw order (equal draws are kept: callers skip them)."""
        return [self.sample() for _ in range(n)]



@dataclass
class GuidedSampler:
    """Strategies sampled under the papers' knowledge constraints (AutoDist §2.4, AutoSync §3.2).

    - partitioning: never below ``small_bytes``, always above ``large_bytes`` (a variable that
      large is bandwidth-bound on one flow), otherwise with probability ``partition_prob``;
    - load balancing (c_lb): each PS shard's server node is drawn from a multinomial whose
      weights grow with the node's NIC bandwidth and shrink with the bytes already placed there;
    - adjacent merging (c_am): all-reduce shards join groups in backward order, and a group
      closes once it holds its share of the strategy's all-reduce bytes, so groups have similar
      loads.
    Each strategy first draws its own PS share, local-aggregation rate and number of groups, so
    a batch spans mostly-PS, mixed and mostly-all-reduce strategies. It also draws, with
    ``compress_prob`` and only when ``lossy``, one lossy compressor for its dense messages (fp16
    or bf16 on all-reduce and PS shards, PowerSGD of rank 1, 2 or 4 on all-reduce shards where
    it fits: AutoSync's "message encoding"), else, with ``hierarchical_prob`` where every node
    holds as many replicas, hierarchical all-reduce (reduce within nodes, all-reduce across, then
    broadcast: Horovod's hierarchical mode). A merge group holds shards of one algorithm and one
    compressor. On nodes of different measured speeds it also draws, with ``subset_prob``, a
    replica subset without one node (the slower, the likelier: TAG §4.2's choice of which devices
    hold replicas; its PS shards move to the kept nodes' servers in turn), and, with
    ``split_prob``, an uneven batch split (else the batch split evenly over the replicas). Where
    sufficient-factor broadcasting sends fewer bytes than a ring all-reduce for some linear
    weights (N·b·rows·(H_in + H_out) < 2·H_in·H_out: TAG §4.2.3's per-variable choice), a
    strategy draws with ``sfb_prob`` a rate at which those weights take it.

    Then each registered kind with a draw of its own (:data:`synctune.search.kinds.SEARCH_KINDS`,
    in its order) turns, at its rate, some drawn strategies into its own: ``shard`` at
    ``shard_prob`` (> 0; at 0 nothing more is drawn, so the stream stays as it was), sharded
    data parallelism as :mod:`synctune.search.shard_draw` draws it, grown until ``fits`` (a
    memory budget's predicate: :class:`synctune.simulator.memory.MemoryBudget`'s ``fits``) holds
    it; any other kind at ``kind_rates[name]`` (kind name -> probability per strategy; 0 where
    not named).

    Every draw is written as strategy columns (:meth:`sample_columns`), from the sampler's numpy
    stream seeded ``seed``; :meth:`sample`, :meth:`sample_many` and :meth:`sharded` are objects
    made of columns.
    """

    model: ModelSpec
    cluster: ClusterSpec
    seed: int = 0
    small_bytes: int = 256 * 1024
    large_bytes: int = 64 * 1024 * 1024
    partition_prob: float = 0.3
    max_shards: int = 8
    lossy: bool = True
    compress_prob: float = 0.3
    hierarchical_prob: float = 0.3
    split_prob: float = 0.6
    subset_prob: float = 0.25
    sfb_prob: float = 0.5
    shard_prob: float = 0.0
    fits: Callable[[Strategy], bool] | None = None
    kind_rates: Mapping[str, float] = field(default_factory=dict)
    #: The share of drawn strategies that checkpoint some blocks
    #: (:mod:`synctune.search.checkpoint_draw`; 0: none, and the stream stays as it was).
    checkpoint_prob: float = 0.0
    #: The share of drawn strategies split by tensor parallelism, Megatron's plan per block
    #: (:mod:`synctune.search.tp_draw`; 0: none, the stream stays as it was, and no growth
    #: splits a draw).
    tp_prob: float = 0.0
    #: Of the sharded draws grown past sharding where both a split and checkpointing would fit,
    #: the share that split first (:func:`synctune.search.shard_draw.grow`; the others
    #: checkpoint): a search sets it from what its trials measured of each.
    split_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("shard_prob", "tp_prob", "split_share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"GuidedSampler: {name}: expected a probability in [0, 1], got {value!r}")
        drawn = [name for name, kind in SEARCH_KINDS.items() if kind.draw is not None and name != _SHARD]
        for name, rate in dict(self.kind_rates).items():
            if name not in drawn:
                raise ValueError(f"GuidedSampler: kind_rates: {name!r} is no kind with a draw of its own; valid: "
                                 f"{', '.join(drawn) or 'none'} (shard's rate is shard_prob)")
            if not (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0):
                raise ValueError(f"GuidedSampler: kind_rates[{name!r}]: expected a probability in [0, 1], got {rate!r}")
        self.np_rng = np.random.default_rng(self.seed)
        self.servers = [node.devices[0] for node in self.cluster.nodes]
        self.nic = [node.nic_gbps for node in self.cluster.nodes]
        self.even_nodes = len({node.num_devices for node in self.cluster.nodes}) == 1
        # Per replica, its node's measured compute speed (calibrated clusters): where they differ,
        # proposals also split the batch unevenly (TAG §4.2's batch split).
        speeds = [node.compute_gflops for node in self.cluster.nodes for _ in node.devices]
        self.speeds = speeds if all(speeds) and len(set(speeds)) > 1 else None
        self.device_speed = dict(zip(self.cluster.devices, speeds))
        n = self.cluster.num_devices
        self.sfb_cheaper = {v.name for v, r in zip(self.model.variables, self.model.factor_rows or ())
                            if r and n * self.model.batch_size * r * (v.shape[0] + v.shape[1]) < 2 * v.num_elements}
        self._tables: dict | None = None
        self._memo: dict = {}  # what the kinds' draws work out once per domain

    @property
    def shardable(self) -> frozenset[str]:
        """The variables a ``shard`` draw may shard (:func:`~synctune.search.shard_draw.shardable`)."""
        return shard_layout(self.model, self._memo).names

    def with_sfb(self, strategy: Strategy) -> Strategy:
        """``strategy`` with sufficient-factor broadcasting for the linear weights whose factors are
        fewer bytes than their gradient (:attr:`sfb_cheaper`), each whole."""
        plans = tuple(VariablePlan(variable=p.variable, partition=(1,) * len(p.partition), shards=(ShardPlan(
            synchronizer=SFBSynchronizer()),)) if p.variable in self.sfb_cheaper else p for p in strategy.plans)
        return dataclasses.replace(strategy, plans=plans)

    def split_towards_speed(self, strategy: Strategy, t: float) -> Strategy:
        """``strategy`` with its global batch split a fraction ``t`` of the way from even
        (``t`` = 0) to proportional to the replicas' measured speeds (``t`` = 1); a split
        strategy's over its TP groups, by the sums of their replicas' shares."""
        if strategy.tensor_parallel is not None:
            degree = strategy.tensor_parallel.degree
            moved = self.split_towards_speed(without_tensor_parallel(strategy), t)
            return dataclasses.replace(strategy, batch_split=tp_batch_split(moved, degree))
        speeds = [self.device_speed[d] or 1.0 for d in strategy.replicas]
        fastest = max(speeds)
        weights = [(1 - t) + t * x / fastest for x in speeds]
        total = strategy.global_batch_size
        raw = [total * w / sum(weights) for w in weights]
        split = [max(1, int(r)) for r in raw]
        # Largest remainders first, until the split sums to the global batch again.
        order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
        i = 0
        while sum(split) < total:
            split[order[i % len(order)]] += 1
            i += 1
        while sum(split) > total:
            j = max(range(len(split)), key=lambda k: split[k])
            split[j] -= 1
        return dataclasses.replace(strategy, batch_split=tuple(split))

    def on_nodes(self, strategy: Strategy, nodes: list[int]) -> Strategy:
        """``strategy`` replicated on every device of the cluster's ``nodes`` only (TAG §4.2:
        which devices hold replicas), the global batch split evenly over them; shards served by
        a node left out (PS shards) move to the kept nodes' first devices in turn (their kind's
        :attr:`~synctune.search.kinds.SearchKind.relocate`). A split strategy keeps its split, its
        global batch over the kept TP groups (a group lies inside a node)."""
        if strategy.tensor_parallel is not None:
            kept = self.on_nodes(without_tensor_parallel(strategy), nodes)
            return dataclasses.replace(kept, tensor_parallel=strategy.tensor_parallel,
                                       batch_split=tp_batch_split(kept, strategy.tensor_parallel.degree))
        keep = [d for j in sorted(nodes) for d in self.cluster.nodes[j].devices]
        kept = set(keep)
        servers = [self.servers[j] for j in sorted(nodes)]
        total = strategy.global_batch_size
        split = [total // len(keep) + (1 if i < total % len(keep) else 0) for i in range(len(keep))]
        plans, moved = [], 0
        for plan in strategy.plans:
            shards = []
            for shard in plan.shards:
                sync = shard.synchronizer
                if sync.server is not None and sync.server not in kept:
                    relocate = SEARCH_KINDS.get(sync.kind).relocate
                    if relocate is None:
                        raise ValueError(f"GuidedSampler.on_nodes: {sync.kind}: a shard served by {sync.server} "
                                         f"cannot move (its search kind has no relocate)")
                    shard = dataclasses.replace(shard, synchronizer=relocate(sync, servers[moved % len(servers)]))
                    moved += 1
                shards.append(shard)
            plans.append(dataclasses.replace(plan, shards=tuple(shards)))
        return dataclasses.replace(strategy, replicas=tuple(keep), batch_split=tuple(split), plans=tuple(plans))

    def without_node(self, strategy: Strategy, out: int) -> Strategy | None:
        """:meth:`on_nodes` every node but ``out``; None where that strategy is not valid (e.g. a
        hierarchical all-reduce left on nodes of different device counts)."""
        candidate = self.on_nodes(strategy, [j for j in range(len(self.cluster.nodes)) if j != out])
        try:
            validate(candidate, self.model, self.cluster)
        except StrategyError:
            return None
        return candidate

    def compressor_for(self, kind: str, rank: int, var, shard_shape: tuple[int, ...], sync_kind: str) -> Compressor:
        """Compressor ``kind`` (at ``rank``, fitted to the shard) where it applies to this shard of
        ``var`` under a ``sync_kind`` synchronizer (dense, a kind it wraps, its shape), else none."""
        info = COMPRESSORS.get(kind)
        if kind == "none" or var.sparse or sync_kind not in info.synchronizers:
            return _UNCOMPRESSED
        if "rank" in info.params:
            fitted = info.fit(shard_shape, rank)
            if fitted is None or info.problem(shard_shape, fitted):
                return _UNCOMPRESSED
            return Compressor(kind=kind, rank=fitted)
        return _UNCOMPRESSED if info.problem(shard_shape, None) else Compressor(kind=kind)

    # ------------------------------------------------------------------ objects, made of columns
    def sample(self) -> Strategy:
        """One strategy (the next one drawn as columns, made an object)."""
        return self.sample_many(1)[0]

    def sample_many(self, n: int) -> list[Strategy]:
        """``n`` strategies drawn as :meth:`sample_columns` draws them, made objects."""
        cols = self.sample_columns(n)
        return [cols.strategy(i) for i in range(cols.size)]

    def sharded(self, strategy: Strategy, mode: str | None = None) -> Strategy:
        """``strategy`` turned into sharded data parallelism as a ``shard_prob`` draw turns one
        (:mod:`~synctune.search.shard_draw`; grown until :attr:`fits` holds it), drawn from this
        sampler's stream; ``mode`` one of :data:`SHARD_MODES` (None: drawn, ``fsdp`` only where
        every variable is shardable). ``strategy`` as it is where nothing can be sharded (no
        shardable variable, or a single replica: a shard group of one shards nothing). The
        result is made of columns: a PS shard placed on its node's first device, no staleness
        bound, replicas in device order (as every sampler draws them)."""
        cols = StrategyColumns.from_strategies(self.model, self.cluster, [strategy])
        out = draw_shard_units(self._context(1.0), cols, mode=mode)
        return strategy if out is cols else out.strategy(0)

    # ------------------------------------------------------------------ columns
    def _context(self, rate: float) -> DrawContext:
        ctx = DrawContext(model=self.model, cluster=self.cluster, rng=self.np_rng, lossy=self.lossy, rate=rate,
                          fits=self.fits, memo=self._memo, split_share=self.split_share)
        if self.tp_prob > 0 and self.fits is not None:  # growth may split blocks (tensor parallelism with SP)
            ctx = dataclasses.replace(ctx, split=functools.partial(grow_split, ctx))
        return ctx

    def _column_tables(self) -> dict:
        """Per variable, what :meth:`sample_columns` draws from, and per (variable, axis,
        pieces, shard) its share of the variable and what each compressor makes of it."""
        if self._tables is not None:
            return self._tables
        upper_cap = max(2, 2 * len(self.servers))
        frac, cells = [], []
        per_var = []
        for var in self.model.variables:
            base = len(frac)
            frac.append((math.prod(var.shape) if var.shape else 1) / max(1, var.num_elements))
            cells.append(self._compressor_cells(var, tuple(var.shape)))
            eligible = bool(var.shape) and var.shape[0] >= 2 and var.num_bytes >= self.small_bytes
            axes = [a for a, d in enumerate(var.shape) if d > 1 and (a == 0 or not var.sparse)] if eligible else []
            uppers = [max(2, min(self.max_shards, var.shape[a], upper_cap)) for a in axes]
            kmax = max(uppers, default=1)
            combo = np.zeros((max(1, len(axes)), kmax + 1), np.int64)
            for ai, a in enumerate(axes):
                for k in range(2, uppers[ai] + 1):
                    combo[ai, k] = len(frac)
                    partition = [1] * len(var.shape)
                    partition[a] = k
                    for shape in shard_shapes(tuple(var.shape), tuple(partition)):
                        frac.append((math.prod(shape) if shape else 1) / max(1, var.num_elements))
                        cells.append(self._compressor_cells(var, shape))
            per_var.append({"base": base, "axes": np.array(axes or [0]), "naxes": len(axes),
                            "upper": np.array(uppers or [1]), "kmax": kmax, "combo": combo,
                            "always": var.num_bytes >= self.large_bytes, "sparse": var.sparse,
                            "bytes": float(var.num_bytes), "sfb": var.name in self.sfb_cheaper})
        # Per (variable, axis, pieces, shard) entry x compressor x compressible synchronizer kind x rank,
        # as the compiled sampler indexes them.
        ok, rank, ratio = (np.stack([c[j] for c in cells]) for j in range(3))
        self._tables = {"per_var": _padded(per_var), "frac": np.array(frac), "ok": ok, "rank": rank, "ratio": ratio}
        return self._tables

    def _compressor_cells(self, var, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a shard of ``var`` of ``shape``, per compressor code, synchronizer kind of
        :data:`_COMPRESSIBLE` and rank choice of :data:`_RANKS`: whether :meth:`compressor_for`
        keeps that compressor there, the rank it takes and its wire bytes per gradient byte."""
        size = (len(COMPRESSORS), len(_COMPRESSIBLE), len(_RANKS))
        ok, rank, ratio = np.zeros(size, bool), np.zeros(size, np.int8), np.ones(size)
        for ci, (kind, info) in enumerate(COMPRESSORS.items()):
            ranks = _RANKS if "rank" in info.params else _RANKS[:1]  # the others take no rank
            for si, sync in enumerate(_COMPRESSIBLE):
                for ri, r in enumerate(ranks):
                    comp = self.compressor_for(kind, r, var, shape, sync)
                    if comp.kind == kind:
                        cell = (ci, si, slice(ri, ri + 1) if len(ranks) > 1 else slice(None))
                        ok[cell] = True
                        rank[cell] = comp.rank or 0
                        ratio[cell] = comp.info.wire_ratio(tuple(shape), comp.rank)
        return ok, rank, ratio

    def sample_columns(self, n: int, chunk: int = 4096) -> StrategyColumns:
        """``n`` strategies drawn under the knowledge constraints (the class docstring), written
        straight into columns from the sampler's numpy stream: a search round's tens of
        thousands of proposals cost microseconds each (:mod:`synctune.strategy.columns`).

        What is independent across variables is drawn with numpy for all ``n`` strategies at
        once; what is sequential inside a strategy (placement by load, merging) runs compiled,
        ``chunk`` strategies per call (:mod:`synctune.search.column_kernel`): the output is
        allocated once and filled chunk by chunk. Replica subsets and batch splits are then
        drawn for all strategies at once, and each registered kind's draw edits the columns
        (vectorized; a ``shard`` draw that ``fits`` refuses is grown as an object)."""
        rows, offsets = self._kernel_rows(n, chunk)
        batch_split = self._replicas(n, rows) if self.speeds is not None else None
        cols = StrategyColumns(model=self.model, cluster=self.cluster, offsets=offsets, batch_split=batch_split,
                               **rows)
        for name, kind in SEARCH_KINDS.items():
            rate = self.shard_prob if name == _SHARD else float(self.kind_rates.get(name, 0.0))
            if kind.draw is not None and rate > 0:
                cols = kind.draw(self._context(rate), cols)
        if self.tp_prob > 0:
            cols = draw_tensor_parallel(self._context(self.tp_prob), cols)
        if self.checkpoint_prob > 0:
            cols = draw_checkpointing(self._context(self.checkpoint_prob), cols)
        return cols

    def _kernel_rows(self, n: int, chunk: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The built-in kinds' rows of ``n`` strategies (the compiled kernel's), and their offsets."""
        from .column_kernel import draw_partitions, fill_rows

        rng = self.np_rng
        t = self._column_tables()
        v = t["per_var"]
        nv = len(v["base"])
        ps_share, local_rate = rng.random(n), rng.random(n)
        compress = (rng.random(n) < self.compress_prob) if self.lossy else np.zeros(n, bool)
        lossy = np.array([COMPRESSORS.get(name).code for name in lossy_compressors()])
        comp_kind = lossy[rng.integers(0, len(lossy), n)]
        rank_idx = rng.integers(0, len(_RANKS), n)
        hier = ~compress & (rng.random(n) < self.hierarchical_prob) if self.even_nodes else np.zeros(n, bool)
        sfb_rate = np.where(rng.random(n) < self.sfb_prob, rng.random(n), 0.0) if self.sfb_cheaper else None
        # Per variable, for all strategies: how many pieces, along which axis, where its
        # per-(variable, axis, pieces, shard) table entries start, and whether it goes by SFB
        # (every variable at once, from the tables' padded per-variable arrays).
        base = np.broadcast_to(v["base"], (n, nv)).copy()
        pieces = np.ones((n, nv), np.int64)
        axes = np.zeros((n, nv), np.int64)
        sfb = np.zeros((n, nv), bool)
        if sfb_rate is not None and len(v["sfb"]):
            sfb[:, v["sfb"]] = rng.random((n, len(v["sfb"]))) < sfb_rate[:, None]
        if len(v["cuttable"]):
            draw_partitions(rng.random((3, n, len(v["cuttable"])), dtype=np.float32), v["cuttable"], v["always"],
                            v["naxes"], v["upper"], v["axes"], v["combo"], self.partition_prob, sfb, pieces, axes, base)
        offsets = np.r_[0, np.cumsum(pieces.sum(1))].astype(np.int64)
        total = int(offsets[-1])
        out = {k: np.empty(total, COLUMN_DTYPES[k]) for k in ("sid", "var", "axis", "nshards", "kind", "node", "group",
                                                               "comp", "rank", "local", "hier", "frac", "ratio",
                                                               "group_order")}
        out.update(ngroups=np.zeros(n))
        nic = np.asarray(self.nic, dtype=np.float64)
        codes = kernel_codes()
        kind_axis = np.array([_COMPRESSIBLE.index(k) if k in _COMPRESSIBLE else -1 for k in SYNCHRONIZER_KINDS])
        for lo in range(0, n, max(1, chunk)):
            hi = min(n, lo + max(1, chunk))
            u = rng.random((int(offsets[hi] - offsets[lo]), 2), dtype=np.float32)
            fill_rows(lo, hi, u, rng.random(hi - lo), offsets, pieces, axes, base, sfb, v["bytes"], v["sparse"], nic,
                      ps_share, local_rate, compress, comp_kind, rank_idx, hier, codes, kind_axis,
                      t["frac"], t["ok"], t["rank"], t["ratio"],
                      out["sid"], out["var"], out["axis"], out["nshards"], out["kind"], out["node"], out["local"],
                      out["group"], out["hier"], out["comp"], out["rank"], out["frac"], out["ratio"],
                      out["group_order"], out["ngroups"])
        return out, offsets

    def _replicas(self, n: int, rows: dict[str, np.ndarray]) -> np.ndarray:
        """(n, devices) batch splits on nodes of different speeds (0: no replica there): with
        ``subset_prob`` (two nodes or more) every node but one holds replicas, the node left out
        drawn with weights 1 / its speed, unless a hierarchical all-reduce would be left on
        nodes of different device counts (what :meth:`without_node` refuses); the PS shards of
        the node left out move to the kept nodes' servers in turn (``rows['node']`` is
        rewritten). Then with ``split_prob`` the global batch split a random point between even
        and proportional to speed (as :meth:`split_towards_speed`), else evenly."""
        rng = self.np_rng
        nodes = self.cluster.nodes
        per_node = np.array([node.num_devices for node in nodes])
        owner = np.repeat(np.arange(len(nodes)), per_node)  # devices are listed node by node
        held = np.ones((n, self.cluster.num_devices), bool)
        if len(nodes) >= 2:
            leave = rng.random(n) < self.subset_prob
            slowness = np.cumsum([1.0 / (node.compute_gflops or 1.0) for node in nodes])
            out = np.minimum(np.searchsorted(slowness, rng.random(n) * slowness[-1], side="right"), len(nodes) - 1)
            # Hierarchical all-reduce is drawn only where every node holds as many devices, so a
            # subset of whole nodes keeps it valid; the check stands where that would not hold.
            hierarchical = np.bincount(rows["sid"], weights=rows["hier"], minlength=n) > 0
            uneven_without = np.array([len(set(np.delete(per_node, j).tolist())) > 1 for j in range(len(nodes))])
            leave &= ~(hierarchical & uneven_without[out])
            held[leave] = owner[None, :] != out[leave][:, None]
            sid, node = rows["sid"], rows["node"]
            moving = np.flatnonzero(leave[sid] & (node == out[sid]))
            if len(moving):
                owners = sid[moving]
                starts = np.r_[0, np.flatnonzero(np.diff(owners)) + 1]
                turn = np.arange(len(moving)) - np.repeat(starts, np.diff(np.r_[starts, len(moving)]))
                k = turn % (len(nodes) - 1)
                node[moving] = k + (k >= out[owners])
        return self._split_columns(n, held)

    def _split_columns(self, n: int, held: np.ndarray) -> np.ndarray:
        """(n, devices) batch splits of the global batch over the ``held`` devices: with
        ``split_prob`` a point between even and proportional to speed (as
        :meth:`split_towards_speed`), else even (the first ``total % replicas`` one row more)."""
        rng = self.np_rng
        total = self.model.batch_size * self.cluster.num_devices
        draw = rng.random(n) < self.split_prob
        tt = np.where(draw, rng.random(n), 0.0)
        speeds = np.array([x or 1.0 for x in self.speeds])[None, :]
        fastest = np.where(held, speeds, 0.0).max(1, keepdims=True)
        weights = np.where(held, (1 - tt)[:, None] + tt[:, None] * speeds / fastest, 0.0)
        raw = total * weights / weights.sum(1, keepdims=True)
        split = np.where(held, np.maximum(1, raw.astype(np.int64)), 0)
        # Largest remainders first (among the replicas), until the split sums to the global batch again.
        short = total - split.sum(1)
        order = np.argsort(np.where(held, -(raw - raw.astype(np.int64)), np.inf), axis=1, kind="stable")
        place = np.empty_like(order)
        np.put_along_axis(place, order, np.arange(held.shape[1])[None, :].repeat(n, 0), axis=1)
        split += (place < short[:, None]) & held
        for i in np.flatnonzero(split.sum(1) > total):  # rare: a share rounded up to one row
            while split[i].sum() > total:
                split[i, int(np.argmax(split[i]))] -= 1
        return split


def _padded(per_var: list[dict]) -> dict[str, np.ndarray]:
    """The per-variable draw tables of :meth:`GuidedSampler._column_tables` as arrays, padded to
    the most axes and pieces any variable has (what the compiled partition draw indexes)."""
    amax = max(1, max(info["naxes"] for info in per_var) if per_var else 1)
    kmax = max((info["kmax"] for info in per_var), default=1)
    padded = {"base": np.array([info["base"] for info in per_var], np.int64),
              "naxes": np.array([info["naxes"] for info in per_var], np.int64),
              "always": np.array([info["always"] for info in per_var], bool),
              "upper": np.ones((len(per_var), amax), np.int64), "axes": np.zeros((len(per_var), amax), np.int64),
              "combo": np.zeros((len(per_var), amax, kmax + 1), np.int64),
              "sfb": np.array([i for i, info in enumerate(per_var) if info["sfb"]], np.int64),
              "cuttable": np.array([i for i, info in enumerate(per_var) if info["naxes"]], np.int64),
              "bytes": np.array([info["bytes"] for info in per_var], np.float64),
              "sparse": np.array([info["sparse"] for info in per_var], bool)}
    for i, info in enumerate(per_var):
        na = info["naxes"]
        if na:
            padded["upper"][i, :na] = info["upper"]
            padded["axes"][i, :na] = info["axes"]
            padded["combo"][i, :na, :info["kmax"] + 1] = info["combo"]
    return padded
