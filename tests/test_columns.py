"""Strategies as columns (a search round's proposals): the guided sampler's column draws are
valid strategies, equal to the columns made of those strategies as objects, follow the object
sampler's distribution, and a round drawn as columns proposes what its simulator ranks best."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.search import GuidedSampler
from synctune.simulator import DomainContext, batch_scale, encode, message_sizes
from synctune.spec import cluster_preset
from synctune.strategy import KIND_CODES, validate

DOMAINS = [("cnn-small", "local-2x2"), ("ncf-small", "local-2x2"), ("bert-tiny", "B7"),
           ("transformer-small", "lab-b10c")]


def _heterogeneous(name: str):
    """lab-b10c with measured speeds, as calibration writes them: the sampler then splits batches."""
    cluster = cluster_preset(name)
    nodes = tuple(dataclasses.replace(n, compute_gflops=10.0 if i == 0 else 20.0) for i, n in enumerate(cluster.nodes))
    return dataclasses.replace(cluster, nodes=nodes)


@pytest.mark.parametrize("model,cluster", DOMAINS)
def test_columns_are_valid_strategies_encoded_as_the_encoder_encodes_them(model, cluster):
    spec = model_spec(model)
    cl = _heterogeneous(cluster) if cluster.startswith("lab-") else cluster_preset(cluster)
    cols = GuidedSampler(spec, cl, seed=3).sample_columns(200, chunk=64)  # several chunks
    strategies = [cols.strategy(i) for i in range(cols.size)]
    for s in strategies:
        validate(s, spec, cl)
    ctx = DomainContext(spec, cl)
    ref = encode(strategies, ctx)
    # The sampler numbers merge groups as the columns do; without its numbering, the columns' own.
    for got in (cols, dataclasses.replace(cols, group_order=None, ngroups=None)):
        for field in dataclasses.fields(ref):
            a, b = getattr(ref, field.name), getattr(got, field.name)
            if field.name in ("model", "cluster"):
                assert a == b, field.name
            elif a is None or b is None:
                assert a is None and b is None, field.name
            else:
                np.testing.assert_allclose(b, a, rtol=1e-12, err_msg=field.name)
        # What the simulator works out of columns in the domain: message sizes, SFB rebuilds, compute scale.
        for name, a, b in (("message sizes", message_sizes(ref, ctx), message_sizes(got, ctx)),
                           ("batch scale", (batch_scale(ref, ctx),), (batch_scale(got, ctx),))):
            for x, y in zip(a, b):
                if x is None or y is None:
                    assert x is None and y is None, name
                else:
                    np.testing.assert_allclose(y, x, rtol=1e-12, err_msg=name)
    # Equal digests exactly for equal strategies.
    hashes = [s.hash for s in strategies]
    digests = cols.digests()
    assert len(set(hashes)) == len(set(digests.tolist()))
    for i in range(len(hashes)):
        for j in range(i):
            assert (hashes[i] == hashes[j]) == (digests[i] == digests[j])
    if cluster.startswith("lab-"):
        assert (cols.batch_split.sum(1) == spec.batch_size * cl.num_devices).all()
        assert (cols.batch_split != spec.batch_size).any(axis=1).mean() > 0.3  # uneven splits drawn


def test_columns_follow_the_object_samplers_distribution():
    """Same knowledge constraints, another random stream: shares of PS shards, partitioned
    variables, compressed and hierarchical strategies, local aggregation and merge groups agree
    with the object sampler's (kept as the reference, tests/_reference_sampler.py) over 1,500
    strategies."""
    from _reference_sampler import GuidedSampler as ReferenceSampler

    spec, cluster = model_spec("bert-tiny"), cluster_preset("B7")
    objects = ReferenceSampler(spec, cluster, seed=0).sample_many(1500)
    cols = GuidedSampler(spec, cluster, seed=0).sample_columns(1500)
    ctx = DomainContext(spec, cluster)
    a, b = encode(objects, ctx), cols

    def stats(batch, strategies):
        comp = np.bincount(batch.sid, weights=batch.comp > 0, minlength=batch.size) > 0
        ps = batch.kind == KIND_CODES["ps"]
        return {"ps shards": ps.mean(), "partitioned": (batch.nshards > 1).mean(),
                "compressed strategies": comp.mean(), "local aggregation": batch.local[ps].mean(),
                "groups per strategy": batch.ngroups.mean() / 20,
                "hierarchical": np.mean([any(getattr(sh.synchronizer, "algorithm", "") == "hierarchical"
                                             for p in s.plans for sh in p.shards) for s in strategies])}

    ref, got = stats(a, objects), stats(b, [cols.strategy(i) for i in range(cols.size)])
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=0.04), (key, ref, got)


def test_a_round_drawn_as_columns_proposes_the_best_scored():
    """The search (``autodist``) with a simulator that scores columns: a round's picks are fresh,
    distinct, valid strategies, and the first is the proposal the simulator scores best (an independent
    reference: the analytic model scoring every proposal as an object)."""
    from synctune.search import Experiment, StrategySearch
    from synctune.simulator import AnalyticSimulator, BoundSimulator

    spec, cluster = model_spec("bert-tiny"), cluster_preset("B7")
    exp = Experiment.from_keys(name="cols", model="bert-tiny", cluster="B7", budget=20, proposals=400, candidates=4,
                               baselines=("allreduce",), simulator="analytic", seed=5)
    sim = BoundSimulator(AnalyticSimulator(), spec, cluster)
    algo = StrategySearch(spec, cluster, exp, sim)
    baseline = algo.ask()
    algo.tell(baseline.trial_id, 1.0)
    picks = [algo.ask() for _ in range(4)]
    assert len({p.strategy.hash for p in picks} | {baseline.strategy.hash}) == 5
    for p in picks:
        validate(p.strategy, spec, cluster)
    from synctune.search.policies import round_seed

    cols = GuidedSampler(spec, cluster, seed=round_seed(exp.seed, 1), lossy=exp.search.lossy).sample_columns(400)
    every = [cols.strategy(i) for i in range(cols.size)]
    scores = -AnalyticSimulator().predict(every, spec, cluster)
    assert picks[0].strategy.hash == every[int(np.argmax(scores))].hash


def test_measured_strategies_are_passed_over_not_counted():
    """A pick the search already measured takes no place and pushes no other candidate away:
    with the best candidate measured, its twin (same decisions) is picked, not a worse,
    different one (before the fix the round picked k + 8, then dropped the measured ones)."""
    from synctune.search import select_diverse

    sig = np.array([[1, 1, 1], [1, 1, 1], [2, 2, 2]])
    scores = np.array([1.0, 0.9, 0.1])
    assert select_diverse(None, scores, 1, None, weight=2.0, signatures=sig, accept=lambda i: i != 0) == [1]
    assert select_diverse(None, scores, 5, None, signatures=sig, accept=lambda i: False) == []


def test_a_columns_round_fills_its_picks_when_the_best_were_measured():
    """An ``autodist`` round drawn as columns, with the simulator's 12 best proposals already
    measured, still proposes `candidates` strategies, none measured, the first the best-scored unmeasured one
    (independent reference: the analytic model scoring every proposal as an object)."""
    from synctune.search import Experiment, StrategySearch
    from synctune.search.policies import _scored_columns, round_seed
    from synctune.simulator import AnalyticSimulator, BoundSimulator

    spec, cluster = model_spec("ncf-small"), cluster_preset("local-2x2")
    exp = Experiment.from_keys(name="cols2", model="ncf-small", cluster="local-2x2", budget=20, proposals=300,
                               candidates=4, baselines=("allreduce",), simulator="analytic", seed=2)
    algo = StrategySearch(spec, cluster, exp, BoundSimulator(AnalyticSimulator(), spec, cluster))
    guided = GuidedSampler(spec, cluster, seed=round_seed(exp.seed, 1), lossy=exp.search.lossy)
    cols = GuidedSampler(spec, cluster, seed=round_seed(exp.seed, 1), lossy=exp.search.lossy).sample_columns(300)
    every = [cols.strategy(i) for i in range(cols.size)]
    scores = -AnalyticSimulator().predict(every, spec, cluster)
    ranked = []
    for i in np.argsort(-scores, kind="stable"):
        if every[i].hash not in ranked:
            ranked.append(every[i].hash)
    seen = set(ranked[:12])
    picks = _scored_columns(algo.round_context(), guided, 4, "r1", seen)
    assert len(picks) == 4 and not {p.strategy.hash for p in picks} & seen
    assert len({p.strategy.hash for p in picks}) == 4
    assert picks[0].strategy.hash == ranked[12]


def test_strategies_made_columns_come_back_the_same_replica_subsets_included():
    """Objects -> columns -> objects is the identity for what samplers draw (PS on a node's first
    device, replicas in device order), replica subsets and uneven splits included; the columns
    count each strategy's replicas per node as its replica list does."""
    from synctune.strategy import StrategyColumns

    spec, cluster = model_spec("transformer-small"), _heterogeneous("lab-b10c")
    sampler = GuidedSampler(spec, cluster, seed=4, subset_prob=0.6)
    strategies = sampler.sample_many(60)
    assert any(len(s.replicas) < cluster.num_devices for s in strategies)  # subsets drawn
    cols = StrategyColumns.from_strategies(spec, cluster, strategies)
    assert [cols.strategy(i).hash for i in range(cols.size)] == [s.hash for s in strategies]
    counts = cols.replica_counts()
    for i, s in enumerate(strategies):
        per_node = [sum(cluster.node_of(d).name == node.name for d in s.replicas) for node in cluster.nodes]
        assert counts[i].tolist() == per_node
    digests = cols.digests()
    for i in range(len(strategies)):
        for j in range(i):
            assert (strategies[i].hash == strategies[j].hash) == (digests[i] == digests[j])


