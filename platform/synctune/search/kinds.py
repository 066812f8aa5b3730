"""The search's part of each synchronizer kind: its choices in the local searches, its moves of a
measured strategy, and how the guided sampler draws it.

:data:`SEARCH_KINDS` maps a kind's name (:data:`synctune.strategy.kinds.SYNCHRONIZERS`) to its
:class:`SearchKind`, as the engine's :data:`~synctune.engine.kinds.ENGINE_KINDS` and the memory
model's :data:`~synctune.simulator.kinds.MEMORY_KINDS` do for their layers, so that no other
file of the search asks which class a synchronizer is:

- :class:`~synctune.search.local_search.ChoiceSpace` (AutoDDL §4.4's coordinates, TAG §4.2.2's
  tree levels) asks every kind, in this registry's order, for its choices on a coordinate, and
  the kind that owns a choice (:attr:`SearchKind.choice_kinds`) to apply it;
- :func:`~synctune.search.moves.global_moves` asks every kind for its moves of the incumbent
  (AutoDDL §4.4's coordinate step, taken on all of a kind's units at once);
- :class:`~synctune.search.sampler.GuidedSampler` draws the built-in ``ps``, ``allreduce``,
  ``allgather`` and ``sfb`` in its compiled kernel, by the codes :func:`kernel_codes` passes it
  (AutoDist §2.4's knowledge constraints are sequential inside a strategy), then lets each kind
  with a :attr:`SearchKind.draw` turn some drawn strategies into its own rows, at the sampler's
  rate for it (``shard``: ZeRO / FSDP units, :mod:`synctune.search.shard_draw`).

A kind registered in the strategy layer and here is drawn, chosen and moved by the search from
then on; one registered in the strategy layer only is never proposed by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..spec.errors import SpecError
from ..spec.registry import Registry
from ..strategy.compressors import COMPRESSORS
from ..strategy.kinds import KIND_CODES, SPARSE_GROUP_BASE, SYNCHRONIZERS, renumber_units
from ..strategy.partition import shard_shapes
from ..strategy.schema import (AllGatherSynchronizer, AllReduceSynchronizer, Compressor, PSSynchronizer,
                               SFBSynchronizer, ShardPlan, ShardSynchronizer, Strategy, VariablePlan)
from ..strategy.columns import StrategyColumns
from .draw import DrawContext
from .shard_draw import draw_shard_units, hsdp_size

__all__ = ["Choice", "SearchKind", "SEARCH_KINDS", "register_search_kind", "choice_owner", "kernel_codes",
           "compressor_choices", "data_parallel_plans", "NO_COMPRESSION", "RANK_CHOICES", "PS_LOSSY_CHOICES",
           "SHARD_DTYPES", "shard_moves"]

#: Ranks tried for a compressor that takes one (PowerSGD): a low and a higher one.
RANK_CHOICES = (1, 4)
#: Lossy compressors offered on a PS server, the first ones in registry order: each adds a
#: choice per server to every coordinate, and the training-free model scores casts of one wire
#: size alike, so a second one costs evaluations and finds nothing new (experiments/findings/
#: README.md, "The replay's versions", the last paragraph).
PS_LOSSY_CHOICES = 1
#: The identity compressor's name: gradients sent as they are.
NO_COMPRESSION = Compressor().kind
#: The reduce dtypes a ``shard`` choice offers: fp32, and bf16 (lossy) when the space is lossy.
SHARD_DTYPES = ("fp32", "bf16")
#: The kinds the sampler's compiled kernel draws, in the order its ``codes`` argument takes them.
_KERNEL_KINDS = ("ps", "allreduce", "allgather", "sfb")


def compressor_choices(sync_kind: str, lossy: bool, max_lossy: int | None = None) -> list[tuple[str, int]]:
    """``(name, rank)`` of the compressors in the registry that wrap ``sync_kind``, in registry
    order: every lossless one, and where ``lossy`` the lossy ones (the first ``max_lossy`` of
    them; None: all); a compressor that takes a rank once per :data:`RANK_CHOICES` (rank 0: it
    takes none)."""
    out: list[tuple[str, int]] = []
    num_lossy = 0
    for name, info in COMPRESSORS.items():
        if sync_kind not in info.synchronizers or not (info.lossless or lossy):
            continue
        if not info.lossless:
            if max_lossy is not None and num_lossy >= max_lossy:
                continue
            num_lossy += 1
        out += [(name, r) for r in RANK_CHOICES] if "rank" in info.params else [(name, 0)]
    return out


@dataclass(frozen=True)
class Choice:
    """One synchronization choice for the variables of a coordinate.

    ``kind``: ``ar`` (dense all-reduce; ``group`` an existing merge group to join, or None for
    a new one), ``ps`` (whole variable on ``server``, ``local`` aggregation within nodes),
    ``pps`` (cut along axis 0 into one shard per server, AutoDist's partitioned PS), ``sfb``
    (sufficient-factor broadcasting of the coordinate's linear weights), ``shard`` (ZeRO-2: the
    coordinate's shardable variables sharded as one new unit, or joining the neighbours' unit
    ``unit``, over shard groups of ``group`` replicas, 0 every one, reducing in
    ``reduce_dtype``; its other variables keep their plans), or a name a registered kind owns
    (:attr:`SearchKind.choice_kinds`). ``algorithm``, ``compressor`` and ``rank`` as in the
    strategy language. Sparse variables given an ``ar`` choice are all-gathered (their rows,
    not a dense tensor)."""

    kind: str
    server: int = 0
    local: bool = False
    group: int | None = None
    algorithm: str = "flat"
    compressor: str = NO_COMPRESSION
    rank: int = 0
    reduce_dtype: str = "fp32"
    unit: int | None = None


def _no_choices(space: Any, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
    return []


def _no_moves(strategy: Strategy, space: Any) -> list[Strategy]:
    return []


@dataclass(frozen=True, kw_only=True)
class SearchKind:
    """What the search needs of one synchronizer kind.

    ``choices(space, strategy, coordinate)``: the kind's choices for the variables of
    ``coordinate`` (indices into ``space.variables``) in ``strategy``, a
    :class:`~synctune.search.local_search.ChoiceSpace`; ``choice_kinds``: the
    :attr:`Choice.kind` names it offers, each applied by ``apply(space, strategy, coordinate,
    choice)`` (the strategy with that choice taken, its units numbered by first appearance).
    ``global_moves(strategy, space)``: moves of every unit of this kind in ``strategy`` at once.
    ``draw(ctx, columns)``: drawn strategy columns with some strategies or rows made this kind's,
    at ``ctx.rate`` (:class:`~synctune.search.draw.DrawContext`); None where the sampler's
    kernel draws the kind or the sampler does not. ``relocate(sync, device)``: the shard's
    synchronizer served from ``device`` instead, for a kind with a server
    (:attr:`~synctune.strategy.kinds.Synchronizer.server`) when a replica subset leaves its
    server out."""

    choices: Callable[[Any, Strategy, Sequence[int]], list[Choice]] = _no_choices
    choice_kinds: tuple[str, ...] = ()
    apply: Callable[[Any, Strategy, Sequence[int], Choice], Strategy] | None = None
    global_moves: Callable[[Strategy, Any], list[Strategy]] = _no_moves
    draw: Callable[[DrawContext, StrategyColumns], StrategyColumns] | None = None
    relocate: Callable[[Any, str], Any] | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.choice_kinds, tuple) and all(isinstance(c, str) and c for c in self.choice_kinds)):
            raise ValueError(f"SearchKind: choice_kinds: expected a tuple of names, got {self.choice_kinds!r}")
        if bool(self.choice_kinds) != (self.apply is not None):
            raise ValueError(f"SearchKind: apply: expected a function exactly when choice_kinds names choices "
                             f"(choice_kinds {self.choice_kinds!r}, apply {self.apply!r})")


#: Synchronizer kind name -> what the search needs of it, in the order the local searches offer
#: their choices and moves.
SEARCH_KINDS: Registry[SearchKind] = Registry("search synchronizer kind")


def register_search_kind(name: str, kind: SearchKind) -> SearchKind:
    """Let the search choose, move and draw synchronizer kind ``name`` (a kind of the strategy
    layer's registry; a second registration, or a choice name another kind offers, is an error)."""
    SYNCHRONIZERS.get(name)  # a kind the strategy layer knows (a miss lists them)
    for other, known in SEARCH_KINDS.items():
        taken = set(kind.choice_kinds) & set(known.choice_kinds)
        if taken:
            raise ValueError(f"register_search_kind: {name}: choice_kinds {sorted(taken)} are {other}'s already")
    return SEARCH_KINDS.register(name, kind)


def choice_owner(choice_kind: str) -> SearchKind:
    """The search kind that offers and applies choices named ``choice_kind``."""
    for _name, kind in SEARCH_KINDS.items():
        if choice_kind in kind.choice_kinds:
            return kind
    offered = [c for _name, kind in SEARCH_KINDS.items() for c in kind.choice_kinds]
    raise SpecError(f"unknown choice kind {choice_kind!r}; valid: {', '.join(offered)}")


def kernel_codes() -> np.ndarray:
    """The codes (:data:`~synctune.strategy.kinds.KIND_CODES`) of the kinds the sampler's
    compiled kernel draws: ps, allreduce, allgather, sfb (arguments, not globals, so a cached
    compilation never keeps stale ones)."""
    return np.array([KIND_CODES[k] for k in _KERNEL_KINDS], np.int64)


def _replaced(space: Any, strategy: Strategy, coordinate: Sequence[int],
              plan_of: Callable[[Any], VariablePlan | None]) -> Strategy:
    """``strategy`` with each variable of ``coordinate`` given ``plan_of(variable)`` (None: kept),
    its units numbered by first appearance (equal groupings hash equal)."""
    plans = list(strategy.plans)
    for i in coordinate:
        plan = plan_of(space.variables[i])
        if plan is not None:
            plans[i] = plan
    return renumber_units(dataclasses.replace(strategy, plans=tuple(plans)))


def _whole(var: Any, sync: Any, compressor: Compressor | None = None) -> VariablePlan:
    return VariablePlan(variable=var.name, partition=tuple(1 for _ in var.shape),
                        shards=(ShardPlan(synchronizer=sync, compressor=compressor or Compressor()),))


# ------------------------------------------------------------------------------ allreduce

def _dense_groups(strategy: Strategy) -> list[int]:
    return [s.synchronizer.group for p in strategy.plans for s in p.shards
            if isinstance(s.synchronizer, AllReduceSynchronizer) and s.synchronizer.group < SPARSE_GROUP_BASE]


def _neighbour_groups(strategy: Strategy, coordinate: Sequence[int]) -> dict[int, tuple[str, str, int]]:
    """The dense merge groups of the variables just before and after ``coordinate``."""
    groups: dict[int, tuple[str, str, int]] = {}
    for i in (min(coordinate) - 1, max(coordinate) + 1):
        if 0 <= i < len(strategy.plans):
            for shard in strategy.plans[i].shards:
                sync = shard.synchronizer
                if isinstance(sync, AllReduceSynchronizer) and sync.group < SPARSE_GROUP_BASE:
                    groups[sync.group] = (sync.algorithm, shard.compressor.kind, shard.compressor.rank or 0)
    return groups


def _allreduce_choices(space: Any, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
    """Joining the dense groups the neighbours use (merging with them, AutoSync's c_am) or a new
    group: flat with every compressor of the registry that wraps all-reduce and fits, or
    hierarchical where the space allows it."""
    dense = [space.variables[i] for i in coordinate if not space.variables[i].sparse]
    out: list[Choice] = []
    for algorithm in space.algorithms:
        for comp, rank in compressor_choices("allreduce", space.lossy):
            if algorithm != "flat" and comp != NO_COMPRESSION:
                continue
            if comp == NO_COMPRESSION or all(space.fits(v, comp, rank, "allreduce") for v in dense) and dense:
                out.append(Choice("ar", algorithm=algorithm, compressor=comp, rank=rank))
    for gid, (algorithm, comp, rank) in _neighbour_groups(strategy, coordinate).items():
        if dense and all(comp == NO_COMPRESSION or space.fits(v, comp, rank, "allreduce") for v in dense):
            out.append(Choice("ar", group=gid, algorithm=algorithm, compressor=comp, rank=rank))
    return out


def _allreduce_plan(space: Any, var: Any, choice: Choice, group: int) -> VariablePlan:
    if var.sparse:  # ``ar`` on a sparse variable: its rows, all-gathered
        return _whole(var, AllGatherSynchronizer())
    return _whole(var, AllReduceSynchronizer(group=group, algorithm=choice.algorithm),
                  space.compressor(var, choice, "allreduce"))


def _allreduce_apply(space: Any, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
    group = choice.group if choice.group is not None else 1 + max(_dense_groups(strategy), default=-1)
    return _replaced(space, strategy, coordinate, lambda var: _allreduce_plan(space, var, choice, group))


def data_parallel_plans(space: Any) -> list[VariablePlan]:
    """Every variable of ``space`` on one flat all-reduce group (sparse ones all-gathered): TAG's
    baseline and the tree's root."""
    return [_allreduce_plan(space, v, Choice("ar"), 0) for v in space.variables]


def _allreduce_moves(strategy: Strategy, space: Any) -> list[Strategy]:
    """Moves of every dense all-reduce merge group of ``strategy`` at once: each compressor that
    takes no rank (of the registry's, those ``space`` allows) on the groups whose members all
    take it, hierarchical all-reduce (where every node holds as many replicas), and the groups
    re-cut into half or twice as many by bytes (when they share one compressor and algorithm)."""
    variables = {v.name: v for v in space.variables}
    dense = [(i, j, sh) for i, plan in enumerate(strategy.plans) for j, sh in enumerate(plan.shards)
             if isinstance(sh.synchronizer, AllReduceSynchronizer) and sh.synchronizer.group < SPARSE_GROUP_BASE
             and not variables[plan.variable].sparse]
    if not dense:
        return []

    def rebuilt(change) -> Strategy:
        plans = [list(p.shards) for p in strategy.plans]
        for i, j, sh in dense:
            new = change(i, j, sh)
            if new is not None:
                plans[i][j] = new
        return renumber_units(dataclasses.replace(strategy, plans=tuple(
            dataclasses.replace(p, shards=tuple(sh)) for p, sh in zip(strategy.plans, plans))))

    out = []
    groups: dict[int, list[str]] = {}
    for i, _j, sh in dense:
        groups.setdefault(sh.synchronizer.group, []).append(strategy.plans[i].variable)
    for kind in [c for c, rank in compressor_choices("allreduce", space.lossy) if c != NO_COMPRESSION and not rank]:
        fits = {g for g, names in groups.items() if all(space.fits(variables[n], kind, 0, "allreduce") for n in names)}
        if fits:
            out.append(rebuilt(lambda i, j, sh, kind=kind, fits=fits: dataclasses.replace(
                sh, compressor=Compressor(kind=kind),
                synchronizer=dataclasses.replace(sh.synchronizer, algorithm="flat")) if sh.synchronizer.group in fits
                else None))
    if "hierarchical" in space.algorithms:
        out.append(rebuilt(lambda i, j, sh: dataclasses.replace(
            sh, compressor=Compressor(), synchronizer=dataclasses.replace(sh.synchronizer, algorithm="hierarchical"))))
    if len({(sh.compressor, sh.synchronizer.algorithm) for _i, _j, sh in dense}) == 1:
        out += _recut(dense, [variables[strategy.plans[i].variable].num_bytes / max(1, len(strategy.plans[i].shards))
                              for i, _j, _sh in dense], len(groups), rebuilt)
    return out


def _recut(dense: list, sizes: list[float], num_groups: int, rebuilt) -> list[Strategy]:
    """The dense shards ``dense`` cut into half and into twice ``num_groups`` merge groups of
    similar bytes, along backward order."""
    out = []
    total = float(sum(sizes)) or 1.0
    for count in {max(1, num_groups // 2), 2 * num_groups}:
        if count == num_groups:
            continue
        cut, filled = {}, 0.0
        for (i, j, _sh), size in zip(dense, sizes):
            cut[(i, j)] = min(count - 1, int(filled / total * count))
            filled += size
        out.append(rebuilt(lambda i, j, sh, cut=cut: dataclasses.replace(
            sh, synchronizer=dataclasses.replace(sh.synchronizer, group=cut[(i, j)]))))
    return out


# ------------------------------------------------------------------------------------- ps

def _ps_choices(space: Any, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
    """A PS on each node holding a replica (uncompressed with and without local aggregation;
    without it, also with the lossless compressors that wrap a PS and, when lossy, the first
    :data:`PS_LOSSY_CHOICES` lossy ones), and a PS partitioned over every such node for
    variables of at least ``space.small_bytes``."""
    variables = [space.variables[i] for i in coordinate]
    dense = [v for v in variables if not v.sparse]
    held = set(strategy.replicas)
    out: list[Choice] = []
    for j in range(len(space.servers)):
        for local in (False, True):
            for comp, rank in compressor_choices("ps", space.lossy, PS_LOSSY_CHOICES):
                if local and comp != NO_COMPRESSION:
                    continue
                if comp != NO_COMPRESSION and not (dense and all(space.fits(v, comp, rank, "ps") for v in dense)):
                    continue
                if space.servers[j] in held:  # a PS lives on a replica
                    out.append(Choice("ps", server=j, local=local, compressor=comp, rank=rank))
    if len(space.servers_of(strategy)) > 1 and any(v.num_bytes >= space.small_bytes and v.shape and v.shape[0] >= 2
                                                   for v in variables):
        out.append(Choice("pps"))
    return out


def _ps_plan(space: Any, var: Any, choice: Choice, servers: list[str]) -> VariablePlan:
    shape = tuple(var.shape)
    if (choice.kind == "pps" and len(servers) > 1 and var.shape and var.shape[0] >= 2
            and var.num_bytes >= space.small_bytes):
        pieces = min(len(servers), var.shape[0])
        partition = (pieces,) + tuple(1 for _ in shape[1:])
        shards = tuple(ShardPlan(synchronizer=PSSynchronizer(placement=servers[k]))
                       for k in range(len(shard_shapes(shape, partition))))
        return VariablePlan(variable=var.name, partition=partition, shards=shards)
    server = space.servers[choice.server] if choice.kind == "ps" else servers[space.index[var.name] % len(servers)]
    sync = PSSynchronizer(placement=server, local_aggregation=choice.local and not var.sparse)
    return _whole(var, sync, space.compressor(var, choice, "ps"))


def _ps_apply(space: Any, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
    servers = space.servers_of(strategy)
    return _replaced(space, strategy, coordinate, lambda var: _ps_plan(space, var, choice, servers))


# ------------------------------------------------------------------------------------ sfb

def _sfb_choices(space: Any, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
    """Sufficient-factor broadcasting for the coordinate's linear weights (TAG §4.2.3)."""
    return [Choice("sfb")] if any(space.variables[i].name in space.linear for i in coordinate) else []


def _sfb_apply(space: Any, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
    return _replaced(space, strategy, coordinate,
                     lambda var: _whole(var, SFBSynchronizer()) if var.name in space.linear else None)


# ---------------------------------------------------------------------------------- shard

def _shard_units(strategy: Strategy) -> list[ShardSynchronizer]:
    return [s.synchronizer for p in strategy.plans for s in p.shards if isinstance(s.synchronizer, ShardSynchronizer)]


def _shard_choices(space: Any, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
    """Where the space offers ``shard``: ZeRO-2 sharding of the coordinate's shardable variables
    as a new unit (over every replica or, where the nodes allow it, HSDP over each node;
    reducing in fp32 or, when lossy, bf16), or joining a neighbouring variable's unit, so units
    can grow to modules (one reduce-scatter for more variables)."""
    if not (space.shard and len(strategy.replicas) > 1
            and any(space.variables[i].name in space.shardable for i in coordinate)):
        return []
    out: list[Choice] = []
    hsdp = hsdp_size(strategy, space.cluster)
    for group in (0, hsdp) if hsdp else (0,):
        for dtype in SHARD_DTYPES if space.lossy else SHARD_DTYPES[:1]:
            out.append(Choice("shard", group=group, reduce_dtype=dtype))
    units: dict[int, ShardSynchronizer] = {}
    inside = set(coordinate)
    for i in (min(coordinate) - 1, max(coordinate) + 1):
        if 0 <= i < len(strategy.plans) and i not in inside:
            for shard in strategy.plans[i].shards:
                if isinstance(shard.synchronizer, ShardSynchronizer):
                    units.setdefault(shard.synchronizer.unit, shard.synchronizer)
    for uid, sync in units.items():
        out.append(Choice("shard", group=sync.group, reduce_dtype=sync.reduce_dtype, unit=uid))
    return out


def _shard_apply(space: Any, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
    """The shardable variables of ``coordinate`` in ``choice``'s unit: the neighbour's (its
    synchronizer as it is) or a new one (ZeRO-2: no reshard)."""
    units = _shard_units(strategy)
    sync = next((u for u in units if u.unit == choice.unit), None) if choice.unit is not None else None
    if sync is None:
        sync = ShardSynchronizer(unit=1 + max((u.unit for u in units), default=-1), group=choice.group or 0,
                                 reduce_dtype=choice.reduce_dtype)
    return _replaced(space, strategy, coordinate,
                     lambda var: _whole(var, sync) if var.name in space.shardable else None)


def shard_moves(strategy: Strategy, space: Any) -> list[Strategy]:
    """Moves of every ``shard`` unit of a strategy whose plans are all ``shard`` (FSDP2's
    whole-model sharding; FSDP2's knobs, each set for the whole model as users set them): every
    unit resharded after forward (ZeRO-3, prefetch 1: FSDP2's default), every unit reducing in
    bf16 (when ``space`` is lossy), and the shard group toggled between every replica and HSDP
    over the nodes (where :func:`~synctune.search.shard_draw.hsdp_size` finds it). A move that
    changes nothing is left out; a strategy with other plans gets none."""
    syncs = [sh.synchronizer for p in strategy.plans for sh in p.shards]
    if not syncs or not all(isinstance(s, ShardSynchronizer) for s in syncs):
        return []

    def every(change) -> Strategy:
        return renumber_units(dataclasses.replace(strategy, plans=tuple(
            dataclasses.replace(p, shards=tuple(dataclasses.replace(sh, synchronizer=change(sh.synchronizer))
                                                for sh in p.shards)) for p in strategy.plans)))

    out = []
    if not all(s.reshard for s in syncs):
        out.append(every(lambda s: dataclasses.replace(s, reshard=True, prefetch=1)))
    if space.lossy and not all(s.reduce_dtype == "bf16" for s in syncs):
        out.append(every(lambda s: dataclasses.replace(s, reduce_dtype="bf16")))
    hsdp = hsdp_size(strategy, space.cluster)
    if hsdp:
        target = hsdp if any(s.group == 0 for s in syncs) else 0
        out.append(every(lambda s: dataclasses.replace(s, group=target)))
    return out


# --------------------------------------------------------------------------- registration

register_search_kind("allreduce", SearchKind(choices=_allreduce_choices, choice_kinds=("ar",), apply=_allreduce_apply,
                                             global_moves=_allreduce_moves))
register_search_kind("ps", SearchKind(choices=_ps_choices, choice_kinds=("ps", "pps"), apply=_ps_apply,
                                      relocate=lambda sync, device: dataclasses.replace(sync, placement=device)))
register_search_kind("allgather", SearchKind())  # drawn by the kernel; chosen through ``ar`` on sparse variables
register_search_kind("sfb", SearchKind(choices=_sfb_choices, choice_kinds=("sfb",), apply=_sfb_apply))
register_search_kind("shard", SearchKind(choices=_shard_choices, choice_kinds=("shard",), apply=_shard_apply,
                                         global_moves=shard_moves, draw=draw_shard_units))
