"""The replay simulator (dPRO §4.3): iteration times worked by hand for all-reduce and PS,
overlap and queueing, an event-by-event reference loop on many strategies, compute profiles
measured for real, and `synctune sim profile` / `sim eval` side by side."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
from click.testing import CliRunner

from synctune.cli import cli
from synctune.simulator import DomainContext, ReplayConstants, ReplaySimulator, encode
from synctune.spec import ClusterSpec, ComputeProfile, ModelSpec, SpecError, VariableSpec
from synctune.strategy import Strategy, build_strategy

# The event model worked by hand below is version 5's: version 6 adds a lower bound on CPU
# clusters (the communication's CPU work after backward), worked by hand on its own.
K = ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4, replay_version=5)
GB = 1e9  # bytes/s of an 8 Gbit/s link


def _cluster() -> ClusterSpec:
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": 1,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    return ClusterSpec.from_dict({"name": "two-nodes", "nodes": [{"name": "n0", **node}, {"name": "n1", **node}]})


def _model(b_elems: int = 1000, a_elems: int = 250_000) -> ModelSpec:
    return ModelSpec(name="two", batch_size=8, variables=(VariableSpec(name="b", shape=(b_elems,), dtype="float32"),
                                                          VariableSpec(name="a", shape=(a_elems,), dtype="float32")))


def _profile(model: ModelSpec) -> ComputeProfile:
    return ComputeProfile(model=model.name, device="cpu", workers=2, batch_size=8, forward_s=0.010,
                          backward_s=0.021, step_s=0.003, ready_s=(0.002, 0.020))


def _with_groups(strategy: Strategy, groups: dict[str, int]) -> Strategy:
    data = strategy.to_dict()
    for plan in data["plans"]:
        plan["shards"][0]["synchronizer"]["group"] = groups[plan["variable"]]
    return Strategy.from_dict(data)


def _replay(model, cluster, strategies):
    sim = ReplaySimulator({}, K)
    sim.add_profile(_profile(model))
    return sim.predict(strategies, model, cluster), sim


def test_all_reduce_worked_by_hand():
    model, cluster = _model(), _cluster()
    one = build_strategy("allreduce", model, cluster)  # one merge group: launches when 'a' is ready
    two = _with_groups(one, {"b": 0, "a": 1})  # 'b' goes while backward still computes 'a'
    (t_one, t_two), sim = _replay(model, cluster, [one, two])
    assert not sim.fallbacks
    # Ring all-reduce, N = 2: 2(N-1) (alpha + bytes / (N beta)), plus the unit's launch cost.
    d_both = 2 * (1e-4 + 1_004_000 / (2 * GB)) + 5e-5
    assert t_one == pytest.approx(max(0.031, 0.030 + d_both) + 0.003 + 5e-4, rel=1e-9)
    d_b, d_a = 2 * (1e-4 + 4000 / (2 * GB)) + 5e-5, 2 * (1e-4 + 1e6 / (2 * GB)) + 5e-5
    assert 0.012 + d_b < 0.030  # 'b' is done before 'a' is ready: fully overlapped
    assert t_two == pytest.approx(0.030 + d_a + 0.003 + 5e-4, rel=1e-9)


def test_a_busy_link_queues_the_next_unit():
    model, cluster = _model(b_elems=12_500_000), _cluster()  # 'b': 50 MB, ready first
    two = _with_groups(build_strategy("allreduce", model, cluster), {"b": 0, "a": 1})
    (t,), sim = _replay(model, cluster, [two])
    d_b = 2 * (1e-4 + 50e6 / (2 * GB)) + 5e-5
    d_a = 2 * (1e-4 + 1e6 / (2 * GB)) + 5e-5
    # 'a' is ready at 30 ms but the link is busy with 'b' until 12 ms + d_b (62 ms).
    assert t == pytest.approx(0.012 + d_b + d_a + 0.003 + 5e-4, rel=1e-9)
    events = sim.timeline(encode([two], DomainContext(model, cluster)), DomainContext(model, cluster))
    assert events["unit_start"][1] == pytest.approx(events["unit_finish"][0])  # waited on the link


def test_the_lower_bound_is_the_larger_of_compute_and_the_links_work_worked_by_hand():
    model, cluster = _model(b_elems=12_500_000), _cluster()  # 'b': 50 MB, the link busier than compute
    two = _with_groups(build_strategy("allreduce", model, cluster), {"b": 0, "a": 1})
    (t,), sim = _replay(model, cluster, [two])
    d_b = 2 * (1e-4 + 50e6 / (2 * GB)) + 5e-5
    d_a = 2 * (1e-4 + 1e6 / (2 * GB)) + 5e-5
    got = sim.lower_bound(two, model, cluster)
    assert got["compute_s"] == pytest.approx(0.031, rel=1e-9)  # forward 10 ms + backward 21 ms
    assert got["comm_s"] == pytest.approx(d_b + d_a, rel=1e-9)
    assert got["bound_s"] == pytest.approx(d_b + d_a, rel=1e-9) and got["bound_s"] < t
    # Small gradients: compute bounds it, and a link half as fast leaves compute where it was.
    small = _model()
    one = build_strategy("allreduce", small, cluster)
    (t_small,), sim = _replay(small, cluster, [one])
    fast = sim.lower_bound(one, small, cluster)
    d_both = 2 * (1e-4 + 1_004_000 / (2 * GB)) + 5e-5
    assert fast == pytest.approx({"compute_s": 0.031, "comm_s": d_both, "bound_s": 0.031}, rel=1e-9)
    assert fast["bound_s"] < t_small
    slow_cluster = ClusterSpec.from_dict({**cluster.to_dict(), "nodes": [
        {**n, "nic_gbps": 4.0, "single_flow_gbps": 4.0} for n in cluster.to_dict()["nodes"]]})
    slow = sim.lower_bound(build_strategy("allreduce", small, slow_cluster), small, slow_cluster)
    assert slow["compute_s"] == pytest.approx(0.031, rel=1e-9)
    assert slow["comm_s"] == pytest.approx(2 * (1e-4 + 1_004_000 / GB) + 5e-5, rel=1e-9)


def test_the_critical_path_names_what_each_unit_waited_for():
    """The figures of the two hand-worked cases above, read as a critical path: with 'b' (50 MB)
    on the link when 'a' is ready, the path is 'b' (waited for its gradients, ready at 12 ms)
    then 'a' (waited for the link until 12 ms + d_b); with a small 'b', fully overlapped, the
    path is 'a' alone, ready when backward ends (30 ms)."""
    cluster = _cluster()
    d_b = 2 * (1e-4 + 50e6 / (2 * GB)) + 5e-5
    d_a = 2 * (1e-4 + 1e6 / (2 * GB)) + 5e-5
    for b_elems, expected in ((12_500_000, [("b", "gradients", 0.012, 0.012), ("a", "link", 0.030, 0.012 + d_b)]),
                              (1000, [("a", "gradients", 0.030, 0.030)])):
        model = _model(b_elems=b_elems)
        sim = ReplaySimulator({}, K)
        sim.add_profile(_profile(model))
        path = sim.critical_path(_with_groups(build_strategy("allreduce", model, cluster), {"b": 0, "a": 1}),
                                 model, cluster)
        got = [(u["variables"][0], u["waited_for"], u["ready_s"], u["start_s"]) for u in path["units"]]
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        for (_v, _w, ready, start), (_ev, _ew, e_ready, e_start) in zip(got, expected):
            assert ready == pytest.approx(e_ready, rel=1e-9) and start == pytest.approx(e_start, rel=1e-9)
        assert path["units"][-1]["finish_s"] == pytest.approx(path["comm_end_s"])
        assert path["backward_end_s"] == pytest.approx(0.031) and path["measured"]
        assert path["units"][-1]["finish_s"] == pytest.approx(expected[-1][3] + d_a, rel=1e-9)


def test_parameter_server_worked_by_hand():
    model, cluster = _model(), _cluster()
    ps = build_strategy("ps", model, cluster)  # both variables on n0:0
    assert {p.shards[0].synchronizer.placement for p in ps.plans} == {"n0:0"}
    (t,), _sim = _replay(model, cluster, [ps])
    # Push: gloo's reduce over N = 2 ranks: a ring reduce-scatter in 2N = 4 segments (N - 1 = 2
    # steps of one segment each, alpha each), then the other rank's half to the server (alpha).
    push_b, push_a = 4000 / GB + 3e-4 + 5e-5, 1e6 / GB + 3e-4 + 5e-5
    assert 0.012 + push_b < 0.030
    comm_end = 0.030 + push_a
    # After the step, the server broadcasts each variable's new value (one round of the binomial
    # tree for two ranks), one variable after the other.
    bcast = (4000 / GB + 1e-4 + 5e-5) + (1e6 / GB + 1e-4 + 5e-5)
    assert t == pytest.approx(max(0.031, comm_end) + 0.003 + bcast + 5e-4, rel=1e-9)


@pytest.mark.parametrize("nodes, per_node, ring, gather, bcast", [
    # 4 nodes x 1: the ring's 4 hops cross nodes (one out and one in per NIC); the 3 others' chunks
    # of 1/4 share the server's NIC; broadcast rounds n0->n1, then n0->n2 beside n1->n3.
    (4, 1, 1 / GB, 3 / GB / 4, 1 / GB + 1 / GB),
    # 2 nodes x 2: two ring hops cross nodes, two stay inside; the server's NIC takes the other
    # node's two chunks; round 0 stays inside n0, round 1 sends n0->n1 twice at once.
    (2, 2, 1 / GB, 2 / GB / 4, 1 / (10 * GB) + 2 / GB),
])
def test_parameter_server_runs_gloos_ring_reduce_and_binomial_broadcast(nodes, per_node, ring, gather, bcast):
    """A dense PS shard as gloo runs ``dist.reduce`` (gloo/reduce.cc: a ring reduce-scatter in at
    least 2N segments, each rank sending to rank - 1, then every chunk to the root at once) and
    ``dist.broadcast`` (gloo/broadcast.cc: a binomial tree), worked by hand from those algorithms
    on links of 1 GB/s, inside a node 10 GB/s."""
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": per_node,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 80.0}
    cluster = ClusterSpec.from_dict({"name": f"c{nodes}x{per_node}",
                                     "nodes": [{"name": f"n{i}", **node} for i in range(nodes)]})
    model = ModelSpec(name="one", batch_size=8, variables=(VariableSpec(name="a", shape=(250_000,), dtype="float32"),))
    sim = ReplaySimulator({}, K)
    sim.add_profile(ComputeProfile(model="one", device="cpu", workers=4, batch_size=8, forward_s=0.001,
                                   backward_s=0.001, step_s=0.001, ready_s=(0.001,)))
    (t,) = sim.predict([build_strategy("ps", model, cluster)], model, cluster)
    nbytes, n = 1e6, 4
    steps = 2 * n - 2  # 8 segments of 125 kB: 6 ring steps, then the gather
    push = nbytes * steps / (2 * n) * ring + steps * 1e-4 + nbytes * gather + 1e-4 + 5e-5
    pull = nbytes * bcast + 2 * 1e-4 + 5e-5  # two rounds
    assert t == pytest.approx(0.002 + push + 0.001 + pull + 5e-4, rel=1e-9)
    # The star of AutoSync's Eq. 2 (every replica's whole gradient through the server's NIC) is
    # what this replaces: on 4 nodes x 1 it would be three times the bytes, not 1.5.
    assert nbytes * (steps / (2 * n) * ring + gather) < 3 * nbytes / GB


def test_uneven_batch_split_waits_for_the_biggest_share():
    model, cluster = _model(), _cluster()
    even = build_strategy("allreduce", model, cluster)
    data = even.to_dict()
    data["batch_split"] = [12, 4]
    uneven = Strategy.from_dict(data)
    (t_even, t_uneven), _ = _replay(model, cluster, [even, uneven])
    d_both = 2 * (1e-4 + 1_004_000 / (2 * GB)) + 5e-5
    scale = 12 / 8  # the replica with 12 samples computes 1.5 times as long
    assert t_uneven == pytest.approx(max(0.031 * scale, 0.030 * scale + d_both) + 0.003 + 5e-4, rel=1e-9)
    assert t_uneven > t_even


def _reference_loop(strategy: Strategy, model: ModelSpec, profile: ComputeProfile, n: int, ring_bw: float) -> float:
    """Event by event: all-reduce units in the engine's fixed order on one queue."""
    index = {v.name: i for i, v in enumerate(model.variables)}
    units: dict[int, list[str]] = {}
    for plan in strategy.plans:
        units.setdefault(plan.shards[0].synchronizer.group, []).append(plan.variable)
    ordered = sorted(units.values(), key=lambda names: min(index[x] for x in names))
    launched = finished = 0.0
    for names in ordered:
        ready = max(profile.forward_s + profile.ready_s[index[x]] for x in names)
        launched = max(launched, ready)  # after every earlier unit launched
        nbytes = sum(model[x].num_bytes for x in names)
        finished = max(launched, finished) + 2 * (n - 1) * (K.alpha_s + nbytes / (n * ring_bw)) + K.unit_s
    return max(profile.forward_s + profile.backward_s, finished) + profile.step_s + K.iteration_s


