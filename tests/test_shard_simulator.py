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


# --------------------------------------------------------------------------- pricing

ALPHA_S = 2e-4  # the links' calibrated latency below: the replay's alpha
GBIT = 1e9 / 8


def _b7():
    """B7 (4 nodes x 4 devices; NIC 50, flow 10, intra-node 80 Gbit/s) with a 0.2 ms link latency."""
    cluster = cluster_preset("B7")
    nodes = tuple(dataclasses.replace(n, latency_ms=ALPHA_S * 1e3) for n in cluster.nodes)
    return dataclasses.replace(cluster, nodes=nodes)


def _sharded(spec, cluster, units: int = 1, **opts) -> Strategy:
    """bert-tiny with every variable sharded, cut into ``units`` units of consecutive variables."""
    per = -(-len(spec.variables) // units)
    return Strategy.over(spec, cluster, [_plan(v, ShardSynchronizer(unit=i // per, **opts))
                                         for i, v in enumerate(spec.variables)])


def _replay(strategies, spec, cluster):
    from synctune.simulator import DomainContext, ReplaySimulator, encode

    ctx = DomainContext(spec, cluster)
    return ReplaySimulator().timeline(encode(strategies, ctx), ctx)


def _shard_unit_s(ev, sid: int = 0) -> float:
    mine = (ev["unit_sid"] == sid) & (ev["unit_kind"] == KIND_CODES["shard"])
    assert mine.sum() == 1
    return float(ev["unit_s"][mine][0])


def test_replay_prices_a_shard_unit_as_alpha_beta_by_hand():
    from synctune.simulator import ReplayConstants

    spec, cluster = model_spec("bert-tiny"), _b7()
    total = float(sum(v.num_bytes for v in spec.variables))
    unit_s = ReplayConstants().unit_s
    flat, hsdp = _sharded(spec, cluster), _sharded(spec, cluster, group=4)
    for s in (flat, hsdp):
        validate(s, spec, cluster)
    ev = _replay([flat, hsdp], spec, cluster)
    # Flat: one reduce-scatter over the 16 replicas across nodes, at the 10 Gbit/s flow.
    k, flow, intra, nic = 16, 10 * GBIT, 80 * GBIT, 50 * GBIT
    want = (k - 1) * (ALPHA_S + total / (k * flow)) + unit_s
    assert _shard_unit_s(ev, 0) == pytest.approx(want, rel=1e-9)
    # Reduce-scatter and all-gather are each half a ring all-reduce: at least (k-1)/k * bytes / bw.
    assert _shard_unit_s(ev, 0) >= (k - 1) / k * total / flow
    # HSDP: a reduce-scatter inside each node (4 devices, intra-node link), then the 4 nodes'
    # slices (bytes / 4) all-reduced in 4 rings that share each node's NIC (50 / 4 > 10 Gbit/s).
    k, g = 4, 4
    cross_bw = min(flow, nic / 4)
    want = (k - 1) * (ALPHA_S + total / (k * intra)) + 2 * (g - 1) * (ALPHA_S + total / k / (g * cross_bw)) + unit_s
    assert _shard_unit_s(ev, 1) == pytest.approx(want, rel=1e-9)
    # ZeRO-2: the updated slices are all-gathered once, after the step.
    gather_flat = (16 - 1) * (ALPHA_S + total / (16 * flow)) + unit_s
    assert ev["broadcast_s"][0] == pytest.approx(gather_flat, rel=1e-9)


def test_reshard_costs_one_more_all_gather_and_prefetch_hides_gathers():
    from synctune.simulator import ReplayConstants

    spec, cluster = model_spec("bert-tiny"), _b7()
    total = float(sum(v.num_bytes for v in spec.variables))
    gather = (16 - 1) * (ALPHA_S + total / (16 * 10 * GBIT)) + ReplayConstants().unit_s
    zero2, zero3 = _sharded(spec, cluster), _sharded(spec, cluster, reshard=True)
    ev = _replay([zero2, zero3], spec, cluster)
    # One unit: ZeRO-3 gathers it before forward and again before backward, ZeRO-2 once after the step.
    assert ev["iteration_s"][1] - ev["iteration_s"][0] == pytest.approx(gather, rel=1e-6)
    # Four units: without prefetch every gather is serialized with compute (2 per unit); with
    # prefetch the next unit's gather overlaps the current unit's compute.
    serial, ahead, deep = (_sharded(spec, cluster, units=4, reshard=True, prefetch=p) for p in (0, 1, 2))
    plain = _sharded(spec, cluster, units=4)
    ev = _replay([plain, serial, ahead, deep], spec, cluster)
    gathers = ev["broadcast_s"][0]  # ZeRO-2's four gathers after the step, one after the other
    assert ev["backward_end"][1] - ev["backward_end"][0] == pytest.approx(2 * gathers, rel=1e-6)
    assert ev["backward_end"][2] < ev["backward_end"][1]
    assert ev["backward_end"][3] <= ev["backward_end"][2] + 1e-12  # a deeper prefetch is never slower
    # Nothing hides a pass's first gather: the physical floor of prefetching.
    assert ev["backward_end"][2] >= ev["backward_end"][0] + 2 * (gathers / 4) * 0.999


def test_bf16_reduce_halves_the_transfer_and_hsdp_sends_a_kth_across_nodes():
    from synctune.simulator import DomainContext, encode
    from synctune.simulator.features import analytic_parts, shard_unit_seconds, shard_units

    spec, cluster = model_spec("bert-tiny"), _b7()
    total = float(sum(v.num_bytes for v in spec.variables))
    s32, s16 = _sharded(spec, cluster, group=4), _sharded(spec, cluster, group=4, reduce_dtype="bf16")
    ev = _replay([s32, s16], spec, cluster)
    latency = 3 * ALPHA_S + 2 * 3 * ALPHA_S + 5e-5  # the messages of both stages, and the unit's launch
    assert _shard_unit_s(ev, 1) - latency == pytest.approx(0.5 * (_shard_unit_s(ev, 0) - latency), rel=1e-9)
    # The all-gather of parameters stays float32.
    assert ev["broadcast_s"][1] == pytest.approx(ev["broadcast_s"][0], rel=1e-12)
    ctx = DomainContext(spec, cluster)
    b = encode([s32, s16], ctx)
    sec = shard_unit_seconds(shard_units(b, ctx), 0.0)
    assert sec["reduce_scatter"][1] == pytest.approx(0.5 * sec["reduce_scatter"][0], rel=1e-12)
    # HSDP's all-reduce across the 4 groups carries each slice, bytes / k: a flat ring all-reduce
    # of the whole model over the same 4-member ring (2(G-1)/G * bytes / bw) divided by k = 4.
    flat_ring = 2 * (4 - 1) / 4 * total / (10 * GBIT)
    assert sec["cross"][0] == pytest.approx(flat_ring / 4, rel=1e-12)
    # The analytic model prices the same terms (phi per message) and bf16 costs it less.
    parts = analytic_parts(b, ctx)
    assert parts["t_shard"][1] < parts["t_shard"][0]
    assert parts["t_gather_exposed"][0] == pytest.approx(parts["t_gather_exposed"][1], rel=1e-12)


def test_analytic_model_reshard_and_prefetch():
    from synctune.simulator import DomainContext, analytic_time, encode
    from synctune.simulator.features import analytic_parts, shard_unit_seconds, shard_units

    spec, cluster = model_spec("bert-tiny"), _b7()
    ctx = DomainContext(spec, cluster)
    strategies = [_sharded(spec, cluster), _sharded(spec, cluster, reshard=True),
                  _sharded(spec, cluster, reshard=True, prefetch=1)]
    b = encode(strategies, ctx)
    gather = float(shard_unit_seconds(shard_units(b, ctx), ctx.constants.phi)["gather"][0])
    parts = analytic_parts(b, ctx)
    assert parts["t_gather_exposed"].tolist() == pytest.approx([gather, 2 * gather, 0.0], rel=1e-12)
    assert parts["t_gather_hidden"].tolist() == pytest.approx([0.0, 0.0, 2 * gather], rel=1e-12)
    t = analytic_time(b, ctx)
    assert t[1] - t[0] == pytest.approx(gather, rel=1e-9)
    assert t[2] <= t[1]
