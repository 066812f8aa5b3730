"""Sufficient-factor broadcasting (TAG §2.3, §4.2.3) outside the engine's numerics (those are in
the conformance and equivalence suites): which variables the model spec marks, what validation
and the engine refuse, what the simulator charges (worked by hand), and where the searches
propose it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from _engine_workers import sfb_refusal_worker, sfb_strategy
from synctune.engine.local import run_local
from synctune.models import model_spec
from synctune.search.local_search import ChoiceSpace
from synctune.search.sampler import GuidedSampler
from synctune.simulator import ReplayConstants, ReplaySimulator
from synctune.spec import ClusterSpec, ComputeProfile, ModelSpec, SpecError, VariableSpec, cluster_preset
from synctune.spec.model import extract_model_spec
from synctune.strategy import (Compressor, SFBSynchronizer, ShardPlan, StrategyError, VariablePlan,
                               build_strategy, validate)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 16)  # on every token: 5 rows per sample
        self.head = torch.nn.Linear(16, 3)  # on the pooled vector, called twice: 2 rows per sample
        self.tied = torch.nn.Linear(8, 50, bias=False)
        self.tied.weight = self.emb.weight

    def forward(self, idx):
        h = self.proj(self.emb(idx))
        pooled = h.mean(1)
        return (self.head(pooled) + self.head(pooled * 2)).sum() + self.tied(self.emb(idx)).sum()


def test_the_spec_marks_linear_weights_with_their_factor_rows():
    module = _Net()
    spec = extract_model_spec(module, name="net", batch_size=4, run_step=lambda m: m(torch.randint(0, 50, (4, 5))),
                              step_batch=4)
    rows = dict(zip([v.name for v in spec.variables], spec.factor_rows))
    # Biases, the embedding and the weight tied to it carry no factors.
    assert rows == {"emb.weight": None, "proj.weight": 5, "proj.bias": None, "head.weight": 2, "head.bias": None}
    again = ModelSpec.from_dict(spec.to_dict())
    assert again.factor_rows == spec.factor_rows and again.hash == spec.hash
    with pytest.raises(SpecError, match="factor_rows"):
        ModelSpec(name="x", variables=(VariableSpec(name="b", shape=(4,)),), factor_rows=(1,))


def _sfb_plan(name, partition=(1, 1), compressor=Compressor()):
    shards = tuple(ShardPlan(synchronizer=SFBSynchronizer(), compressor=compressor)
                   for _ in range(math.prod(partition)))
    return VariablePlan(variable=name, partition=partition, shards=shards)


@pytest.mark.parametrize("plan, message", [
    (lambda: _sfb_plan("conv.weight", (1, 1, 1, 1)), "does not mark this variable"),
    (lambda: _sfb_plan("fc.bias", (1,)), "does not mark this variable"),
    (lambda: _sfb_plan("fc.weight", (2, 1)), "use partition \\[1, 1\\] with sfb"),
    (lambda: _sfb_plan("fc.weight", compressor=Compressor(kind="fp16")), "fp16 wraps ps or allreduce or allgather"),
])
def test_validation_refuses_sfb_it_cannot_run_exactly(plan, message):
    spec = model_spec("cnn-small")
    cluster = cluster_preset("local-1x2")
    base = build_strategy("allreduce", spec, cluster)
    p = plan()
    if p.variable == "conv.weight":  # a 4-D convolution kernel
        conv = next(v for v in spec.variables if len(v.shape) == 4)
        p = dataclasses.replace(p, variable=conv.name, partition=(1, 1, 1, 1))
    plans = tuple(p if q.variable == p.variable else q for q in base.plans)
    with pytest.raises(StrategyError, match=message) as err:
        validate(dataclasses.replace(base, plans=plans), spec, cluster)
    assert repr(p.variable) in str(err.value), err.value


@pytest.mark.parametrize("variable, message", [
    ("emb.weight", "needs the weight of an nn.Linear layer, and this is 'weight' of a Embedding; use allreduce or ps"),
    ("out.weight", "shared by 2 modules (tied)"),
])
def test_the_engine_refuses_sfb_on_a_weight_that_is_no_plain_linear_layer(variable, message):
    """A spec that wrongly marks a variable (written by hand): the engine checks the module."""
    error = run_local(sfb_refusal_worker, 1, (variable,), timeout_s=300)[0]
    assert error.startswith("StrategyError") and repr(variable) in error and message in error, error


def _cluster() -> ClusterSpec:
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": 1,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    return ClusterSpec.from_dict({"name": "two-nodes", "nodes": [{"name": "n0", **node}, {"name": "n1", **node}]})


def test_the_replay_charges_sfb_its_factors_and_the_rebuild_worked_by_hand():
    model = ModelSpec(name="lin", batch_size=8, factor_rows=(4,),
                      variables=(VariableSpec(name="w", shape=(1000, 2000)),))
    cluster = _cluster()
    sim = ReplaySimulator({}, ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4))
    sim.add_profile(ComputeProfile(model="lin", device="cpu", workers=2, batch_size=8, forward_s=0.001,
                                   backward_s=0.002, step_s=0.0, ready_s=(0.001,)))
    ar = build_strategy("allreduce", model, cluster)
    sfb = dataclasses.replace(ar, plans=(_sfb_plan("w"),))
    validate(sfb, model, cluster)
    t_ar, t_sfb = sim.predict([ar, sfb], model, cluster)
    gb = 1e9  # bytes/s of 8 Gbit/s
    ready = 0.002
    # All-reduce, N = 2: 2 (N-1) (alpha + M / (N beta)) of the 8 MB gradient.
    assert t_ar == pytest.approx(ready + 2 * (1e-4 + 8e6 / (2 * gb)) + 5e-5 + 5e-4, rel=1e-9)
    # SFB: two gathers (N-1) (2 alpha + F / beta) of F = 8 samples x 4 rows x (1000 + 2000) x 4 bytes,
    # then the rebuild: 2 x 16 samples x 4 rows x 2e6 weights FLOPs at the CPU's nominal 5e10 FLOP/s.
    factors = 8 * 4 * 3000 * 4
    rebuild = 2 * 16 * 4 * 2e6 / 5e10
    assert t_sfb == pytest.approx(ready + 2e-4 + factors / gb + 5e-5 + rebuild + 5e-4, rel=1e-9)
    assert t_sfb < t_ar


def test_the_searches_propose_sfb_where_it_sends_fewer_bytes():
    spec, cluster = model_spec("vgg16"), cluster_preset("B7")
    sampler = GuidedSampler(spec, cluster, seed=3)
    # N b rows (in + out) < 2 in out for the three classifier layers only.
    assert sampler.sfb_cheaper == {"classifier.0.weight", "classifier.2.weight", "classifier.4.weight"}
    drawn = sampler.sample_many(60)
    with_sfb = [s for s in drawn if s.stats()["num_sfb_shards"]]
    assert 5 <= len(with_sfb) < 60
    for s in with_sfb:
        validate(s, spec, cluster)
        assert {p.variable for p in s.plans if p.shards[0].synchronizer.kind == "sfb"} <= sampler.sfb_cheaper
    # Where no weight is cheaper by SFB the sampler draws exactly as it did before SFB existed.
    small = model_spec("cnn-small")
    a = GuidedSampler(small, cluster_preset("local-2x2"), seed=5).sample_many(20)
    b = GuidedSampler(small, cluster_preset("local-2x2"), seed=5, sfb_prob=0.0).sample_many(20)
    assert [s.hash for s in a] == [s.hash for s in b]
    space = ChoiceSpace(spec, cluster)
    base = build_strategy("allreduce", spec, cluster)
    at = [i for i, v in enumerate(spec.variables) if v.name == "classifier.0.weight"]
    kinds = {c.kind for c in space.choices(base, at)}
    assert "sfb" in kinds
    moved = [n for n in space.neighbours(base, at) if n.plan_for("classifier.0.weight").shards[0].synchronizer.kind
             == "sfb"]
    assert len(moved) == 1
    validate(moved[0], spec, cluster)
    bias = [i for i, v in enumerate(spec.variables) if v.name == "classifier.0.bias"]
    assert "sfb" not in {c.kind for c in space.choices(base, bias)}


def test_the_simulators_rank_sfb_first_where_tag_says_it_wins():
    """VGG16's 400 MB classifier on a 10 GbE cluster of T4s: SFB's factors (32 x (25088 + 4096)
    values per replica) beat all-reducing the weights, in the analytic model and the replay."""
    from synctune.simulator.features import DomainContext, analytic_time, encode

    spec, cluster = model_spec("vgg16"), cluster_preset("B7")
    ar = build_strategy("allreduce", spec, cluster)
    sfb = sfb_strategy("vgg16", cluster, ar.batch_split)
    ctx = DomainContext(spec, cluster)
    t_ar, t_sfb = analytic_time(encode([ar, sfb], ctx), ctx)
    assert t_sfb < 0.6 * t_ar
    r_ar, r_sfb = ReplaySimulator().predict([ar, sfb], spec, cluster)
    assert r_sfb < 0.6 * r_ar