def test_replay_matches_an_event_loop_on_random_merge_groups():
    from synctune.models import model_spec

    model = model_spec("bert-tiny")
    cluster = _cluster()
    rng = random.Random(0)
    ready, t = [], 0.0
    for _ in model.variables:
        t += rng.uniform(0.0, 0.002)
        ready.append(t)
    profile = ComputeProfile(model=model.name, device="cpu", workers=2, batch_size=model.batch_size,
                             forward_s=0.01, backward_s=t + 0.001, step_s=0.002, ready_s=tuple(ready))
    base = build_strategy("allreduce", model, cluster)
    strategies = []
    for _ in range(40):
        strategies.append(_with_groups(base, {v.name: rng.randrange(6) for v in model.variables}))
    sim = ReplaySimulator({}, K)
    sim.add_profile(profile)
    got = sim.predict(strategies, model, cluster)
    want = [_reference_loop(s, model, profile, 2, GB) for s in strategies]
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert len(set(np.round(want, 9))) > 10  # the strategies really differ


def test_sparse_on_all_reduce_is_dense_on_the_wire():
    model = ModelSpec(name="emb", batch_size=8, variables=(
        VariableSpec(name="e", shape=(100_000, 16), dtype="float32", sparse=True),), touched_rows=(64,))
    cluster = _cluster()
    profile = ComputeProfile(model="emb", device="cpu", workers=2, batch_size=8, forward_s=0.001, backward_s=0.002,
                             step_s=0.0, ready_s=(0.001,))
    sim = ReplaySimulator({}, K)
    sim.add_profile(profile)
    ag = build_strategy("allreduce", model, cluster)  # the builder gathers sparse gradients
    assert ag.plans[0].shards[0].synchronizer.kind == "allgather"
    data = ag.to_dict()
    data["plans"][0]["shards"][0]["synchronizer"] = {"kind": "allreduce", "group": 0, "algorithm": "flat"}
    ar = Strategy.from_dict(data)
    t_ar, t_ag = sim.predict([ar, ag], model, cluster)
    dense, touched = 100_000 * 16 * 4, 64 * 16 * 4
    assert t_ar == pytest.approx(0.002 + 2 * (1e-4 + dense / (2 * GB)) + 5e-5 + 5e-4, rel=1e-9)
    # All-gather: (N-1) (alpha + touched rows / beta), done before backward ends here.
    assert 0.002 + 1e-4 + touched / GB + 5e-5 < 0.003 and t_ag == pytest.approx(0.003 + 5e-4, rel=1e-9)
    # Exposed (the gradient ready as backward ends): SparseAllGatherUnit's three ring all-gathers
    # of N - 1 messages each, the row counts, the rows' int64 indices and the rows.
    late = ReplaySimulator({}, K)
    late.add_profile(ComputeProfile(model="emb", device="cpu", workers=2, batch_size=8, forward_s=0.001,
                                    backward_s=0.002, step_s=0.0, ready_s=(0.002,)))
    (t_late,) = late.predict([ag], model, cluster)
    assert t_late == pytest.approx(0.003 + 3 * 1e-4 + (touched + 64 * 8) / GB + 5e-5 + 5e-4, rel=1e-9)


def test_a_sparse_ps_shard_replays_the_engines_messages():
    """A sparse shard on a PS as SparsePSUnit runs it, worked by hand on 2 nodes: the row counts
    all-gathered (N - 1 = 1 message), the touched rows' int64 indices and the rows gathered to the
    server (one message each), and after the step the count, the indices and the rows broadcast
    (one binomial round each); version 2 priced one gather and one broadcast of the rows."""

    model = ModelSpec(name="emb", batch_size=8, variables=(
        VariableSpec(name="e", shape=(100_000, 16), dtype="float32", sparse=True),), touched_rows=(64,))
    cluster = _cluster()
    profile = ComputeProfile(model="emb", device="cpu", workers=2, batch_size=8, forward_s=0.001, backward_s=0.002,
                             step_s=0.0, ready_s=(0.001,))
    ps = build_strategy("ps", model, cluster)
    rows, indices = 64 * 16 * 4, 64 * 8
    push = 1e-4 + (indices / GB + 1e-4) + (rows / GB + 1e-4) + 5e-5
    pull = (rows + indices) / GB + 3 * 1e-4 + 5e-5
    for version, want in ((3, max(0.003, 0.002 + push) + pull + 5e-4),
                          (2, max(0.003, 0.002 + rows / GB + 1e-4 + 5e-5) + rows / GB + 1e-4 + 5e-5 + 5e-4)):
        sim = ReplaySimulator({}, dataclasses.replace(K, replay_version=version))
        sim.add_profile(profile)
        assert sim.predict([ps], model, cluster)[0] == pytest.approx(want, rel=1e-9), version


