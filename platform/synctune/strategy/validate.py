"""Validation of a strategy against a model spec and a cluster spec (AutoDist §2.2 semantics).

Every inconsistency is a :class:`StrategyError` whose message names the variable (or the
graph-level field), the field, what was expected and what was found.
"""

from __future__ import annotations

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec, VariableSpec
from ..spec._util import shown
from .partition import shard_shapes
from .schema import (AllGatherSynchronizer, AllReduceSynchronizer, PSSynchronizer, SFBSynchronizer, ShardSynchronizer,
                     Strategy, StrategyError)

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
    (lossy ones not on sparse gradients; PowerSGD on matrices with a rank that fits).
    """
    if check_refs:
        _check_refs(strategy, model, cluster)
    seen = _check_replicas(strategy, cluster)
    uneven_nodes = _uneven_nodes(strategy, cluster)
    planned: set[str] = set()
    groups: dict[int, tuple[str, str, str]] = {}
    units: dict[int, tuple[tuple, str]] = {}
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
            _check_shard(f"{where}: shards[{j}]", shard, var, len(plan.shards), shapes[j], model, cluster, seen,
                         uneven_nodes, groups, plan.variable)
            if isinstance(shard.synchronizer, ShardSynchronizer):
                _check_sharded(f"{where}: shards[{j}]", shard.synchronizer, var, len(plan.shards), strategy, cluster,
                               units, plan.variable)
    missing = [v.name for v in model.variables if v.name not in planned]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise StrategyError(
            f"strategy: plans: no plan for variable(s) {', '.join(repr(m) for m in missing[:3])}{more} "
            f"of model {model.name!r}"
        )


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


def _check_shard(swhere: str, shard, var, num_shards: int, shape, model: ModelSpec, cluster: ClusterSpec,
                 seen: set[str], uneven_nodes: str, groups: dict, variable: str) -> None:
    """One shard's synchronizer and compressor against its variable, the cluster and the merge groups so far."""
    sync = shard.synchronizer
    comp = shard.compressor
    if isinstance(sync, PSSynchronizer):
        if sync.local_aggregation and var.sparse:
            raise StrategyError(
                f"{swhere}.synchronizer.local_aggregation: not executed for a sparse gradient (its rows go "
                f"to the server directly); set it to false"
            )
        if not cluster.has_device(sync.placement):
            raise StrategyError(
                f"{swhere}.synchronizer.placement: device {shown(sync.placement)} does not exist in cluster "
                f"{cluster.name!r}"
            )
        if sync.placement not in seen:
            raise StrategyError(
                f"{swhere}.synchronizer.placement: device {shown(sync.placement)} holds no replica; "
                f"a PS placement must be one of the replicas"
            )
    elif isinstance(sync, SFBSynchronizer):
        if model.factor_rows is None or model.factor_rows[model.position(var.name)] is None:
            raise StrategyError(
                f"{swhere}.synchronizer: sfb rebuilds the gradient of a linear layer's weight from its "
                f"inputs and output gradients, and model {model.name!r} does not mark this variable as one "
                f"(its factor_rows entry is empty: not an nn.Linear weight, tied to another module, or a "
                f"spec written without factor_rows); use allreduce or ps"
            )
        if num_shards > 1:
            raise StrategyError(
                f"{swhere}.synchronizer: sfb sends the factors of the whole layer, and this plan cuts the "
                f"variable into {num_shards} shards; use partition {[1] * len(var.shape)} with sfb"
            )
    elif isinstance(sync, AllGatherSynchronizer) and not var.sparse:
        raise StrategyError(
            f"{swhere}.synchronizer: allgather is for sparse gradients, and this variable's gradient is dense "
            f"(use allreduce or ps)"
        )
    if isinstance(sync, ShardSynchronizer) and comp.kind != "none":
        raise StrategyError(
            f"{swhere}.compressor: {comp.label} is not executed with shard (its reduce-scatter sums in the "
            f"unit's reduce_dtype); use compressor none, and reduce_dtype bf16 for half the bytes"
        )
    if not comp.lossless and var.sparse:
        raise StrategyError(
            f"{swhere}.compressor: lossy compressor {comp.label!r} on a sparse gradient; "
            f"sparse variables take 'none'"
        )
    info = comp.info
    problem = info.problem(shape, comp.rank)
    if problem:
        raise StrategyError(f"{swhere}.compressor: {problem}")
    if sync.kind not in info.synchronizers:
        raise StrategyError(
            f"{swhere}.compressor: {comp.label} wraps {' or '.join(info.synchronizers)} only, not {sync.kind}"
        )
    if isinstance(sync, AllReduceSynchronizer) and sync.algorithm == "hierarchical":
        if comp.kind != "none":
            raise StrategyError(
                f"{swhere}.compressor: {comp.label} with a hierarchical all-reduce is not executed; use "
                f"compressor none, or algorithm flat"
            )
        if uneven_nodes:
            raise StrategyError(
                f"{swhere}.synchronizer.algorithm: hierarchical needs the same number of replicas on every "
                f"node, and the replicas are {uneven_nodes}; use algorithm flat"
            )
    if isinstance(sync, AllReduceSynchronizer):
        key = (sync.algorithm, comp.label, "sparse" if var.sparse else "dense")
        first = groups.setdefault(sync.group, key + (variable,))
        if first[:3] != key:
            raise StrategyError(
                f"{swhere}.synchronizer.group: group {sync.group} mixes "
                f"(algorithm {key[0]}, compressor {key[1]}, {key[2]}) with "
                f"(algorithm {first[0]}, compressor {first[1]}, {first[2]}) of variable {first[3]!r}; "
                f"a merge group is one collective"
            )


