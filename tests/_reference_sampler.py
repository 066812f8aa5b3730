"""Today's object sampler, kept as an independent reference for the column sampler.

``synctune.search.sampler.GuidedSampler`` drew strategies object by object with Python's
``random`` before the column sampler became the only one. Its drawing methods are here
unchanged (``sample``, ``sharded`` and what they call: partitions, PS placement by load, merge
groups by load, a compressor or hierarchical all-reduce per strategy, SFB, replica subsets,
batch splits, shard units and their growth under ``fits``). What is not a draw comes from the
package's sampler, which this class extends: the domain's figures (servers, NIC bandwidths,
node speeds, the weights cheaper by SFB, the shardable variables) and the deterministic helpers
(a compressor fitted to a shard, the batch split towards speed, replicas on some nodes). So what
``tests/test_sampler_distributions.py`` compares is how the two draw: the random streams differ
(Python's and numpy's), the knowledge constraints must not. Nothing in the package imports it.
"""

from __future__ import annotations

import dataclasses
import math
import random

from synctune.search import sampler as package
from synctune.search.sampler import SHARD_MODES, canonical_groups, hsdp_size, module_at
from synctune.strategy.compressors import lossy_compressors
from synctune.strategy.schema import (
    SPARSE_GROUP_BASE,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    PSSynchronizer,
    SFBSynchronizer,
    ShardPlan,
    ShardSynchronizer,
    Strategy,
    VariablePlan,
)
from synctune.strategy.partition import shard_shapes

__all__ = ["GuidedSampler"]

_RANKS = (1, 2, 4)  # the PowerSGD ranks a strategy draws from (fitted to each shard)
#: The prefetch depths a resharded unit draws: FSDP2's default (1) or one unit more.
_PREFETCH = (1, 2)


