"""The ``fsdp`` runtime: torch FSDP2 (``torch.distributed.fsdp.fully_shard``), as users run it
(DESIGN.md "runtime"; papers/sharding-notes.md "FSDP2").

Each **unit** is one ``fully_shard`` call on a module: its parameters (those not already in a
unit below it) become DTensors sharded on dim 0 over a ``DeviceMesh``, all-gathered as one
collective before use and reduce-scattered as one after backward. The root module is always
wrapped last and takes every parameter left. The mesh is 1-D over every replica, or 2-D
``(replicas // k, k)`` named ``("replicate", "shard")`` for HSDP: shard inside groups of ``k``
consecutive replicas, all-reduce the slices across groups.

This runtime is configured by its own :class:`FSDPConfig` (shard-group size,
``reshard_after_forward``, reduce dtype, prefetch depth, which modules are units), recorded as
the row's ``runtime_json``: the default and tuned FSDP2 baselines, the strategy then giving
replicas and batch split only, as for DDP. A strategy whose ``shard`` plans say everything runs
on the ``fsdp-plans`` runtime (:mod:`synctune.engine.fsdp_plans`), each unit id becoming the
module whose parameters are exactly that unit's variables (:func:`plan_from_strategy`, here with
the rest of FSDP2's machinery both runtimes share).

Activation checkpointing (``checkpoint``: ``none``, ``selective``, ``full``, as torchtitan's
``activation_checkpoint.mode``) checkpoints every block of the model
(:func:`~synctune.strategy.checkpoint.checkpoint_blocks` of its spec) in that mode before
``fully_shard`` wraps it (:meth:`FSDPRuntime.checkpoint_of`; the trial applies it, as for every
PyTorch runtime: :func:`synctune.engine.checkpoint.apply_checkpointing`). A strategy that
checkpoints modules of its own is run with them under ``none``, and refused beside another mode.

Prefetch (torch 2.13's API): FSDP2 by default overlaps the next unit's all-gather implicitly in
forward and prefetches one unit ahead in backward, and an empty explicit list falls back to that
default (it cannot be switched off). So prefetch 0 and 1 both mean FSDP2's default; N >= 2 sets
``set_modules_to_forward_prefetch`` to the next N units and ``set_modules_to_backward_prefetch``
to the previous N, in forward order.

FSDP2 averages gradients over ranks (``ReduceOp.AVG``, over both mesh dimensions for HSDP). An
uneven batch split is made exact as the engine weights ranks (``batch_split[r] / global_batch``)
by scaling rank r's loss by ``replicas * batch_split[r] / global_batch`` before backward
(:attr:`~synctune.engine.runtime.Stepper.loss_scale`); gradients are linear in the loss, so the
average is then the weighted mean.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from ..spec.checks import is_int
from ..spec.errors import SpecError
from ..strategy.checkpoint import CHECKPOINT_MODES, checkpoint_blocks
from ..strategy.schema import MAX_PREFETCH, REDUCE_DTYPES, ShardPlan, ShardSynchronizer, VariablePlan
from .runtime import ArmContext, ConfiguredRuntime, Stepper, per_world
from .tuning import Categorical, NothingToTune, Tuning, TuningSpace

__all__ = ["FSDPConfig", "FSDP_DEFAULT", "FSDPUnit", "FSDPPlan", "FSDPRuntime", "UNIT_CHOICES", "plan_from_config",
           "plan_from_strategy", "strategy_of_config", "apply_fsdp", "loss_scales", "has_shard_plans",
           "meta_model", "check_shard_group", "check_plan", "fsdp_stepper", "escaping_parameters",
           "fsdp_layout", "fsdp_layouts", "fsdp_config_of", "FSDP_PREFETCH", "refuse_sparse", "shard_units",
           "FSDP_CHECKPOINT", "checkpoint_pairs"]

#: What ``units`` names besides a list of module paths: every child of every ``nn.ModuleList``
#: (FSDP's usual per-block wrapping; a list inside a chosen block is not descended into), or the
#: root module alone (one unit for the whole model).
UNIT_CHOICES = ("blocks", "root")

#: The ``checkpoint`` settings, from the most memory held to the least: ``none`` (every block saves
#: its activations), ``selective``, ``full`` (:mod:`synctune.strategy.checkpoint`).
FSDP_CHECKPOINT = ("none",) + tuple(reversed(CHECKPOINT_MODES))

#: The torch dtype name of each reduce dtype.
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """What configures an FSDP2 run. ``group``: the shard-group size (0 = every replica, a 1-D
    mesh; k = HSDP over a ``(replicas // k, k)`` mesh). ``reshard_after_forward``: True (ZeRO-3:
    free after forward, gather again for backward), False (ZeRO-2) or an int (reshard to groups
    of that many, a non-trivial divisor of the shard-group size), for every unit but the root,
    which keeps its parameters (FSDP's own advice: backward needs them first). ``reduce_dtype``:
    what gradients travel and are summed in (parameters stay float32). ``prefetch``: all-gathers
    issued ahead (0 and 1: FSDP2's implicit default; N >= 2 explicit, see the module docstring).
    ``units``: ``blocks``, ``root`` or module paths. ``checkpoint``: activation checkpointing of
    every block of the model (:data:`FSDP_CHECKPOINT`; ``none``: the strategy's own, if any)."""

    group: int = 0
    reshard_after_forward: bool | int = True
    reduce_dtype: str = "fp32"
    prefetch: int = 0
    units: str | tuple[str, ...] = "blocks"
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.units, list):
            object.__setattr__(self, "units", tuple(self.units))
        if not (is_int(self.group) and 0 <= self.group <= 1_000_000):
            raise SpecError(f"fsdp config: group: expected 0 (every replica) or a shard-group size, got {self.group!r}")
        r = self.reshard_after_forward
        if not (isinstance(r, bool) or (is_int(r) and r >= 2)):
            raise SpecError(f"fsdp config: reshard_after_forward: expected true, false or a group size of at least "
                            f"2, got {r!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise SpecError(f"fsdp config: reduce_dtype: expected one of {', '.join(REDUCE_DTYPES)}, "
                            f"got {self.reduce_dtype!r}")
        if not (is_int(self.prefetch) and 0 <= self.prefetch <= MAX_PREFETCH):
            raise SpecError(f"fsdp config: prefetch: expected an integer from 0 to {MAX_PREFETCH}, "
                            f"got {self.prefetch!r}")
        if self.checkpoint not in FSDP_CHECKPOINT:
            raise SpecError(f"fsdp config: checkpoint: expected one of {', '.join(FSDP_CHECKPOINT)}, "
                            f"got {self.checkpoint!r:.60}")
        units = self.units
        if isinstance(units, str):
            if units not in UNIT_CHOICES:
                raise SpecError(f"fsdp config: units: expected one of {', '.join(UNIT_CHOICES)} or a list of module "
                                f"paths, got {units!r:.80}")
        elif not (isinstance(units, tuple) and units and all(isinstance(u, str) and u and len(u) <= 1024
                                                             for u in units)):
            raise SpecError(f"fsdp config: units: expected one of {', '.join(UNIT_CHOICES)} or a non-empty list of "
                            f"module paths (the root is always a unit, last), got {units!r:.80}")
        elif len(set(units)) != len(units):
            twice = next(u for u in units if units.count(u) > 1)
            raise SpecError(f"fsdp config: units: module {twice!r} is listed twice")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (``units`` a list when it names modules), what a
        dataset row and a runtime record hold; ``checkpoint`` only when it is not ``none``, so a
        configuration without checkpointing is recorded as before the setting existed (and rows
        without the key read back as ``none``)."""
        return {"group": self.group, "reshard_after_forward": self.reshard_after_forward,
                "reduce_dtype": self.reduce_dtype, "prefetch": self.prefetch,
                "units": self.units if isinstance(self.units, str) else list(self.units),
                **({"checkpoint": self.checkpoint} if self.checkpoint != "none" else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FSDPConfig":
        """The configuration of :meth:`to_dict`'s form. ``from_strategy: false``, which dataset rows
        of this runtime may hold, is read as nothing; ``from_strategy: true`` marks a row of the
        ``fsdp-plans`` runtime (:func:`synctune.engine.runtimes.runtime_from_record` reads those)."""
        data = dict(data)
        if data.get("from_strategy") is False:
            del data["from_strategy"]
        elif "from_strategy" in data:
            raise SpecError("fsdp config: from_strategy: a strategy's own shard plans run on the fsdp-plans runtime, "
                            "not with FSDP2's settings; drop from_strategy")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"fsdp config: unknown key(s) {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**data)

    def summary(self) -> str:
        """A short human-readable form, e.g. ``fsdp2 blocks, group 2, reshard, reduce bf16,
        checkpoint full``."""
        units = self.units if isinstance(self.units, str) else f"{len(self.units)} module(s)"
        group = f", group {self.group}" if self.group else ""
        r = self.reshard_after_forward
        reshard = "reshard" if r is True else "no reshard" if r is False else f"reshard to {r}"
        prefetch = f", prefetch {self.prefetch}" if self.prefetch >= 2 else ""
        checkpoint = f", checkpoint {self.checkpoint}" if self.checkpoint != "none" else ""
        return f"fsdp2 {units}{group}, {reshard}, reduce {self.reduce_dtype}{prefetch}{checkpoint}"


#: FSDP2 as users start with it: per-block units, every replica one shard group, resharded after
#: forward, fp32 reduce, the implicit prefetch.
FSDP_DEFAULT = FSDPConfig()


@dataclass(frozen=True, kw_only=True)
class FSDPUnit:
    """One ``fully_shard`` call: the module (its path; ``""`` is the root), its options, and the
    spec variables it holds (its parameters not already in a unit below it)."""

    module: str
    reshard_after_forward: bool | int
    reduce_dtype: str
    prefetch: int
    variables: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class FSDPPlan:
    """What :func:`apply_fsdp` does to a model: the mesh shape (``(replicas,)``, or
    ``(replicas // k, k)`` for HSDP) and the units bottom-up (a unit before any unit holding
    it), the root last; ``forward_order`` lists the non-root units in the order their forward
    runs (module registration order), for explicit prefetching."""

    mesh_shape: tuple[int, ...]
    units: tuple[FSDPUnit, ...]
    forward_order: tuple[str, ...]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The device mesh's dimension names: ``("replicate", "shard")`` for HSDP's 2-D mesh, else
        ``("shard",)``."""
        return ("replicate", "shard") if len(self.mesh_shape) == 2 else ("shard",)


def _fsdp_kind(sync: Any) -> bool:
    """Whether FSDP2's ``fully_shard`` runs units of ``sync``'s kind (``shard``:
    :attr:`synctune.engine.kinds.EngineKind.fsdp`)."""
    from .kinds import ENGINE_KINDS

    return ENGINE_KINDS.get(sync.kind).fsdp


def has_shard_plans(strategy: Any) -> bool:
    """Whether any plan of ``strategy`` is of a kind FSDP2 runs (``shard``)."""
    return any(_fsdp_kind(shard.synchronizer) for _p, _i, shard in strategy.iter_shards())


def loss_scales(batch_split) -> tuple[float, ...]:
    """Per rank, what its loss is multiplied by so that FSDP2's average over ranks is the mean
    weighted by each rank's share of the global batch (1.0 each for an even split)."""
    split = list(batch_split)
    if len(set(split)) <= 1:
        return tuple(1.0 for _ in split)
    total = sum(split)
    return tuple(len(split) * b / total for b in split)


def _mesh_shape(replicas: int, group: int) -> tuple[int, ...]:
    size = group or replicas
    return (replicas,) if size == replicas else (replicas // size, size)


def check_shard_group(where: str, group: int, strategy: Any, cluster: Any) -> None:
    """A shard group that divides the replicas and lies inside one node or spans whole nodes."""
    replicas = len(strategy.replicas)
    size = group or replicas
    if replicas % size:
        raise SpecError(f"{where}: a shard group of {size} does not divide the {replicas} replicas; use a divisor of "
                        f"{replicas} (0 for every replica)")
    if cluster is None:
        return
    nodes = [cluster.node_of(d).name for d in strategy.replicas]
    for start in range(0, replicas, size):
        members = nodes[start:start + size]
        split = [n for n in set(members) if members.count(n) != nodes.count(n)]
        if len(set(members)) > 1 and split:
            raise SpecError(f"{where}: shard group {start // size} (replicas {start}..{start + size - 1}) takes part "
                            f"of node {sorted(split)[0]!r}'s replicas together with another node's; a shard group "
                            f"lies inside one node or spans whole nodes (an HSDP mesh that matches the nodes)")


def _owners(module: Any) -> tuple[dict[str, str], list[str]]:
    """Each trainable parameter's name -> the path of the module registering it (a tied
    parameter under its first name, as ``named_parameters`` and the model spec list it), and
    every module path in registration order."""
    paths = [name for name, _m in module.named_modules()]
    owner: dict[str, str] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            owner[name] = name.rpartition(".")[0]
    return owner, paths


def _inside(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is ``ancestor`` or lies below it (``""`` is the root)."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _held(owner: dict[str, str], path: str, below: list[str]) -> tuple[str, ...]:
    """The parameters ``fully_shard`` on ``path`` takes: those of its subtree, less those of the
    units ``below`` it (wrapped earlier)."""
    inner = [u for u in below if u != path and _inside(u, path)]
    return tuple(n for n, m in owner.items() if _inside(m, path) and not any(_inside(m, u) for u in inner))


def _bottom_up(paths: list[str], order: list[str]) -> list[str]:
    """``paths`` ordered deepest first (a unit before any unit holding it), ties in registration order."""
    rank = {p: i for i, p in enumerate(order)}
    return sorted(paths, key=lambda p: (-(p.count(".") + 1), rank.get(p, 0)))


def _block_paths(module: Any) -> list[str]:
    import torch.nn as nn

    blocks: list[str] = []
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and not any(_inside(name, b) for b in blocks):
            blocks.extend(f"{name}.{child}" if name else child for child, _c in m.named_children())
    return blocks


def plan_from_config(module: Any, config: FSDPConfig, strategy: Any) -> FSDPPlan:
    """The units of ``config`` on ``module`` (an ``nn.Module``, on any device, meta included)."""
    owner, order = _owners(module)
    if config.units == "blocks":
        chosen = _block_paths(module)
    elif config.units == "root":
        chosen = []
    else:
        known = set(order)
        for path in config.units:
            if path not in known:
                near = [p for p in order if p and p.split(".")[0] == path.split(".")[0]][:6]
                raise SpecError(f"fsdp config: units: model has no module {path!r}"
                                + (f" (modules there: {', '.join(near)})" if near else ""))
        chosen = [p for p in config.units if p != ""]
    chosen = _bottom_up(chosen, order)
    units = []
    for path in chosen:
        held = _held(owner, path, chosen)
        if not held:
            raise SpecError(f"fsdp config: units: module {path!r} has no trainable parameters outside the units below "
                            f"it; leave it out")
        units.append(FSDPUnit(module=path, reshard_after_forward=config.reshard_after_forward,
                              reduce_dtype=config.reduce_dtype, prefetch=config.prefetch, variables=held))
    units.append(FSDPUnit(module="", reshard_after_forward=False, reduce_dtype=config.reduce_dtype,
                          prefetch=config.prefetch, variables=_held(owner, "", chosen)))
    return FSDPPlan(mesh_shape=_mesh_shape(len(strategy.replicas), config.group), units=tuple(units),
                    forward_order=tuple(p for p in order if p in set(chosen)))


def refuse_sparse(spec: Any) -> None:
    """FSDP2 reduce-scatters dense gradients: a model with a sparse one is refused, naming it."""
    sparse = [v.name for v in spec.variables if v.sparse]
    if sparse:
        raise SpecError(f"fsdp runtime: variable {sparse[0]!r} has sparse gradients, and FSDP2 reduce-scatters "
                        f"dense ones; use the engine or ddp for this model")


def checkpoint_pairs(config: FSDPConfig, strategy: Any, spec: Any) -> tuple[tuple[str, str], ...]:
    """The ``(module, mode)`` pairs FSDP2 under ``config`` checkpoints for a trial of ``strategy``:
    every block of the model (:func:`~synctune.strategy.checkpoint.checkpoint_blocks` of
    ``spec``'s variables) in ``config.checkpoint``'s mode, or the strategy's own under ``none``."""
    if config.checkpoint == "none":
        return tuple(strategy.checkpoint)
    return tuple(sorted((block, config.checkpoint) for block in checkpoint_blocks(v.name for v in spec.variables)))


def _check_checkpoint_setting(config: FSDPConfig, strategy: Any, spec: Any) -> None:
    """Refuse a ``checkpoint`` setting beside a strategy that checkpoints modules of its own (one
    of the two would be ignored), or on a model without blocks (it would checkpoint nothing)."""
    if config.checkpoint == "none":
        return
    if strategy.checkpoint:
        raise SpecError(f"fsdp config: checkpoint: {config.checkpoint!r} beside the strategy's own checkpoint "
                        f"({len(strategy.checkpoint)} module(s)); set checkpoint=none to run the strategy's, or "
                        f"drop the strategy's checkpoint field")
    if not checkpoint_blocks(v.name for v in spec.variables):
        raise SpecError(f"fsdp config: checkpoint: model {spec.name!r} has no blocks to checkpoint (its variables "
                        f"all belong to the root module); use checkpoint=none")


def strategy_of_config(module: Any, config: FSDPConfig, strategy: Any, spec: Any) -> Any:
    """The all-``shard`` strategy FSDP2 runs under ``config`` on ``module`` (an ``nn.Module``,
    meta included), on ``strategy``'s replicas and batch split: what the memory model
    (:func:`synctune.simulator.memory.predict_memory`) predicts an FSDP2 baseline from
    (papers/sharding-notes.md "FSDP2").

    Unit i of :func:`plan_from_config` (bottom-up, the root last) becomes ``shard`` unit i over
    ``config.group``, in ``config.reduce_dtype``; the root unit keeps its parameters as FSDP2
    does (no reshard). Prefetch as the strategy language has it: 0 without reshard (parameters
    stay whole, nothing to count ahead), else ``config.prefetch`` but at least 1 (FSDP2 always
    gathers the next unit ahead). An int ``reshard_after_forward`` (reshard to a smaller group)
    is counted as *no* reshard: between forward and backward FSDP2 then holds each unit's
    parameters sharded over that smaller group, which the language cannot say, and whole
    parameters are an upper bound of it (1/r + 1/shard <= 1 for r, shard >= 2), the side a memory
    budget must err on. A shard group of the whole replica set is written 0 (the same 1-D mesh).
    Its ``checkpoint`` is what the trial checkpoints (:func:`checkpoint_pairs`: every block in
    ``config.checkpoint``'s mode, or the strategy's own under ``none``). Refuses a model with
    sparse gradients (FSDP2 cannot run it) and a shard group of 1 (nothing sharded: that is
    replicated training)."""
    refuse_sparse(spec)
    replicas = len(strategy.replicas)
    if config.group == 1:
        raise SpecError("fsdp config: group: a shard group of 1 shards nothing (every rank keeps whole parameters "
                        "and all-reduces them); the strategy language says that with allreduce, not shard")
    group = 0 if config.group in (0, replicas) else config.group
    plan = plan_from_config(module, config, strategy)
    unit_of: dict[str, tuple[int, bool]] = {}
    for i, unit in enumerate(plan.units):
        reshard = unit.reshard_after_forward is True  # an int counts as no reshard: see above
        for name in unit.variables:
            unit_of[name] = (i, reshard)
    missing = [v.name for v in spec.variables if v.name not in unit_of]
    if missing:
        raise SpecError(f"fsdp config: variable {missing[0]!r} of the model spec is not a trainable parameter of "
                        f"the module FSDP2 would wrap; build the spec from the same model")
    plans = []
    for v in spec.variables:
        i, reshard = unit_of[v.name]
        sync = ShardSynchronizer(unit=i, group=group, reshard=reshard,
                                 prefetch=max(1, config.prefetch) if reshard else 0, reduce_dtype=config.reduce_dtype)
        plans.append(VariablePlan(variable=v.name, partition=(1,) * len(v.shape), shards=(ShardPlan(synchronizer=sync),)))
    return dataclasses.replace(strategy, plans=tuple(plans), schema=None,
                               checkpoint=checkpoint_pairs(config, strategy, spec))


def _common_module(names: list[str], owner: dict[str, str]) -> str:
    """The deepest module holding every parameter of ``names``."""
    parts = [owner[n].split(".") if owner[n] else [] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def shard_units(strategy: Any) -> tuple[dict[int, list[str]], dict[int, ShardSynchronizer], tuple[int, str]]:
    """The variables of each unit id, each unit's synchronizer and the shard group (with the
    variable it was first seen on), refusing another synchronizer or units on different groups."""
    by_unit: dict[int, list[str]] = {}
    syncs: dict[int, ShardSynchronizer] = {}
    group = None
    for i, plan in enumerate(strategy.plans):
        for j, shard in enumerate(plan.shards):
            sync = shard.synchronizer
            where = f"strategy: plans[{i}] (variable {plan.variable!r}).shards[{j}].synchronizer"
            if not _fsdp_kind(sync):
                raise SpecError(f"{where}: the fsdp runtime runs strategies whose plans are all shard, and this one "
                                f"is {sync.kind}; run it with the engine (--runtime engine)")
            if group is None:
                group = (sync.group, plan.variable)
            elif sync.group != group[0]:
                raise SpecError(f"{where}.group: FSDP2 runs every unit on one mesh, and this unit's shard group is "
                                f"{sync.group} where variable {group[1]!r}'s is {group[0]}; give every unit the "
                                f"same group")
            if sync.reshard and sync.prefetch == 0:
                raise SpecError(f"{where}.prefetch: 0 with reshard is not executed: FSDP2 always gathers the next "
                                f"unit ahead (torch 2.13 cannot switch its implicit prefetch off); set prefetch 1")
            by_unit.setdefault(sync.unit, []).append(plan.variable)
            syncs.setdefault(sync.unit, sync)
    return by_unit, syncs, group or (0, "")


def plan_from_strategy(module: Any, strategy: Any, spec: Any) -> FSDPPlan:
    """The FSDP2 units of a strategy whose plans are all ``shard``: each unit id becomes the
    module whose parameters are exactly that unit's variables (parameters of modules wrapped
    as units below it excluded, as ``fully_shard`` does); the root module is always wrapped last
    and must then hold nothing else. Refuses, naming the variable and field, what FSDP2 cannot
    express: another synchronizer, units on different shard groups, a unit that is not a
    module boundary."""
    by_unit, syncs, group = shard_units(strategy)
    owner, order = _owners(module)
    spec_names = {v.name for v in spec.variables}
    missing = sorted(spec_names - set(owner))
    if missing:
        raise SpecError(f"strategy: variable {missing[0]!r}: the model has no trainable parameter of that name")
    untracked = sorted(set(owner) - spec_names)
    if untracked:
        raise SpecError(f"model parameter {untracked[0]!r} is not in the model spec; FSDP2 would shard it with no plan")
    where_of = {p.variable: i for i, p in enumerate(strategy.plans)}
    paths = {u: _common_module(names, owner) for u, names in by_unit.items()}
    seen: dict[str, int] = {}
    for unit, path in paths.items():
        if path in seen:
            var = by_unit[unit][0]
            module = repr(path) if path else "the root module"
            raise SpecError(
                f"strategy: plans[{where_of[var]}] (variable {var!r}).shards[0].synchronizer.unit: units "
                f"{seen[path]} and {unit} both need {module} (the smallest module holding each), and one module is "
                f"one fully_shard unit; merge them, or split them along modules")
        seen[path] = unit
    if "" not in seen and paths and not _held(owner, "", list(paths.values())):
        # The root holds none of the model's variables: the shallowest unit becomes the root's,
        # since fully_shard on the root takes exactly the same variables, and the root's forward
        # encloses every use of them (a tied weight, as an embedding reused as the output
        # projection, is used outside its own module's forward, where a resharded parameter
        # would already be a shard).
        rank = {p: i for i, p in enumerate(order)}
        top = min(seen, key=lambda p: (p.count("."), rank.get(p, 0)))
        seen[""] = seen.pop(top)
        paths[seen[""]] = ""
    placed = [p for p in paths.values() if p]
    for path in placed:
        _refuse_container(module, path, seen[path], by_unit, where_of)
    units = []
    for path in _bottom_up(placed, order):
        unit = seen[path]
        held, want = set(_held(owner, path, placed)), set(by_unit[unit])
        if held != want:
            _refuse_boundary(unit, path, held, want, by_unit, where_of)
        sync = syncs[unit]
        units.append(FSDPUnit(module=path, reshard_after_forward=sync.reshard, reduce_dtype=sync.reduce_dtype,
                              prefetch=sync.prefetch, variables=tuple(n for n in owner if n in want)))
    rest = set(_held(owner, "", placed))
    root_unit = seen.get("")
    if root_unit is not None and rest != set(by_unit[root_unit]):
        _refuse_boundary(root_unit, "", rest, set(by_unit[root_unit]), by_unit, where_of)
    _refuse_split_ties(module, units, where_of)
    root_sync = syncs[root_unit] if root_unit is not None else None
    units.append(FSDPUnit(module="", reshard_after_forward=root_sync.reshard if root_sync else False,
                          reduce_dtype=root_sync.reduce_dtype if root_sync else "fp32",
                          prefetch=root_sync.prefetch if root_sync else 0,
                          variables=tuple(n for n in owner if n in rest)))
    return FSDPPlan(mesh_shape=_mesh_shape(len(strategy.replicas), group[0]), units=tuple(units),
                    forward_order=tuple(p for p in order if p in set(placed)))


def _refuse_split_ties(module: Any, units: list, where_of: dict) -> None:
    """Refuse a unit (below the root) holding a tied parameter (one tensor registered in two
    modules, as a Hugging Face BERT's word embedding is its output layer's weight) whose other
    module lies outside the unit: ``fully_shard`` on a unit enclosing that other module would find
    the tensor already managed by another FSDP group: torch 2.12 and later refuse it at the first
    iteration, torch 2.11 unties the two and trains each copy apart without a word."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    placed = sorted((u.module for u in units if u.module), key=len, reverse=True)

    def unit_of(name: str) -> str:  # the innermost unit holding the module registering ``name``
        return next((u for u in placed if _inside(name.rpartition(".")[0], u)), "")

    for group in names.values():
        if len(group) < 2:
            continue
        var, held = group[0], unit_of(group[0])
        other = next((o for o in group[1:] if unit_of(o) != held), None)
        if other is not None:
            name = lambda u: f"unit {u!r}" if u else "the root's unit"  # noqa: E731
            raise SpecError(
                f"strategy: plans[{where_of.get(var, 0)}] (variable {var!r}).shards[0].synchronizer.unit: {var!r} is "
                f"tied to {other!r} (one tensor in two modules), which {name(unit_of(other))} would wrap while "
                f"{name(held)} holds it; FSDP2 keeps a tied parameter in one unit enclosing both modules: leave both "
                f"modules to the root's unit, or cut the units at a module holding both")


def _refuse_boundary(unit: int, path: str, held: set, want: set, by_unit: dict, where_of: dict) -> None:
    """The refusal of a unit that is not one module's parameters, naming a variable that breaks it."""
    module = repr(path) if path else "the root module"
    extra = sorted(held - want)
    if extra:
        other = next((u for u, names in by_unit.items() if extra[0] in names), None)
        var = extra[0]
        raise SpecError(
            f"strategy: plans[{where_of[var]}] (variable {var!r}).shards[0].synchronizer.unit: unit {unit}'s "
            f"variables share {module} with this variable (unit {other}); FSDP2's fully_shard takes every parameter "
            f"of a module not in a unit below it: give {var!r} unit {unit}, or put the other parameters of its "
            f"module in a unit of their own module")
    var = sorted(want - held)[0]
    raise SpecError(
        f"strategy: plans[{where_of[var]}] (variable {var!r}).shards[0].synchronizer.unit: unit {unit} is not a "
        f"module boundary ({module} holds its variables but {var!r} falls in a unit below it); FSDP2 shards whole "
        f"modules: make each unit exactly the parameters of one module")


def _refuse_container(module: Any, path: str, unit: int, by_unit: dict, where_of: dict) -> None:
    """Refuse a unit whose module has no ``forward`` of its own (a ``ModuleList`` or
    ``ModuleDict``): ``fully_shard`` refuses it at the first iteration (its hooks run around a
    forward), and the search must know before it proposes one."""
    import torch

    sub = module.get_submodule(path)
    if type(sub).forward is torch.nn.Module.forward:
        var = by_unit[unit][0]
        raise SpecError(
            f"strategy: plans[{where_of[var]}] (variable {var!r}).shards[0].synchronizer.unit: unit {unit} is module "
            f"{path!r}, a {type(sub).__name__} with no forward of its own, which FSDP2's fully_shard cannot wrap; "
            f"cut the units one module deeper (its children), or leave its variables to the root's unit")


def escaping_parameters(module: Any, workload: Any) -> frozenset[str]:
    """The trainable parameters ``workload``'s forward uses outside the forward of the module that
    registers them (a tied weight: bert-tiny's word embedding, multiplied in the root's forward
    as the output projection), traced once on ``module`` (built on the meta device) with a
    batch of 2 there; empty where the workload's batch cannot be made on the meta device. FSDP2
    hands such a parameter, in a unit resharded after forward, as a shard to that later use,
    which fails at the first iteration ("mixed torch.Tensor and DTensor")."""
    cached = getattr(module, "_synctune_escaping", None)
    if cached is not None:
        return cached
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    paths = {id(m): n for n, m in module.named_modules()}
    stack: list[str] = []
    found: set[str] = set()

    class _Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for leaf in tree_leaves((args, kwargs or {})):
                name = names.get(id(leaf))
                if name is not None and name.rpartition(".")[0] not in stack:
                    found.add(name)
            return func(*args, **(kwargs or {}))

    def pre(m, _args):
        stack.append(paths.get(id(m), "?"))

    def post(m, _args, _out):
        stack.pop()

    hooks = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        batch = workload.make_batch(2, rank=0, generator=None, device=torch.device("meta"))
        with _Uses():
            workload.loss(module, batch)
        result = frozenset(found)
    except Exception:  # noqa: BLE001 - no meta batch (an imported model): the workers' first iteration decides
        result = frozenset()
    finally:
        for hook in hooks:
            hook.remove()
    module._synctune_escaping = result
    return result


def check_plan(plan: FSDPPlan, escaping: frozenset[str] = frozenset(), *, from_plans: bool = False,
               checkpoint: Any = ()) -> None:
    """What FSDP2 refuses at its first iteration, refused before any worker starts (``escaping``:
    :func:`escaping_parameters`); ``from_plans``: the plan is a strategy's own shard plans (the
    messages then name the strategy's fields, else the configuration's). ``checkpoint``: the
    blocks the trial checkpoints; a ``selective`` one with a unit strictly inside it is refused:
    torch's selective checkpointing replays the block's ops by their order, and under a profiler
    (every trial's memory probe, a user's ``torch.profiler``) the inner unit's FSDP2 hooks record
    functions in forward that the recompute does not replay alike (torch fails it in backward)."""
    for block, mode in checkpoint:
        inner = next((u.module for u in plan.units if mode == "selective" and u.module.startswith(block + ".")), None)
        if inner is not None:
            field = "strategy: checkpoint" if from_plans else "fsdp config: checkpoint"
            raise SpecError(f"{field}: block {block!r} is checkpointed selective and holds FSDP2 unit {inner!r} "
                            f"inside it, whose hooks torch's selective checkpointing cannot replay under a profiler; "
                            f"checkpoint it full, or cut the units at the block")
    shard = plan.mesh_shape[-1]
    for unit in plan.units:
        held = sorted(set(unit.variables) & escaping)
        if unit.module and unit.reshard_after_forward is not False and held:
            field = (f"strategy: variable {held[0]!r}: shard: reshard" if from_plans
                     else "fsdp config: reshard_after_forward")
            raise SpecError(f"{field}: unit {unit.module!r} holds {held[0]!r}, which the model uses outside that "
                            f"module's forward (a tied weight), where a unit resharded after forward hands it over "
                            f"as a shard; do not reshard that unit, or leave {held[0]!r} to the root's unit")
        r = unit.reshard_after_forward
        if not isinstance(r, bool) and not (1 < r < shard and shard % r == 0):
            field = "shard: reshard" if from_plans else "fsdp config: reshard_after_forward"
            raise SpecError(f"{field}: resharding to groups of {r} needs a divisor of the shard group ({shard}) "
                            f"other than 1 and {shard}; use true, false or such a divisor")


def _world_mesh(device_type: str, plan: FSDPPlan) -> Any:
    """The device mesh of ``plan`` on ``device_type``, built once per world
    (:func:`~synctune.engine.runtime.per_world`): a mesh of more than one dimension makes a
    process group per dimension, which a mesh per trial would pile up."""
    from torch.distributed.device_mesh import init_device_mesh

    return per_world(("mesh", device_type, plan.mesh_shape, plan.mesh_dim_names),
                     lambda: init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names))


def _process_groups() -> set:
    """The process groups the world holds now."""
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map)


def _destroy_groups(groups: set) -> None:
    """Destroy ``groups``, which one trial made: FSDP2 builds a mesh of its own for a unit
    resharded to a part of its group (``reshard_after_forward`` an int), per unit and per trial.
    Every rank runs the same trials, so every rank destroys the same groups."""
    import torch.distributed as dist

    for group in groups:
        dist.destroy_process_group(group)


def apply_fsdp(model: Any, plan: FSDPPlan, device_type: str, mesh: Any = None) -> Any:
    """``fully_shard`` every unit of ``plan`` on ``model`` (bottom-up, the root last) on a mesh
    of ``device_type`` over the default process group (or on ``mesh``: tensor parallelism's
    data-parallel sub-mesh), then the explicit prefetch lists; returns the model (the same
    object, now an ``FSDPModule``)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _world_mesh(device_type, plan) if mesh is None else mesh
    for unit in plan.units:
        reduce = None if unit.reduce_dtype == "fp32" else getattr(torch, _TORCH_DTYPES[unit.reduce_dtype])
        fully_shard(model.get_submodule(unit.module), mesh=mesh, reshard_after_forward=unit.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce))
    order = [model.get_submodule(p) for p in plan.forward_order]
    depth = {u.module: u.prefetch for u in plan.units}
    for i, path in enumerate(plan.forward_order):
        n = depth[path]
        if n >= 2:
            # FSDP2's implicit default already overlaps one unit ahead: explicit lists from two on.
            order[i].set_modules_to_forward_prefetch(order[i + 1:i + 1 + n])
            order[i].set_modules_to_backward_prefetch(order[max(0, i - n):i][::-1])
    if order and depth[""] >= 2:
        model.set_modules_to_forward_prefetch(order[:depth[""]])
    return model


def meta_model(workload: Any) -> Any:
    """The workload's model on the meta device (no memory), or None when it cannot be built there
    (the workers then check the same plan on the real model, all ranks alike)."""
    import torch

    try:
        with torch.device("meta"):
            return workload.build_model()
    except Exception:  # noqa: BLE001 - an op without a meta kernel: checked on the workers instead
        return None


def fsdp_stepper(ctx: ArmContext, plan: FSDPPlan) -> Stepper:
    """One rank's FSDP2 under ``plan``: ``fully_shard`` applied (:func:`apply_fsdp`), the
    optimizer over the sharded parameters, the loss scaled for an uneven batch split
    (:func:`loss_scales`), and the process groups this trial made destroyed when it closes."""
    _world_mesh(ctx.device.type, plan)  # kept for the next trial: made (or found) before the count
    before = _process_groups()
    model = apply_fsdp(ctx.model, plan, ctx.device.type)
    made = _process_groups() - before
    # After fully_shard: the optimizer holds the DTensor shards, so its state is sharded too.
    optimizer = ctx.make_optimizer([p for p in model.parameters() if p.requires_grad])

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The memory probe sees the optimizer's (sharded) state; FSDP2's gather and reduce-scatter
    # buffers live only inside an iteration, so they are in its peak, not a persistent part.
    return Stepper(forward_model=model, step=step, loss_scale=loss_scales(ctx.strategy.batch_split)[ctx.rank],
                   memory_parts=lambda: {"optimizer": optimizer, "units": []},
                   close=lambda: _destroy_groups(made))


# --------------------------------------------------------------------------- tuned FSDP2

#: The prefetch depths tuned (0 and 1 are the same FSDP2 run: see the module docstring).
FSDP_PREFETCH = (1, 2)


def fsdp_layout(config: FSDPConfig) -> str:
    """The layout string of ``config``'s units, shard group and resharding, e.g.
    ``blocks/g0/reshard`` (per-block units over every replica, ZeRO-3), ``blocks/g2/keep`` (HSDP
    with shard groups of 2, parameters kept after forward) or ``root/g0/keep`` (one unit; FSDP2
    never reshards the root, so a root layout is always ``keep``)."""
    if not isinstance(config.units, str) or not isinstance(config.reshard_after_forward, bool):
        raise SpecError(f"fsdp layout: only units {' or '.join(UNIT_CHOICES)} with reshard_after_forward true or "
                        f"false have a layout, got units {config.units!r:.60}, reshard_after_forward "
                        f"{config.reshard_after_forward!r}")
    keep = config.units == "root" or not config.reshard_after_forward
    return f"{config.units}/g{config.group}/{'keep' if keep else 'reshard'}"


def _layout_config(layout: str, prefetch: int = 1, reduce_dtype: str = "fp32", checkpoint: str = "none") -> FSDPConfig:
    parts = layout.split("/") if isinstance(layout, str) else []
    ok = (len(parts) == 3 and parts[0] in UNIT_CHOICES and parts[1][:1] == "g" and parts[1][1:].isascii()
          and parts[1][1:].isdigit() and len(parts[1]) <= 8 and parts[2] in ("reshard", "keep"))
    if not ok:
        raise SpecError(f"tuned fsdp: layout: expected UNITS/gGROUP/reshard|keep (units {', '.join(UNIT_CHOICES)}), "
                        f"got {str(layout)[:60]!r}")
    return FSDPConfig(units=parts[0], group=int(parts[1][1:]), reshard_after_forward=parts[2] == "reshard",
                      prefetch=prefetch, reduce_dtype=reduce_dtype, checkpoint=checkpoint)


def fsdp_config_of(params: dict) -> FSDPConfig:
    """The :class:`FSDPConfig` of one tuned-FSDP2 point (``layout``, ``prefetch``, ``reduce_dtype``,
    ``checkpoint``; a point recorded before ``checkpoint`` was tuned has none: ``none``)."""
    prefetch = params["prefetch"]
    if prefetch not in FSDP_PREFETCH or isinstance(prefetch, bool):
        raise SpecError(f"tuned fsdp: prefetch: expected one of {FSDP_PREFETCH}, got {prefetch!r}")
    return _layout_config(params["layout"], int(prefetch), params["reduce_dtype"], params.get("checkpoint", "none"))


def _fsdp_groups(cluster: Any) -> list[int]:
    """The shard groups tuned: 0 (every replica), and HSDP over the nodes (shard inside a node,
    all-reduce across) where there are several nodes of the same two or more devices."""
    sizes = {n.num_devices for n in cluster.nodes}
    per_node = next(iter(sizes))
    return [0] + ([per_node] if len(cluster.nodes) > 1 and len(sizes) == 1 and per_node >= 2 else [])


def fsdp_layouts(model: Any, cluster: Any, fits=None) -> list[str]:
    """The layouts a tuned-FSDP2 search tries in a domain: units ``blocks`` (resharded or kept)
    and ``root``, on each shard group of :func:`_fsdp_groups`, those whose configuration at
    prefetch 1, an fp32 reduce and full checkpointing (the least memory of the layout's points)
    ``fits`` (an :class:`FSDPConfig` predicate) accepts (all when None); none for a model with
    sparse gradients (FSDP2 cannot run it)."""
    if any(v.sparse for v in model.variables):
        return []
    configs = [FSDPConfig(units=units, group=group, reshard_after_forward=reshard, prefetch=1,
                          checkpoint=FSDP_CHECKPOINT[-1])
               for units in UNIT_CHOICES for group in _fsdp_groups(cluster)
               for reshard in ((True, False) if units != "root" else (False,))]
    return [fsdp_layout(c) for c in configs if fits is None or fits(c)]


@dataclass(frozen=True)
class FSDPRuntime(ConfiguredRuntime):
    """torch FSDP2 as :attr:`config` says (see the module docstring); the strategy gives replicas
    and batch split only. A strategy with shard plans, which this configuration would ignore, is
    refused: its plans run on :attr:`plans_runtime`."""

    config: FSDPConfig = FSDP_DEFAULT
    name = "fsdp"
    config_type = FSDPConfig
    fsdp_layout = True
    label = "FSDP2"
    trials_noun = "torch FSDP2 trials, its defaults first"
    tuning = Tuning(params=("layout", "prefetch", "reduce_dtype", "checkpoint"), origin="fsdp-tuned",
                    label="tuned FSDP2", title="torch FSDP2",
                    knobs="mesh (HSDP group), units, reshard after forward, prefetch, reduce dtype and activation "
                          "checkpointing")
    #: The runtime that runs a strategy's own shard plans (``--runtime fsdp`` without settings on
    #: such a strategy means it: :func:`synctune.engine.runtimes.runtime_from_options`).
    plans_runtime = "fsdp-plans"

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, an FSDP2 trial that would not run as claimed."""
        config = self.config
        refuse_sparse(spec)
        if has_shard_plans(strategy):
            raise SpecError(f"fsdp config: the strategy has shard plans, which this configuration would ignore; run "
                            f"them on the {self.plans_runtime} runtime (no --fsdp settings) or use a strategy without "
                            f"shard plans")
        check_shard_group("fsdp config: group", config.group, strategy, cluster)
        _check_checkpoint_setting(config, strategy, spec)
        module = meta_model(workload) if workload is not None else None
        if module is not None:
            check_plan(plan_from_config(module, config, strategy), escaping_parameters(module, workload),
                       checkpoint=self.checkpoint_of(strategy, spec))

    def prepare(self, ctx: ArmContext) -> Stepper:
        plan = plan_from_config(ctx.model, self.config, ctx.strategy)
        check_plan(plan)
        return fsdp_stepper(ctx, plan)

    def plans_of(self, strategy: Any, module, spec: Any) -> Any:
        """The all-``shard`` strategy FSDP2 runs under this configuration, with the modules it
        checkpoints (:func:`strategy_of_config`)."""
        return strategy_of_config(module(), self.config, strategy, spec)

    def checkpoint_of(self, strategy: Any, spec: Any) -> tuple[tuple[str, str], ...]:
        """Every block of the model in the ``checkpoint`` setting's mode, or the strategy's own
        under ``none`` (:func:`checkpoint_pairs`)."""
        return checkpoint_pairs(self.config, strategy, spec)

    def describe(self, strategy: Any) -> str:
        return f"torch FSDP2: {self.summary()} (replicas and batch split of {strategy.summary()})"

    def training_format(self, strategy: Any) -> str:
        return "fsdp"

    @classmethod
    def tuning_space(cls, model: Any, cluster: Any, *, lossy: bool, fits=None) -> TuningSpace:
        """``layout`` (units, shard group, reshard after forward: one categorical over
        :func:`fsdp_layouts`, so that only layouts the memory budget admits are in it),
        ``prefetch`` (1: FSDP2's implicit one unit ahead; 2: explicit lists), ``reduce_dtype``
        (bf16 only where ``lossy``) and ``checkpoint`` (:data:`FSDP_CHECKPOINT`: every block
        checkpointed in that mode, or none). The first point is FSDP2's default where it fits,
        else the first layout that fits, without checkpointing where that fits (else the least
        checkpointing that does); a drawn point whose prefetch, reduce dtype or checkpointing
        would not fit gives way to the same layout at the nearest settings that do: its own
        checkpointing first, then more of it. A point recorded before ``checkpoint`` was tuned
        reads as ``none`` (the space's ``defaults``)."""
        def admits_config(config: FSDPConfig) -> bool:
            return fits is None or fits(cls(config))

        layouts = fsdp_layouts(model, cluster, admits_config)
        if not layouts:
            why = ("the model has sparse gradients, which FSDP2 cannot reduce-scatter"
                   if any(v.sparse for v in model.variables) else "no FSDP2 layout fits the memory budget")
            raise NothingToTune(cls.name, why)
        dtypes = ("fp32", "bf16") if lossy else ("fp32",)
        default = fsdp_layout(FSDP_DEFAULT)

        def admits(point) -> bool:
            return fits is None or admits_config(fsdp_config_of(dict(point)))

        def fallbacks(point) -> list[dict]:
            less = FSDP_CHECKPOINT[FSDP_CHECKPOINT.index(point.get("checkpoint", "none")):]
            return [{"layout": point["layout"], "prefetch": p, "reduce_dtype": d, "checkpoint": c} for c in less
                    for p in dict.fromkeys((point["prefetch"], 1)) for d in dict.fromkeys((point["reduce_dtype"], "fp32"))]

        first = {"layout": default if default in layouts else layouts[0], "prefetch": 1, "reduce_dtype": "fp32"}
        first["checkpoint"] = next((c for c in FSDP_CHECKPOINT if admits({**first, "checkpoint": c})),
                                   FSDP_CHECKPOINT[-1])
        return TuningSpace(
            params={"layout": Categorical(tuple(layouts)), "prefetch": Categorical(FSDP_PREFETCH),
                    "reduce_dtype": Categorical(dtypes), "checkpoint": Categorical(FSDP_CHECKPOINT)},
            first=first, admits=None if fits is None else admits, fallbacks=fallbacks,
            defaults={"checkpoint": "none"})

    @classmethod
    def from_tuned(cls, point: dict[str, Any]) -> "FSDPRuntime":
        """FSDP2 as a tuned point says (:func:`fsdp_config_of`)."""
        return cls(fsdp_config_of(point))

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Any = None, spec: Any = None) -> "FSDPRuntime":
        """``--fsdp KEY=VALUE`` settings, typed as :class:`FSDPConfig`'s fields; unset ones are
        :data:`FSDP_DEFAULT`'s. Settings beside a strategy with shard plans are refused (its plans
        configure FSDP2 on :attr:`plans_runtime`)."""
        if strategy is not None and has_shard_plans(strategy) and options:
            raise SpecError(f"--fsdp: the strategy's shard plans configure FSDP2; drop --fsdp "
                            f"{sorted(options)[0]}=... or use a strategy without shard plans")
        values = {**FSDP_DEFAULT.to_dict(), "checkpoint": FSDP_DEFAULT.checkpoint}
        for key, text in options.items():
            if key not in values:
                raise SpecError(f"--fsdp: unknown key {key!r}; valid: {', '.join(values)}")
            values[key] = _typed_option(key, text)
        return cls(FSDPConfig.from_dict(values))


def _typed_option(key: str, text: str) -> Any:
    """One ``--fsdp`` value as its field's type."""
    lower = text.strip().lower()
    if key in ("group", "prefetch"):
        if not (text.isascii() and text.isdigit()) or len(text) > 9:
            raise SpecError(f"--fsdp: {key}: expected a non-negative integer, got {text[:40]!r}")
        return int(text)
    if key == "reshard_after_forward":
        if lower in ("true", "false"):
            return lower == "true"
        if text.isascii() and text.isdigit() and len(text) <= 9:
            return int(text)
        raise SpecError(f"--fsdp: reshard_after_forward: expected true, false or a group size, got {text[:40]!r}")
    if key == "units":
        return text if text in UNIT_CHOICES else [p.strip() for p in text.split(",") if p.strip()]
    return text
