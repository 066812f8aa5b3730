"""Strategy representation: JSON round trip, canonical hash, and validation errors."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from synctune.spec import ClusterSpec, ModelSpec, VariableSpec, cluster_preset
from synctune.strategy import (
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    ShardPlan,
    Strategy,
    StrategyError,
    VariablePlan,
    build_strategy,
    load_strategy,
    shard_shapes,
    validate,
)

MODEL = ModelSpec(
    name="toy",
    batch_size=4,
    variables=(
        VariableSpec(name="head.weight", shape=(10, 6)),
        VariableSpec(name="head.bias", shape=(10,)),
        VariableSpec(name="emb.weight", shape=(7, 6), sparse=True),
    ),
)
CLUSTER = cluster_preset("local-2x2")


def _composed() -> Strategy:
    """A mixed strategy: a partitioned matrix (shard 0 PS, shard 1 all-reduce), PS with local
    aggregation, an all-gather'ed sparse embedding, uneven batch split."""
    return Strategy(
        model={"name": MODEL.name, "hash": MODEL.hash},
        cluster={"name": CLUSTER.name, "hash": CLUSTER.hash},
        replicas=CLUSTER.devices,
        batch_split=(3, 4, 4, 5),
        plans=(
            VariablePlan(variable="head.weight", partition=(2, 1), shards=(
                ShardPlan(synchronizer=PSSynchronizer(placement="node1:0")),
                ShardPlan(synchronizer=AllReduceSynchronizer(group=0), compressor=Compressor(kind="powersgd", rank=2)),
            )),
            VariablePlan(variable="head.bias", partition=(1,), shards=(
                ShardPlan(synchronizer=PSSynchronizer(placement="node0:0", local_aggregation=True)),)),
            VariablePlan(variable="emb.weight", partition=(1, 1), shards=(
                ShardPlan(synchronizer=AllGatherSynchronizer()),)),
        ),
    )


def test_composed_strategy_validates_and_round_trips(tmp_path):
    s = _composed()
    validate(s, MODEL, CLUSTER)
    path = tmp_path / "s.json"
    path.write_text(s.to_json())
    back = load_strategy(path)
    assert back == s and back.hash == s.hash
    assert Strategy.from_json(s.to_json(indent=None)) == s


def test_hash_is_of_the_canonical_form():
    s = _composed()
    data = s.to_dict()
    shuffled = json.dumps(dict(reversed(list(data.items()))), indent=4)  # other key order, other spacing
    assert Strategy.from_json(shuffled).hash == s.hash
    other = copy.deepcopy(data)
    other["plans"][0]["shards"][0]["synchronizer"]["placement"] = "node1:1"
    assert Strategy.from_dict(other).hash != s.hash


def test_hash_is_stable_across_releases():
    """The canonical form is a storage format: a change here breaks every dataset row's hash."""
    cluster = ClusterSpec.from_dict({"name": "c", "nodes": [{"instance_type": "local-cpu", "num_devices": 2}]})
    model = ModelSpec(name="m", variables=(VariableSpec(name="w", shape=(2, 2)),), batch_size=2)
    s = build_strategy("allreduce", model, cluster)
    assert s.to_json(indent=None) == (
        '{"batch_split":[2,2],"cluster":{"hash":"%s","name":"c"},"model":{"hash":"%s","name":"m"},'
        '"plans":[{"partition":[1,1],"shards":[{"compressor":{"kind":"none"},"synchronizer":'
        '{"algorithm":"flat","group":0,"kind":"allreduce"}}],"variable":"w"}],"replicas":["node0:0","node0:1"],'
        '"schema":2}' % (cluster.hash, model.hash)
    )
    assert s.hash == hashlib.sha256(s.to_json(indent=None).encode()).hexdigest()


def test_schema_1_strategies_still_load_migrated():
    """Schema 1 named all-reduce algorithms (auto, ring, tree) that never executed: every group ran
    as one flat collective. Old files (and dataset rows) load, as what really ran."""
    s = _composed()
    old = s.to_dict()
    old["schema"] = 1
    for plan, algorithm in zip(old["plans"], ("tree", "auto", "ring")):
        for shard in plan["shards"]:
            if shard["synchronizer"]["kind"] == "allreduce":
                shard["synchronizer"]["algorithm"] = algorithm
    back = Strategy.from_dict(old)
    assert back.schema == 2 and back == s
    assert {sh.synchronizer.algorithm for _p, _i, sh in back.iter_shards() if sh.synchronizer.kind == "allreduce"} == {
        "flat"}
    old["schema"] = 6
    with pytest.raises(StrategyError, match="schema: expected 5"):
        Strategy.from_dict(old)