def test_a_locally_aggregated_ps_shard_runs_beside_the_worlds_queue():
    """A dense PS shard with local aggregation runs on the node roots' process group, which gloo
    serves beside the world's group: worked by hand on 2 nodes, an all-reduce of 1 MB and such a
    PS push of 1 MB both ready at 30 ms run at once (version 3), not one after the other (version
    2, one queue)."""

    model = ModelSpec(name="two", batch_size=8, variables=(VariableSpec(name="b", shape=(250_000,), dtype="float32"),
                                                           VariableSpec(name="a", shape=(250_000,), dtype="float32")))
    cluster = _cluster()
    data = build_strategy("ps", model, cluster).to_dict()
    for plan in data["plans"]:
        if plan["variable"] == "a":
            plan["shards"][0]["synchronizer"]["local_aggregation"] = True
        else:
            plan["shards"][0]["synchronizer"] = {"kind": "allreduce", "group": 0, "algorithm": "flat"}
    strategy = Strategy.from_dict(data)
    profile = ComputeProfile(model="two", device="cpu", workers=2, batch_size=8, forward_s=0.010, backward_s=0.021,
                             step_s=0.003, ready_s=(0.020, 0.020))
    ar = 2 * (1e-4 + 1e6 / (2 * GB)) + 5e-5  # ring all-reduce over 2 ranks
    push = 1e6 / GB + 3e-4 + 5e-5  # gloo's reduce over the 2 node roots (one replica a node)
    pull = 1e6 / GB + 1e-4 + 5e-5
    for version, comm_end in ((3, 0.030 + max(ar, push)), (2, 0.030 + ar + push)):
        sim = ReplaySimulator({}, dataclasses.replace(K, replay_version=version))
        sim.add_profile(profile)
        got = sim.predict([strategy], model, cluster)[0]
        assert got == pytest.approx(max(0.031, comm_end) + 0.003 + pull + 5e-4, rel=1e-9), version


def test_profiles_are_validated():
    with pytest.raises(SpecError, match="forward_s"):
        ComputeProfile(model="m", device="cpu", workers=1, batch_size=1, forward_s=-1.0, backward_s=0, step_s=0,
                       ready_s=())
    with pytest.raises(SpecError, match="schema"):
        ComputeProfile.from_dict({"schema": 9})
    with pytest.raises(SpecError, match="ready_s"):
        _profile(_model()).check(ModelSpec(name="two", variables=(VariableSpec(name="x", shape=(1,)),)))
    assert ComputeProfile.from_dict(_profile(_model()).to_dict()) == _profile(_model())


def test_measured_profile_follows_the_real_backward_order():
    from synctune.engine.profile import profile_compute
    from synctune.workload import zoo_workload

    workload = zoo_workload("cnn-small")
    profile = profile_compute(workload, workers=2, warmup=1, iters=3)
    spec = workload.spec()
    profile.check(spec)
    ready = np.array(profile.ready_s)
    # The spec's order was traced on the meta device; the hooks fire on real tensors: the
    # gradients must become ready in that order, all within backward.
    assert (np.diff(ready) >= 0).all(), ready
    assert 0 < ready[0] and ready[-1] <= profile.backward_s
    assert profile.forward_s > 0 and profile.step_s > 0 and profile.workers == 2


def test_cli_profile_then_eval_side_by_side(tmp_path, monkeypatch):
    from synctune.data import TrialDataset, pull_release
    from pathlib import Path

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    res = runner.invoke(cli, ["sim", "profile", "-m", "cnn-small", "-c", "local-1x2", "--warmup", "1", "--iters", "2"])
    assert res.exit_code == 0, res.output
    path = tmp_path / "home" / "profiles" / "cnn-small@cpu-w2.json"
    assert json.loads(path.read_text())["workers"] == 2
    ds = TrialDataset(tmp_path / "data")
    pull_release(str(Path(__file__).resolve().parents[1] / "dataset" / "sample-local-v0"), ds)
    res = runner.invoke(cli, ["sim", "eval", "--data", str(ds.root), "--domain", "cnn-small@local-1x2"])
    assert res.exit_code == 0, res.output
    lines = [line.split() for line in res.output.splitlines()]
    replay = next(line for line in lines if line[1:3] == ["cnn-small@local-1x2", "replay"])
    analytic = next(line for line in lines if line[1:3] == ["cnn-small@local-1x2", "analytic"])
    assert replay[-1].endswith("%") and analytic[-1].endswith("%")  # both predict seconds: errors shown
    assert "no measured compute profile" not in res.stderr  # the profile just measured was used
    res = runner.invoke(cli, ["sim", "profile", "-m", "cnn-small", "-c", "B7"])
    assert res.exit_code == 2 and "GPU nodes" in res.stderr


def test_calibrated_link_latency_is_alpha():
    model = _model()
    data = _cluster().to_dict()
    # A probe's round trip is only ever lengthened by what else the host runs (a lab of four nodes
    # shaped alike measured 0.11, 0.12, 0.62 and 1.82 ms): the smallest one is the links'.
    data["nodes"][0]["latency_ms"], data["nodes"][1]["latency_ms"] = 0.5, 2.0
    cluster = ClusterSpec.from_dict(data)
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster and cluster.hash != _cluster().hash
    assert "latency_ms" not in _cluster().to_dict()["nodes"][0]  # specs never calibrated keep their hash
    (t,), _ = _replay(model, cluster, [build_strategy("allreduce", model, cluster)])
    d_both = 2 * (0.5e-3 + 1_004_000 / (2 * GB)) + 5e-5
    assert t == pytest.approx(max(0.031, 0.030 + d_both) + 0.003 + 5e-4, rel=1e-9)


def test_learned_models_take_the_replay_as_input_and_keep_its_profiles(tmp_path):
    from synctune.simulator import Domain, load_simulator, make_simulator
    from synctune.simulator.features import GLOBAL_NAMES

    model, cluster = _model(b_elems=12_500_000), _cluster()
    base = build_strategy("allreduce", model, cluster)
    strategies = [_with_groups(base, {"b": g, "a": h}) for g, h in ((0, 0), (0, 1), (1, 0))]
    strategies.append(build_strategy("ps", model, cluster))
    ctx = DomainContext(model, cluster)
    replay = ReplaySimulator({}, K)
    replay.add_profile(_profile(model))
    truth = replay.predict(strategies, model, cluster)
    sim = make_simulator("rnn", epochs=3, seed=0)
    sim.use_profiles(replay)
    sim.fit([Domain(ctx, strategies, truth)])
    x, g = sim._features(encode(strategies, ctx), ctx)
    # The last global inputs are the replay's: log of its predicted iteration time first.
    np.testing.assert_allclose(g[:, len(GLOBAL_NAMES)], np.log(truth), rtol=1e-12)
    path = tmp_path / "rnn.pt"
    sim.save(path)
    again = load_simulator(path)
    assert set(again.replay.profiles) == {"two@cpu-w2"} and again.replay.constants == K
    np.testing.assert_allclose(again.predict(strategies, model, cluster), sim.predict(strategies, model, cluster),
                               rtol=1e-6)


def test_a_search_measures_the_profile_once_and_starts_from_the_replay(tmp_path, monkeypatch):
    from synctune.run.profiles import ensure_profile
    from synctune.run.simulators import make_search_simulator
    from synctune.search import Experiment
    from synctune.spec import cluster_preset
    from synctune.workload import zoo_workload

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home"))
    workload, cluster = zoo_workload("cnn-small"), cluster_preset("local-1x2")
    model = workload.spec()
    exp = Experiment.from_keys(name="x", model="cnn-small", cluster="local-1x2", simulator="rnn", budget=4)
    assert make_search_simulator(exp, model, cluster).training_free.kind == "analytic"  # nothing measured yet
    said = []
    path = ensure_profile(workload, model, cluster, said.append)
    assert path == tmp_path / "home" / "profiles" / "cnn-small@cpu-w2.json" and len(said) == 1
    stamp = path.stat().st_mtime_ns
    assert ensure_profile(workload, model, cluster, said.append) == path and len(said) == 1  # reused
    assert path.stat().st_mtime_ns == stamp
    assert make_search_simulator(exp, model, cluster).training_free.kind == "replay-calibrated"
    assert ensure_profile(workload, model, cluster_preset("B7"), said.append) is None  # GPUs: not here


