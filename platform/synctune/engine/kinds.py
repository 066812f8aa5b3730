"""The engine's part of each synchronizer kind: what it refuses to run, the process sub-groups its
units need, and how a unit of it is built (AutoDist §2.3, one kernel per synchronizer).

:data:`ENGINE_KINDS` maps a kind's name (:data:`synctune.strategy.kinds.SYNCHRONIZERS`) to its
:class:`EngineKind`; :class:`~synctune.engine.core.StrategyEngine` groups a strategy's shards into
units with :func:`~synctune.strategy.kinds.units_of` and asks each unit's kind to build it, never
which class a synchronizer is. A kind registered here runs in the engine from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..spec.registry import Registry
from ..strategy.kinds import PlanUnit
from ..strategy.schema import StrategyError
from .compress import make_compressor
from .units import (AllReduceUnit, HierarchicalAllReduceUnit, Member, PSUnit, SFBUnit, ShardUnit, SparseAllGatherUnit,
                    SparsePSUnit)

__all__ = ["BuildContext", "EngineKind", "ENGINE_KINDS", "register_engine_kind", "GRAD_IN_BUCKET_MAX_ELEMENTS"]


class BuildContext:
    """What a kind's unit builder may use of the engine that builds it: this rank, the world,
    the rank's share of the global batch, the byte counter, the device, the rank layout, the
    seed, the module, and the process groups (made once per world, in one order on every rank,
    before any unit is built: :meth:`EngineKind.subgroups`)."""

    def __init__(self, *, rank: int, world: int, weight: float, counter: Any, device: Any, layout: Any, seed: int,
                 module: torch.nn.Module, spec: Any, group: Callable[[Iterable[int]], Any],
                 linear_layer: Callable[[str], torch.nn.Linear]) -> None:
        self.rank, self.world, self.weight, self.counter = rank, world, weight, counter
        self.device, self.layout, self.seed, self.module, self.spec = device, layout, seed, module, spec
        self.group = group
        self.linear_layer = linear_layer

    def hierarchy(self) -> tuple[list[list[int]], list[list[int]]]:
        """Ranks per node, and per local index the ranks holding it on every node."""
        return hierarchy(self.layout)

    def shard_groups(self, size: int) -> tuple[list[list[int]], list[list[int]]]:
        """Shard groups of ``size`` consecutive ranks (0: all), and the groups across them."""
        return shard_groups(self.world, size)


def hierarchy(layout: Any) -> tuple[list[list[int]], list[list[int]]]:
    """Ranks per node of ``layout``, and per local index the ranks holding it on every node."""
    nodes = [layout.ranks_on_node(n) for n in layout.nodes()]
    width = len(nodes[0])
    return nodes, [[ranks[i] for ranks in nodes] for i in range(width)]


def shard_groups(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Shard groups of ``size`` consecutive ranks (0: all), and the groups across them (HSDP's
    replicate dimension: the ranks holding the same slice)."""
    size = size or world
    shards = [list(range(start, start + size)) for start in range(0, world, size)]
    return shards, [[g[i] for g in shards] for i in range(size)]


@dataclass(frozen=True)
class EngineKind:
    """How the engine runs one synchronizer kind.

    ``build(ctx, unit, members)``: the engine unit of ``unit`` (a
    :class:`~synctune.strategy.kinds.PlanUnit`), whose shards' parameters ``members`` are (in
    the unit's order). ``subgroups(world, layout, sync)``: the rank tuples whose process groups
    the kind's units need (made before any unit, on every rank alike). ``refuse(unit, model)``:
    a message when the engine cannot run ``unit`` exactly, else None. ``fsdp``: its units are
    what torch FSDP2's ``fully_shard`` runs too (a strategy of only such plans runs on FSDP2:
    :mod:`synctune.engine.fsdp_plans`)."""

    build: Callable[[BuildContext, PlanUnit, list[Member]], Any]
    subgroups: Callable[[int, Any, Any], Iterable[tuple[int, ...]]] = lambda world, layout, sync: ()
    refuse: Callable[[PlanUnit, Any], str | None] = lambda unit, model: None
    fsdp: bool = False


#: Synchronizer kind name -> how the engine runs it.
ENGINE_KINDS: Registry[EngineKind] = Registry("engine synchronizer kind")


