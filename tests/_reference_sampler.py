"""Today's object sampler, kept unchanged as an independent reference for the column sampler.

This is ``synctune.search.sampler.GuidedSampler`` as it drew strategies object by object with
Python's ``random`` before the column sampler became the only one (its column path, which drew
no replica subsets and no shard plans, left out). ``tests/test_sampler_distributions.py`` draws
a few hundred strategies from both and compares the distributions of what they decide: the
random streams differ (Python's and numpy's), the knowledge constraints must not.
Nothing in the package imports it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from synctune.spec.cluster import ClusterSpec
from synctune.spec.model import ModelSpec
from synctune.strategy.compressors import COMPRESSORS, lossy_compressors
from synctune.strategy.kinds import renumber_units
from synctune.strategy.partition import shard_shapes
from synctune.strategy.schema import (
    SPARSE_GROUP_BASE,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardPlan,
    ShardSynchronizer,
    Strategy,
    StrategyError,
    VariablePlan,
)
from synctune.strategy.validate import validate

__all__ = ["GuidedSampler", "SHARD_MODES", "canonical_groups", "hsdp_size", "module_at", "shardable"]

_RANKS = (1, 2, 4)  # the PowerSGD ranks a strategy draws from (fitted to each shard)
_UNCOMPRESSED = Compressor()  # frozen: one object serves every shard that sends its gradient as it is
#: How a sharded draw shards (:meth:`GuidedSampler.sample` with ``shard_prob``): ``zero2``, some
#: modules' variables sharded without reshard beside the other plans (the engine runs it);
#: ``fsdp``, every variable sharded, units resharded at a drawn rate (FSDP2 runs it).
SHARD_MODES = ("zero2", "fsdp")
#: The prefetch depths a resharded unit draws: FSDP2's default (1) or one unit more.
_PREFETCH = (1, 2)


def shardable(var) -> bool:
    """Whether ``var`` may take a ``shard`` synchronizer: dense, not a scalar, float32 (what
    :func:`synctune.strategy.validate.validate` accepts on an unpartitioned variable)."""
    return not var.sparse and bool(var.shape) and var.dtype == "float32"


def module_at(name: str, depth: int) -> str:
    """The module holding variable ``name`` cut at ``depth`` (``blocks.0`` of
    ``blocks.0.attn.q.weight`` at depth 2; ``""``, the root, for a top-level variable), as the
    ``shard`` builder cuts units: every module at one depth is an FSDP2 ``fully_shard`` boundary."""
    return ".".join(name.split(".")[:-1][:depth])


def hsdp_size(strategy: Strategy, cluster: ClusterSpec) -> int | None:
    """The shard-group size of HSDP that matches the nodes (one node's devices per group, the
    groups all-reduced across nodes), or None where there is none: the replicas must be whole
    nodes, more than one, and every node of the cluster the same number of devices, two or more."""
    sizes = {node.num_devices for node in cluster.nodes}
    if len(sizes) != 1 or min(sizes) < 2:
        return None
    held = set(strategy.replicas)
    nodes = [node for node in cluster.nodes if held & set(node.devices)]
    if len(nodes) < 2 or any(not set(node.devices) <= held for node in nodes):
        return None
    # Consecutive replicas form a group: each node's devices must be listed together.
    owner = [cluster.node_of(d).name for d in strategy.replicas]
    size = sizes.pop()
    if any(len(set(owner[i:i + size])) != 1 for i in range(0, len(owner), size)):
        return None
    return size


def canonical_groups(strategy: Strategy) -> Strategy:
    """``strategy`` with its dense merge groups numbered by first appearance in plan (backward)
    order, its sparse ones from :data:`SPARSE_GROUP_BASE`, and its ``shard`` units from 0 by first
    appearance (:func:`synctune.strategy.kinds.renumber_units`): two strategies that group the
    same shards the same way get the same hash, so neither is measured twice."""
    return renumber_units(strategy)


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
    hold replicas), and, with ``split_prob``, an uneven batch split. Where sufficient-factor
    broadcasting sends fewer bytes than a ring all-reduce for some linear weights (N·b·rows·
    (H_in + H_out) < 2·H_in·H_out: TAG §4.2.3's per-variable choice), a strategy draws with
    ``sfb_prob`` a rate at which those weights take it.

    With ``shard_prob`` (> 0; at 0 nothing more is drawn, so every random stream stays as it
    was), a draw is then turned into sharded data parallelism (DESIGN.md "shard"; ZeRO, FSDP2),
    in one of :data:`SHARD_MODES`: units are the modules at a depth drawn from the model's
    (:func:`module_at`, the ``shard`` builder's cut); ``zero2`` shards, at a drawn rate per
    unit, the shardable variables of each unit (no reshard), the others keeping their plans;
    ``fsdp`` (only where every variable is shardable) shards every variable and reshards each
    unit at a drawn rate, prefetching 1 or 2 units. One shard group per strategy (every replica,
    or HSDP over the nodes where :func:`hsdp_size` finds it) and one reduce dtype (bf16 only
    when ``lossy``). The replica subset and batch split drawn before are kept.

    With ``fits`` (a memory budget's predicate: :class:`synctune.simulator.memory.MemoryBudget`'s
    ``fits``), a sharded draw the budget does not hold is grown until it does, with no further
    draw from the stream: the modules left replicated join units, the largest first, and where
    every module is a unit and it still does not fit, the shard group widens from one node
    (HSDP) to every replica, and then the units reshard, the largest first
    (only where every variable is shardable: FSDP2 runs a resharded unit). What then still does
    not fit is returned as it is, for the search's filter to drop. This is ZeRO's order of
    stages (ZeRO §5: shard optimizer state and gradients first, parameters only where that is
    not enough), per module; without it, under a budget replicated training does not fit, a
    zero2 draw shards a random share of modules and almost never fits.
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

    def __post_init__(self) -> None:
        if not (isinstance(self.shard_prob, (int, float)) and 0.0 <= self.shard_prob <= 1.0):
            raise ValueError(f"GuidedSampler: shard_prob: expected a probability in [0, 1], got {self.shard_prob!r}")
        self.rng = random.Random(self.seed)
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
        self.shardable = {v.name for v in self.model.variables if shardable(v)}
        #: The deepest module of any variable (1 at least: depth 1 cuts at the root's children).
        self.max_depth = max(1, max((v.name.count(".") for v in self.model.variables), default=1))

    def with_sfb(self, strategy: Strategy) -> Strategy:
        """``strategy`` with sufficient-factor broadcasting for the linear weights whose factors are
        fewer bytes than their gradient (:attr:`sfb_cheaper`), each whole."""
        plans = tuple(VariablePlan(variable=p.variable, partition=(1,) * len(p.partition), shards=(ShardPlan(
            synchronizer=SFBSynchronizer()),)) if p.variable in self.sfb_cheaper else p for p in strategy.plans)
        return dataclasses.replace(strategy, plans=plans)

    def split_towards_speed(self, strategy: Strategy, t: float) -> Strategy:
        """``strategy`` with its global batch split a fraction ``t`` of the way from even
        (``t`` = 0) to proportional to the replicas' measured speeds (``t`` = 1)."""
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
        which devices hold replicas), the global batch split evenly over them; PS shards placed
        on a node left out move to the kept nodes' first devices in turn."""
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
                if isinstance(sync, PSSynchronizer) and sync.placement not in kept:
                    sync = dataclasses.replace(sync, placement=servers[moved % len(servers)])
                    shard = dataclasses.replace(shard, synchronizer=sync)
                    moved += 1
                shards.append(shard)
            plans.append(dataclasses.replace(plan, shards=tuple(shards)))
        return dataclasses.replace(strategy, replicas=tuple(keep), batch_split=tuple(split), plans=tuple(plans))

    def without_node(self, strategy: Strategy, out: int) -> Strategy | None:
        """:meth:`on_nodes` every node but ``out``; None where that strategy is not valid (e.g. a
        hierarchical all-reduce left on one node)."""
        candidate = self.on_nodes(strategy, [j for j in range(len(self.cluster.nodes)) if j != out])
        try:
            validate(candidate, self.model, self.cluster)
        except StrategyError:
            return None
        return candidate

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

    def _compressor(self, kind: str, rank: int, var, shard_shape: tuple[int, ...], sync_kind: str) -> Compressor:
        """``kind`` where it applies to this shard (dense, its synchronizer, its shape), else none."""
        info = COMPRESSORS.get(kind)
        if kind == "none" or var.sparse or sync_kind not in info.synchronizers:
            return _UNCOMPRESSED
        if "rank" in info.params:
            fitted = info.fit(shard_shape, rank)
            if fitted is None or info.problem(shard_shape, fitted):
                return _UNCOMPRESSED
            return Compressor(kind=kind, rank=fitted)
        return _UNCOMPRESSED if info.problem(shard_shape, None) else Compressor(kind=kind)

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
