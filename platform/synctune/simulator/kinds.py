"""The simulator's part of each synchronizer kind: what the memory model books for its units.

:data:`MEMORY_KINDS` maps a kind's name (:data:`synctune.strategy.kinds.SYNCHRONIZERS`) to its
:class:`MemoryKind`; :func:`synctune.simulator.memory.predict_memory` groups a strategy's shards
into units once (:func:`~synctune.strategy.kinds.units_of`) and hands each kind its units, never
asking which class a synchronizer is. What each kind books is what the engine's unit of that
kind holds on a rank (:mod:`synctune.engine.units`; the module docstring of
:mod:`synctune.simulator.memory` lists it part by part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..spec.registry import Registry
from ..strategy.kinds import PlanUnit
from ..strategy.partition import shard_rows, shard_shapes

__all__ = ["MemoryContext", "MemoryKind", "MEMORY_KINDS", "Tally", "register_memory_kind"]


@dataclass
class Tally:
    """Per-rank byte counts while the memory model walks a strategy; :meth:`own` books the
    optimizer state of ``elements`` updated elements (and the per-tensor scalars) on rank ``r``."""

    world: int
    multiplier: float
    step_bytes: int
    params: list[int] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "state", "buffers"):
            setattr(self, name, [0] * self.world)

    def own(self, r: int, elements: int, item: int) -> None:
        """Book the optimizer state of ``elements`` updated elements of ``item`` bytes on rank ``r``."""
        self.state[r] += int(self.multiplier * elements) * item + self.step_bytes


@dataclass(frozen=True)
class MemoryContext:
    """What a kind's tally knows of the strategy: the model spec, each rank's batch, each
    replica device's rank, each rank's node, the looked-up rows per sample of a sparse gradient,
    and whether FSDP2 runs it (``fsdp``) rather than the engine."""

    model: Any
    split: Sequence[int]
    rank_of: dict[str, int]
    nodes: Sequence[str]
    sparse_rows_per_sample: float
    fsdp: bool

    @property
    def world(self) -> int:
        """The number of ranks."""
        return len(self.split)

    def shard_shape(self, member) -> tuple[int, ...]:
        """The shape of a unit member's shard."""
        var = self.model[member.variable]
        return shard_shapes(var.shape, member.plan.partition)[member.index]


@dataclass(frozen=True)
class MemoryKind:
    """How the memory model books one synchronizer kind.

    ``count(tally, units, ctx)``: book the kind's units of one strategy (all of them at once: a
    kind's in-flight buffers may depend on its largest units). ``holds_rows(sync, fsdp)``: the
    variable's parameters and gradients are this rank's rows, not whole (booked by ``count``).
    ``reference``: a strategy of only such kinds (and other reference kinds) adds no temporaries
    of its own, so its measured breakdown gives the strategy-independent bytes
    (:func:`~synctune.simulator.memory.reference_activations`)."""

    count: Callable[[Tally, list[PlanUnit], MemoryContext], None]
    holds_rows: Callable[[Any, bool], bool] = lambda sync, fsdp: False
    reference: bool = False


#: Synchronizer kind name -> what the memory model books for it.
MEMORY_KINDS: Registry[MemoryKind] = Registry("memory-model synchronizer kind")


def register_memory_kind(name: str, kind: MemoryKind) -> MemoryKind:
    """Let the memory model book synchronizer kind ``name`` (a second registration is an error)."""
    return MEMORY_KINDS.register(name, kind)


def _item(var) -> int:
    return var.num_bytes // var.num_elements


def _rows(tally: Tally, ctx: MemoryContext, member, receivers: Sequence[int]) -> None:
    """A sparse shard's row buffers: each rank's own rows (and the padded copy), the receivers every rank's."""
    var = ctx.model[member.variable]
    shape = ctx.shard_shape(member)
    rows = [int(ctx.sparse_rows_per_sample * b) for b in ctx.split]
    row_bytes = shape[1] * _item(var) + 8
    longest = max(rows)
    for r in range(tally.world):
        tally.buffers[r] += (rows[r] + longest) * row_bytes
    for r in receivers:
        tally.buffers[r] += tally.world * longest * row_bytes


def _everyone_owns(tally: Tally, ctx: MemoryContext, member) -> None:
    var = ctx.model[member.variable]
    numel = math.prod(ctx.shard_shape(member))
    for r in range(tally.world):
        tally.own(r, numel, _item(var))


# ---------------------------------------------------------------------------- kinds