def register_engine_kind(name: str, kind: EngineKind) -> EngineKind:
    """Let the engine run synchronizer kind ``name`` (a second registration is an error)."""
    return ENGINE_KINDS.register(name, kind)


def _where(unit: PlanUnit, m: int = 0) -> str:
    member = unit.members[m]
    return f"variable {member.variable!r}: shards[{member.index}]"


# ------------------------------------------------------------------------------- ps

def _ps_build(ctx: BuildContext, unit: PlanUnit, members: list[Member]):
    member, sync = members[0], unit.synchronizer
    layout = ctx.layout
    placement = layout.rank_of(sync.placement)
    if ctx.spec[member.variable].sparse:
        return SparsePSUnit(member, ctx.weight, rank=ctx.rank, placement=placement, world=ctx.world,
                            device=ctx.device, counter=ctx.counter)
    intra = roots = local_root = None
    if sync.local_aggregation:
        nodes = layout.nodes()
        node = layout.node_of_rank[ctx.rank]
        local_root = layout.local_root(node, placement)
        node_ranks = layout.ranks_on_node(node)
        if len(node_ranks) > 1:
            intra = (ctx.group(node_ranks), node_ranks)
        if len(nodes) > 1:
            root_ranks = sorted(layout.local_root(n, placement) for n in nodes)
            roots = (ctx.group(root_ranks), root_ranks)
    return PSUnit(member, ctx.weight, make_compressor(unit.compressor, counter=ctx.counter), rank=ctx.rank,
                  placement=placement, device=ctx.device, counter=ctx.counter, intra=intra, roots=roots,
                  local_root=local_root)


def _ps_subgroups(world: int, layout: Any, sync: Any) -> set[tuple[int, ...]]:
    needed: set[tuple[int, ...]] = set()
    if sync.local_aggregation:
        placement = layout.rank_of(sync.placement)
        nodes = layout.nodes()
        for node in nodes:
            ranks = layout.ranks_on_node(node)
            if len(ranks) > 1:
                needed.add(tuple(ranks))
        if len(nodes) > 1:
            needed.add(tuple(sorted(layout.local_root(n, placement) for n in nodes)))
    return needed


def _ps_refuse(unit: PlanUnit, model: Any) -> str | None:
    sync = unit.synchronizer
    if sync.staleness > 0:
        return (f"{_where(unit)}.synchronizer.staleness: {sync.staleness} is not supported; the engine runs "
                f"synchronous training only (staleness 0)")
    return None


# ------------------------------------------------------------------------ allreduce

#: A whole dense variable of at most this many elements on all-reduce has its ``.grad`` in its
#: bucket slot, which autograd accumulates into (torch DDP's ``gradient_as_bucket_view``): its
#: hook copies nothing. A copy in the hook costs a few µs of host time whatever the size, which
#: is what a small gradient's copy is; for a larger one the slot's zeroing, autograd's in-place
#: add and the separate scaling move more memory than copying it scaled in one pass.
GRAD_IN_BUCKET_MAX_ELEMENTS = 8192


def _in_bucket(ctx: BuildContext, members: list[Member]) -> list[Member]:
    """The members whose gradient lives in the bucket (:data:`GRAD_IN_BUCKET_MAX_ELEMENTS`)."""
    return [m for m in members if m.whole and not ctx.spec[m.variable].sparse
            and m.numel <= GRAD_IN_BUCKET_MAX_ELEMENTS]