def test_summary_and_stats():
    s = _composed()
    stats = s.stats()
    assert stats["num_shards"] == 4 and stats["num_partitioned"] == 1
    assert stats["num_ps_shards"] == 2 and stats["num_ps_servers"] == 2 and stats["num_local_aggregation"] == 1
    assert stats["compressors"] == ["none", "powersgd(2)"]
    line = s.summary()
    assert "\n" not in line and "4 replicas" in line and "batch 16 uneven" in line


def test_shard_shapes_follow_tensor_split():
    assert shard_shapes((7, 6), (3, 2)) == [(3, 3), (3, 3), (2, 3), (2, 3), (2, 3), (2, 3)]


def _broken(mutate) -> dict:
    data = _composed().to_dict()
    mutate(data)
    return data


BROKEN = [
    (lambda d: d["plans"][0].update(variable="head.wieght"), "variable 'head.wieght' is not a variable of model"),
    (lambda d: d["plans"].pop(1), "no plan for variable\\(s\\) 'head.bias'"),
    (lambda d: d["plans"].append(copy.deepcopy(d["plans"][1])), "variable 'head.bias' has more than one plan"),
    (lambda d: d["plans"][0].update(partition=[11, 1], shards=[d["plans"][0]["shards"][0]] * 11),
     "variable 'head.weight': partition: axis 0 has length 10, cannot cut it into 11 shards"),
    (lambda d: d["plans"][0].update(partition=[2]), "variable 'head.weight': partition: expected 2 entries"),
    (lambda d: d["plans"][2].update(partition=[1, 2], shards=d["plans"][2]["shards"] * 2),
     "sparse variable can be partitioned on axis 0"),
    (lambda d: d["plans"][1]["shards"][0]["synchronizer"].update(placement="node7:0"),
     "variable 'head.bias': shards\\[0\\].synchronizer.placement: device 'node7:0' does not exist"),
    (lambda d: d["plans"][1]["shards"][0].update(compressor={"kind": "zip"}), "unknown compressor 'zip'"),
    (lambda d: d["plans"][2]["shards"][0].update(compressor={"kind": "fp16"}),
     "variable 'emb.weight': shards\\[0\\].compressor: lossy compressor 'fp16' on a sparse gradient"),
    (lambda d: d["plans"][1]["shards"][0].update(synchronizer={"kind": "allgather"}),
     "variable 'head.bias': shards\\[0\\].synchronizer: allgather is for sparse gradients"),
    (lambda d: d["plans"][1]["shards"][0].update(
        synchronizer={"kind": "allreduce", "group": 0, "algorithm": "hierarchical"}),
     "group 0 mixes"),
    (lambda d: d["plans"][0]["shards"][1]["compressor"].update(rank=9), "powersgd rank 9 exceeds"),
    (lambda d: d["plans"][1]["shards"][0].update(compressor={"kind": "powersgd", "rank": 1}),
     "powersgd needs a shard of 2 or more dimensions"),
    (lambda d: d.update(replicas=["node0:0", "node0:0", "node1:0", "node1:1"]), "listed twice"),
    (lambda d: d.update(replicas=["node0:0", "node0:1", "node1:0", "node3:0"]),
     "replicas\\[3\\]: device 'node3:0' does not exist"),
    (lambda d: d.update(batch_split=[4, 4, 4]), "batch_split: expected 4 entries"),
    (lambda d: d.update(batch_split=[4, 0, 4, 4]), "batch_split\\[1\\]: expected a positive batch size"),
    (lambda d: d.update(replicas=["node0:0", "node0:1", "node1:1"], batch_split=[1, 1, 1]),
     "device 'node1:0' holds no replica"),
    (lambda d: d["model"].update(hash="0" * 64), "strategy: model: built for 'toy'"),
    (lambda d: d.update(schema=6), "schema: expected 5"),
    (lambda d: d.update(checkpoint={"x": "full"}), "checkpoint: expected a mode|schema: expected 4"),
    (lambda d: d.update(checkpoint={"x": "all"}), "module .x.: expected a mode of full, selective"),
    (lambda d: d["plans"][1]["shards"][0].update(
        synchronizer={"kind": "allreduce", "group": 5, "algorithm": "hierarchical"}, compressor={"kind": "fp16"}),
     "variable 'head.bias': shards\\[0\\].compressor: fp16 with a hierarchical all-reduce is not executed"),
    (lambda d: (d.update(replicas=["node0:0", "node0:1", "node1:0"], batch_split=[1, 1, 1]),
                d["plans"][1]["shards"][0].update(
                    synchronizer={"kind": "allreduce", "group": 5, "algorithm": "hierarchical"})),
     "algorithm: hierarchical needs the same number of replicas on every node, and the replicas are 2 on node0, "
     "1 on node1"),
    (lambda d: d["plans"][2]["shards"][0].update(
        synchronizer={"kind": "ps", "placement": "node0:0", "local_aggregation": True}),
     "variable 'emb.weight': shards\\[0\\].synchronizer.local_aggregation: not executed for a sparse gradient"),
    (lambda d: d["plans"][1]["shards"][0]["synchronizer"].update(staleness=-1), "staleness: expected a non-negative"),
    (lambda d: d["plans"][1]["shards"][0]["synchronizer"].update(kind="gossip"), "kind: expected one of ps"),
    (lambda d: d["plans"][1].update(colour="red"), "unknown key\\(s\\) \\['colour'\\]"),
]


