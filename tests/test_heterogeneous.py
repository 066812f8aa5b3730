"""Nodes of different compute speed (TAG §2.1) in the simulator and the search: the replay waits
for the slowest replica, the sampler splits the batch towards the measured speeds only where they
differ, and Algorithm 1 takes one coordinate step on the split per round (AutoDDL §4.4).

The "cluster" of the search test is synthetic: each replica computes for batch / speed, and the
iteration is the slowest replica plus a fixed synchronization cost, so the best split is known
(proportional to speed) independently of the simulator under test."""

from __future__ import annotations

import dataclasses

import pytest

from synctune.models import model_spec
from synctune.search.algorithm import StrategySearch
from synctune.search.experiment import Experiment
from synctune.search.sampler import GuidedSampler
from synctune.simulator import AnalyticSimulator, BoundSimulator, DomainContext, batch_scale, encode
from synctune.spec import cluster_preset
from synctune.spec.cluster import ClusterSpec
from synctune.strategy.builders import build_strategy

MODEL = model_spec("cnn-small")


def _with_speeds(cluster: ClusterSpec, speeds: list[float]) -> ClusterSpec:
    return dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, compute_gflops=s)
                                                    for n, s in zip(cluster.nodes, speeds)))


HETERO = _with_speeds(cluster_preset("lab-b10c"), [17.0, 34.0])  # g3-like node half as fast


def test_the_slowest_replica_sets_the_compute_scale():
    even = build_strategy("allreduce", MODEL, HETERO)
    ctx = DomainContext(MODEL, HETERO)
    proportional = dataclasses.replace(even, batch_split=(11, 11, 21, 21))
    scales = batch_scale(encode([even, proportional], ctx), ctx)
    # Even: the slow node's 16 samples at half speed count as 32; proportional: max(11 x 2, 21 x 1).
    assert list(scales) == [pytest.approx(32 / 16), pytest.approx(22 / 16)]
    plain = DomainContext(MODEL, cluster_preset("lab-b10c"))  # never calibrated: no slowdown
    assert list(batch_scale(encode([even], plain), plain)) == [pytest.approx(1.0)]



def test_the_analytic_model_waits_for_the_slowest_replica():
    """The training-free analytic model, which the simulator-only searches use: cnn-small is
    compute-bound on the lab, so the even split on a node half as fast takes twice the compute
    of the uncalibrated cluster, and the speed-proportional split 22/16 of it (independent
    reference: the batch shares times the slowdown, worked out by hand)."""
    even = build_strategy("allreduce", MODEL, HETERO)
    proportional = dataclasses.replace(even, batch_split=(11, 11, 21, 21))
    plain = BoundSimulator(AnalyticSimulator(), MODEL, cluster_preset("lab-b10c"))
    hetero = BoundSimulator(AnalyticSimulator(), MODEL, HETERO)
    nominal = -plain.score([build_strategy("allreduce", MODEL, cluster_preset("lab-b10c"))])[0]
    t_even, t_prop = -hetero.score([even, proportional])
    assert t_even == pytest.approx(2 * nominal) and t_prop == pytest.approx(22 / 16 * nominal)

def test_the_sampler_splits_only_where_speeds_differ():
    samples = GuidedSampler(MODEL, HETERO, seed=3).sample_many(60)
    assert all(s.global_batch_size == 64 for s in samples)
    splits = [s.batch_split for s in samples if len(s.replicas) == 4]
    uneven = [s for s in splits if len(set(s)) > 1]
    assert 0 < len(uneven) < len(splits)
    assert all(s[0] <= s[2] and s[1] <= s[3] for s in uneven)  # the slow node never gets more
    # Same speeds (or none measured): no split is drawn, and the random stream is the one a
    # sampler that never splits draws, so searches on such clusters propose what they did.
    same = _with_speeds(cluster_preset("lab-b10c"), [20.0, 20.0])
    for cluster in (same, cluster_preset("lab-b10c")):
        a = [s.hash for s in GuidedSampler(MODEL, cluster, seed=3).sample_many(20)]
        b = [s.hash for s in GuidedSampler(MODEL, cluster, seed=3, split_prob=0.0, subset_prob=0.0).sample_many(20)]
        assert a == b


def test_the_sampler_proposes_replica_subsets_without_the_slow_node_mostly():
    """TAG §4.2: which devices hold replicas. On nodes of different speeds some proposals leave
    one node out, the slower node (half the speed here) twice as often as the faster; they keep
    the global batch and place every PS shard on a replica, and they validate."""
    from synctune.strategy import validate

    samples = GuidedSampler(MODEL, HETERO, seed=11, subset_prob=0.5).sample_many(200)
    subsets = [s for s in samples if len(s.replicas) < 4]
    assert 60 < len(subsets) < 140
    slow, fast = HETERO.nodes[0].devices, HETERO.nodes[1].devices
    without_slow = sum(s.replicas == fast for s in subsets)
    assert without_slow + sum(s.replicas == slow for s in subsets) == len(subsets)
    assert without_slow > 1.4 * (len(subsets) - without_slow)
    for s in subsets:
        validate(s, MODEL, HETERO)
        assert s.global_batch_size == 64
        assert all(sh.synchronizer.placement in s.replicas for p in s.plans for sh in p.shards
                   if sh.synchronizer.kind == "ps")


def _synthetic_runtime(strategy) -> float:
    speed = {d: n.compute_gflops for n in HETERO.nodes for d in n.devices}
    return max(b / speed[d] for b, d in zip(strategy.batch_split, strategy.replicas)) + 0.05


def test_each_round_takes_a_coordinate_step_on_the_split():
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=HETERO.name, budget=10, proposals=40, candidates=3,
                               baselines=("allreduce",), algorithm="autodist")
    algo = StrategySearch(MODEL, HETERO, exp, BoundSimulator(AnalyticSimulator(), MODEL, HETERO))
    told = []
    while (p := algo.ask()) is not None:
        algo.tell(p.trial_id, _synthetic_runtime(p.strategy))
        told.append(p)
    steps = [p for p in told if p.origin == "autodist+split"]
    assert steps, [p.origin for p in told]
    first = steps[0].strategy
    baseline = told[0].strategy  # the only measured strategy before round 1
    assert [dataclasses.replace(first, batch_split=baseline.batch_split).hash] == [baseline.hash]
    assert first.batch_split != baseline.batch_split and first.batch_split[0] < first.batch_split[2]
    best = min(told, key=lambda p: _synthetic_runtime(p.strategy))
    assert _synthetic_runtime(best.strategy) < _synthetic_runtime(baseline) / 1.3  # the known optimum: 1.5x