class GuidedSampler(package.GuidedSampler):
    """The guided sampler as it drew objects (the package sampler's class docstring says what
    it draws); every draw from ``random.Random(seed)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.rng = random.Random(self.seed)
        #: The deepest module of any variable (1 at least: depth 1 cuts at the root's children).
        self.max_depth = max(1, max((v.name.count(".") for v in self.model.variables), default=1))

    def _compressor(self, kind: str, rank: int, var, shard_shape: tuple[int, ...], sync_kind: str):
        return self.compressor_for(kind, rank, var, shard_shape, sync_kind)

    def _subset(self, strategy: Strategy) -> Strategy:
        """On nodes of different measured speeds and with ``subset_prob``: ``strategy`` without
        one node's replicas, the slower a node the likelier it is left out (draws nothing on
        homogeneous clusters or on one node)."""
        if self.speeds is None or len(self.cluster.nodes) < 2 or self.rng.random() >= self.subset_prob:
            return strategy
        slowness = [1.0 / (node.compute_gflops or 1.0) for node in self.cluster.nodes]
        out = self.rng.choices(range(len(self.cluster.nodes)), weights=slowness)[0]
        return self.without_node(strategy, out) or strategy

    def _batch_split(self, strategy: Strategy) -> Strategy:
        """``strategy`` with, on nodes of different speeds and with ``split_prob``, the global
        batch split between even and proportional to speed (a random point between the two), so
        the slow replicas stop holding every step back. Draws nothing on homogeneous clusters (the
        random streams of existing searches stay as they were)."""
        if self.speeds is None or self.rng.random() >= self.split_prob:
            return strategy
        return self.split_towards_speed(strategy, self.rng.random())

    def _partition(self, var) -> list[int]:
        partition = [1] * len(var.shape)
        if not var.shape or var.shape[0] < 2 or var.num_bytes < self.small_bytes:
            return partition
        if var.num_bytes >= self.large_bytes or self.rng.random() < self.partition_prob:
            axes = [a for a, d in enumerate(var.shape) if d > 1 and (a == 0 or not var.sparse)]
            axis = self.rng.choice(axes)
            upper = min(self.max_shards, var.shape[axis], max(2, 2 * len(self.servers)))
            partition[axis] = self.rng.randint(2, max(2, upper))
        return partition

    def sample(self) -> Strategy:
        rng = self.rng
        ps_share = rng.random()
        local_rate = rng.random()
        comp_kind, comp_rank, algorithm = "none", 0, "flat"
        if self.lossy and rng.random() < self.compress_prob:
            comp_kind = rng.choice(lossy_compressors())
            comp_rank = rng.choice(_RANKS)
        elif self.even_nodes and rng.random() < self.hierarchical_prob:
            algorithm = "hierarchical"
        loads = [0.0] * len(self.servers)
        decisions = []
        # Draws nothing where no linear weight is cheaper by SFB (existing streams stay as they were).
        sfb_rate = rng.random() if self.sfb_cheaper and rng.random() < self.sfb_prob else 0.0
        for var in self.model.variables:
            if sfb_rate and var.name in self.sfb_cheaper and rng.random() < sfb_rate:
                decisions.append((var, [1] * len(var.shape), [("sfb", None)], var.num_bytes))
                continue
            partition = self._partition(var)
            k = math.prod(partition)
            shard_bytes = var.num_bytes / k
            kinds = []
            for _ in range(k):
                if rng.random() < ps_share:
                    weights = [nic / (1.0 + load / max(1.0, shard_bytes)) for nic, load in zip(self.nic, loads)]
                    j = rng.choices(range(len(self.servers)), weights=weights)[0]
                    loads[j] += shard_bytes
                    kinds.append(("ps", j))
                else:
                    kinds.append(("allgather", None) if var.sparse and rng.random() < 0.5 else ("allreduce", None))
            decisions.append((var, partition, kinds, shard_bytes))
        ar_bytes = sum(b for _v, _p, ks, b in decisions for kind, _ in ks if kind == "allreduce")
        num_groups = rng.randint(1, max(1, min(16, sum(1 for _v, _p, ks, _b in decisions for kd, _ in ks
                                                      if kd == "allreduce"))))
        target = ar_bytes / num_groups if ar_bytes else 1.0
        group, filled, sparse_group = 0, 0.0, SPARSE_GROUP_BASE
        group_comp = None  # the compressor label of the open dense group
        plans = []
        for var, partition, kinds, shard_bytes in decisions:
            shards = []
            for (kind, j), shard_shape in zip(kinds, shard_shapes(tuple(var.shape), tuple(partition))):
                comp = self._compressor(comp_kind, comp_rank, var, shard_shape, kind)
                if kind == "ps":
                    local = rng.random() < local_rate
                    sync = PSSynchronizer(placement=self.servers[j], local_aggregation=local and not var.sparse)
                elif kind == "allgather":
                    sync = AllGatherSynchronizer()
                elif kind == "sfb":
                    sync = SFBSynchronizer()
                elif var.sparse:
                    sync = AllReduceSynchronizer(group=sparse_group, algorithm=algorithm)
                else:
                    if filled and (filled + shard_bytes > target * 1.0001 or comp.label != group_comp):
                        group, filled = group + 1, 0.0
                    filled += shard_bytes
                    group_comp = comp.label
                    sync = AllReduceSynchronizer(group=group, algorithm=algorithm)
                shards.append(ShardPlan(synchronizer=sync, compressor=comp))
            plans.append(VariablePlan(variable=var.name, partition=tuple(partition), shards=tuple(shards)))
        strategy = self._batch_split(self._subset(Strategy.over(self.model, self.cluster, plans)))
        if self.shard_prob > 0 and rng.random() < self.shard_prob:
            strategy = self.sharded(strategy)
        return strategy

    def sharded(self, strategy: Strategy, mode: str | None = None) -> Strategy:
        """``strategy`` turned into sharded data parallelism (see the class docstring), drawn from
        this sampler's stream; ``mode`` one of :data:`SHARD_MODES` (None: drawn, ``fsdp`` only
        where every variable is shardable). ``strategy`` as it is where nothing can be sharded
        (no shardable variable, or a single replica: a shard group of one shards nothing)."""
        if mode is not None and mode not in SHARD_MODES:
            raise ValueError(f"GuidedSampler.sharded: mode: expected one of {SHARD_MODES}, got {mode!r}")
        every = len(self.shardable) == len(self.model.variables)
        if mode == "fsdp" and not every:
            odd = next(v.name for v in self.model.variables if v.name not in self.shardable)
            raise ValueError(f"GuidedSampler.sharded: mode fsdp shards every variable, and {odd!r} cannot be "
                             f"sharded (sparse, scalar or not float32); use mode zero2")
        if not self.shardable or len(strategy.replicas) < 2:
            return strategy
        rng = self.rng
        if mode is None:
            mode = SHARD_MODES[1] if every and rng.random() < 0.5 else SHARD_MODES[0]
        depth = rng.randint(1, self.max_depth)
        hsdp = hsdp_size(strategy, self.cluster)
        group = rng.choice((0, hsdp)) if hsdp else 0
        reduce_dtype = "bf16" if self.lossy and rng.random() < 0.5 else "fp32"
        modules = list(dict.fromkeys(module_at(p.variable, depth) for p in strategy.plans
                                     if p.variable in self.shardable))
        rate = rng.random()
        if mode == "zero2":
            chosen = {m for m in modules if rng.random() < rate}
            if not chosen:  # a sharded draw shards something
                chosen = {modules[rng.randrange(len(modules))]}
            options = {m: (False, 0) for m in chosen}
        else:
            options = {}
            for m in modules:
                reshard = rng.random() < rate
                options[m] = (reshard, rng.choice(_PREFETCH) if reshard else 0)
        out = self._with_units(strategy, depth, options, group, reduce_dtype)
        if self.fits is None or self.fits(out):
            return out
        # Grow the draw until the budget holds it (the class docstring): more modules, then reshard.
        size: dict[str, int] = {}
        for var in self.model.variables:
            if var.name in self.shardable:
                module = module_at(var.name, depth)
                size[module] = size.get(module, 0) + var.num_bytes
        order = {m: i for i, m in enumerate(modules)}
        for m in sorted((m for m in modules if m not in options), key=lambda m: (-size[m], order[m])):
            options[m] = (False, 0)
            out = self._with_units(strategy, depth, options, group, reduce_dtype)
            if self.fits(out):
                return out
        if group:  # HSDP keeps a copy per node: shard over every replica before resharding
            group = 0
            out = self._with_units(strategy, depth, options, group, reduce_dtype)
            if self.fits(out):
                return out
        if not every:
            return out
        for m in sorted((m for m in modules if not options[m][0]), key=lambda m: (-size[m], order[m])):
            options[m] = (True, 1)
            out = self._with_units(strategy, depth, options, group, reduce_dtype)
            if self.fits(out):
                return out
        return out

    def _with_units(self, strategy: Strategy, depth: int, options: dict[str, tuple[bool, int]], group: int,
                    reduce_dtype: str) -> Strategy:
        """``strategy`` with the shardable variables of each module of ``options`` (module to
        (reshard, prefetch)) in one ``shard`` unit per module."""
        # New units are numbered after the units ``strategy`` may already have (kept where their
        # module is not chosen), then every unit renumbered by first appearance.
        base = 1 + max((sh.synchronizer.unit for p in strategy.plans for sh in p.shards
                        if isinstance(sh.synchronizer, ShardSynchronizer)), default=-1)
        units: dict[str, int] = {}
        plans = []
        for plan in strategy.plans:
            module = module_at(plan.variable, depth)
            if plan.variable not in self.shardable or module not in options:
                plans.append(plan)
                continue
            reshard, prefetch = options[module]
            sync = ShardSynchronizer(unit=units.setdefault(module, base + len(units)), group=group, reshard=reshard,
                                     prefetch=prefetch, reduce_dtype=reduce_dtype)
            plans.append(VariablePlan(variable=plan.variable, partition=(1,) * len(plan.partition),
                                      shards=(ShardPlan(synchronizer=sync),)))
        # Merge groups that lost members to the units are renumbered, so equal strategies hash equal.
        return canonical_groups(dataclasses.replace(strategy, plans=tuple(plans)))

    def sample_many(self, n: int) -> list[Strategy]:
        return [self.sample() for _ in range(n)]