def test_a_replica_subset_is_simulated_as_the_smaller_cluster_it_runs_on():
    """TAG §4.2: devices left out of the replicas take no part in synchronization. A strategy on
    one device of each of two 2-device nodes is predicted, by the analytic model and by the
    replay, exactly as the same strategy on a cluster that has only those two devices
    (independent reference: the smaller cluster's own tables), for all-reduce, PS (with local
    aggregation) and all-gather; the same strategy on every device is predicted slower."""

    from synctune.simulator import AnalyticSimulator
    from synctune.strategy import validate

    small = _cluster()
    node = small.nodes[0]
    big = dataclasses.replace(small, name="two-by-two", nodes=tuple(dataclasses.replace(n, num_devices=2)
                                                                    for n in small.nodes))
    model = ModelSpec(name="two", batch_size=8, variables=(
        VariableSpec(name="emb", shape=(5000, 32), sparse=True), VariableSpec(name="b", shape=(1000,)),
        VariableSpec(name="a", shape=(250_000,))))
    profile = ComputeProfile(model=model.name, device="cpu", workers=2, batch_size=8, forward_s=0.010,
                             backward_s=0.021, step_s=0.003, ready_s=(0.001, 0.002, 0.020))
    assert node.devices[0] == "n0:0"
    for builder in ("allreduce", "ps-lb", "parallax", "ps"):
        on_small = build_strategy(builder, model, small)
        data = on_small.to_dict()
        data["cluster"] = {"name": big.name, "hash": big.hash}
        subset = Strategy.from_dict(data)  # replicas n0:0 and n1:0 of the bigger cluster
        validate(subset, model, big)
        everywhere = build_strategy(builder, model, big)
        analytic = AnalyticSimulator()
        a_small, = analytic.predict([on_small], model, small)
        a_subset, a_all = analytic.predict([subset, everywhere], model, big)
        assert a_subset == pytest.approx(a_small, rel=1e-12), builder
        sim = ReplaySimulator({}, K)
        sim.add_profile(profile)
        sim.add_profile(dataclasses.replace(profile, workers=4))
        r_small, = sim.predict([on_small], model, small)
        r_subset, r_all = sim.predict([subset, everywhere], model, big)
        assert r_subset == pytest.approx(r_small, rel=1e-12), builder
        assert r_all > r_subset and a_all >= a_subset, builder


def _hierarchical(strategy: Strategy) -> Strategy:
    data = strategy.to_dict()
    for plan in data["plans"]:
        for shard in plan["shards"]:
            shard["synchronizer"]["algorithm"] = "hierarchical"
    return Strategy.from_dict(data)


def test_hierarchical_all_reduce_worked_by_hand():
    """Hierarchical all-reduce as the engine runs it: a reduce-scatter inside each node, the
    node's pieces all-reduced across nodes as parallel rings sharing the NIC, an all-gather
    inside each node. On 2 nodes of 2 replicas with a fast intra-node link, the replay and the
    analytic model charge it (worked by hand here) less than the flat ring over 4 replicas,
    whose every NIC carries 2(N-1)/N = 1.5 message sizes instead of 2(W-1)/W = 1 (before the
    fix both were charged the flat ring)."""

    from synctune.simulator import AnalyticSimulator

    small = _cluster()
    big = dataclasses.replace(small, name="two-by-two", nodes=tuple(
        dataclasses.replace(n, num_devices=2, intra_node_gbps=80.0, single_flow_gbps=4.0) for n in small.nodes))
    model = _model(b_elems=1000, a_elems=250_000)
    flat = build_strategy("allreduce", model, big)
    hier = _hierarchical(flat)
    sim = ReplaySimulator({}, K)
    sim.add_profile(dataclasses.replace(_profile(model), workers=4))
    t_flat, t_hier = sim.predict([flat, hier], model, big)
    m = 1_004_000
    flow, nic, intra = 0.5 * GB, GB, 10 * GB  # bytes/s of 4, 8 and 80 Gbit/s
    d_flat = 2 * 3 * (1e-4 + m / (4 * flow)) + 5e-5
    cross = min(nic, 2 * flow)  # two rings (one per local index) share each node's NIC
    # Four collectives launched (two reduces inside the node, the cross-node all-reduce, the
    # all-gather), each paying the launch cost (replay version 5).
    d_hier = (2 * 1 + 2 * 1) * 1e-4 + m * (2 * 0.5 / intra + 2 * 0.5 / cross) + 4 * 5e-5
    assert t_flat == pytest.approx(0.030 + d_flat + 0.003 + 5e-4, rel=1e-9)
    assert t_hier == pytest.approx(0.030 + d_hier + 0.003 + 5e-4, rel=1e-9)
    a_flat, a_hier = AnalyticSimulator().predict([flat, hier], model, big)
    assert a_hier < a_flat


def test_a_units_cpu_cost_is_per_other_replica_worked_by_hand():
    """From replay version 4 a unit's CPU cost is per other replica of its collective (a ring
    takes a step per peer): an all-reduce unit on four replicas pays three times the cost, on
    two once; version 3 charges it once per unit whatever the replicas."""

    model = _model()
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": 1,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    four = ClusterSpec.from_dict({"name": "four-nodes", "nodes": [{"name": f"n{i}", **node} for i in range(4)]})
    for cluster, workers in ((_cluster(), 2), (four, 4)):
        strategy = build_strategy("allreduce", model, cluster)  # one merge group: one unit
        profile = dataclasses.replace(_profile(model), workers=workers)
        for version, per_unit in ((4, 0.004 * (workers - 1)), (3, 0.004)):
            base = ReplaySimulator({}, dataclasses.replace(K, replay_version=version))
            base.add_profile(profile)
            slow = ReplaySimulator({}, dataclasses.replace(K, replay_version=version, ar_unit_s=0.004))
            slow.add_profile(profile)
            # The unit starts at the last gradient (30 ms) and ends after backward: all on the path.
            delay = slow.predict([strategy], model, cluster)[0] - base.predict([strategy], model, cluster)[0]
            assert delay == pytest.approx(per_unit, rel=1e-6), (cluster.name, version)


def test_on_cpu_workers_the_communications_cpu_work_does_not_hide_behind_backward_worked_by_hand():
    """Version 6: on a CPU cluster an iteration ends no sooner than backward, then every unit's
    CPU cost (launch and calibrated cost per other replica), then the step. Unit 'b' (ready at
    12 ms) costs 4.05 ms of CPU while backward still runs until 31 ms; version 5 hides it, version
    6 charges it after backward. A GPU cluster computes on the device: no such bound."""
    model = _model()
    strategy = _with_groups(build_strategy("allreduce", model, _cluster()), {"b": 0, "a": 1})
    gpu_node = {"instance_type": "gpu-box", "device_kind": "gpu", "device_model": "GPU X", "num_devices": 1,
                "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    gpu = ClusterSpec.from_dict({"name": "two-gpus", "nodes": [{"name": "n0", **gpu_node}, {"name": "n1", **gpu_node}]})

    def predict(version, cluster, device="cpu"):
        sim = ReplaySimulator({}, dataclasses.replace(K, replay_version=version, ar_unit_s=0.004))
        sim.add_profile(dataclasses.replace(_profile(model), device=device))
        return float(sim.predict([strategy], model, cluster)[0])

    cpu_per_unit = 5e-5 + 0.004  # launch, then one step with the other replica
    d_a = 2 * (1e-4 + 1e6 / (2 * GB)) + cpu_per_unit
    events = 0.030 + d_a + 0.003 + 5e-4  # 'a' on the link after backward, then the step
    assert predict(5, _cluster()) == pytest.approx(events, rel=1e-9)
    assert predict(6, _cluster()) == pytest.approx(0.031 + 2 * cpu_per_unit + 0.003 + 5e-4, rel=1e-9)
    assert predict(6, _cluster()) > events + 0.002
    assert predict(6, gpu, device="GPU X") == pytest.approx(events, rel=1e-9)


def test_an_all_reduce_units_cpu_cost_worked_by_hand():
    """A per-unit CPU cost lengthens each all-reduce unit by exactly that much, and a compute
    scale scales forward, backward and step."""
    model, cluster = _model(), _cluster()
    strategy = build_strategy("allreduce", model, cluster)  # one merge group: one unit
    base = ReplaySimulator({}, K)
    base.add_profile(_profile(model))
    t0 = base.predict([strategy], model, cluster)[0]
    slow = ReplaySimulator(dict(base.profiles), ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4,
                                                                ar_unit_s=0.004))
    # The unit starts at the last gradient (30 ms) and ends after backward (31 ms): all on the path.
    assert slow.predict([strategy], model, cluster)[0] - t0 == pytest.approx(0.004, rel=1e-6)
    scaled = ReplaySimulator(dict(base.profiles), ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4,
                                                                  compute_scale=0.5))
    comm = base.timeline(encode([strategy], DomainContext(model, cluster)), DomainContext(model, cluster))
    unit = float(comm["unit_s"][0])
    # Forward 10 ms + ready at 20 ms, halved: the unit starts at 15 ms; then the step (3 ms, halved).
    assert scaled.predict([strategy], model, cluster)[0] == pytest.approx(
        max(0.0155, 0.015 + unit) + 0.0015 + 5e-4, rel=1e-6)