def _allreduce_build(ctx: BuildContext, unit: PlanUnit, members: list[Member]):
    """One merge group: flat (its compressor wrapped around it) or hierarchical (intra-node,
    then across nodes)."""
    dtype = members[0].view.dtype
    if unit.synchronizer.algorithm == "hierarchical":
        per_node, per_index = ctx.hierarchy()
        mine = next(r for r in per_node if ctx.rank in r)
        cross = next(r for r in per_index if ctx.rank in r)
        return HierarchicalAllReduceUnit(
            members, ctx.weight, ctx.counter, ctx.device, dtype, rank=ctx.rank, intra_ranks=mine,
            intra=ctx.group(mine) if len(mine) > 1 else None,
            cross=ctx.group(cross) if len(cross) > 1 else None, in_bucket=_in_bucket(ctx, members))
    offsets, at = [], 0
    for m in members:
        if len(m.shape) >= 2:
            offsets.append((at, m.shape[0], m.numel // m.shape[0]))
        at += m.numel
    comp = make_compressor(unit.compressor, members=offsets, weight=ctx.weight,
                           seed=ctx.seed * 7919 + unit.merge_id, counter=ctx.counter)
    return AllReduceUnit(members, ctx.weight, comp, ctx.device, dtype, in_bucket=_in_bucket(ctx, members))


def _allreduce_subgroups(world: int, layout: Any, sync: Any) -> set[tuple[int, ...]]:
    if sync.algorithm != "hierarchical":
        return set()
    per_node, per_index = hierarchy(layout)
    return {tuple(r) for r in per_node + per_index if len(r) > 1}


def _allreduce_refuse(unit: PlanUnit, model: Any) -> str | None:
    """One merge group is one flat buffer: its members share a dtype."""
    first = model[unit.members[0].variable].dtype
    for m, member in enumerate(unit.members):
        dtype = model[member.variable].dtype
        if dtype != first:
            return (f"{_where(unit, m)}.synchronizer.group: group {unit.merge_id} mixes {dtype} with {first} "
                    f"of variable {unit.members[0].variable!r}")
    return None


# ------------------------------------------------------------------ allgather, sfb

def _allgather_build(ctx: BuildContext, unit: PlanUnit, members: list[Member]):
    return SparseAllGatherUnit(members[0], ctx.weight, world=ctx.world, device=ctx.device, counter=ctx.counter)


def _sfb_build(ctx: BuildContext, unit: PlanUnit, members: list[Member]):
    member = members[0]
    return SFBUnit(member, ctx.weight, layer=ctx.linear_layer(member.variable), world=ctx.world, device=ctx.device,
                   counter=ctx.counter)


# ---------------------------------------------------------------------------- shard

def _shard_build(ctx: BuildContext, unit: PlanUnit, members: list[Member]):
    sync = unit.synchronizer
    shards, across = ctx.shard_groups(sync.group)
    mine = next(g for g in shards if ctx.rank in g)
    cross = next(g for g in across if ctx.rank in g)
    dtype = {"fp32": members[0].view.dtype, "bf16": torch.bfloat16}[sync.reduce_dtype]
    return ShardUnit(members, ctx.weight, rank=ctx.rank, shard_ranks=mine,
                     group=None if len(mine) == ctx.world else ctx.group(mine),
                     cross=ctx.group(cross) if len(cross) > 1 else None, reduce_dtype=dtype, device=ctx.device,
                     counter=ctx.counter)


def _shard_subgroups(world: int, layout: Any, sync: Any) -> set[tuple[int, ...]]:
    if not sync.group or sync.group >= world:
        return set()
    shards, across = shard_groups(world, sync.group)
    return {tuple(g) for g in shards + across if len(g) > 1}


def _shard_refuse(unit: PlanUnit, model: Any) -> str | None:
    sync = unit.synchronizer
    if sync.reshard:
        return (f"{_where(unit)}.synchronizer.reshard: true (unit {sync.unit}) is not executed by the engine, which "
                f"keeps a unit's parameters whole between forward and backward (ZeRO-2); run the strategy with "
                f"--runtime fsdp (torch FSDP2 frees and re-gathers them), or set reshard false")
    return None


register_engine_kind("ps", EngineKind(build=_ps_build, subgroups=_ps_subgroups, refuse=_ps_refuse))
register_engine_kind("allreduce", EngineKind(build=_allreduce_build, subgroups=_allreduce_subgroups,
                                             refuse=_allreduce_refuse))
register_engine_kind("allgather", EngineKind(build=_allgather_build))
register_engine_kind("sfb", EngineKind(build=_sfb_build))
register_engine_kind("shard", EngineKind(build=_shard_build, subgroups=_shard_subgroups, refuse=_shard_refuse,
                                         fsdp=True))


def check_refusals(units: list[PlanUnit], model: Any) -> None:
    """Raise the first refusal of ``units`` (in order), as a StrategyError naming the variable."""
    for unit in units:
        message = ENGINE_KINDS.get(unit.kind).refuse(unit, model)
        if message:
            raise StrategyError(message)
