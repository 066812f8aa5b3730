"""Builders: every builder's output validates for every zoo model on every preset, and each
reproduces the system it is named after."""

from __future__ import annotations

from collections import Counter

import pytest

from synctune.spec import CLUSTER_PRESETS, SpecError, cluster_preset
from synctune.strategy import BUILDERS, StrategyError, build_strategy, parse_builder_options, validate


#: Builders that apply to some domains only: the others are refused naming the builder's option.
PARTIAL = {"megatron"}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_every_builder_validates_on_every_model_and_preset(builder, zoo_specs):
    built = 0
    for model in zoo_specs.values():
        for preset in CLUSTER_PRESETS:
            cluster = cluster_preset(preset)
            try:
                strategy = build_strategy(builder, model, cluster)
            except StrategyError as exc:
                assert builder in PARTIAL and str(exc).startswith(f"builder {builder}: "), exc
                continue
            validate(strategy, model, cluster)
            built += 1
            assert len(strategy.replicas) == cluster.num_devices
            # a TP group's ranks each hold the batch its replicas would train together
            degree = strategy.tensor_parallel.degree if strategy.tensor_parallel is not None else 1
            assert set(strategy.batch_split) == {model.batch_size * degree}
            assert strategy.global_batch_size == model.batch_size * cluster.num_devices
    assert built


def _syncs(strategy):
    return [(plan.variable, i, shard.synchronizer) for plan, i, shard in strategy.iter_shards()]


def test_parallax_sends_sparse_to_ps_and_dense_to_allreduce(zoo_specs):
    model, cluster = zoo_specs["lm1b"], cluster_preset("B7")
    strategy = build_strategy("parallax", model, cluster)
    for var, _i, sync in _syncs(strategy):
        assert sync.kind == ("ps" if model[var].sparse else "allreduce"), var
    # Three sparse variables of similar size spread over three different servers (load balancing).
    assert len({s.placement for _v, _i, s in _syncs(strategy) if s.kind == "ps"}) == 3