def test_calibration_recovers_the_cpu_costs_that_generated_the_times():
    """Times generated with known CPU costs and a known compute scale (the replay's own event
    model, other constants): the calibration of the training-free replay finds those constants
    again, and predicts held-out strategies within 2%."""
    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import CalibratedReplay, Domain, calibrate_replay
    from synctune.spec import cluster_preset

    model, cluster = model_spec("ncf-small"), cluster_preset("lab-2x2")
    profile = ComputeProfile(model=model.name, device="cpu", workers=4, batch_size=model.batch_size,
                             forward_s=0.004, backward_s=0.009, step_s=0.001,
                             ready_s=tuple(0.009 * (i + 1) / len(model.variables) for i in range(len(model.variables))))
    truth = ReplayConstants(ar_unit_s=0.0012, ag_unit_s=0.004, ps_unit_s=0.0006, compute_scale=1.3,
                            iteration_s=0.003, serial_share=0.4)
    generator = ReplaySimulator({}, truth)
    generator.add_profile(profile)
    strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=3).sample_many(160)}.values())
    ctx = DomainContext(model, cluster)
    domain = Domain(ctx, strategies, generator.predict(strategies, model, cluster))
    train, test = domain.subset(range(0, len(strategies), 2)), domain.subset(range(1, len(strategies), 2))
    blank = ReplaySimulator({}, ReplayConstants())
    blank.add_profile(profile)
    fitted = calibrate_replay(blank, [train], rounds=10)
    assert fitted.compute_scale == pytest.approx(1.3, rel=0.05)
    assert fitted.ar_unit_s == pytest.approx(0.0012, rel=0.15)
    assert fitted.ag_unit_s == pytest.approx(0.004, rel=0.15)
    assert fitted.iteration_s == pytest.approx(0.003, rel=0.15)
    assert fitted.serial_share == pytest.approx(0.4, abs=0.08)
    before = np.median(np.abs(blank.predict_domain(test) / test.times_s - 1))
    sim = CalibratedReplay()
    sim.use_profiles(blank)
    sim.fit([train])
    after = np.median(np.abs(sim.predict_domain(test) / test.times_s - 1))
    assert before > 0.1 and after < 0.02, (before, after)


def test_an_unseen_model_on_a_known_cluster_replays_with_that_clusters_constants():
    """Two clusters whose communication costs CPU at different rates (a quota on one, as on the
    lab's lab-b10c), three models: calibrated on two models of both clusters, the third model
    on each cluster is predicted with that cluster's constants, within 3% of the generating
    replay's times (the reference); the constants pooled over both clusters (what an unseen
    model replayed with before) put it more than 10% off on at least one."""
    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import CalibratedReplay, Domain
    from synctune.spec import cluster_preset

    costs = {"lab-2x2": ReplayConstants(ar_unit_s=0.0012, ps_unit_s=0.0006, compute_scale=1.2),
             "lab-b12": ReplayConstants(ar_unit_s=0.006, ps_unit_s=0.004, compute_scale=2.4)}
    profiles, domains = [], []
    for name in ("ncf-small", "cnn-small", "lm-small"):
        model = model_spec(name)
        n = len(model.variables)
        profiles.append(ComputeProfile(model=name, device="cpu", workers=4, batch_size=model.batch_size,
                                       forward_s=0.004, backward_s=0.009, step_s=0.001,
                                       ready_s=tuple(0.009 * (i + 1) / n for i in range(n))))
        for preset, truth in costs.items():
            generator = ReplaySimulator({}, truth)
            for p in profiles:
                generator.add_profile(p)
            cluster = cluster_preset(preset)
            strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=1).sample_many(40)}.values())
            domains.append(Domain(DomainContext(model, cluster), strategies,
                                  generator.predict(strategies, model, cluster)))
    base = ReplaySimulator({}, ReplayConstants())
    for p in profiles:
        base.add_profile(p)
    sim = CalibratedReplay()
    sim.use_profiles(base)
    sim.fit([d for d in domains if d.ctx.model.name != "lm-small"])
    unseen = [d for d in domains if d.ctx.model.name == "lm-small"]
    assert set(sim.per_cluster) == set(costs) and not any(d.key in sim.per_domain for d in unseen)

    def errors():
        return [float(np.median(np.abs(sim.predict_domain(d) / d.times_s - 1))) for d in unseen]

    own = errors()
    sim.per_cluster = {}
    pooled = errors()
    assert max(own) < 0.03 and max(pooled) > 0.10, (own, pooled)


@pytest.mark.parametrize("version,within", [(5, 0.15), (6, 0.25)])
def test_an_unseen_model_keeps_its_own_profiles_compute(version, within):
    """Two small models whose iterations are mostly a fixed cost of their own (1.3 ms of compute,
    15 ms per iteration, as the lab's small models on quota'd CPUs) and a large one (300 ms of
    compute, no fixed cost): the constants fitted on the small two replay the large, unseen
    one within 15% of the generating replay (13% here, 9% with replay version 4: the costs per
    unit take up some of the small models' fixed cost, and from version 5 the PS cost is also
    paid by each broadcast; within 25% from version 6, 20% here: the costs per unit that take up
    the small models' fixed cost are CPU work the large one then pays after its backward) when
    the compute scale is held at the profile's (the costs per unit fitted alone, as for every
    domain never measured); fitted on them as well (the replay's fit for unseen domains
    before), more than 200% off: the fixed cost taken for slow compute."""
    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import Domain, calibrate_replay
    from synctune.simulator.replay import UNIT_COSTS
    from synctune.spec import cluster_preset

    cluster = cluster_preset("lab-2x2")
    k = ReplayConstants(replay_version=version)
    base = ReplaySimulator({}, k)
    domains = {}
    for name, compute, fixed in (("ncf-small", 0.0013, 0.015), ("cnn-small", 0.0013, 0.015),
                                 ("transformer-small", 0.3, 0.0)):
        model = model_spec(name)
        n = len(model.variables)
        profile = ComputeProfile(model=name, device="cpu", workers=4, batch_size=model.batch_size,
                                 forward_s=compute / 3, backward_s=2 * compute / 3, step_s=compute / 30,
                                 ready_s=tuple(2 * compute / 3 * (i + 1) / n for i in range(n)))
        base.add_profile(profile)
        generator = ReplaySimulator({}, dataclasses.replace(k, ar_unit_s=0.001, ps_unit_s=0.0005, iteration_s=fixed))
        generator.add_profile(profile)
        strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=2).sample_many(40)}.values())
        domains[name] = Domain(DomainContext(model, cluster), strategies, generator.predict(strategies, model, cluster))
    unseen, errors = domains["transformer-small"], []
    for fields in (UNIT_COSTS, UNIT_COSTS + ("compute_scale",)):
        sim = ReplaySimulator({}, k)
        sim.profiles = base.profiles
        sim.set_constants(calibrate_replay(sim, [domains["ncf-small"], domains["cnn-small"]], fields=fields))
        errors.append(float(np.median(np.abs(sim.predict_domain(unseen) / unseen.times_s - 1))))
    held, free = errors
    assert held < within and free > 2.0, (held, free)


