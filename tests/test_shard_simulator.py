"""The ``shard`` synchronizer in strategy columns and in the simulator (issue 33 item 5): shard
plans as columns and back, the analytic model's and the replay's prices of reduce-scatter, HSDP's
cross-group all-reduce, all-gathers (after the step, or in forward and backward when resharded),
prefetch and the reduce dtype, checked against alpha-beta figures worked out by hand from the
cluster spec (DESIGN.md "Measurement conventions": ring all-reduce >= 2(N-1)/N * bytes / bw,
reduce-scatter and all-gather each half of it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.spec import cluster_preset
from synctune.strategy import KIND_CODES, StrategyColumns, validate
from synctune.strategy.schema import (AllGatherSynchronizer, AllReduceSynchronizer, ShardPlan, ShardSynchronizer,
                                      Strategy, VariablePlan)


def _plan(var, sync) -> VariablePlan:
    return VariablePlan(variable=var.name, partition=tuple(1 for _ in var.shape), shards=(ShardPlan(synchronizer=sync),))


def _mixed(spec, cluster, **unit0) -> Strategy:
    """ncf-small's MLP sharded in two units (unit 0 HSDP over each node's 2 devices), its output
    layer all-reduced, its sparse embeddings all-gathered: the language composing kinds."""
    opts = {"group": 2, "reshard": True, "prefetch": 1, "reduce_dtype": "bf16", **unit0}
    plans = []
    for v in spec.variables:
        if v.sparse:
            sync = AllGatherSynchronizer()
        elif v.name.startswith("mlp.0"):
            sync = ShardSynchronizer(unit=7, **opts)
        elif v.name.startswith("mlp.1"):
            sync = ShardSynchronizer(unit=3)
        else:
            sync = AllReduceSynchronizer(group=1)
        plans.append(_plan(v, sync))
    return Strategy.over(spec, cluster, plans)


def test_shard_plans_become_columns_and_come_back():
    spec, cluster = model_spec("ncf-small"), cluster_preset("local-2x2")
    strategies = [_mixed(spec, cluster), _mixed(spec, cluster, reshard=False, prefetch=0),
                  _mixed(spec, cluster, group=0, reduce_dtype="fp32"), _mixed(spec, cluster, prefetch=3)]
    for s in strategies:
        validate(s, spec, cluster)
    cols = StrategyColumns.from_strategies(spec, cluster, strategies)
    assert [cols.strategy(i).hash for i in range(cols.size)] == [s.hash for s in strategies]
    assert [cols.strategy(i).to_json() for i in range(cols.size)] == [s.to_json() for s in strategies]
    names = [v.name for v in spec.variables]
    row = {(int(cols.sid[r]), names[int(cols.var[r])]): r for r in range(len(cols.sid))}
    first = row[(0, "mlp.0.weight")]
    assert cols.kind[first] == KIND_CODES["shard"] and cols.group[first] == 7 and cols.shard_group[first] == 2
    assert cols.reshard[first] and cols.prefetch[first] == 1 and cols.reduce_dtype[first] == 1
    other = row[(0, "mlp.1.weight")]
    assert (cols.group[other], cols.shard_group[other], cols.reshard[other], cols.prefetch[other],
            cols.reduce_dtype[other]) == (3, 0, False, 0, 0)
    emb, out = row[(0, "item_embedding.weight")], row[(0, "output.weight")]
    assert cols.kind[emb] == KIND_CODES["allgather"] and cols.shard_group[emb] == -1 and cols.group[emb] == -1
    assert cols.kind[out] == KIND_CODES["allreduce"] and cols.group[out] == 1 and cols.group_order[out] == 0
    # Units are not merge groups: the one all-reduce group is the strategy's only group.
    assert cols.ngroups.tolist() == [1.0] * 4 and (cols.group_order[cols.kind == KIND_CODES["shard"]] == -1).all()
    # Strategies differing only in a shard option differ in digest and in the variable's signature.
    digests = cols.digests()
    assert len(set(digests.tolist())) == 4
    sig = cols.signatures()
    v0 = names.index("mlp.0.weight")
    assert len(set(sig[:, v0].tolist())) == 4 and len(set(sig[:, names.index("output.weight")].tolist())) == 1