@pytest.mark.parametrize("mutate, fragment", BROKEN)
def test_validation_names_the_variable_and_field(mutate, fragment):
    data = _broken(mutate)
    with pytest.raises(StrategyError, match=fragment):
        validate(Strategy.from_dict(data), MODEL, CLUSTER)


def test_malformed_json_gives_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"schema": 1,\n  "model": }')
    with pytest.raises(StrategyError, match=r"bad.json: malformed JSON at line 2, column 12"):
        load_strategy(path)
    with pytest.raises(StrategyError, match="no such strategy file"):
        load_strategy(tmp_path / "missing.json")


def test_paired_ratio_interval_uses_students_t_quantiles():
    """The 95% interval's factor is Student's t for n - 1 degrees of freedom, from printed
    tables (2.262 at 9, 2.021 at 40: no jump to the normal's 1.960 past 30 rounds)."""
    import math
    import statistics

    from synctune.stats import paired_ratio, t_quantile

    assert t_quantile(0.975, 9) == pytest.approx(2.262, abs=5e-4)
    assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=5e-4)
    assert t_quantile(0.975, 40) == pytest.approx(2.021, abs=5e-4)
    for n, expected in ((10, 2.262), (41, 2.021)):
        base = [1.0 + 0.01 * (i % 4) for i in range(n)]
        cand = [1.0] * n
        got = paired_ratio(base, cand)
        logs = [math.log(b) for b in base]
        factor = math.log(got.high / got.ratio) * math.sqrt(n) / statistics.stdev(logs)
        assert factor == pytest.approx(expected, abs=5e-4)
        assert math.log(got.ratio / got.low) == pytest.approx(math.log(got.high / got.ratio))


def test_differences_from_ddp_name_what_the_strategy_does_that_ddp_does_not():
    """The search summary's one-line "why": each departure from torch DDP (all-reduce of every
    dense gradient, even split, every device) named with the bytes it concerns, checked
    against the model's own variable sizes; a DDP-like strategy is said to be one."""
    import dataclasses

    from synctune.models import model_spec
    from synctune.spec import cluster_preset
    from synctune.strategy.builders import baseline_strategy
    from synctune.strategy.explain import differences_from_ddp

    cluster = cluster_preset("local-2x2")
    ncf = model_spec("ncf-small")
    sparse_bytes = sum(v.num_bytes for v in ncf.variables if v.sparse)
    line = differences_from_ddp(baseline_strategy("allreduce", ncf, cluster), ncf, cluster.num_devices)
    assert line.startswith("all-gathers the rows") and f"{sparse_bytes / 1024:.0f} KiB" in line, line
    assert "item_embedding.weight" in line and "user_embedding.weight" in line
    # The embeddings all-reduced densely in one sparse merge group (what the quickstart's search found).
    from synctune.strategy.schema import SPARSE_GROUP_BASE, AllReduceSynchronizer, ShardPlan

    dense_plans = tuple(dataclasses.replace(p, shards=(ShardPlan(synchronizer=AllReduceSynchronizer(
        group=SPARSE_GROUP_BASE)),)) if p.variable.endswith("embedding.weight") else p
        for p in baseline_strategy("allreduce", ncf, cluster).plans)
    line = differences_from_ddp(dataclasses.replace(baseline_strategy("allreduce", ncf, cluster), plans=dense_plans),
                                ncf, cluster.num_devices)
    assert line.startswith("all-reduces the sparse gradients of item_embedding.weight, user_embedding.weight as "
                           f"dense tensors ({sparse_bytes / 1024:.0f} KiB in 1 fused collective(s))"), line
    ps = differences_from_ddp(baseline_strategy("ps-lb", ncf, cluster), ncf, cluster.num_devices)
    assert "parameter server(s) on node0:0, node1:0" in ps and f"({len(ncf.variables)} variable(s))" in ps, ps
    bert = model_spec("bert-tiny")
    dense = baseline_strategy("allreduce", bert, cluster)
    assert differences_from_ddp(dense, bert, cluster.num_devices).startswith("synchronizes as DDP does")
    uneven = dataclasses.replace(dense, batch_split=(dense.global_batch_size - 3, 1, 1, 1))
    assert "splits the batch unevenly" in differences_from_ddp(uneven, bert, cluster.num_devices)
    fewer = dataclasses.replace(dense, replicas=dense.replicas[:2], batch_split=dense.batch_split[:2])
    assert "trains on 2 of the 4 devices" in differences_from_ddp(fewer, bert, cluster.num_devices)