def test_calibration_leaves_a_term_no_trial_moves_where_it_was():
    """Trials of a dense model have no all-gather unit (all-gather is for sparse gradients): the
    fit has nothing to say of the cost per all-gather unit and leaves it at the base, so the
    constants it gives an unseen sparse model do not charge that model an invented cost (least
    squares put it at 0.1 s before). Likewise the fixed cost per iteration for unseen domains."""
    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import Domain, calibrate_replay
    from synctune.simulator.replay import UNIT_COSTS
    from synctune.spec import cluster_preset

    model, cluster = model_spec("cnn-small"), cluster_preset("lab-2x2")
    n = len(model.variables)
    profile = ComputeProfile(model=model.name, device="cpu", workers=4, batch_size=model.batch_size,
                             forward_s=0.004, backward_s=0.009, step_s=0.001,
                             ready_s=tuple(0.009 * (i + 1) / n for i in range(n)))
    generator = ReplaySimulator({}, ReplayConstants(ar_unit_s=0.0012, ps_unit_s=0.0006, iteration_s=0.004))
    generator.add_profile(profile)
    strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=5).sample_many(80)}.values())
    domain = Domain(DomainContext(model, cluster), strategies, generator.predict(strategies, model, cluster))
    assert not (domain.encoded().kind == 2).any()  # no all-gather shard among them
    blank = ReplaySimulator({}, ReplayConstants())
    blank.add_profile(profile)
    fitted = calibrate_replay(blank, [domain])
    assert fitted.ag_unit_s == 0.0 and fitted.ar_unit_s == pytest.approx(0.0012, rel=0.15)
    assert fitted.iteration_s == pytest.approx(0.004, rel=0.15)
    unseen = calibrate_replay(blank, [domain], fields=UNIT_COSTS)
    assert (unseen.iteration_s, unseen.serial_share) == (ReplayConstants().iteration_s, 0.0)


def test_calibration_finds_where_between_the_node_latencies_alpha_lies():
    """Nodes whose probes measured 0.1 and 1.5 ms (a quota-throttled node, or a probe that ran
    beside something else): times generated with alpha at 60% of the way from the smallest to
    the largest; the fit finds that share again from the strategies' message counts, and keeps
    it out of the constants for unseen domains."""

    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import Domain, calibrate_replay
    from synctune.simulator.replay import UNIT_COSTS
    from synctune.spec import cluster_preset

    model = model_spec("cnn-small")
    preset = cluster_preset("lab-2x2")
    cluster = dataclasses.replace(preset, nodes=tuple(dataclasses.replace(n, latency_ms=ms)
                                                      for n, ms in zip(preset.nodes, (0.1, 1.5))))
    n = len(model.variables)
    profile = ComputeProfile(model=model.name, device="cpu", workers=4, batch_size=model.batch_size,
                             forward_s=0.004, backward_s=0.009, step_s=0.001,
                             ready_s=tuple(0.009 * (i + 1) / n for i in range(n)))
    generator = ReplaySimulator({}, ReplayConstants(latency_share=0.6, ar_unit_s=0.001))
    generator.add_profile(profile)
    strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=7).sample_many(80)}.values())
    domain = Domain(DomainContext(model, cluster), strategies, generator.predict(strategies, model, cluster))
    blank = ReplaySimulator({}, ReplayConstants())
    blank.add_profile(profile)
    before = np.median(np.abs(blank.predict_domain(domain) / domain.times_s - 1))
    fitted = calibrate_replay(blank, [domain])
    assert fitted.latency_share == pytest.approx(0.6, abs=0.1), fitted
    blank.set_constants(fitted)
    assert np.median(np.abs(blank.predict_domain(domain) / domain.times_s - 1)) < min(0.01, before / 5)
    # A cluster's share is its own probe's: constants for domains never measured keep the base.
    blank.set_constants(ReplayConstants())
    assert calibrate_replay(blank, [domain], fields=UNIT_COSTS).latency_share == 0.0


def test_a_search_calibrates_its_replay_on_its_own_trials_after_judging_it():
    """In a search, the replay is recalibrated at every batch from the trials measured so far
    (times generated with a 4 ms CPU cost per all-gather unit, which the links do not show):
    the all-gather strategies it over-rated are then ranked as the generator ranks them, and the
    cost it finds is the generator's. Independent reference: the generating replay."""
    from synctune.models import model_spec
    from synctune.run.simulators import CALIBRATE_AFTER, SelectedSimulator
    from synctune.search import GuidedSampler
    from synctune.simulator import BoundSimulator, CalibratedReplay
    from synctune.simulator.evaluate import pairwise_accuracy
    from synctune.spec import cluster_preset

    model, cluster = model_spec("ncf-small"), cluster_preset("lab-2x2")
    profile = ComputeProfile(model=model.name, device="cpu", workers=4, batch_size=model.batch_size,
                             forward_s=0.004, backward_s=0.009, step_s=0.001,
                             ready_s=tuple(0.009 * (i + 1) / len(model.variables) for i in range(len(model.variables))))
    generator = ReplaySimulator({}, ReplayConstants(ag_unit_s=0.004, ar_unit_s=0.001, compute_scale=1.2))
    generator.add_profile(profile)
    strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=5).sample_many(120)}.values())
    truth = generator.predict(strategies, model, cluster)
    replay = CalibratedReplay(min_trials=CALIBRATE_AFTER)
    replay.add_profile(profile)
    physical = BoundSimulator(replay, model, cluster)
    test = strategies[40:]
    before = pairwise_accuracy(physical.score(test), -truth[40:])
    sim = SelectedSimulator(physical, _Scores(), learned_ready=True)
    for upto in (4, 12, 20, 28, 40):
        sim.fit(strategies[:upto], truth[:upto])
        if upto < CALIBRATE_AFTER:
            assert model.name + "@" + cluster.name not in replay.per_domain
    after = pairwise_accuracy(physical.score(test), -truth[40:])
    assert before < 0.9 and after > 0.97, (before, after)
    fitted = replay.per_domain[f"{model.name}@{cluster.name}"]
    assert fitted.ag_unit_s == pytest.approx(0.004, rel=0.2)


class _Scores:
    """A learned model that scores everything alike (it never takes over)."""

    def score(self, items):
        return np.zeros(len(items))

    def fit(self, items, runtimes):
        pass


def _generated_domains(effect, seed: int = 0):
    """Domains (four models on two lab presets) whose "measured" times are the replay's under
    known CPU costs, times ``effect(strategies, ctx)`` (a factor per strategy the replay's event
    model has no term for), times 2% noise. Their strategies are data fixed by ``seed``: drawn by
    the object sampler kept in tests/_reference_sampler.py, whose stream does not move with the
    package's sampler (the strict rule keeps a correction on about 5 seeds in 6 with either
    sampler's draws; the figures in the tests' comments are this draw's)."""
    from _reference_sampler import GuidedSampler

    from synctune.models import model_spec
    from synctune.simulator import Domain
    from synctune.spec import cluster_preset

    rng = np.random.default_rng(seed)
    truth = ReplayConstants(ar_unit_s=0.0012, ag_unit_s=0.004, ps_unit_s=0.0006, compute_scale=1.0)
    generator, profiles, domains = ReplaySimulator({}, truth), [], []
    for name in ("ncf-small", "cnn-small", "transformer-small", "lm-small"):
        model = model_spec(name)
        n = len(model.variables)
        profile = ComputeProfile(model=name, device="cpu", workers=4, batch_size=model.batch_size, forward_s=0.004,
                                 backward_s=0.009, step_s=0.001, ready_s=tuple(0.009 * (i + 1) / n for i in range(n)))
        generator.add_profile(profile)
        profiles.append(profile)
        for preset in ("lab-2x2", "lab-b12"):
            cluster = cluster_preset(preset)
            ctx = DomainContext(model, cluster)
            strategies = list({s.hash: s for s in GuidedSampler(model, cluster, seed=seed).sample_many(60)}.values())
            times = generator.predict(strategies, model, cluster) * effect(strategies, ctx)
            domains.append(Domain(ctx, strategies, times * np.exp(rng.normal(0, 0.02, len(strategies)))))
    return domains, profiles


def _ps_share(strategies, ctx):
    b = encode(strategies, ctx)
    size = ctx.var_bytes[b.var] * b.frac
    return np.bincount(b.sid, weights=np.where(b.kind == 0, size, 0.0), minlength=b.size) / np.bincount(
        b.sid, weights=size, minlength=b.size)


def _unseen_lm_small(effect):
    """Generated domains (``_generated_domains(effect)``), a calibrated replay and a residual
    trained on every model but lm-small, and both scored on lm-small's domains: (train, test,
    calibrated, residual, {label: median |error|, label + " rank": mean pairwise accuracy})."""
    from synctune.simulator import CalibratedReplay, ResidualReplay, pairwise_accuracy

    domains, profiles = _generated_domains(effect)
    base = ReplaySimulator({}, ReplayConstants())
    for p in profiles:
        base.add_profile(p)
    train = [d for d in domains if d.ctx.model.name != "lm-small"]
    test = [d for d in domains if d.ctx.model.name == "lm-small"]
    calibrated, residual = CalibratedReplay(), ResidualReplay()
    for sim in (calibrated, residual):
        sim.use_profiles(base)
        sim.fit(train)
    err = {}
    for label, sim in (("calibrated", calibrated), ("residual", residual)):
        pred = [sim.predict_domain(d) for d in test]
        err[label] = float(np.median(np.abs(np.concatenate([p / d.times_s - 1 for p, d in zip(pred, test)]))))
        err[label + " rank"] = float(np.mean([pairwise_accuracy(p, d.times_s) for p, d in zip(pred, test)]))
    return train, test, calibrated, residual, err