def _count_ps(tally: Tally, units: list[PlanUnit], ctx: MemoryContext) -> None:
    """A PS shard: its optimizer state on the placement; a dense shard's buffer on every rank, a
    sparse one's row buffers (the server receives every rank's)."""
    for unit in units:
        member, sync = unit.members[0], unit.synchronizer
        var = ctx.model[member.variable]
        numel = math.prod(ctx.shard_shape(member))
        placement = ctx.rank_of[sync.placement]
        if var.sparse:
            _rows(tally, ctx, member, [placement])
        else:
            for r in range(tally.world):
                tally.buffers[r] += numel * _item(var)
        tally.own(placement, numel, _item(var))


def _count_allreduce(tally: Tally, units: list[PlanUnit], ctx: MemoryContext) -> None:
    """Every member's optimizer state on every rank, and each merge group's bucket (hierarchical:
    padded to a multiple of the node's ranks, plus the piece this rank all-reduces across nodes)."""
    for unit in units:
        used = 0
        for member in unit.members:
            _everyone_owns(tally, ctx, member)
            used += math.prod(ctx.shard_shape(member)) * _item(ctx.model[member.variable])
        item = _item(ctx.model[unit.members[0].variable])
        for r in range(tally.world):
            if unit.synchronizer.algorithm == "hierarchical":
                local = sum(1 for n in ctx.nodes if n == ctx.nodes[r])
                padded = used + (-used) % (local * item)
                tally.buffers[r] += padded + padded // local
            else:
                tally.buffers[r] += used


def _count_allgather(tally: Tally, units: list[PlanUnit], ctx: MemoryContext) -> None:
    """Optimizer state on every rank; a sparse shard's row buffers, every rank receiving every rank's."""
    for unit in units:
        member = unit.members[0]
        if ctx.model[member.variable].sparse:
            _rows(tally, ctx, member, range(tally.world))
        _everyone_owns(tally, ctx, member)


def _count_sfb(tally: Tally, units: list[PlanUnit], ctx: MemoryContext) -> None:
    """Optimizer state on every rank (the factors are activations-sized temporaries)."""
    for unit in units:
        _everyone_owns(tally, ctx, unit.members[0])


def _count_shard(tally: Tally, units: list[PlanUnit], ctx: MemoryContext) -> None:
    """Each ``shard`` unit: this rank's rows' optimizer state, the unit's buffers, and with
    reshard this rank's rows of parameters and gradients plus the largest ``prefetch + 1``
    units gathered whole (in flight). Under FSDP2 (``fsdp``): no persistent buffers; every
    unit's rows of parameters and gradients, a kept unit's whole parameters beside them, and the
    largest unit's whole gradient (before its reduce-scatter)."""
    fsdp = ctx.fsdp
    largest_gathered = []
    largest_unit = 0
    for unit in units:
        sync = unit.synchronizer
        variables = [ctx.model[m.variable] for m in unit.members]
        whole = sum(v.num_bytes for v in variables)
        for r in range(tally.world):
            size = sync.group or tally.world
            index = r % size
            mine = 0
            padded_slice = 0
            for var in variables:
                row = var.num_bytes // var.shape[0]
                cut = shard_rows(var.shape[0], size)
                mine += (cut[index].stop - cut[index].start) * row
                padded_slice += (cut[0].stop - cut[0].start) * row
                if cut[index].stop > cut[index].start:  # an empty slice is no optimizer parameter
                    tally.own(r, (cut[index].stop - cut[index].start) * (var.num_elements // var.shape[0]),
                              var.num_bytes // var.num_elements)
            # The unit's bucket (every member's padded rows) and this rank's output segment, in the
            # variables' float32; a bf16 reduce adds the same two in bfloat16 (what travels), so
            # 1.5 times the float32 pair.
            pair = padded_slice * size + padded_slice
            if not fsdp:
                tally.buffers[r] += pair + (pair // 2 if sync.reduce_dtype == "bf16" else 0)
            if sync.reshard or fsdp:
                tally.params[r] += mine
                tally.grads[r] += mine
            if fsdp and not sync.reshard:
                tally.params[r] += whole
        if sync.reshard:
            largest_gathered.append((whole, sync.prefetch))
        largest_unit = max(largest_unit, whole)
    if largest_gathered:
        depth = max(p for _, p in largest_gathered) + 1
        in_flight = sum(sorted((w for w, _ in largest_gathered), reverse=True)[:depth])
        for r in range(tally.world):
            tally.params[r] += in_flight
    if fsdp and units:
        for r in range(tally.world):
            tally.grads[r] += largest_unit


register_memory_kind("ps", MemoryKind(count=_count_ps))
register_memory_kind("allreduce", MemoryKind(count=_count_allreduce, reference=True))
register_memory_kind("allgather", MemoryKind(count=_count_allgather, reference=True))
register_memory_kind("sfb", MemoryKind(count=_count_sfb))
register_memory_kind("shard", MemoryKind(count=_count_shard, holds_rows=lambda sync, fsdp: sync.reshard or fsdp))
