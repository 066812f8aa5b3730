"""Validation of a strategy against a model spec and a cluster spec (AutoDist §2.2 semantics).

Every inconsistency is a :class:`StrategyError` whose message names the variable (or the
graph-level field), the field, what was expected and what was found.
"""

from __future__ import annotations

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec, VariableSpec
from ..spec.checks import shown
from .checkpoint import check_checkpoint
from .kinds import ShardContext
from .partition import shard_shapes
from .schema import Strategy, StrategyError
from .tensor_parallel import check_tensor_parallel

__all__ = ["validate"]


def _check_plan_shape(var: VariableSpec, partition: tuple[int, ...], where: str) -> None:
    if len(partition) != len(var.shape):
        raise StrategyError(
            f"{where}: partition: expected {len(var.shape)} entries (one per axis of shape {list(var.shape)}), "
            f"got {list(partition)}"
        )
    for axis, (pieces, length) in enumerate(zip(partition, var.shape)):
        if pieces > length:
            raise StrategyError(
                f"{where}: partition: axis {axis} has length {length}, cannot cut it into {pieces} shards"
            )
        if var.sparse and axis > 0 and pieces > 1:
            raise StrategyError(
                f"{where}: partition: a sparse variable can be partitioned on axis 0 (rows) only, got {list(partition)}"
            )


def validate(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec, *, check_refs: bool = True) -> None:
    """Raise :class:`StrategyError` on the first inconsistency of ``strategy`` with the specs.

    Checks: the model/cluster references (when ``check_refs``), replicas (exist, unique),
    batch split (one positive entry per replica), exactly one plan per model variable, the
    partition (one entry per axis, at most the axis length, sparse on axis 0 only), the
    shard synchronizers (PS placement is a replica device; all-gather only for sparse
    gradients; all-reduce groups agree on algorithm and compressor) and compressors
    (lossy ones not on sparse gradients; PowerSGD on matrices with a rank that fits), and
    tensor parallelism (:func:`~synctune.strategy.tensor_parallel.check_tensor_parallel`).
    """
    if check_refs:
        _check_refs(strategy, model, cluster)
    seen = _check_replicas(strategy, cluster)
    check_checkpoint(strategy.checkpoint, (v.name for v in model.variables), model.name)
    uneven_nodes = _uneven_nodes(strategy, cluster)
    planned: set[str] = set()
    units: dict[tuple[str, int], tuple[tuple, str]] = {}
    ctx = ShardContext(where="", variable=None, num_shards=1, shape=(), compressor=None, model=model,
                       cluster=cluster, strategy=strategy, replicas=frozenset(seen), uneven_nodes=uneven_nodes)
    for i, plan in enumerate(strategy.plans):
        where = f"variable {shown(plan.variable)}"
        if plan.variable not in model:
            raise StrategyError(f"strategy: plans[{i}]: {where} is not a variable of model {model.name!r}")
        if plan.variable in planned:
            raise StrategyError(f"strategy: plans[{i}]: {where} has more than one plan")
        planned.add(plan.variable)
        var = model[plan.variable]
        _check_plan_shape(var, plan.partition, where)
        shapes = shard_shapes(var.shape, plan.partition)
        for j, shard in enumerate(plan.shards):
            ctx.where, ctx.variable, ctx.num_shards = f"{where}: shards[{j}]", var, len(plan.shards)
            ctx.shape, ctx.compressor = shapes[j], shard.compressor
            _check_shard(ctx, shard.synchronizer, units)
    missing = [v.name for v in model.variables if v.name not in planned]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise StrategyError(
            f"strategy: plans: no plan for variable(s) {', '.join(repr(m) for m in missing[:3])}{more} "
            f"of model {model.name!r}"
        )
    check_tensor_parallel(strategy, model, cluster)


def _check_refs(strategy: Strategy, model: ModelSpec, cluster: ClusterSpec) -> None:
    """The strategy was built for these specs (names and hashes)."""
    for key, spec in (("model", model), ("cluster", cluster)):
        ref = strategy.to_dict()[key]
        if ref["name"] != spec.name or ref["hash"] != spec.hash:
            raise StrategyError(
                f"strategy: {key}: built for {shown(ref['name'])} (hash {ref['hash'][:12]}), "
                f"validated against {spec.name!r} (hash {spec.hash[:12]})"
            )


def _check_replicas(strategy: Strategy, cluster: ClusterSpec) -> set[str]:
    """Replicas exist and are distinct, one positive batch entry each; returns the replica devices."""
    if not strategy.replicas:
        raise StrategyError("strategy: replicas: expected at least one device, got []")
    seen: set[str] = set()
    for i, dev in enumerate(strategy.replicas):
        if not cluster.has_device(dev):
            raise StrategyError(
                f"strategy: replicas[{i}]: device {shown(dev)} does not exist in cluster {cluster.name!r} "
                f"(devices: {', '.join(cluster.devices[:8])}{', ...' if cluster.num_devices > 8 else ''})"
            )
        if dev in seen:
            raise StrategyError(f"strategy: replicas[{i}]: device {shown(dev)} is listed twice")
        seen.add(dev)
    if len(strategy.batch_split) != len(strategy.replicas):
        raise StrategyError(
            f"strategy: batch_split: expected {len(strategy.replicas)} entries (one per replica), "
            f"got {len(strategy.batch_split)}"
        )
    for i, b in enumerate(strategy.batch_split):
        if b <= 0:
            raise StrategyError(f"strategy: batch_split[{i}]: expected a positive batch size, got {b}")

    return seen


def _uneven_nodes(strategy: Strategy, cluster: ClusterSpec) -> str:
    """How the replicas spread over nodes when nodes hold different numbers of them, else empty."""
    per_node: dict[str, int] = {}
    for dev in strategy.replicas:
        node = cluster.node_of(dev).name
        per_node[node] = per_node.get(node, 0) + 1
    if len(set(per_node.values())) <= 1:
        return ""
    return ", ".join(f"{n} on {node}" for node, n in per_node.items())


def _check_shard(ctx: ShardContext, sync, units: dict) -> None:
    """One shard: its kind's own checks, its compressor against its variable and synchronizer,
    the kind's checks against the strategy, and its unit's agreement with the members so far."""
    sync.check(ctx)
    comp, var, swhere = ctx.compressor, ctx.variable, ctx.where
    if not comp.lossless and var.sparse:
        raise StrategyError(
            f"{swhere}.compressor: lossy compressor {comp.label!r} on a sparse gradient; "
            f"sparse variables take 'none'"
        )
    info = comp.info
    problem = info.problem(ctx.shape, comp.rank)
    if problem:
        raise StrategyError(f"{swhere}.compressor: {problem}")
    if not info.wraps(sync.kind):
        raise StrategyError(
            f"{swhere}.compressor: {comp.label} wraps {' or '.join(info.synchronizers)} only, not {sync.kind}"
        )
    sync.check_in_strategy(ctx)
    terms = sync.unit_terms(ctx)
    if terms is not None:
        first = units.setdefault((sync.kind, sync.merge_id), (terms, var.name))
        if first[0] != terms:
            raise StrategyError(sync.unit_conflict(ctx, first[0], first[1], terms))