def test_narrow_columns_hold_their_bounds_and_score_as_int64_columns_do():
    """A round's codes are stored narrow (the memory of a search round). Each narrow dtype holds
    its column's values from -1 to the bound the spec enforces (nodes, shards, devices,
    prefetch, ...), and columns at large values (PS servers on node 299 of 300, a shard group of
    all 300 devices) give the same signatures, digests and predictions as the same columns
    widened to int64 (the reference: what every column was before)."""
    from synctune.simulator import ReplaySimulator, analytic_time
    from synctune.spec import ClusterSpec
    from synctune.strategy.columns import COLUMN_BOUNDS, COLUMN_DTYPES

    for name, (why, bound) in COLUMN_BOUNDS.items():
        info = np.iinfo(COLUMN_DTYPES[name])
        assert info.min <= -1 and info.max >= bound, f"{name}: {COLUMN_DTYPES[name]} cannot hold {bound} ({why})"
    spec = model_spec("bert-tiny")
    cluster = ClusterSpec.from_dict({"name": "wide", "nodes": [{"instance_type": "g4dn.2xlarge", "count": 300}]})
    ctx = DomainContext(spec, cluster)
    drawn = GuidedSampler(spec, cluster, seed=1).sample_columns(300, chunk=64)
    sharded = encode(GuidedSampler(spec, cluster, seed=2, shard_prob=0.7).sample_many(30), ctx)
    assert int(drawn.node.max()) > 127, "the draw should put PS servers beyond an int8's reach"
    assert (sharded.shard_group >= 0).any(), "the sharded draw should hold shard units"
    # Shard groups written as their size, every device (300: beyond an int8), instead of 0.
    everyone = dataclasses.replace(sharded, shard_group=np.where(sharded.shard_group >= 0, 300, -1).astype(np.int32))
    for cols in (drawn, sharded, everyone):
        assert cols.node.dtype == np.int16 and cols.kind.dtype == np.int8 and cols.shard_group.dtype == np.int32
        wide = dataclasses.replace(cols, **{k: getattr(cols, k).astype(np.int64) for k in COLUMN_BOUNDS})
        np.testing.assert_array_equal(cols.signatures(), wide.signatures())
        np.testing.assert_array_equal(cols.digests(), wide.digests())
        np.testing.assert_array_equal(analytic_time(cols, ctx), analytic_time(wide, ctx))
        np.testing.assert_array_equal(ReplaySimulator()._predict_batch(cols, ctx),
                                      ReplaySimulator()._predict_batch(wide, ctx))