def _check_sharded(swhere: str, sync: ShardSynchronizer, var: VariableSpec, num_shards: int, strategy: Strategy,
                   cluster: ClusterSpec, units: dict, variable: str) -> None:
    """A ``shard`` synchronizer: a dense, unpartitioned float32 variable with rows to slice; a
    shard group that divides the replicas and lies inside one node or spans whole nodes (an HSDP
    mesh that matches the nodes); one unit's variables agreeing on everything but their rows."""
    if var.sparse:
        raise StrategyError(f"{swhere}.synchronizer: shard reduce-scatters a dense gradient, and this variable's "
                            f"gradient is sparse; use allgather or ps")
    if num_shards > 1:
        raise StrategyError(f"{swhere}.synchronizer: shard slices the whole variable by rows itself, and this plan "
                            f"partitions it into {num_shards} shards; use partition {[1] * len(var.shape)} with shard")
    if not var.shape:
        raise StrategyError(f"{swhere}.synchronizer: shard slices a variable by rows, and this one is a scalar "
                            f"(shape []); use allreduce")
    if var.dtype != "float32":
        raise StrategyError(f"{swhere}.synchronizer: shard runs float32 variables (reduce_dtype fp32 or bf16), and "
                            f"this one is {var.dtype}; use allreduce")
    replicas = len(strategy.replicas)
    size = sync.group or replicas
    if replicas % size:
        raise StrategyError(f"{swhere}.synchronizer.group: a shard group of {size} does not divide the {replicas} "
                            f"replicas; use a divisor of {replicas} (0 for every replica)")
    nodes = [cluster.node_of(dev).name for dev in strategy.replicas]
    count = {n: nodes.count(n) for n in nodes}
    for start in range(0, replicas, size):
        members = nodes[start:start + size]
        if len(set(members)) > 1 and any(members.count(n) != count[n] for n in set(members)):
            raise StrategyError(
                f"{swhere}.synchronizer.group: shard group {start // size} (replicas {start}..{start + size - 1}) "
                f"takes part of node {next(n for n in members if members.count(n) != count[n])!r}'s replicas "
                f"together with another node's; a shard group lies inside one node or spans whole nodes (an HSDP "
                f"mesh that matches the nodes)")
    first = units.setdefault(sync.unit, (sync.unit_key, variable))
    if first[0] != sync.unit_key:
        names = ("group", "reshard", "prefetch", "reduce_dtype")
        field = next(n for n, a, b in zip(names, sync.unit_key, first[0]) if a != b)
        raise StrategyError(
            f"{swhere}.synchronizer.{field}: unit {sync.unit} has {field} {dict(zip(names, first[0]))[field]!r} "
            f"on variable {first[1]!r} and {getattr(sync, field)!r} here; a unit is one reduce-scatter and one "
            f"all-gather, so its variables agree on group, reshard, prefetch and reduce_dtype")
