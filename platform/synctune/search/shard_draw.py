"""The guided sampler's draw of sharded data parallelism (DESIGN.md "shard"; ZeRO, FSDP2), on
strategy columns: the ``shard`` kind's draw (:data:`synctune.search.kinds.SEARCH_KINDS`).

A drawn strategy is turned, at the sampler's ``shard_prob``, into one of :data:`SHARD_MODES`:
units are the modules at a depth drawn from the model's (:func:`module_at`, the ``shard``
builder's cut); ``zero2`` shards, at a drawn rate per unit, the shardable variables of each
unit (no reshard), the others keeping their plans; ``fsdp`` (only where every variable is
shardable) shards every variable and reshards each unit at a drawn rate, prefetching 1 or 2
units. One shard group per strategy (every replica, or HSDP over the nodes where
:func:`hsdp_size` finds it) and one reduce dtype (bf16 only when lossy). The replica subset and
batch split drawn before are kept; a strategy on fewer than two replicas is left as it is.

With a memory budget's predicate (``fits``), a sharded draw the budget does not hold is grown
until it does, with no further draw from the stream: the modules left replicated join units,
the largest first, and where every module is a unit and it still does not fit, the shard group
widens from one node (HSDP) to every replica, and then the units reshard, the largest first
(only where every variable is shardable: FSDP2 runs a resharded unit). What then still does not
fit is returned as it is, for the search's filter to drop. This is ZeRO's order of stages
(ZeRO §5: shard optimizer state and gradients first, parameters only where that is not
enough), per module. ``fits`` takes strategy objects, so growth works on the objects of the
draws that do not fit, spliced back into the columns; everything else is drawn for all
strategies at once. Where sharding all of it is not enough, the growth goes on with activation
checkpointing (:func:`~synctune.search.checkpoint_draw.grow_checkpointing`) or, where the search
proposes tensor parallelism, with Megatron's plan and sequence parallelism
(:func:`~synctune.search.tp_draw.grow_split`), whichever fits; where both do, the draw context's
``split_share`` of the draws split first (half, until the search has measured both: then the
one measured faster leads, :func:`~synctune.search.policies.split_share`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..strategy.columns import KIND_CODES, StrategyColumns
from ..strategy.kinds import REDUCE_DTYPES, renumber_units
from ..strategy.schema import Compressor, ShardPlan, ShardSynchronizer, Strategy, VariablePlan
from ..strategy.checkpoint import checkpoint_blocks
from .checkpoint_draw import grow_checkpointing
from .draw import DrawContext, edited, first_rows, splice, takes_turn

__all__ = ["SHARD_MODES", "ModuleDraw", "ShardLayout", "Units", "draw_shard_units", "grow", "hsdp_size", "hsdp_sizes",
           "module_at", "shard_layout", "shardable"]

#: How a sharded draw shards: ``zero2``, some modules' variables sharded without reshard beside
#: the other plans (the engine runs it); ``fsdp``, every variable sharded, units resharded at a
#: drawn rate (FSDP2 runs it).
SHARD_MODES = ("zero2", "fsdp")
#: The prefetch depths a resharded unit draws: FSDP2's default (1) or one unit more.
_PREFETCH = (1, 2)
_MEMO_KEY = "shard-layout"


def shardable(var) -> bool:
    """Whether ``var`` may take a ``shard`` synchronizer: dense, not a scalar, float32 (what
    :func:`synctune.strategy.validate.validate` accepts on an unpartitioned variable)."""
    return not var.sparse and bool(var.shape) and var.dtype == "float32"


def module_at(name: str, depth: int) -> str:
    """The module holding variable ``name`` cut at ``depth`` (``blocks.0`` of
    ``blocks.0.attn.q.weight`` at depth 2; ``""``, the root, for a top-level variable), as the
    ``shard`` builder cuts units: every module at one depth is an FSDP2 ``fully_shard`` boundary."""
    return ".".join(name.split(".")[:-1][:depth])


def hsdp_size(strategy: Strategy, cluster: Any) -> int | None:
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


def hsdp_sizes(held: np.ndarray, cluster: Any) -> np.ndarray:
    """:func:`hsdp_size` of many strategies whose replicas are in the cluster's device order (as
    strategy columns keep them): ``held`` (strategies, devices) says which devices hold a
    replica; 0 where there is no HSDP."""
    n = held.shape[0]
    sizes = {node.num_devices for node in cluster.nodes}
    if len(sizes) != 1 or min(sizes) < 2:
        return np.zeros(n, np.int64)
    size = sizes.pop()
    per_node = held.reshape(n, len(cluster.nodes), size).sum(2)  # devices are listed node by node
    whole = per_node == size
    ok = (whole.sum(1) >= 2) & ~((per_node > 0) & ~whole).any(1)
    return np.where(ok, size, 0)


@dataclass(frozen=True)
class ShardLayout:
    """What a model's variables are to a shard draw: the shardable ones (``names``, and whether
    that is ``every`` variable), the deepest cut (``max_depth``, 1 at least), and per depth d
    its modules in first-appearance order (``modules[d]``), their bytes, how many
    (``counts[d]``) and each variable's module index (``var_module[d]``, -1 where the variable
    is not shardable); per variable, the ``frac`` and ``ratio`` columns of it whole and
    uncompressed."""

    names: frozenset[str]
    every: bool
    max_depth: int
    modules: tuple[tuple[str, ...], ...]
    module_bytes: tuple[dict[str, int], ...]
    counts: np.ndarray
    var_module: np.ndarray
    frac: np.ndarray
    ratio: np.ndarray

    @classmethod
    def of(cls, model: Any) -> "ShardLayout":
        """The layout of ``model`` (a model spec)."""
        variables = list(model.variables)
        names = frozenset(v.name for v in variables if shardable(v))
        max_depth = max(1, max((v.name.count(".") for v in variables), default=1))
        var_module = np.full((max_depth + 1, len(variables)), -1, np.int64)
        modules: list[tuple[str, ...]] = [()]
        module_bytes: list[dict[str, int]] = [{}]
        for d in range(1, max_depth + 1):
            index: dict[str, int] = {}
            size: dict[str, int] = {}
            for vi, v in enumerate(variables):
                if v.name in names:
                    m = module_at(v.name, d)
                    var_module[d, vi] = index.setdefault(m, len(index))
                    size[m] = size.get(m, 0) + v.num_bytes
            modules.append(tuple(index))
            module_bytes.append(size)
        whole = Compressor()
        return cls(names=names, every=len(names) == len(variables), max_depth=max_depth, modules=tuple(modules),
                   module_bytes=tuple(module_bytes), counts=np.array([len(m) for m in modules], np.int64),
                   var_module=var_module,
                   frac=np.array([(float(np.prod(v.shape)) if v.shape else 1.0) / max(1, v.num_elements)
                                  for v in variables]),
                   ratio=np.array([whole.info.wire_ratio(tuple(v.shape), None) for v in variables]))


def shard_layout(model: Any, memo: dict) -> ShardLayout:
    """``model``'s :class:`ShardLayout`, cached in ``memo`` (a sampler's, one domain)."""
    layout = memo.get(_MEMO_KEY)
    if layout is None:
        layout = memo[_MEMO_KEY] = ShardLayout.of(model)
    return layout


@dataclass(frozen=True, kw_only=True)
class ModuleDraw:
    """What the strategies picked for a shard draw drew: per strategy whether it is an ``fsdp``
    draw, its module ``depth``, its shard ``group`` (0: every replica, else HSDP's size) and
    whether it reduces in ``bf16``; per module at its depth one slot (strategy ``k``'s are
    ``slots[k]`` to ``slots[k + 1] - 1``, modules in first-appearance order): whether the module
    is ``chosen`` as a unit, that unit's rank among the strategy's chosen modules (``unit``),
    and its ``reshard`` and ``prefetch``."""

    fsdp: np.ndarray
    depth: np.ndarray
    group: np.ndarray
    bf16: np.ndarray
    slots: np.ndarray
    chosen: np.ndarray
    unit: np.ndarray
    reshard: np.ndarray
    prefetch: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, layout: ShardLayout, hsdp: np.ndarray, lossy: bool,
             mode: str | None) -> "ModuleDraw":
        """The draw of ``len(hsdp)`` strategies (``hsdp``: each one's HSDP group size, 0 where
        there is none), from ``rng``: one uniform per module at a strategy's depth, so its
        memory follows the modules, not the strategies times the variables."""
        m = len(hsdp)
        if mode is None:
            fsdp = (rng.random(m) < 0.5) if layout.every else np.zeros(m, bool)
        else:
            fsdp = np.full(m, mode == SHARD_MODES[1])
        depth = rng.integers(1, layout.max_depth + 1, m)
        group = np.where((hsdp > 0) & (rng.random(m) < 0.5), hsdp, 0)
        bf16 = (rng.random(m) < 0.5) if lossy else np.zeros(m, bool)
        rate, one = rng.random(m), rng.random(m)
        count = layout.counts[depth]
        slots = np.r_[0, np.cumsum(count)].astype(np.int64)
        owner = np.repeat(np.arange(m), count)
        u = rng.random((2, int(slots[-1])))
        # zero2 makes each module a unit at the drawn rate (one at least: a sharded draw shards
        # something); fsdp makes every module a unit and reshards it at the drawn rate.
        hit = u[0] < rate[owner]
        chosen = fsdp[owner] | hit
        empty = np.flatnonzero(np.bincount(owner, weights=chosen, minlength=m) == 0)
        chosen[slots[empty] + np.minimum((one[empty] * count[empty]).astype(np.int64), count[empty] - 1)] = True
        reshard = fsdp[owner] & hit
        pick = np.minimum((u[1] * len(_PREFETCH)).astype(np.int64), len(_PREFETCH) - 1)
        prefetch = np.where(reshard, np.asarray(_PREFETCH)[pick], 0)
        ranked = np.cumsum(chosen)
        unit = ranked - 1 - np.r_[0, ranked][slots[:-1]][owner]
        return cls(fsdp=fsdp, depth=depth, group=group, bf16=bf16, slots=slots, chosen=chosen, unit=unit,
                   reshard=reshard, prefetch=prefetch)

    def options(self, k: int, layout: ShardLayout) -> dict[str, tuple[bool, int]]:
        """Strategy ``k``'s chosen modules -> (reshard, prefetch)."""
        lo, hi = int(self.slots[k]), int(self.slots[k + 1])
        modules = layout.modules[int(self.depth[k])]
        return {modules[j]: (bool(self.reshard[lo + j]), int(self.prefetch[lo + j]))
                for j in np.flatnonzero(self.chosen[lo:hi]).tolist()}


def draw_shard_units(ctx: DrawContext, cols: StrategyColumns, mode: str | None = None) -> StrategyColumns:
    """``cols`` with each strategy, at ``ctx.rate``, turned into sharded data parallelism (the
    module docstring), in ``mode`` (one of :data:`SHARD_MODES`; None: ``fsdp`` or ``zero2``
    with even odds where every variable is shardable, else ``zero2``). Units a strategy holds
    already are kept where their variables' modules are not drawn; every unit id and merge
    group of a drawn strategy is then numbered by first appearance. ``ctx.split``: the growth
    step that splits the blocks (:func:`grow`), where the search proposes tensor parallelism."""
    layout = shard_layout(ctx.model, ctx.memo)
    if mode is not None and mode not in SHARD_MODES:
        raise ValueError(f"draw_shard_units: mode: expected one of {SHARD_MODES}, got {mode!r}")
    if mode == SHARD_MODES[1] and not layout.every:
        odd = next(v.name for v in ctx.model.variables if v.name not in layout.names)
        raise ValueError(f"draw_shard_units: mode fsdp shards every variable, and {odd!r} cannot be sharded "
                         f"(sparse, scalar or not float32); use mode zero2")
    n = cols.size
    if not layout.names or not n:
        return cols
    held = cols.splits() > 0
    picked = np.flatnonzero((ctx.rng.random(n) < ctx.rate) & (held.sum(1) >= 2))
    if not len(picked):
        return cols
    drawn = ModuleDraw.draw(ctx.rng, layout, hsdp_sizes(held[picked], ctx.cluster), ctx.lossy, mode)
    # New units are numbered after the units a strategy holds already (renumbered below).
    base = np.zeros(n, np.int64)
    shard_rows = cols.shard_group >= 0
    np.maximum.at(base, cols.sid[shard_rows], cols.group[shard_rows] + 1)
    # The rows of picked strategies whose variable's module is chosen: the first shard of each
    # becomes the variable's shard row, the others go.
    which = np.full(n, -1, np.int64)
    which[picked] = np.arange(len(picked))
    rows = np.flatnonzero(which[cols.sid] >= 0)
    k = which[cols.sid[rows]]
    module = layout.var_module[drawn.depth[k], cols.var[rows]]
    slot = drawn.slots[k] + np.maximum(module, 0)
    on = (module >= 0) & drawn.chosen[slot]
    rows, k, slot = rows[on], k[on], slot[on]
    row_on = np.zeros(len(cols.sid), bool)
    row_on[rows] = True
    var = cols.var[rows]
    values = {"axis": 0, "nshards": 1, "kind": KIND_CODES["shard"], "node": -1, "local": False,
              "group": base[cols.sid[rows]] + drawn.unit[slot], "hier": False, "comp": Compressor().info.code,
              "rank": 0, "frac": layout.frac[var], "ratio": layout.ratio[var], "shard_group": drawn.group[k],
              "reshard": drawn.reshard[slot], "prefetch": drawn.prefetch[slot],
              "reduce_dtype": np.where(drawn.bf16[k], REDUCE_DTYPES.index("bf16"), REDUCE_DTYPES.index("fp32"))}
    touched = np.zeros(n, bool)
    touched[picked] = True
    out = edited(cols, at=rows, values=values, keep=~row_on | first_rows(cols), renumber=touched)
    if ctx.fits is None:
        return out
    grown = {}
    for k, i in enumerate(picked.tolist()):  # fits takes objects: the draws it refuses grow as objects
        made = out.strategy(i)
        if not ctx.fits(made):
            units = Units(layout=layout, depth=int(drawn.depth[k]), group=int(drawn.group[k]),
                          reduce_dtype="bf16" if drawn.bf16[k] else "fp32", base=int(base[i]))
            # Where a split step exists, a draw either splits first or checkpoints first (the
            # draw context's split share of them split); else half checkpoint before widening.
            split_first = ctx.split is not None and takes_turn(k, ctx.split_share)
            checkpoint_first = not split_first if ctx.split is not None else k % 2 == 1
            fitted = grow(cols.strategy(i), made, units, drawn.options(k, layout), ctx.fits,
                          checkpoint_first=checkpoint_first, split=ctx.split, split_first=split_first)
            grown[i] = StrategyColumns.from_strategies(ctx.model, ctx.cluster, [fitted])
    return splice(out, grown)


@dataclass(frozen=True, kw_only=True)
class Units:
    """How a drawn strategy's shard units are cut: the model's ``layout``, the module ``depth``,
    one shard ``group`` and ``reduce_dtype``, new unit ids from ``base`` on."""

    layout: ShardLayout
    depth: int
    group: int
    reduce_dtype: str
    base: int

    def applied(self, strategy: Strategy, options: dict[str, tuple[bool, int]]) -> Strategy:
        """``strategy`` with the shardable variables of each module of ``options`` (module to
        (reshard, prefetch)) in one ``shard`` unit per module, every unit and merge group then
        numbered by first appearance."""
        units: dict[str, int] = {}
        plans = []
        for plan in strategy.plans:
            module = module_at(plan.variable, self.depth)
            if plan.variable not in self.layout.names or module not in options:
                plans.append(plan)
                continue
            reshard, prefetch = options[module]
            sync = ShardSynchronizer(unit=units.setdefault(module, self.base + len(units)), group=self.group,
                                     reshard=reshard, prefetch=prefetch, reduce_dtype=self.reduce_dtype)
            plans.append(VariablePlan(variable=plan.variable, partition=(1,) * len(plan.partition),
                                      shards=(ShardPlan(synchronizer=sync),)))
        return renumber_units(dataclasses.replace(strategy, plans=tuple(plans)))


def grow(strategy: Strategy, drawn: Strategy, units: Units, options: dict[str, tuple[bool, int]],
         fits: Callable[[Strategy], bool], checkpoint_first: bool = False,
         split: Callable[[Strategy], Strategy | None] | None = None, split_first: bool = False) -> Strategy:
    """The sharded draw ``drawn`` of ``strategy`` (its modules ``options``, cut as ``units``)
    grown until ``fits`` holds it, in ZeRO's order (the module docstring); the last growth
    where nothing fits. ``checkpoint_first``: once every module is a unit, checkpointing the
    blocks is tried before the shard group widens across nodes and before any unit reshards
    (both add collectives on every iteration, where checkpointing adds a recomputed forward):
    the sampler grows half its draws each way, and the trials tell which costs less. ``split``:
    where the search proposes tensor parallelism, the step that splits the blocks instead of
    checkpointing them (:func:`~synctune.search.tp_draw.grow_split`: what it returns fits), taken
    where checkpointing every block does not fit, or first where ``split_first`` (the draw
    context's ``split_share`` of the draws)."""
    layout, out = units.layout, drawn
    modules = layout.modules[units.depth]
    size = layout.module_bytes[units.depth]
    order = {m: i for i, m in enumerate(modules)}
    blocks = checkpoint_blocks(p.variable for p in strategy.plans)
    for m in sorted((m for m in modules if m not in options), key=lambda m: (-size[m], order[m])):
        options[m] = (False, 0)
        out = units.applied(strategy, options)
        if fits(out):
            return out
    if checkpoint_first and blocks:
        checkpointed = grow_checkpointing(out, fits, blocks)
        if fits(checkpointed):
            return checkpointed
    if units.group:  # HSDP keeps a copy per node: shard over every replica before resharding
        units = dataclasses.replace(units, group=0)
        out = units.applied(strategy, options)
        if fits(out):
            return out
    if layout.every:
        for m in sorted((m for m in modules if not options[m][0]), key=lambda m: (-size[m], order[m])):
            options[m] = (True, 1)
            out = units.applied(strategy, options)
            if fits(out):
                return out
    # Sharding is not enough: checkpoint the blocks, one more at a time, or split them (tensor
    # parallelism with sequence parallelism): whichever the memory model says fits, and where both
    # do, ``split_first`` says which comes first (the trials' measured costs set its share).
    checkpointed = grow_checkpointing(out, fits, blocks)
    if split is not None and (split_first or not fits(checkpointed)):
        made = split(out)
        if made is not None:
            return made
    return checkpointed