def test_a_round_scored_a_chunk_at_a_time_scores_as_in_one_piece(monkeypatch):
    """``StrategyColumns.take`` cuts a round into strategies of their own: each piece holds the
    strategies the whole holds (as objects), and the search's chunked scoring (a chunk of 7 here)
    gives every simulator's scores of the whole round in one piece, uneven splits included."""
    from synctune.simulator import AnalyticSimulator, BoundSimulator, ReplaySimulator

    spec = model_spec("transformer-small")
    cluster = _heterogeneous("lab-b10c")
    cols = GuidedSampler(spec, cluster, seed=5).sample_columns(40, chunk=16)
    piece = cols.take(10, 17)
    assert piece.size == 7 and [piece.strategy(i).hash for i in range(7)] == [cols.strategy(i).hash
                                                                             for i in range(10, 17)]
    for sim in (AnalyticSimulator(), ReplaySimulator()):
        bound = BoundSimulator(sim, spec, cluster)
        whole = bound.score_columns(cols)
        monkeypatch.setattr(BoundSimulator, "SCORE_CHUNK", 7)
        # the replay's cumulative sums start elsewhere in a chunk: equal up to rounding
        np.testing.assert_allclose(bound.score_columns(cols), whole, rtol=1e-9)
        monkeypatch.undo()