def test_the_learned_residual_finds_what_the_replay_misses_and_is_the_replay_where_nothing_is():
    """The calibrated replay times a learned correction, tested on domains it never saw (unseen
    model: every domain of one model held out). (1) Where the times hold an effect the replay
    has no term for (PS-held bytes cost 60% more per share, a stand-in for the CPU work of
    serving them; with 40%, replay version 5's calibration, whose PS cost also prices the
    broadcasts, takes up enough of it that a correction is better on the mean over the
    cross-validation groups, 6.5% against 11.2%, but not on every group, and the strict rule
    keeps none), the correction ranks the unseen model's pairs far better, and its error
    stays within a third of the calibrated replay's (twice it, extrapolating its features past
    the range it was fitted on, before they were held at that range's edge). (2) Where the
    times are the replay's own plus noise, cross-validation keeps no correction for the unseen
    model (the predictions are the calibrated replay's exactly), and on the seen domains at most
    one far inside the noise."""
    for effect, expect_gain in ((lambda s, ctx: np.exp(0.6 * _ps_share(s, ctx)), True),
                                (lambda s, ctx: np.ones(len(s)), False)):
        train, test, calibrated, residual, err = _unseen_lm_small(effect)
        if expect_gain:
            # The calibration's per-unit costs, fixed cost per iteration and serial share take up
            # most of the effect's size already (12% left, mostly the unseen model's level, which
            # a correction learned on other models carries imperfectly): the correction must at
            # least halve the pairs the calibrated replay orders wrong (0.86 -> 0.95 here; with
            # a CPU cost per unit rather than per peer, 0.71 -> 0.90), its error within a third
            # of the calibrated replay's. On v0.3's rows it is below it (docs/results/simulator.md).
            assert err["residual"] < 1.35 * err["calibrated"], err
            assert 1 - err["residual rank"] <= 0.5 * (1 - err["calibrated rank"]), err
        else:
            assert residual.unseen.penalty == np.inf, (residual.unseen.cv, err)
            for d in test:
                np.testing.assert_allclose(residual.predict_domain(d), calibrated.predict_domain(d), rtol=1e-12)
            for d in train:  # seen domains: at most a correction far inside the noise
                np.testing.assert_allclose(residual.predict_domain(d), calibrated.predict_domain(d), rtol=0.005)


def test_an_unseen_models_correction_does_not_carry_other_models_levels():
    """Each model's times carry a level of its own (0.8-1.25 times the replay's) that nothing
    the replay or a strategy shows predicts: what an unseen model's correction could learn of it
    is only where the training models sit on the features that name a model (its variables, its
    sparse share), which says nothing of a new one. The unseen model (lm-small, whose 6
    variables are below every training model's) must be predicted no worse than by the
    calibrated replay; with those features in and its penalty chosen on the mean over random
    groups of domains (before), its error was 30.1% against the replay's 28.3% (though it ranked
    the pairs better, 0.95 against 0.88: the price of the rule, see the module docstring).
    Also checks which correction each kind of domain is predicted with."""
    from synctune.spec import cluster_preset

    level = {"ncf-small": 0.8, "cnn-small": 1.25, "transformer-small": 0.85, "lm-small": 1.2}
    train, test, calibrated, residual, err = _unseen_lm_small(lambda s, ctx: np.full(len(s), level[ctx.model.name]))
    assert err["residual"] <= 1.05 * err["calibrated"], err
    assert err["residual rank"] >= err["calibrated rank"] - 0.01, err

    assert residual.correction_for(test[0].ctx) is residual.unseen
    assert residual.correction_for(train[0].ctx) is residual.seen
    other = cluster_preset("lab-4x1")
    assert residual.correction_for(DomainContext(train[0].ctx.model, other)) is residual.elsewhere
    assert residual.correction_for(DomainContext(test[0].ctx.model, other)) is residual.unseen


def test_a_residual_simulator_saved_loads_back_and_predicts_the_same(tmp_path):
    """A residual simulator's file loads back (``load_simulator``: what ``simulator: FILE`` and
    ``synctune sim eval FILE`` use) and predicts what the trained object predicted."""
    from synctune.simulator import ResidualReplay, load_simulator

    domains, profiles = _generated_domains(lambda s, ctx: np.exp(0.4 * _ps_share(s, ctx)))
    base = ReplaySimulator({}, ReplayConstants())
    for p in profiles:
        base.add_profile(p)
    sim = ResidualReplay()
    sim.use_profiles(base)
    sim.fit(domains[:4])
    sim.save(tmp_path / "residual.json")
    back = load_simulator(tmp_path / "residual.json")
    for d in domains:
        np.testing.assert_allclose(back.predict_domain(d), sim.predict_domain(d), rtol=1e-9)


def test_per_node_profiles_price_each_replica_at_its_own_type():
    """Nodes of two device types (lab-b10c: quota'd CPUs of a g3 and a g4dn node), each with its
    own profile, the g3's every figure twice the g4dn's: the replay predicts what it predicts
    from one profile with the cluster's calibrated speeds saying the g3 computes at half the
    speed (the path TAG's heterogeneous replay already had, the reference), for even and uneven
    batch splits alike; and a GPU type's one-worker profile serves a cluster of several GPUs."""

    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.spec import cluster_preset

    model = model_spec("cnn-small")
    cluster = cluster_preset("lab-b10c")
    n = len(model.variables)

    def profile(device: str, k: float) -> ComputeProfile:
        return ComputeProfile(model=model.name, device=device, workers=cluster.num_devices,
                              batch_size=model.batch_size, forward_s=0.004 * k, backward_s=0.009 * k, step_s=0.001,
                              ready_s=tuple(0.009 * k * (i + 1) / n for i in range(n)))

    typed = ReplaySimulator({})
    typed.add_profile(profile("cpu-g4dn", 1.0))
    typed.add_profile(profile("cpu-g3", 2.0))
    speeds = dataclasses.replace(cluster, nodes=tuple(
        dataclasses.replace(node, compute_gflops=10.0 if node.device_model == "cpu-g3" else 20.0)
        for node in cluster.nodes))
    reference = ReplaySimulator({})
    reference.add_profile(profile("cpu", 1.0))
    strategies = GuidedSampler(model, speeds, seed=4).sample_many(40)  # uneven splits drawn on these speeds
    assert any(s.batch_split and len(set(s.batch_split)) > 1 for s in strategies)
    np.testing.assert_allclose(typed.predict(strategies, model, cluster), reference.predict(strategies, model, speeds),
                               rtol=1e-12)
    gpus = ClusterSpec.from_dict({"name": "h200x4", "nodes": [
        {"instance_type": "g4dn.12xlarge", "device_model": "NVIDIA H200", "num_devices": 4}]})
    gpu = ReplaySimulator({})
    gpu.add_profile(dataclasses.replace(profile("NVIDIA H200", 1.0), workers=1))
    gpu.predict([build_strategy("allreduce", model, gpus)], model, gpus)
    assert not gpu.fallbacks, "the H200's one-worker profile should serve the 4-GPU cluster"


def test_a_gpu_profile_carries_the_hosts_own_time_and_old_profiles_load():
    """A GPU profile's host figures round-trip; a profile without them (every CPU profile, every
    file written before) loads with none and replays as before; negative seconds are refused."""

    plain = _profile(_model())
    assert plain.launch_s is None and plain.host_s() is None and "launch_s" not in plain.to_dict()
    gpu = dataclasses.replace(plain, launch_s=0.0125, hook_s=4e-5)
    assert ComputeProfile.from_dict(gpu.to_dict()) == gpu
    assert gpu.host_s() == pytest.approx(0.0125 + 2 * 4e-5)
    with pytest.raises(SpecError, match="hook_s"):
        dataclasses.replace(plain, launch_s=0.01, hook_s=-1e-5)


