"""The search's memory budget: experiment settings, the budget's arithmetic,
the search never proposing what it says does not fit, trials judged ``oom`` on their measured
peak, and a budget that nothing fits refused before any trial.

References are independent of the code under test: a fit rule written here (a fake check), a
line through known points, measured trial memory from real 2-process trials."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from synctune.engine.measure import OPTIMIZERS
from synctune.models import model_spec
from synctune.search.algorithm import StrategySearch
from synctune.search.interface import MemoryCheck
from synctune.search.experiment import TRIAL_OPTIMIZERS, Experiment
from synctune.simulator.memory import GIB, ActivationFigures, MemoryBudget
from synctune.spec import SpecError, cluster_preset
from synctune.strategy import Strategy, build_strategy, validate
from synctune.strategy.schema import PSSynchronizer, ShardSynchronizer

from _searches import ROOT, search_env


def test_the_experiment_names_the_optimizers_the_engine_steps():
    assert TRIAL_OPTIMIZERS == OPTIMIZERS


@pytest.mark.parametrize("keys, message", [
    ({"memory_gib": -1}, "search.memory_gib: expected a non-negative number of GiB"),
    ({"memory_headroom": 1.0}, "search.memory_headroom: expected a number in [0, 1)"),
    ({"shard": "yes"}, "search.shard: expected auto, true or false"),
    ({"optimizer": "lamb"}, "trial.optimizer: expected one of sgd, adam"),
    ({"fsdp_trials": -2}, "baselines.fsdp_trials: expected auto or an integer from 0 to"),
])
def test_bad_budget_settings_are_refused_naming_the_key(keys, message):
    section = {"memory_gib": "search", "memory_headroom": "search", "shard": "search", "optimizer": "trial",
               "fsdp_trials": "baselines"}[next(iter(keys))]
    base = {"name": "t", "domain": {"model": "cnn-small", "cluster": "local-1x2"}, "search": {"budget": 3}}
    base.setdefault(section, {}).update(keys)
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Experiment.from_dict(base)


def test_activation_figures_take_medians_where_measured_and_a_line_elsewhere():
    figures = ActivationFigures({8: [100, 300, 200], 4: [110]})
    assert figures(8) == 200 and figures(4) == 110
    # A line through (4, 110) and (8, 200): slope 22.5 per sample.
    assert figures(16) == 110 + 22.5 * 12
    assert figures(2) == 110 - 22.5 * 2
    assert ActivationFigures({8: [80]})(4) == 40  # one batch size seen: proportional to the batch
    assert ActivationFigures()(8) == 0


def test_the_budget_is_the_given_gib_less_headroom_else_the_clusters_device_memory():
    model, cluster = model_spec("bert-tiny"), cluster_preset("B7")
    skeleton = build_strategy("allreduce", model, cluster)
    n = len(skeleton.replicas)
    assert MemoryBudget(model, cluster, gib=2, headroom=0.25).limits(skeleton) == [int(1.5 * GIB)] * n
    assert MemoryBudget(model, cluster, headroom=0.0).limits(skeleton) == [
        cluster.node_of(d).device_memory_bytes for d in skeleton.replicas]


def test_replicated_adam_outgrows_a_budget_that_sharding_fits():
    """bert-tiny's parameters, gradients and two Adam moments are about four times its 16.9 MiB
    of weights on every replica; sharded over 4 ranks, its state is a quarter of that."""
    model, cluster = model_spec("bert-tiny"), cluster_preset("lab-2x2")
    weights = sum(v.num_bytes for v in model.variables)
    budget = MemoryBudget(model, cluster, gib=3.2 * weights / GIB, headroom=0.0, optimizer="adam")
    assert not budget.fits(build_strategy("allreduce", model, cluster))
    assert budget.fits(build_strategy("shard", model, cluster, depth=2, reshard=True))
    peak, name, _fits = budget.smallest()
    assert name.startswith("shard") and peak < 3.2 * weights


class _NoPS(MemoryCheck):
    """A fit rule written here: a strategy fits when at most 45% of its shards go through a PS
    (the builders: all-reduce fits, PS-LB and partitioned PS do not)."""

    def __init__(self) -> None:
        self.fitted = []

    def fits(self, strategy: Strategy) -> bool:
        kinds = [isinstance(s.synchronizer, PSSynchronizer) for _p, _i, s in strategy.iter_shards()]
        return sum(kinds) <= 0.45 * len(kinds)

    def fit(self, strategies, breakdowns) -> None:
        self.fitted.append(len(strategies))


def _time(strategy: Strategy) -> float:
    return 1.0 + 0.01 * len(strategy.plans) + 0.001 * sum(p.num_shards for p in strategy.plans)


@pytest.mark.parametrize("algorithm", ["random-guided", "random", "coordinate-descent", "genetic"])
def test_the_search_never_proposes_what_the_memory_check_says_does_not_fit(algorithm):
    from synctune.simulator import AnalyticSimulator, BoundSimulator

    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=14, algorithm=algorithm,
                               proposals=60, candidates=4, seed=3, sim_evaluations=300,
                               baselines=["allreduce", "ps-lb", "partitioned-ps"])
    check = _NoPS()
    sim = BoundSimulator(AnalyticSimulator(), model, cluster) if algorithm not in ("random", "random-guided") else None
    algo = StrategySearch(model, cluster, exp, sim, memory=check)
    assert algo.over_budget_baselines == ["ps-lb", "partitioned-ps"]
    asked = 0
    while (p := algo.ask()) is not None:
        validate(p.strategy, model, cluster)
        assert check.fits(p.strategy), p.trial_id
        algo.tell(p.trial_id, _time(p.strategy))
        asked += 1
    assert asked >= 8 and check.fitted  # the check learned where the simulator does


class _Refuses(MemoryCheck):
    """A fit rule written here: nothing fits once the baselines are done (``open`` False)."""

    def __init__(self) -> None:
        self.open = True

    def fits(self, strategy: Strategy) -> bool:
        return self.open

    def fit(self, strategies, breakdowns) -> None:
        pass


def test_a_round_the_budget_emptied_draws_afresh_and_an_exhausted_one_stops():
    """A round emptied by the budget is followed by fresh rounds (up to MAX_EMPTY_ROUNDS); a round
    with nothing new and nothing refused ends the search at once (it drew 20 rounds before)."""
    from synctune.search.algorithm import MAX_EMPTY_ROUNDS

    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=12, algorithm="random-guided",
                               candidates=3, seed=5, baselines=["allreduce"])
    check = _Refuses()
    refused = StrategySearch(model, cluster, exp, memory=check)
    p = refused.ask()
    refused.tell(p.trial_id, 1.0)
    check.open = False
    assert refused.ask() is None and refused.exhausted
    assert refused.rounds == MAX_EMPTY_ROUNDS and refused.over_budget > MAX_EMPTY_ROUNDS

    class _Nothing:  # a round policy with nothing new left to propose
        def propose(self, search, round_, k):
            return []

    for memory in (None, _Refuses()):
        done = StrategySearch(model, cluster, exp, memory=memory)
        p = done.ask()
        done.tell(p.trial_id, 1.0)
        done.policy = _Nothing()
        assert done.ask() is None and done.exhausted and done.rounds == 1


def test_a_search_with_a_memory_check_resumes_exactly():
    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=12, algorithm="random-guided",
                               candidates=3, seed=5)
    full = StrategySearch(model, cluster, exp, memory=_NoPS())
    order = []
    while (p := full.ask()) is not None:
        full.tell(p.trial_id, _time(p.strategy), memory=[{"peak_bytes": 1}])
        order.append(p.strategy.hash)
    part = StrategySearch(model, cluster, exp, memory=_NoPS())
    for _ in range(7):
        p = part.ask()
        part.tell(p.trial_id, _time(p.strategy), memory=[{"peak_bytes": 1}])
    resumed = StrategySearch.from_state(json.loads(json.dumps(part.state())), model, cluster, exp, memory=_NoPS())
    assert list(resumed.trials[-1].memory) == [{"peak_bytes": 1}]
    rest = []
    while (p := resumed.ask()) is not None:
        resumed.tell(p.trial_id, _time(p.strategy))
        rest.append(p.strategy.hash)
    assert [t.strategy.hash for t in part.trials] + rest == order


def test_a_resumed_search_judges_with_the_probe_the_interrupted_one_measured():
    """The probe's figures travel in the search's state: a search resumed with a budget whose own
    probe measured three times the activations (a second probe differs) proposes what the
    uninterrupted one did. The limit sits where that difference decides what fits (the shard
    builder fits with the first figure, not with the second)."""

    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    shard = build_strategy("shard", model, cluster)

    def budget(figure: int) -> MemoryBudget:
        return MemoryBudget(model, cluster, gib=limit / GIB, headroom=0.0, optimizer="adam",
                            probe=ActivationFigures({model.batch_size: [figure]}))

    limit = 2**40
    limit = max(budget(0).peaks(shard)) + 2 * 2**20  # the builder fits with 1 MiB of activations, not with 3 MiB
    assert budget(2**20).fits(shard) and not budget(3 * 2**20).fits(shard)
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=10, algorithm="random-guided",
                               candidates=3, seed=2, baselines=["allreduce", "shard"])
    full = StrategySearch(model, cluster, exp, memory=budget(2**20), shard_prob=1.0)
    order = []
    while (p := full.ask()) is not None:
        full.tell(p.trial_id, _time(p.strategy))
        order.append(p.strategy.hash)
    part = StrategySearch(model, cluster, exp, memory=budget(2**20), shard_prob=1.0)
    for _ in range(4):
        p = part.ask()
        part.tell(p.trial_id, _time(p.strategy))
    state = json.loads(json.dumps(part.state()))
    resumed = StrategySearch.from_state(state, model, cluster, exp, memory=budget(3 * 2**20), shard_prob=1.0)
    rest = []
    while (p := resumed.ask()) is not None:
        resumed.tell(p.trial_id, _time(p.strategy))
        rest.append(p.strategy.hash)
    assert [t.strategy.hash for t in part.trials] + rest == order
    assert resumed.memory.fits(shard)


def test_per_runtime_residual_learns_what_fsdp2_costs_and_the_search_follows():
    """The reference is a timing rule written here: strategies FSDP2 runs (resharded units) take
    three times the analytic model's prediction, the engine's take it as predicted. Scaled per
    runtime after a fit, the simulator ranks every pair of strategies as that rule does; and a
    search over sharded draws, told those times, proposes FSDP2-run strategies in its later
    rounds far less often than the same search with the bare simulator."""
    from synctune.engine.runtimes import executor_for, executor_names
    from synctune.simulator import AnalyticSimulator, BoundSimulator, RuntimeResidual
    from synctune.search.sampler import GuidedSampler

    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    bare = BoundSimulator(AnalyticSimulator(), model, cluster)

    def runtime_class(strategy) -> str:
        return executor_for(strategy).name

    def true_s(strategies) -> np.ndarray:
        base = -bare.score(strategies)
        return base * np.array([3.0 if runtime_class(s) == "fsdp-plans" else 1.0 for s in strategies])

    draws = GuidedSampler(model, cluster, seed=4, shard_prob=1.0).sample_many(60)
    assert {runtime_class(s) for s in draws} == {"fsdp-plans", "engine"}
    sim = RuntimeResidual(BoundSimulator(AnalyticSimulator(), model, cluster), runtime_class, executor_names)
    assert np.allclose(sim.score(draws), bare.score(draws))  # nothing learned: the inner's scores
    sim.fit(draws[:20], true_s(draws[:20]))
    assert sim.factors == pytest.approx({"fsdp-plans": 3.0, "engine": 1.0})
    rest = draws[20:]
    assert np.array_equal(np.argsort(sim.score(rest), kind="stable"), np.argsort(-true_s(rest), kind="stable"))
    assert not np.array_equal(np.argsort(bare.score(rest), kind="stable"), np.argsort(-true_s(rest), kind="stable"))

    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=24, algorithm="autodist",
                               proposals=80, candidates=4, seed=1, baselines=["shard"])
    late = {}
    for name, simulator in (("bare", BoundSimulator(AnalyticSimulator(), model, cluster)),
                            ("residual", RuntimeResidual(BoundSimulator(AnalyticSimulator(), model, cluster),
                                                         runtime_class, executor_names))):
        algo = StrategySearch(model, cluster, exp, simulator, shard_prob=1.0)
        kinds = []
        while (p := algo.ask()) is not None:
            kinds.append(runtime_class(p.strategy))
            algo.tell(p.trial_id, float(true_s([p.strategy])[0]))
        late[name] = kinds[len(kinds) // 2:].count("fsdp-plans")
    assert late["residual"] < late["bare"], late


def test_a_trial_over_its_budget_is_oom_and_ranks_nowhere():
    from synctune.run.slices import judge_memory

    result = {"status": "ok", "mean_s": 0.1, "extra": {"memory": {"peak_bytes": [90, 120]}}}
    judged = judge_memory(result, [100, 100])
    assert judged["status"] == "oom" and "rank 1" in judged["error"] and judged["mean_s"] == 0.1
    assert judge_memory(result, [200, 200])["status"] == "ok"
    assert judge_memory(result, [None, None])["status"] == "ok"
    assert judge_memory(dict(result, status="failed"), [1, 1])["status"] == "failed"


def test_the_single_process_probe_agrees_with_a_real_trials_activation_figure():
    """The figure a search judges with before any trial (one process, here) against the one a real
    2-process all-reduce trial measures (its probe's peak less parameters, optimizer state,
    buffers and gradients), for Adam on bert-tiny."""
    from synctune.engine import TrialConfig, run_trial_local
    from synctune.engine.memory import breakdown_from_row, single_process_activations
    from synctune.simulator.memory import reference_activations
    from synctune.workload.zoo import zoo_workload

    model, cluster = model_spec("bert-tiny"), cluster_preset("local-1x2")
    workload = zoo_workload("bert-tiny")
    strategy = build_strategy("allreduce", model, cluster)
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=2, optimizer="adam"), workload=workload)
    assert result.ok, result.error
    measured = reference_activations(strategy, breakdown_from_row(result.extra["memory"]))
    probe = single_process_activations(workload, [model.batch_size], optimizer="adam")
    for batch, figure in measured:
        assert probe[batch] == pytest.approx(figure, rel=0.02), (probe, measured)


def test_a_split_strategys_breakdown_is_no_reference_for_unsplit_activations():
    # A Megatron plan's ranks hold a slice of the split blocks' activations: learned as the
    # strategy-independent figure, it would book every unsplit strategy of that batch too little.
    from synctune.simulator.memory import reference_activations

    model, cluster = model_spec("transformer-small"), cluster_preset("local-2x2")
    breakdown = [{"peak_bytes": 1000, "params_bytes": 100, "grads_bytes": 100, "optimizer_state_bytes": 100,
                  "comm_buffers_bytes": 0}] * cluster.num_devices
    plain = build_strategy("allreduce", model, cluster)
    assert reference_activations(plain, breakdown) == [(b, 700) for b in plain.batch_split]
    split = build_strategy("megatron", model, cluster, dp="allreduce")
    assert split.tensor_parallel is not None and all(s.synchronizer.kind == "allreduce"
                                                     for _p, _i, s in split.iter_shards())
    assert reference_activations(split, breakdown) == []


def test_a_budget_nothing_fits_is_refused_before_any_trial(tmp_path):
    exp = tmp_path / "tight.yaml"
    exp.write_text("name: tight\nmodel: bert-tiny\ncluster: local-1x2\nbudget: 3\nsimulator: replay\n"
                   "memory_gib: 0.01\noptimizer: adam\nddp_trials: 0\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "smallest predicted peak is" in lines[0] and "search.memory_gib" in lines[0], lines
    assert "Traceback" not in out.stderr
    assert not list(home.rglob("*.parquet"))  # no trial ran, nothing was recorded


def test_a_search_under_a_budget_replicated_training_does_not_fit(tmp_path):
    """A real search (Ray Tune, 2 local workers, Adam) at a budget between what the memory model
    predicts for replicated training and for sharded: tuned DDP and the all-reduce builder are
    never run, FSDP2 is tuned, every searched strategy shards, and every trial's measured peak
    (its own probe, not the model) is within the budget or the trial is ``oom``."""
    from synctune.data import TrialDataset

    model, cluster = model_spec("transformer-small"), cluster_preset("local-1x2")
    weights = sum(v.num_bytes for v in model.variables)
    limit_mib = 6.4 if weights < 2**20 else None
    assert limit_mib is not None  # transformer-small: 0.88 MiB of weights; replicated Adam ~6.7 MiB, ZeRO-2 ~6.3 MiB, FSDP2 ~4.7 MiB
    exp = tmp_path / "tight.yaml"
    exp.write_text("name: tight\nmodel: transformer-small\ncluster: local-1x2\nbudget: 4\nalgorithm: random-guided\n"
                   f"memory_gib: {limit_mib / 1024}\nmemory_headroom: 0\noptimizer: adam\nwarmup: 1\niters: 3\n"
                   "baselines: [allreduce, 'shard:depth=2']\nddp_trials: 2\nfsdp_trials: 2\nconfirm_rounds: 2\n"
                   "confirm_iters: 2\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tuned torch DDP skipped: replicated training does not fit" in out.stderr
    assert "builder baselines over the memory budget, not trialled: allreduce" in out.stderr
    rows = TrialDataset(home / "dataset").records()
    assert not [r for r in rows if r.runtime == "ddp"]
    assert len([r for r in rows if r.runtime == "fsdp" and r.origin == "fsdp-tuned"]) == 2
    limit = int(limit_mib * 2**20)
    searched = [r for r in rows if r.trial_id.startswith(("r", "baseline-"))]
    assert len(searched) == 4 and all(r.strategy_hash != build_strategy("allreduce", model, cluster).hash
                                      for r in searched)
    for r in searched:
        assert any(isinstance(s.synchronizer, ShardSynchronizer) for _p, _i, s in
                   Strategy.from_json(r.strategy_json).iter_shards()), r.trial_id
    for r in rows:
        peaks = [m["peak_bytes"] for m in r.memory_breakdown or [] if m.get("peak_bytes") is not None]
        if r.status == "ok" and peaks:
            assert max(peaks) <= limit, (r.trial_id, peaks, limit)
        if peaks and max(peaks) > limit:
            assert r.status == "oom", r.trial_id
    result = json.loads(next((home / "searches").glob("*-best-result.json")).read_text())
    memory = result["memory"]
    assert memory["over_budget_builders"] == ["allreduce"] and memory["predicted_peak_bytes"]
    assert all(p <= limit for p in memory["measured_peak_bytes"] or [0])


def test_a_shard_search_may_score_with_the_shipped_simulator_which_has_seen_shard_plans():
    """``shard: true`` with the experiment's default simulator (the shipped one) is prepared, not
    refused: the shipped simulator was trained on release v0.3, whose rows hold shard plans, and
    scores them (the refusal said it was trained before the shard synchronizer, which stopped
    being true when it was retrained)."""
    from synctune.run.prepare import prepare_memory
    from synctune.simulator import load_simulator, pretrained_info
    from synctune.workload.zoo import zoo_workload

    model, cluster = model_spec("transformer-small"), cluster_preset("lab-2x2")
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=4, shard=True)
    assert exp.search.simulator == "pretrained" and exp.search.uses_simulator
    assert "shard" in load_simulator("pretrained").config["synchronizers"]
    assert "shard plans included" in pretrained_info()["trained_on"]
    _budget, rate = prepare_memory(exp, model, cluster, zoo_workload(model.name))
    assert rate == 0.5
