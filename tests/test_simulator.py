"""Simulator: features and the analytic model, the ranking loss, learned rankers on real trials
(the shipped sample release), evaluation metrics, transfer, safe save/load, and the CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from synctune.cli import cli
from synctune.data import TrialDataset, pull_release
from synctune.models import model_spec
from synctune.simulator import (
    AnalyticSimulator,
    DomainContext,
    analytic_time,
    domains_from_records,
    encode,
    evaluate,
    kendall_tau,
    load_simulator,
    make_simulator,
    pairwise_accuracy,
    split_domains,
    top_k_recall,
)
from synctune.simulator.features import GLOBAL_NAMES, PRE_NAMES, RAW_NAMES, analytic_parts, per_shard_inputs
from synctune.simulator.models import ranking_loss
from synctune.spec import SpecError, cluster_preset
from synctune.strategy import build_strategy

SAMPLE = Path(__file__).resolve().parents[1] / "dataset" / "sample-local-v0"


@pytest.fixture(scope="module")
def sample_dataset(tmp_path_factory) -> TrialDataset:
    """The shipped release of 316 real trials (cnn-small, ncf-small on local-1x2, local-2x2)."""
    ds = TrialDataset(tmp_path_factory.mktemp("sample"))
    assert pull_release(str(SAMPLE), ds)["rows"] == 316
    return ds


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The learned rankers' figures below were measured with one intra-op thread: torch's float sums
    depend on the thread count, and 150 epochs of training carry that difference into the ranking
    (test_rnn_beats_analytic: 0.653 with 1 or 4 threads, 0.616 with 2 on the same seed), so the
    figures hold only where the thread count is pinned."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def domains(sample_dataset):
    return domains_from_records(sample_dataset.records())


def _builders(model, cluster):
    spec, cl = model_spec(model), cluster_preset(cluster)
    return spec, cl, {b: build_strategy(b, spec, cl) for b in ("ps", "ps-lb", "partitioned-ps", "allreduce")}


def test_analytic_model_orders_the_classic_cases():
    spec, cl, s = _builders("bert-large", "B7")
    t = dict(zip(s, AnalyticSimulator().predict(list(s.values()), spec, cl)))
    assert t["ps"] > t["ps-lb"] > t["partitioned-ps"]  # one server < balanced < balanced shards (AutoDist Fig. 6)
    assert t["allreduce"] < t["ps"]
    # Faster links, faster synchronization: the same PS strategy on 40 GbE A-nodes beats B7's 10 Gb/s flows.
    spec_a, cl_a, s_a = _builders("bert-large", "A2")
    assert AnalyticSimulator().predict([s_a["ps-lb"]], spec_a, cl_a)[0] < t["ps-lb"]


def _two_variable_domain():
    """Two dense float32 variables (4000 and 2000 bytes) on two 1-device nodes with 8 Gbit/s
    (1e9 B/s) links: small enough to work AutoSync's Eq. 2 and the ring formula out by hand."""
    from synctune.spec import ClusterSpec, ModelSpec, VariableSpec

    spec = ModelSpec(name="two", variables=(VariableSpec(name="a", shape=(1000,)), VariableSpec(name="b", shape=(500,))),
                     batch_size=1)
    link = {"instance_type": "x", "device_kind": "cpu", "device_model": "cpu", "num_devices": 1, "nic_gbps": 8.0,
            "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    cluster = ClusterSpec.from_dict({"name": "two-nodes", "nodes": [dict(link), dict(link)]})
    return spec, cluster


def test_analytic_times_match_the_formulas_worked_by_hand():
    from synctune.strategy import AllReduceSynchronizer, PSSynchronizer, ShardPlan, Strategy, VariablePlan

    spec, cluster = _two_variable_domain()
    ctx = DomainContext(spec, cluster)
    phi, delta = ctx.constants.phi, ctx.constants.delta

    def strategy(sync):
        return Strategy.over(spec, cluster, [VariablePlan(variable=v.name, partition=(1,),
                                                          shards=(ShardPlan(synchronizer=sync),))
                                             for v in spec.variables])

    allreduce, ps = strategy(AllReduceSynchronizer(group=0)), strategy(PSSynchronizer(placement="node0:0"))
    got = analytic_time(encode([allreduce, ps], ctx), ctx)
    # Ring all-reduce, N = 2, one merge group: 2(N-1)/N * 6000 B / 1e9 B/s, a kernel per shard,
    # and the group's 2(N-1) message overheads once.
    ring = 6000 / 1e9 + 2 * delta + phi * 2
    # PS on node0: node1 sends 6000 B up and receives 6000 B down over one 1e9 B/s flow (the NIC
    # carries the same), plus per shard one message overhead and one kernel.
    server = 12000 / 1e9 + 2 * (phi + delta)
    compute = 6 * 1500 * 1 / 5e10  # FLOPs per parameter-sample x parameters x batch / CPU FLOP/s
    np.testing.assert_allclose(got, [max(compute, ring), max(compute, server)], rtol=1e-12)
    parts = analytic_parts(encode([ps], ctx), ctx)
    np.testing.assert_allclose(parts["per_server"][0], [server, 0.0], rtol=1e-12)


def test_group_order_is_the_position_among_merge_groups():
    """The raw feature ``group_order`` is a merge group's index over the number of groups (it
    once divided by the number of all-reduce shards)."""
    from synctune.strategy import AllReduceSynchronizer, ShardPlan, Strategy, VariablePlan

    spec, cluster = _two_variable_domain()
    ctx = DomainContext(spec, cluster)
    plans = [VariablePlan(variable="a", partition=(3,), shards=tuple(
                 ShardPlan(synchronizer=AllReduceSynchronizer(group=g)) for g in (0, 0, 1))),
             VariablePlan(variable="b", partition=(1,), shards=(ShardPlan(synchronizer=AllReduceSynchronizer(group=1)),))]
    batch = encode([Strategy.over(spec, cluster, plans)], ctx)
    from synctune.simulator.features import message_sizes, raw_features

    col = RAW_NAMES.index("group_order")
    order = raw_features(batch, ctx, message_sizes(batch, ctx)[0] * batch.ratio)[:, col]
    assert order.tolist() == [0.0, 0.0, 0.5, 0.5]  # 2 groups, 4 all-reduce shards


def test_compression_and_local_aggregation_reduce_modelled_traffic():
    spec, cl = model_spec("vgg16"), cluster_preset("B7")
    plain = build_strategy("allreduce", spec, cl)
    fp16 = build_strategy("allreduce", spec, cl, compressor="fp16")
    ps = build_strategy("ps-lb", spec, cl)
    ps_local = build_strategy("ps-lb", spec, cl, local_aggregation=True)
    t = AnalyticSimulator().predict([plain, fp16, ps, ps_local], spec, cl)
    assert t[1] < t[0] and t[3] < t[2]


def test_features_are_finite_and_scale_free():
    """Times are divided by the domain's reference time: doubling every link speed changes the
    predicted seconds but not the normalised communication features."""
    from synctune.spec import ClusterSpec

    spec = model_spec("bert-large")
    slow = cluster_preset("B11")
    data = slow.to_dict()
    for node in data["nodes"]:
        for key in ("nic_gbps", "single_flow_gbps", "intra_node_gbps"):
            node[key] *= 2
    data["name"] = "B11-doubled"
    fast = ClusterSpec.from_dict(data)
    strategy = build_strategy("partitioned-ps", spec, slow, local_aggregation=True)
    feats = {}
    for cl in (slow, fast):
        ctx = DomainContext(spec, cl)
        x, g = per_shard_inputs(encode([strategy], ctx), ctx)
        assert np.isfinite(x).all() and np.isfinite(g).all()
        assert x.shape[1] == len(RAW_NAMES) + len(PRE_NAMES) and g.shape[1] == len(GLOBAL_NAMES)
        feats[cl.name] = (x, g, AnalyticSimulator().predict([strategy], spec, cl)[0], ctx)
    comm = [i for i, n in enumerate(GLOBAL_NAMES) if n.split("_", 1)[1] in ("ps_flow", "ps_nic", "ps_intra", "t_ps")]
    np.testing.assert_allclose(feats[slow.name][1][0, comm], feats[fast.name][1][0, comm], rtol=1e-9)
    assert feats[fast.name][2] < feats[slow.name][2]  # while the modelled time does drop


def test_ranking_loss_prefers_correct_order_and_penalises_partitions():
    f = torch.tensor([1.0, 2.0])
    parts = torch.tensor([1.0, 1.0])
    good = ranking_loss(torch.tensor([0.0, 5.0]), f, parts, sigma=0.0)
    bad = ranking_loss(torch.tensor([5.0, 0.0]), f, parts, sigma=0.0)
    assert good < bad
    # Equal runtimes: with the penalty, the more partitioned strategy counts as the slower one.
    same = torch.tensor([1.0, 1.0])
    more_parts = torch.tensor([4.0, 1.0])
    assert ranking_loss(torch.tensor([0.0, 0.0]), same, more_parts, sigma=0.1) > 0
    assert ranking_loss(torch.tensor([0.0, 0.0]), same, torch.tensor([1.0, 1.0]), sigma=0.1) == 0


def test_metrics():
    truth = np.array([1.0, 2.0, 3.0, 4.0])
    assert pairwise_accuracy(truth * 10, truth) == 1.0
    assert pairwise_accuracy(-truth, truth) == 0.0
    assert pairwise_accuracy(np.zeros(4), truth) == 0.5
    assert kendall_tau(truth, truth) == pytest.approx(1.0)
    assert top_k_recall(np.array([4.0, 3.0, 2.0, 1.0]), truth, k=2) == 0.0
    assert top_k_recall(truth, truth, k=2) == 1.0


def test_rnn_beats_analytic_on_held_out_real_trials(domains):
    assert [d.key for d in domains] == ["cnn-small@local-1x2", "cnn-small@local-2x2", "ncf-small@local-1x2",
                                        "ncf-small@local-2x2"]
    train, test = split_domains(domains, held_out=0.3, seed=0)
    rnn = make_simulator("rnn", epochs=150, seed=0).fit(train)
    acc = np.mean([r["pairwise_accuracy"] for r in evaluate(rnn, test)])
    base = np.mean([r["pairwise_accuracy"] for r in evaluate(AnalyticSimulator(), test)])
    # Measured on the shipped release (seeded, one thread): 0.653 against the analytic model's 0.602.
    assert acc > base + 0.03, (acc, base)
    assert acc > 0.64, acc


#: Held-out pairwise accuracy each ranker reaches on the shipped release (seeded), less a margin of
#: about 0.02: linear measured 0.745, GAT 0.684 (the analytic model 0.602, chance 0.5).
_REACHED = {"linear": 0.72, "gat": 0.66}


@pytest.mark.parametrize("kind", ["linear", "gat"])
def test_other_rankers_learn(domains, kind):
    train, test = split_domains(domains, held_out=0.3, seed=0)
    sim = make_simulator(kind, epochs=60, seed=0).fit(train)
    acc = np.mean([r["pairwise_accuracy"] for r in evaluate(sim, test)])
    base = np.mean([r["pairwise_accuracy"] for r in evaluate(AnalyticSimulator(), test)])
    assert acc > base + 0.03, (acc, base)
    assert acc > _REACHED[kind], acc


def test_save_load_round_trip_and_corrupt_files(domains, tmp_path):
    sim = make_simulator("rnn", epochs=5, seed=1).fit(domains[:1])
    path = tmp_path / "sim.pt"
    sim.save(path)
    back = load_simulator(path)
    d = domains[1]
    np.testing.assert_allclose(back.predict_domain(d), sim.predict_domain(d), rtol=1e-6)
    data = bytearray(path.read_bytes())
    (tmp_path / "trunc.pt").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(SpecError, match="not a readable synctune simulator file"):
        load_simulator(tmp_path / "trunc.pt")
    torch.save({"format": "something-else"}, tmp_path / "other.pt")
    with pytest.raises(SpecError, match="not a synctune simulator file"):
        load_simulator(tmp_path / "other.pt")

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"format": "synctune-simulator", "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(SpecError, match="not a readable synctune simulator file"):
        load_simulator(tmp_path / "evil.pt")  # weights_only: the object is never rebuilt


def test_cli_train_eval_transfer_and_score(sample_dataset, tmp_path):
    runner = CliRunner()
    sim = tmp_path / "rnn.pt"
    res = runner.invoke(cli, ["sim", "train", "--model", "rnn", "--data", str(sample_dataset.root), "--held-out", "0.3",
                              "--epochs", "40", "-o", str(sim)])
    assert res.exit_code == 0, res.output
    # Not a terminal (as in a log): the training says how far it is, a line per tenth of the epochs.
    epochs = [line for line in res.stderr.splitlines() if line.startswith("train rnn: epoch ")]
    assert [line.split()[3] for line in epochs] == [f"{e}/40," for e in range(4, 41, 4)], res.stderr
    res = runner.invoke(cli, ["sim", "eval", str(sim), "--data", str(sample_dataset.root), "--held-out", "0.3"])
    assert res.exit_code == 0, res.output
    assert "mean pairwise ranking accuracy: analytic " in res.output and f", rnn ({sim}) " in res.output
    assert "replay" in res.output and "|err| median" in res.output

    transfer = tmp_path / "transfer.pt"
    res = runner.invoke(cli, ["sim", "train", "--model", "rnn", "--data", str(sample_dataset.root), "--domain",
                              "cnn-small@local-2x2", "--epochs", "20", "-o", str(transfer)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["sim", "eval", str(transfer), "--data", str(sample_dataset.root), "--domain",
                              "ncf-small@local-2x2"])
    assert res.exit_code == 0 and "ncf-small@local-2x2" in res.output

    strategies = []
    for b in ("ps", "allreduce"):
        out = tmp_path / f"{b}.json"
        runner.invoke(cli, ["strategy", "build", b, "-m", "cnn-small", "-c", "local-2x2", "-o", str(out)])
        strategies.append(str(out))
    res = runner.invoke(cli, ["sim", "score", str(sim), *strategies])
    assert res.exit_code == 0 and "ps.json" in res.output and "allreduce.json" in res.output
    res = runner.invoke(cli, ["sim", "eval", str(sim), "--data", str(sample_dataset.root), "--domain", "gpt@B7"])
    assert res.exit_code == 2 and "no successful trials for domain(s) gpt@B7" in res.stderr
    res = runner.invoke(cli, ["sim", "score", str(tmp_path / "nope.pt"), *strategies])
    assert res.exit_code == 2 and "no such simulator file" in res.stderr


def test_cross_domain_protocols_never_train_on_what_they_test(sample_dataset):
    """`sim eval --protocol`: held out, an unseen model, an unseen cluster, both. No fold's test
    strategies are among its training ones, an unseen model's (cluster's) folds train on no domain
    of that model (cluster), and every protocol tests each domain it can."""
    from synctune.simulator import domains_from_records, protocol_folds

    doms = domains_from_records(sample_dataset.records())
    keys = {d.key for d in doms}
    assert keys == {"cnn-small@local-1x2", "cnn-small@local-2x2", "ncf-small@local-1x2", "ncf-small@local-2x2"}
    (name, train, test), = protocol_folds(doms, "held-out", held_out=0.3, seed=0)
    for tr, te in zip(train, test):
        assert tr.key == te.key and not {s.hash for s in tr.strategies} & {s.hash for s in te.strategies}
    for protocol, part in (("unseen-model", lambda k: k.split("@")[0]), ("unseen-cluster", lambda k: k.split("@")[1])):
        folds = protocol_folds(doms, protocol)
        assert sorted(d.key for _f, _tr, test in folds for d in test) == sorted(keys)
        for fold, train, test in folds:
            assert {part(d.key) for d in test} == {fold}
            assert fold not in {part(d.key) for d in train}
    folds = protocol_folds(doms, "unseen-both")
    assert [(f, [d.key for d in tr], [d.key for d in te]) for f, tr, te in folds] == [
        ("cnn-small@local-1x2", ["ncf-small@local-2x2"], ["cnn-small@local-1x2"]),
        ("ncf-small@local-2x2", ["cnn-small@local-1x2"], ["ncf-small@local-2x2"])]

    runner = CliRunner()
    res = runner.invoke(cli, ["sim", "eval", "--data", str(sample_dataset.root), "--protocol", "unseen-model",
                              "--protocol", "held-out", "--train", "linear", "--epochs", "5"])
    assert res.exit_code == 0, res.output
    # Not a terminal: a line per model trained, numbered, so a long evaluation in a log is not silent.
    progress = [line.split(":")[0] for line in res.stderr.splitlines() if line.startswith("[")]
    assert progress == ["[1/3] unseen-model cnn-small", "[2/3] unseen-model ncf-small", "[3/3] held-out held-out"], \
        res.stderr
    lines = [line.split() for line in res.output.splitlines()]
    trained = [line for line in lines if line[:1] == ["unseen-model"] and line[2:4] == ["linear", "(trained)"]]
    assert sorted(line[1] for line in trained) == sorted(keys) + ["overall"]
    assert "unseen-model: mean pairwise ranking accuracy: analytic" in res.output
    assert "held-out: mean pairwise ranking accuracy: analytic" in res.output
    res = runner.invoke(cli, ["sim", "eval", "--data", str(sample_dataset.root), "--train", "rnn"])
    assert res.exit_code == 2 and "--train needs --protocol" in res.stderr


def test_failed_trials_are_not_training_data(sample_dataset):
    rec = sample_dataset.records()[0]
    failed = dataclasses.replace(rec, record_id="x", status="failed", mean_s=None)
    assert sum(len(d.strategies) for d in domains_from_records([rec, failed])) == 1


def test_the_shipped_simulator_is_the_default_and_transfers(tmp_path, monkeypatch):
    """`simulator: pretrained` (an experiment's default) loads the simulator shipped in the
    package; a search starts from it as a transferred model (fine-tuned, never re-initialised)
    and judges it against the training-free model from its first trials."""
    from synctune.run.simulators import SelectedSimulator, make_search_simulator
    from synctune.search import Experiment
    from synctune.simulator import load_simulator, pretrained_info, pretrained_path

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home"))
    assert pretrained_path().is_file()
    info = pretrained_info()
    sim = load_simulator("pretrained")
    assert sim.learned and sim.kind == info["kind"]
    exp = Experiment.from_keys(name="p", model="cnn-small", cluster="local-2x2", budget=4)
    assert exp.search.simulator == "pretrained"
    bound = make_search_simulator(exp, model_spec("cnn-small"), cluster_preset("local-2x2"))
    assert isinstance(bound, SelectedSimulator) and bound.ready and bound.learned.transfer
    before = {k: v.clone() for k, v in bound.learned.simulator.net.state_dict().items()}
    strategies = [build_strategy(b, model_spec("cnn-small"), cluster_preset("local-2x2"))
                  for b in ("allreduce", "ps", "parallax", "horovod")]
    bound.fit(strategies, np.array([0.02, 0.05, 0.03, 0.021]))
    after = bound.learned.simulator.net.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # fine-tuned
    # ... from the shipped weights: they moved a little (a fresh initialisation is uncorrelated).
    a = torch.cat([before[k].flatten().float() for k in before])
    b = torch.cat([after[k].flatten().float() for k in before])
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.95