def test_the_replay_ends_an_iteration_no_sooner_than_its_host_path():
    """One GPU, no communication: where the host's path (launches plus the engine's hooks on
    every variable) is longer than the device's, the iteration is that path plus the fixed cost
    per iteration, worked by hand; where it is shorter the prediction is the device's, exactly
    what the profile without host figures predicts."""

    from synctune.models import model_spec

    model = model_spec("cnn-small")
    n = len(model.variables)
    gpu = ClusterSpec.from_dict({"name": "h100x1", "nodes": [
        {"instance_type": "this-machine", "device_kind": "gpu", "device_model": "NVIDIA H100", "num_devices": 1,
         "nic_gbps": 100.0, "single_flow_gbps": 100.0, "intra_node_gbps": 100.0}]})
    base = ComputeProfile(model=model.name, device="NVIDIA H100", workers=1, batch_size=model.batch_size,
                          forward_s=0.004, backward_s=0.009, step_s=0.001,
                          ready_s=tuple(0.009 * (i + 1) / n for i in range(n)))
    strategy = [build_strategy("allreduce", model, gpu)]

    def predict(profile):
        sim = ReplaySimulator({})
        sim.add_profile(profile)
        return float(sim.predict(strategy, model, gpu)[0])

    device_only = predict(base)
    assert device_only > 0.014  # forward + backward + step at least
    host_bound = dataclasses.replace(base, launch_s=0.012, hook_s=5e-4)
    assert predict(host_bound) == pytest.approx(0.012 + n * 5e-4 + ReplayConstants().iteration_s, rel=1e-12)
    device_bound = dataclasses.replace(base, launch_s=0.003, hook_s=1e-5)
    assert predict(device_bound) == device_only


def test_the_hook_probe_measures_what_the_engine_adds_per_variable():
    """The probe's figure follows a cost planted in the engine's gradient hook: 300 us of host
    time per variable (a busy wait in every hook) shows as at least 250 us more than without it."""
    from synctune.engine.local import run_local

    free = run_local(_probe_worker, 1, (0.0,), timeout_s=300)[0]
    slowed = run_local(_probe_worker, 1, (3e-4,), timeout_s=300)[0]
    assert 0 <= free < 2e-4, free
    assert slowed - free >= 2.5e-4, (free, slowed)


def _probe_worker(rank: int, world: int, planted: float) -> float:
    import time as _time

    import torch

    from synctune.engine import core
    from synctune.engine.profile import hook_cost

    if planted:
        original = core.StrategyEngine._hook

        def slowed(self, name):
            hook = original(self, name)

            def wrapped(param):
                end = _time.perf_counter() + planted
                while _time.perf_counter() < end:  # a busy wait: sleep's granularity is coarser
                    pass
                return hook(param)
            return wrapped

        core.StrategyEngine._hook = slowed
    return hook_cost(torch.device("cpu"), variables=64, warmup=2, iters=10)


def test_each_compressors_stages_are_the_collectives_its_engine_launches():
    """The replay prices :attr:`CompressorInfo.stages` collectives per unit: for every compressor
    the engine implements, that is how many collectives its all-reduce really launches (the
    implementation's generator yields one launch per collective)."""
    import torch

    from synctune.strategy.compressors import COMPRESSORS

    for name in COMPRESSORS.names():
        info = COMPRESSORS.get(name)
        impl = info.engine(rank=2, members=[(0, 8, 6)], weight=0.5, seed=0)
        launches = sum(1 for _launch in impl.all_reduce(torch.ones(48), None, lambda _t: None))
        assert launches == info.stages == impl.stages, name
    assert COMPRESSORS.get("powersgd").stages == 2  # the P factors, then the Q factors
    assert [n for n in COMPRESSORS.names() if COMPRESSORS.get(n).low_rank] == ["powersgd"]


def test_a_powersgd_unit_pays_two_collectives_and_its_own_encoding_price_worked_by_hand():
    """Replay version 5: a PowerSGD unit runs two chained all-reduces, so it pays the latency
    2(N-1) alpha, the launch cost and the CPU cost per other replica twice (the bytes once: the
    wire ratio counts both factors), and its encoding at ``lowrank_s_per_mb``, not at the casts'
    ``compress_s_per_mb``; version 4 priced it as one collective at the casts' price. An fp16 unit
    is one collective at the casts' price in both."""

    w = VariableSpec(name="w", shape=(500, 500), dtype="float32")  # 1 MB, the only variable
    model, cluster = ModelSpec(name="two", batch_size=8, variables=(w,)), _cluster()
    profile = ComputeProfile(model="two", device="cpu", workers=2, batch_size=8, forward_s=0.010, backward_s=0.021,
                             step_s=0.003, ready_s=(0.020,))
    psgd = build_strategy("allreduce", model, cluster, compressor="powersgd", powersgd_rank=2)
    fp16 = build_strategy("allreduce", model, cluster, compressor="fp16")

    def unit_s(strategy, **constants) -> float:
        sim = ReplaySimulator({}, dataclasses.replace(K, **constants))
        sim.add_profile(profile)
        ctx = DomainContext(model, cluster)
        return float(sim.timeline(encode([strategy], ctx), ctx)["unit_s"][0])

    n_peers = 1  # two replicas
    latency_and_launch = 2 * n_peers * K.alpha_s + K.unit_s
    for version in (5, 4):
        extra_stage = latency_and_launch if version == 5 else 0.0
        base = unit_s(psgd, replay_version=version)
        assert base - unit_s(psgd, replay_version=version, alpha_s=0.0, unit_s=0.0) == pytest.approx(
            latency_and_launch + extra_stage, rel=1e-9)
        cpu = 0.004 * n_peers * (2 if version == 5 else 1)
        assert unit_s(psgd, replay_version=version, ar_unit_s=0.004) - base == pytest.approx(cpu, rel=1e-9)
        casts, lowrank = (unit_s(psgd, replay_version=version, **{f: 0.01}) - base
                          for f in ("compress_s_per_mb", "lowrank_s_per_mb"))
        assert (casts, lowrank) == pytest.approx((0.0, 0.01) if version == 5 else (0.01, 0.0), abs=1e-12)
        fp16_base = unit_s(fp16, replay_version=version)
        assert fp16_base - unit_s(fp16, replay_version=version, alpha_s=0.0, unit_s=0.0) == pytest.approx(
            latency_and_launch, rel=1e-9)
        assert unit_s(fp16, replay_version=version, compress_s_per_mb=0.01) - fp16_base == pytest.approx(0.01)


def test_each_collective_of_a_hierarchical_all_reduce_pays_its_cpu_cost_worked_by_hand():
    """Replay version 5: the engine's hierarchical all-reduce on 2 nodes of 2 replicas launches
    two reduces inside the node (one peer each), the cross-node all-reduce (one peer) and the
    all-gather inside the node (one peer): four steps with another replica at the all-reduce CPU
    cost, where the flat ring over the 4 replicas takes three (version 4 charged both three)."""

    small = _cluster()
    big = dataclasses.replace(small, name="two-by-two", nodes=tuple(
        dataclasses.replace(n, num_devices=2) for n in small.nodes))
    model = _model()
    flat = build_strategy("allreduce", model, big)  # one merge group: one unit, after backward
    hier = _hierarchical(flat)
    for version, (n_flat, n_hier) in ((5, (3, 4)), (4, (3, 3))):
        base = ReplaySimulator({}, dataclasses.replace(K, replay_version=version))
        slow = ReplaySimulator({}, dataclasses.replace(K, replay_version=version, ar_unit_s=0.004))
        for sim in (base, slow):
            sim.add_profile(dataclasses.replace(_profile(model), workers=4))
        delay = slow.predict([flat, hier], model, big) - base.predict([flat, hier], model, big)
        assert delay == pytest.approx([0.004 * n_flat, 0.004 * n_hier], rel=1e-6), version


def test_a_ps_shards_broadcasts_pay_the_ps_cpu_cost_per_round_worked_by_hand():
    """Replay version 5: after the step each PS shard's new value is broadcast (gloo's binomial
    tree: one round for two ranks), and each round costs the PS CPU cost as the push's step with
    the other replica does. Two variables on the server: the push of 'a' (on the path; 'b' is
    pushed while backward computes) and both broadcasts pay it, 3 x 4 ms; version 4 charged the
    push only."""

    model, cluster = _model(), _cluster()
    ps = build_strategy("ps", model, cluster)
    for version, paid in ((5, 3), (4, 1)):
        base = ReplaySimulator({}, dataclasses.replace(K, replay_version=version))
        slow = ReplaySimulator({}, dataclasses.replace(K, replay_version=version, ps_unit_s=0.004))
        for sim in (base, slow):
            sim.add_profile(_profile(model))
        delay = slow.predict([ps], model, cluster)[0] - base.predict([ps], model, cluster)[0]
        assert delay == pytest.approx(0.004 * paid, rel=1e-6), version