def test_allreduce_chunks_adjacent_variables(zoo_specs):
    model = zoo_specs["bert-base"]
    strategy = build_strategy("allreduce", model, cluster_preset("B5"), chunk=64)
    groups = [s.group for _v, _i, s in _syncs(strategy)]
    assert groups == [i // 64 for i in range(len(model.variables))]


def test_allreduce_uses_allgather_for_sparse(zoo_specs):
    strategy = build_strategy("allreduce", zoo_specs["ncf-small"], cluster_preset("local-2x2"))
    kinds = {v: s.kind for v, _i, s in _syncs(strategy)}
    assert kinds["user_embedding.weight"] == "allgather" and kinds["output.weight"] == "allreduce"


def test_horovod_fusion_respects_threshold(zoo_specs):
    model = zoo_specs["vgg16"]
    threshold = 64 * 2**20
    strategy = build_strategy("horovod", model, cluster_preset("B7"))
    sizes = Counter()
    for var, _i, sync in _syncs(strategy):
        sizes[sync.group] += model[var].num_bytes
    # A group only exceeds the threshold when one variable alone does (VGG16's 392 MiB fc6).
    for group, size in sizes.items():
        members = [v for v, _i, s in _syncs(strategy) if s.group == group]
        assert size <= threshold or len(members) == 1
    groups = [s.group for _v, _i, s in _syncs(strategy)]
    assert groups == sorted(groups)  # adjacent in backward order
    # And it fuses: Horovod's greedy rule (a buffer takes the next tensor unless that would pass the
    # threshold), computed here from the sizes alone. A builder that never fuses fails this.
    expected, filled = [], 0
    for var, _i, _s in _syncs(strategy):
        if filled and filled + model[var].num_bytes > threshold:
            expected.append([])
            filled = 0
        if not expected:
            expected.append([])
        expected[-1].append(var)
        filled += model[var].num_bytes
    actual = [[v for v, _i, s in _syncs(strategy) if s.group == g] for g in dict.fromkeys(groups)]
    assert actual == expected
    assert len(actual) < len(groups) / 2  # VGG16's small conv tensors share buffers


def test_ps_puts_everything_on_one_server(zoo_specs):
    strategy = build_strategy("ps", zoo_specs["resnet50"], cluster_preset("B7"))
    assert {s.placement for _v, _i, s in _syncs(strategy)} == {"node0:0"}


def test_ps_lb_balances_bytes(zoo_specs):
    model = zoo_specs["bert-large"]
    strategy = build_strategy("ps-lb", model, cluster_preset("B7"))
    loads = Counter()
    for var, _i, sync in _syncs(strategy):
        loads[sync.placement] += model[var].num_bytes
    assert len(loads) == 4
    largest = max(v.num_bytes for v in model.variables)
    assert max(loads.values()) - min(loads.values()) <= largest  # greedy bound


def test_partitioned_ps_uses_smallest_divisor_on_axis_0(zoo_specs):
    model = zoo_specs["bert-base"]
    strategy = build_strategy("partitioned-ps", model, cluster_preset("B5"))
    plan = strategy.plan_for("word_embeddings.weight")  # 30522 = 2 x 15261
    assert plan.partition == (2, 1)
    assert [s.synchronizer.placement for s in plan.shards] == sorted({s.synchronizer.placement for s in plan.shards})
    assert strategy.plan_for("embedding_norm.weight").partition == (1,)  # norms stay whole


def test_uneven_partitioned_ps_makes_uneven_shards(zoo_specs):
    model = zoo_specs["bert-base"]
    strategy = build_strategy("uneven-partitioned-ps", model, cluster_preset("B5"))
    plan = strategy.plan_for("word_embeddings.weight")
    assert plan.partition[0] == 4 and 30522 % 4  # smallest non-divisor of 30522
    single_node = build_strategy("uneven-partitioned-ps", model, cluster_preset("B4"))
    assert all(not p.is_partitioned for p in single_node.plans)


def test_random_axis_is_reproducible_and_random(zoo_specs):
    model, cluster = zoo_specs["bert-base"], cluster_preset("B7")
    a = build_strategy("random-axis-allreduce", model, cluster, seed=1)
    b = build_strategy("random-axis-allreduce", model, cluster, seed=1)
    c = build_strategy("random-axis-allreduce", model, cluster, seed=2)
    assert a.hash == b.hash != c.hash
    axes = {tuple(p.partition).index(max(p.partition)) for p in a.plans if p.is_partitioned and len(p.partition) == 2}
    assert axes == {0, 1}


def test_partitioned_allreduce_counts_shards_into_groups(zoo_specs):
    model = zoo_specs["bert-tiny"]
    strategy = build_strategy("partitioned-allreduce", model, cluster_preset("local-2x2"), chunk=4)
    groups = [s.synchronizer.group for _p, _i, s in strategy.iter_shards() if s.synchronizer.kind == "allreduce"]
    assert groups == [i // 4 for i in range(len(groups))]


def test_allreduce_with_powersgd_keeps_groups_uniform(zoo_specs):
    model, cluster = zoo_specs["bert-tiny"], cluster_preset("local-2x2")
    strategy = build_strategy("allreduce", model, cluster, compressor="powersgd", powersgd_rank=2)
    validate(strategy, model, cluster)
    assert "powersgd(2)" in strategy.stats()["compressors"]


def test_builder_options_are_typed_and_checked():
    assert parse_builder_options("allreduce", {"chunk": "64"}).chunk == 64
    assert parse_builder_options("ps-lb", {"local_aggregation": "true"}).local_aggregation is True
    with pytest.raises(StrategyError, match="unknown option 'chunks'; valid: chunk"):
        parse_builder_options("allreduce", {"chunks": "2"})
    with pytest.raises(StrategyError, match="option chunk: expected a positive integer, got 0"):
        parse_builder_options("allreduce", {"chunk": "0"})
    with pytest.raises(SpecError, match="unknown builder 'horovd'; valid: allreduce, horovod"):
        build_strategy("horovd", None, None)


def test_hierarchical_ps_cuts_large_variables_into_one_shard_per_node(zoo_specs):
    # AutoDist §3.1 builder (5): over the threshold, #nodes shards, shard i served by node i;
    # dense gradients reduced within each node first, sparse rows sent as they are.
    model, cluster = zoo_specs["lm1b"], cluster_preset("B7")
    threshold = 4 * 2**20
    strategy = build_strategy("ps-hierarchical", model, cluster, threshold_bytes=threshold)
    validate(strategy, model, cluster)
    servers = [node.devices[0] for node in cluster.nodes]
    big = [p for p in strategy.plans if model[p.variable].num_bytes >= threshold and len(model[p.variable].shape) > 1]
    assert big, "lm1b has variables over 4 MiB"
    for plan in big:
        assert plan.num_shards == min(len(servers), model[plan.variable].shape[0])
        assert [s.synchronizer.placement for s in plan.shards] == servers[:plan.num_shards]
    for plan in strategy.plans:
        if model[plan.variable].num_bytes < threshold:
            assert plan.num_shards == 1, plan.variable
        for shard in plan.shards:
            assert shard.synchronizer.kind == "ps"
            assert shard.synchronizer.local_aggregation == (not model[plan.variable].sparse)
    # A threshold above every variable cuts nothing.
    whole = build_strategy("ps-hierarchical", model, cluster, threshold_bytes=2**40)
    assert all(p.num_shards == 1 for p in whole.plans)


def test_tuned_baselines_parse_and_expand():
    from synctune.search import Experiment
    from synctune.strategy.builders import TUNED_BASELINES, parse_baseline

    assert parse_baseline("allreduce:chunk=8")[1].chunk == 8
    assert parse_baseline("ps-hierarchical:threshold_bytes=1024,local_aggregation=false")[1].local_aggregation is False
    with pytest.raises(StrategyError, match="unknown option"):
        parse_baseline("allreduce:fusion=3")
    with pytest.raises(StrategyError, match="option=value"):
        parse_baseline("allreduce:chunk")
    exp = Experiment.from_keys(name="t", model="cnn-small", cluster="local-1x2", budget=30, baselines=("tuned", "ps"))
    assert exp.baselines.expanded_builders == (*TUNED_BASELINES, "ps")
    with pytest.raises(SpecError, match="baselines: builder allreduce: option chunk"):
        Experiment.from_keys(name="t", model="cnn-small", cluster="local-1x2", budget=30,
                             baselines=("allreduce:chunk=x",))


def test_sharded_variants_of_a_collection_are_distinct_runnable_settings():
    """The --sharded stream of a lab collection: distinct strategies, none the shard builder's
    default (trialled already as a builder), none resharded (the engine refuses it), and on a
    cluster of multi-device nodes HSDP groups of one node's devices among them."""
    from synctune.models import model_spec
    from synctune.run.collect import collection_plan, sharded_variants
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy, validate

    spec, cluster = model_spec("transformer-small"), cluster_preset("local-2x2")
    variants = sharded_variants(spec, cluster)
    hashes = [s.hash for _label, s in variants]
    assert len(set(hashes)) == len(hashes) >= 6
    assert build_strategy("shard", spec, cluster).hash not in hashes
    groups = set()
    for _label, s in variants:
        validate(s, spec, cluster)
        syncs = [sh.synchronizer for _p, _i, sh in s.iter_shards() if sh.synchronizer.kind == "shard"]
        assert syncs and not any(x.reshard for x in syncs)
        groups |= {x.group for x in syncs}
    assert groups == {0, 2}
    plan = collection_plan(spec, cluster, num_random=0, num_sharded=3)
    assert [t for t, _o, _s in plan[-3:]] == ["shard-0000", "shard-0001", "shard-0002"]
