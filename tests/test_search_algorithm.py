"""The search shell (Algorithm 1 and its variants) with a fake trial runner: a deterministic
function of the strategy, in seconds, stands in for the cluster, so the search loop is tested
exactly (ask/tell, rounds, persistence, deduplication), together with the experiment files.

These are unit tests of the loop, not evidence that the search wins on a real cluster: the
"cluster" here is the simulator's own cost model with other constants. Measured evidence lives
in experiments/findings/ and benchmarks/."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.search.algorithm import StrategySearch
from synctune.search.experiment import ALGORITHMS, Experiment, load_experiment
from synctune.search.policies import ROUND_POLICIES
from synctune.search.sampler import GuidedSampler
from synctune.search.selection import _Index, _signature, fidelity_level, select_diverse
from synctune.simulator import AnalyticSimulator, BoundSimulator, DomainContext, encode
from synctune.simulator.features import AnalyticConstants
from synctune.spec import SpecError, cluster_preset
from synctune.strategy import Strategy, validate

MODEL, CLUSTER = model_spec("bert-large"), cluster_preset("B7")
# The "cluster": the analytic model with other constants than the simulator's defaults, and a
# cost per extra shard the simulator does not know about.
TRUTH = DomainContext(MODEL, CLUSTER, AnalyticConstants(phi=1e-4, delta=4e-5))


def measured_s(strategy) -> float:
    t = AnalyticSimulator()._predict_batch(encode([strategy], TRUTH), TRUTH)[0]
    return float(t * (1 + 0.002 * sum(p.num_shards - 1 for p in strategy.plans)))


def analytic():
    return BoundSimulator(AnalyticSimulator(), MODEL, CLUSTER)


def run(algorithm: str, budget: int = 20, seed: int = 1) -> StrategySearch:
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=budget, algorithm=algorithm,
                               proposals=120, candidates=5, seed=seed)
    algo = StrategySearch(MODEL, CLUSTER, exp, analytic() if algorithm in ("autodist", "genetic") else None)
    while (p := algo.ask()) is not None:
        validate(p.strategy, MODEL, CLUSTER)
        algo.tell(p.trial_id, measured_s(p.strategy))
    return algo


def test_the_loop_uses_its_simulator_on_a_synthetic_cost_model():
    """With a simulator close to the synthetic "cluster", the scored loop reaches 1.2x sooner than
    the unscored ablations: a check that scores steer the selection, not a claim about real runs."""
    full, guided, plain = (run(a).summary() for a in ("autodist", "random-guided", "random"))
    for s in (full, guided, plain):
        assert s.trials == 20 and s.best_baseline_s == pytest.approx(full.best_baseline_s)
    assert full.speedup >= 1.2
    assert full.trials_to_1_2x is not None
    reached = [s.trials_to_1_2x for s in (guided, plain) if s.trials_to_1_2x is not None]
    assert all(full.trials_to_1_2x < r for r in reached)
    assert full.hit_rate > guided.hit_rate >= plain.hit_rate
    assert full.best_mean_s <= min(guided.best_mean_s, plain.best_mean_s)


def test_baselines_come_first_and_failures_are_recorded():
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=8, proposals=20, candidates=2,
                               baselines=("allreduce", "ps-lb"))
    algo = StrategySearch(MODEL, CLUSTER, exp, analytic())
    first = [algo.ask() for _ in range(2)]
    assert [p.origin for p in first] == ["allreduce", "ps-lb"]
    algo.tell(first[0].trial_id, 2.0)
    algo.tell(first[1].trial_id, None)  # a failed trial
    while (p := algo.ask()) is not None:
        algo.tell(p.trial_id, measured_s(p.strategy))
    s = algo.summary()
    assert s.trials == 8 and s.failed == 1 and s.best_baseline_s == 2.0


def _drive(algo: StrategySearch, until: int | None = None) -> list[tuple[str, str]]:
    """Ask and tell until the search ends (or ``until`` trials are told); (trial id, hash) told."""
    told = []
    while (until is None or len(algo.trials) < until) and (p := algo.ask()) is not None:
        algo.tell(p.trial_id, measured_s(p.strategy))
        told.append((p.trial_id, p.strategy.hash))
    return told


@pytest.mark.parametrize("algorithm", ["autodist", "random-guided", "genetic"])
def test_a_restored_search_goes_on_exactly_as_the_uninterrupted_one(algorithm):
    """Interrupted mid-round (one trial asked, never told), rebuilt from its finished trials only
    (what the dataset holds): it proposes the unfinished trial again and then exactly the
    strategies, in the order, the uninterrupted search of the same seed proposes."""
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=16, proposals=30, candidates=4,
                               seed=3, algorithm=algorithm)
    sim = analytic if algorithm != "random-guided" else (lambda: None)
    whole = StrategySearch(MODEL, CLUSTER, exp, sim())
    expected = _drive(whole)
    assert len(expected) == 16 and len({h for _i, h in expected}) == 16  # never the same strategy twice

    algo = StrategySearch(MODEL, CLUSTER, exp, sim())
    _drive(algo, until=9)
    unfinished = algo.ask()  # asked, never told: the driver "died" here
    saved = json.loads(json.dumps(algo.state()))
    back = StrategySearch.from_state(saved, MODEL, CLUSTER, exp, sim())
    again = back.ask()
    assert (again.trial_id, again.strategy.hash) == (unfinished.trial_id, unfinished.strategy.hash)
    back.tell(again.trial_id, measured_s(again.strategy))
    resumed = [(t.trial_id, t.strategy.hash) for t in back.trials] + _drive(back)
    assert resumed == expected


def test_a_state_written_before_times_were_called_mean_s_resumes_exactly():
    """Checkpoints and dataset-rebuilt states of older versions (version 2 and before) hold a
    trial's time as ``runtime``: restored from one, the search keeps it as ``mean_s`` and goes on
    exactly as the uninterrupted search (the reference: the uninterrupted search itself)."""
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=12, proposals=60, candidates=4,
                               seed=4)
    expected = _drive(StrategySearch(MODEL, CLUSTER, exp, analytic()))
    algo = StrategySearch(MODEL, CLUSTER, exp, analytic())
    _drive(algo, until=7)
    old = {"version": 2, "trials": [{("runtime" if k == "mean_s" else k): v for k, v in t.items()}
                                    for t in json.loads(json.dumps(algo.state()))["trials"]]}
    assert all("runtime" in t and "mean_s" not in t for t in old["trials"])
    back = StrategySearch.from_state(old, MODEL, CLUSTER, exp, analytic())
    assert [t.mean_s for t in back.trials] == [t.mean_s for t in algo.trials]
    assert all("runtime" not in t.to_dict() for t in back.trials)
    assert [(t.trial_id, t.strategy.hash) for t in back.trials] + _drive(back) == expected
    summary = back.summary()
    assert not hasattr(summary, "best_runtime_s") and summary.best_mean_s == min(
        measured_s(t.strategy) for t in back.trials)
    with pytest.raises(ValueError, match="trial 'baseline-allreduce': expected a mean_s entry"):
        StrategySearch.from_state({"trials": [{k: v for k, v in t.items() if k != "runtime"}
                                              for t in old["trials"]]}, MODEL, CLUSTER, exp, analytic())


def test_every_algorithm_is_a_registered_round_policy():
    """The experiment files' algorithms and the registry name the same policies; an unknown
    name is refused with the valid ones listed, a second registration of a name is refused."""
    assert ROUND_POLICIES.names() == list(ALGORITHMS)
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=4)
    object.__setattr__(exp.search, "algorithm", "bayes")  # past the experiment's own check
    with pytest.raises(SpecError, match="unknown search algorithm 'bayes'; valid: autodist, random-guided, random, "
                                        "genetic, coordinate-descent, mcts"):
        StrategySearch(MODEL, CLUSTER, exp)
    with pytest.raises(ValueError, match="already registered"):
        ROUND_POLICIES.register("mcts", ROUND_POLICIES.get("mcts"))


def test_the_shell_trials_what_its_policy_proposes():
    """A policy is all an algorithm is to the shell: a stand-in drawing each round from a
    sampler of its own gets exactly its draws asked and told, in order after the baselines, and
    is asked for each round once the previous one was told, with the places the budget leaves."""
    from synctune.search.interface import Proposal

    calls = []

    class Fixed:
        def propose(self, search, round_, k):
            calls.append((round_, k, len(search.trials)))
            drawn = GuidedSampler(MODEL, CLUSTER, seed=100 + round_).sample_many(k)
            return [Proposal(trial_id=f"r{round_}-{j}", strategy=s, origin="fixed", predicted=None)
                    for j, s in enumerate(drawn)]

    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=6, candidates=2,
                               baselines=("allreduce",), algorithm="random")
    search = StrategySearch(MODEL, CLUSTER, exp)
    search.policy = Fixed()
    told = _drive(search)
    # Each round's k draws (the budget leaves one place in round 3): a sampler draws its n
    # strategies at once, so the first of n draws is not the first of m.
    draws = [s.hash for r, k in ((1, 2), (2, 2), (3, 1))
             for s in GuidedSampler(MODEL, CLUSTER, seed=100 + r).sample_many(k)]
    assert [i for i, _h in told] == ["baseline-allreduce", "r1-0", "r1-1", "r2-0", "r2-1", "r3-0"]
    assert [h for _i, h in told[1:]] == draws
    assert calls == [(1, 2, 1), (2, 2, 3), (3, 1, 5)] and search.finished
    assert [t.origin for t in search.trials] == ["allreduce"] + ["fixed"] * 5


def test_no_strategy_is_measured_twice():
    """A proposal equal to a measured strategy (here: every baseline is also what the sampler
    would propose) is dropped, not re-measured."""
    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=12, proposals=40, candidates=4,
                               seed=0)
    algo = StrategySearch(MODEL, CLUSTER, exp, analytic())
    measured = set()
    while (p := algo.ask()) is not None:
        assert p.strategy.hash not in measured or p.trial_id.startswith("baseline-")
        measured.add(p.strategy.hash)
        algo.tell(p.trial_id, measured_s(p.strategy))
    # A sampler that can only repeat what was measured ends the search early instead of looping.
    exp_small = Experiment.from_keys(name="t", model="cnn-small", cluster="local-1x1", budget=50, proposals=5,
                                     candidates=2, seed=0, algorithm="random-guided", baselines=("allreduce",))
    small, one = model_spec("cnn-small"), cluster_preset("local-1x1")
    tiny = StrategySearch(small, one, exp_small)
    hashes = []
    while (p := tiny.ask()) is not None:
        hashes.append(p.strategy.hash)
        tiny.tell(p.trial_id, 1.0)
    assert len(hashes) == len(set(hashes)) and tiny.finished


def test_genetic_children_are_valid_strategies():
    algo = run("genetic", budget=14)
    assert algo.summary().trials == 14


def test_guided_sampler_respects_its_constraints():
    sampler = GuidedSampler(MODEL, CLUSTER, seed=0)
    for s in sampler.sample_many(30):
        validate(s, MODEL, CLUSTER)
        for plan in s.plans:
            var = MODEL[plan.variable]
            if var.num_bytes < sampler.small_bytes:
                assert not plan.is_partitioned, plan.variable
            if var.num_bytes >= sampler.large_bytes:
                assert plan.is_partitioned, plan.variable
        groups = [sh.synchronizer.group for _p, _i, sh in s.iter_shards() if sh.synchronizer.kind == "allreduce"]
        assert groups == sorted(groups)  # adjacent merging: groups follow backward order


def test_guided_sampler_proposes_compression_and_hierarchical_all_reduce_unless_told_not_to():
    from synctune.strategy.compressors import COMPRESSORS

    cluster = cluster_preset("local-2x2")
    model = model_spec("bert-tiny")

    def kinds(strategies):
        comps = {sh.compressor.kind for s in strategies for _p, _i, sh in s.iter_shards()}
        algos = {sh.synchronizer.algorithm for s in strategies for _p, _i, sh in s.iter_shards()
                 if sh.synchronizer.kind == "allreduce"}
        return comps, algos

    drawn = GuidedSampler(model, cluster, seed=0).sample_many(200)
    for s in drawn:
        validate(s, model, cluster)
    comps, algos = kinds(drawn)
    assert {"fp16", "bf16", "powersgd"} <= comps and "hierarchical" in algos
    exact = GuidedSampler(model, cluster, seed=0, lossy=False).sample_many(200)
    comps, algos = kinds(exact)
    assert all(COMPRESSORS.get(c).lossless for c in comps) and "hierarchical" in algos


def test_diversity_sees_every_shard():
    # Two strategies alike in every variable's first shard but not in the others: the
    # signature tells them apart (it used to look at shard 0 only).
    cluster = cluster_preset("local-2x2")
    model = model_spec("bert-tiny")
    from synctune.strategy import build_strategy

    a = build_strategy("partitioned-ps", model, cluster)
    plans = []
    for plan in a.plans:
        if plan.num_shards > 1:
            last = plan.shards[-1]
            other = dataclasses.replace(last, synchronizer=dataclasses.replace(
                last.synchronizer, placement=cluster.nodes[0].devices[0] if last.synchronizer.placement !=
                cluster.nodes[0].devices[0] else cluster.nodes[1].devices[0]))
            plan = dataclasses.replace(plan, shards=plan.shards[:-1] + (other,))
        plans.append(plan)
    b = dataclasses.replace(a, plans=tuple(plans))
    validate(b, model, cluster)
    index = _Index(model, cluster)
    assert (_signature(a, index) != _signature(b, index)).any()
    assert (_signature(a, index) == _signature(a, index)).all()


def test_fidelity_level_and_diverse_selection():
    times_s = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    good_scores = -times_s  # a perfect simulator: it vouches for every score
    assert fidelity_level(good_scores, times_s, 0.8) == pytest.approx(-1.0)
    assert fidelity_level(times_s.copy(), times_s, 0.8) == -np.inf  # ranks everything backwards
    strategies = GuidedSampler(MODEL, CLUSTER, seed=5).sample_many(6)
    same = [strategies[0]] * 3 + strategies[1:4]
    chosen = select_diverse(same, np.array([5.0, 5.0, 5.0, 1.0, 1.0, 1.0]), 2, _Index(MODEL, CLUSTER), weight=2.0)
    assert chosen[0] in (0, 1, 2) and chosen[1] >= 3  # a copy of the first pick is not picked again


def test_experiment_files(tmp_path):
    good = tmp_path / "e.yaml"
    good.write_text("name: q\nmodel: bert-tiny\ncluster: local-2x2\nbudget: 6\nalgorithm: random-guided\n")
    assert load_experiment(good).search.budget == 6
    for text, fragment in [
        ("name: q\nmodel: m\ncluster: c\nbudget: 0\n", "budget: expected an integer from 1 to 1000000, got 0"),
        ("name: q\nmodel: m\ncluster: c\nbudget: 5\nalgoritm: x\n", "unknown key(s) ['algoritm']"),
        ("name: q\nmodel: m\ncluster: c\nbudget: 5\nalgorithm: bayes\n", "algorithm: expected one of autodist"),
        ("name: q\nmodel: m\ncluster: c\n", "missing key 'budget'"),
        ("name: q\nmodel: m\ncluster: c\nbudget: 5\nbaselines: [horovd]\n", "unknown builder 'horovd'"),
        ("name: [\n", "malformed YAML"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(SpecError) as info:
            load_experiment(bad)
        assert fragment in str(info.value) and str(bad) in str(info.value)


FLAT = """name: q
workload: job.py:workload
cluster: local-2x2
seed: 3
budget: 6
algorithm: autodist
generator: mcts
sim_evaluations: 500
simulator: analytic
proposals: 40
candidates: 2
fidelity_accuracy: 0.7
incumbent_moves: true
lossy: false
warmup: 2
iters: 5
timeout_s: 60
baselines: [tuned, ps, hvd, 'hvd:cycle_time_ms=5']
ddp_trials: 2
confirm_rounds: 4
confirm_iters: 3
confirm_candidates: 2
slices: 2
output: best.json
"""

NESTED = """name: q
seed: 3
domain: {workload: job.py:workload, cluster: local-2x2}
search:
  budget: 6
  algorithm: autodist
  generator: mcts
  sim_evaluations: 500
  simulator: analytic
  proposals: 40
  candidates: 2
  fidelity_accuracy: 0.7
  incumbent_moves: true
  lossy: false
trial: {warmup: 2, iters: 5, timeout_s: 60}
baselines: {builders: [tuned, ps], horovod: [hvd, 'hvd:cycle_time_ms=5'], ddp_trials: 2}
confirm: {rounds: 4, iters: 3, candidates: 2}
run: {slices: 2, output: best.json}
"""


def test_a_flat_file_and_its_nested_form_are_the_same_experiment(tmp_path):
    from synctune.search import DomainSection, SearchSection
    from synctune.strategy.builders import TUNED_BASELINES

    (tmp_path / "flat.yaml").write_text(FLAT)
    (tmp_path / "nested.yaml").write_text(NESTED)
    flat, nested = load_experiment(tmp_path / "flat.yaml"), load_experiment(tmp_path / "nested.yaml")
    assert flat == nested
    assert nested.domain.workload == f"{tmp_path / 'job.py'}:workload"  # relative to the file, either way
    assert (nested.search.generator, nested.trial.timeout_s, nested.confirm.rounds, nested.run.slices) == \
        ("mcts", 60, 4, 2)
    assert nested.baselines.builders == ("tuned", "ps") and nested.baselines.horovod == ("hvd", "hvd:cycle_time_ms=5")
    assert nested.baselines.expanded_builders == (*TUNED_BASELINES, "ps")
    assert nested.baselines.explicit_builders == ("ps",)
    assert nested.num_trials == 6 + 2 + 2
    # Mixed (some keys flat, some nested) and built from sections in code: the same again.
    mixed = NESTED.replace("trial: {warmup: 2, iters: 5, timeout_s: 60}", "warmup: 2\niters: 5\ntimeout_s: 60")
    (tmp_path / "mixed.yaml").write_text(mixed)
    assert load_experiment(tmp_path / "mixed.yaml") == flat
    small = Experiment(name="q", domain=DomainSection(model="cnn-small", cluster="local-1x2"),
                       search=SearchSection(budget=4))
    assert small == Experiment.from_keys(name="q", model="cnn-small", cluster="local-1x2", budget=4)
    assert small == Experiment.from_keys(name="q", domain={"model": "cnn-small", "cluster": "local-1x2"},
                                         search={"budget": 4})


@pytest.mark.parametrize("text, message", [
    ("budget: 5\nsearch: {budget: 6}\n", "budget and search.budget are the same setting"),
    ("confirm_rounds: 4\nconfirm: {rounds: 2}\n", "confirm_rounds and confirm.rounds are the same setting"),
    ("ddp_trials: 1\nbaselines: {ddp_trials: 2}\n", "ddp_trials and baselines.ddp_trials are the same setting"),
    ("model: cnn-small\ndomain: {model: mlp}\n", "model and domain.model are the same setting"),
])
def test_a_setting_given_both_flat_and_nested_is_refused_naming_both(tmp_path, text, message):
    path = tmp_path / "e.yaml"
    path.write_text("name: q\ncluster: local-2x2\n" + ("" if "budget" in text else "budget: 3\n")
                    + ("" if "model" in text else "model: cnn-small\n") + text)
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("budget: 3\nalgorithm: bayes\n", "e.yaml: algorithm: expected one of autodist, random-guided, random, genetic, "
                                       "coordinate-descent, mcts, got 'bayes'"),
    ("search: {budget: 3, algorithm: bayes}\n", "e.yaml: search.algorithm: expected one of autodist, random-guided, "
                                                "random, genetic, coordinate-descent, mcts, got 'bayes'"),
    ("search: {budget: 3, generator: tabu}\n", "e.yaml: search.generator: expected one of sampler, "
                                               "coordinate-descent, mcts, got 'tabu'"),
    ("search: {budget: 3, simulator: oracle}\n", "e.yaml: search.simulator: expected one of pretrained, analytic, "
                                                 "replay, rnn, linear, gat or a saved simulator file (.pt), "
                                                 "got 'oracle'"),
    ("budget: 3\nconfirm: {rounds: 1}\n", "e.yaml: confirm.rounds: expected 0 (no confirmation) or an integer from 2"),
    ("budget: 3\nconfirm_rounds: 1\n", "e.yaml: confirm_rounds: expected 0 (no confirmation) or an integer from 2"),
    ("budget: 3\ntrial: {iter: 3}\n", "e.yaml: trial: unknown key(s) ['iter']; valid: warmup, iters, timeout_s"),
    ("budget: 3\nsearch: 5\n", "e.yaml: search: expected a mapping of budget, algorithm"),
    ("budget: 3\nbaselines: {builders: [hvd]}\n", "e.yaml: baselines.builders: 'hvd' is a real Horovod run, not a "
                                                   "builder: list it under baselines.horovod"),
    ("budget: 3\nbaselines: {horovod: [ps]}\n", "e.yaml: baselines.horovod: 'ps': expected hvd or hvd:KEY=VALUE"),
    ("search: {proposals: 3}\n", "e.yaml: missing key 'budget' (or search.budget)"),
])
def test_an_error_names_the_key_as_written_and_the_valid_choices(tmp_path, text, message):
    path = tmp_path / "e.yaml"
    path.write_text("name: q\nmodel: cnn-small\ncluster: local-2x2\n" + text)
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert str(info.value).startswith(str(tmp_path)) and message in str(info.value), str(info.value)


def test_shipped_experiment_files_load_and_name_real_domains():
    from pathlib import Path

    from synctune.models import MODELS
    from synctune.spec import CLUSTER_PRESETS

    files = sorted((Path(__file__).resolve().parents[1] / "experiments").glob("*.yaml"))
    assert {f.name for f in files} >= {"quickstart.yaml", "bert-large-B7.yaml", "vgg16-A2.yaml", "ncf-dense-B7.yaml"}
    from synctune.workload import resolve_workload

    for f in files:
        exp = load_experiment(f)
        assert exp.name == f.stem and exp.domain.cluster in CLUSTER_PRESETS
        if exp.domain.workload:  # a workload file shipped beside it: it imports and its spec extracts
            assert resolve_workload(exp.domain.workload).spec().variables
        else:
            assert exp.domain.model in MODELS


class _Oracle:
    """Scores by a known table of times (perfect), or backwards (``sign=+1``); fit does nothing."""

    def __init__(self, table, sign=-1.0):
        self.table, self.sign = table, sign

    def score(self, items):
        return np.array([self.sign * self.table[i] for i in items])

    def fit(self, items, times_s):
        pass


class _Memorizer:
    """Ranks perfectly what it was fitted on and backwards what it has not seen: a model that
    looks perfect on its training data and is useless on new strategies."""

    def __init__(self, table):
        self.table, self.known = table, set()

    def score(self, items):
        return np.array([-self.table[i] if i in self.known else self.table[i] for i in items])

    def fit(self, items, times_s):
        self.known |= set(items)


def test_the_learned_model_scores_only_once_it_beats_the_training_free_one_on_held_out_trials():
    from synctune.run.simulators import SelectedSimulator

    rng = np.random.default_rng(0)
    table = {i: float(t) for i, t in enumerate(rng.uniform(1, 2, 40))}
    items = list(table)

    def run(free, learned, ready):
        sim = SelectedSimulator(free, learned, learned_ready=ready)
        for upto in (5, 9, 13, 17, 21):  # a baseline batch, then rounds of 4
            sim.fit(items[:upto], np.array([table[i] for i in items[:upto]]))
        return sim

    # A perfect learned model against a backwards training-free one: it takes over, but only
    # after it has been judged on enough trials it had not seen.
    sim = run(_Oracle(table, +1.0), _Oracle(table), ready=False)
    assert [(h["scoring"], h["held_out_pairs"]) for h in sim.history][:2] == [("training-free", 0), ("learned", 6)]
    assert sim.use_learned and sim.history[-1]["learned_accuracy"] == 1.0
    assert list(sim.score([0, 1])) == list(_Oracle(table).score([0, 1]))
    # A model that only memorizes its training trials never scores: judged on held-out trials.
    sim = run(_Oracle(table), _Memorizer(table), ready=False)
    assert not sim.use_learned and all(h["scoring"] == "training-free" for h in sim.history)
    assert sim.history[-1]["learned_accuracy"] == 0.0
    # A transferred model is judged from the first batch on.
    sim = run(_Oracle(table, +1.0), _Oracle(table), ready=True)
    assert sim.history[0]["held_out_pairs"] == 10 and sim.history[0]["scoring"] == "learned"


def test_each_autodist_round_tries_the_best_measured_strategy_one_move_away():
    """Exploitation beside the sampler: once the baselines are measured, every round's last
    proposal is the fastest baseline with one move (a compressor or hierarchical all-reduce on
    all its merge groups, its groups re-cut, or one choice on a run of variables), the move the
    simulator scores best; never a strategy measured before."""
    from synctune.search.moves import global_moves
    from synctune.search.local_search import ChoiceSpace

    exp = Experiment.from_keys(name="t", model=MODEL.name, cluster=CLUSTER.name, budget=14, proposals=60, candidates=4,
                               baselines=("allreduce", "horovod", "ps-lb"), incumbent_moves=True)
    algo = StrategySearch(MODEL, CLUSTER, exp, analytic())
    measured, asked = {}, []
    while (p := algo.ask()) is not None:
        if p.strategy.hash in measured:
            raise AssertionError(f"{p.trial_id} re-measures a strategy")
        prefix = p.trial_id.split("-")[0]
        if not asked or asked[-1].trial_id.split("-")[0] != prefix:
            before = dict(measured)  # a round is drawn when its first trial is asked
        if p.origin == "autodist+incumbent":
            best = min(before.values(), key=lambda v: v[1])[0]
            space = ChoiceSpace(MODEL, CLUSTER)
            moves = global_moves(best, space) + [n for c in space.coordinates(8) for n in space.neighbours(best, c)]
            assert p.strategy.hash in {m.hash for m in moves}
            same_round = {q.strategy.hash for q in asked if q.trial_id.split("-")[0] == p.trial_id.split("-")[0]}
            fresh = [m for m in moves if m.hash not in before and m.hash not in same_round and m.hash != best.hash]
            assert -p.predicted == pytest.approx(float(np.max(algo.simulator.score(fresh))), rel=1e-9)
        asked.append(p)
        measured[p.strategy.hash] = (p.strategy, measured_s(p.strategy))
        algo.tell(p.trial_id, measured[p.strategy.hash][1])
    origins = [t.origin for t in algo.trials]
    assert origins.count("autodist+incumbent") == 3, origins  # rounds of 4, 4 and 3 after 3 baselines


@pytest.mark.parametrize("seed", [0, 1])
def test_a_search_runs_its_whole_budget_when_the_elite_is_what_it_measured(seed):
    """Searched strategies twice as fast as the baselines make the simulator's fidelity level
    the score of what was measured, so a round's elite can hold the measured strategies and
    nothing else: the round must then fill its places from the rest of its proposals, not end
    the search (it ended after 13-16 of 24 trials)."""
    model, cluster = model_spec("ncf-small"), cluster_preset("lab-2x2")
    exp = Experiment.from_keys(name="t", model=model.name, cluster=cluster.name, budget=24, seed=seed, proposals=300,
                               candidates=3, baselines=("tuned",))
    algo = StrategySearch(model, cluster, exp, BoundSimulator(AnalyticSimulator(), model, cluster))
    hashes = []
    while (p := algo.ask()) is not None:
        hashes.append(p.strategy.hash)
        algo.tell(p.trial_id, 1.0 if p.trial_id.startswith("baseline-") else 0.5)
    assert algo.asked == 24 and len(set(hashes)) == 24


def test_a_proposal_records_a_predicted_time_only_from_a_model_that_predicts_times():
    """The dataset's ``predicted_time_s`` is seconds: the analytic model's prediction of the
    proposed strategy (independent reference: the analytic model run on it again), and nothing
    where a learned ranker scored the round (its scores are not times; before the fix its
    negated scores were recorded, -16 to -32 "seconds" in a lab search)."""
    from synctune.simulator import LinearSimulator

    spec, cluster = model_spec("cnn-small"), cluster_preset("local-2x2")

    def proposals(sim):
        exp = Experiment.from_keys(name="t", model=spec.name, cluster=cluster.name, budget=9, proposals=60,
                                   candidates=4, baselines=("allreduce",), seed=3)
        algo = StrategySearch(spec, cluster, exp, sim)
        out = []
        while (p := algo.ask()) is not None:
            algo.tell(p.trial_id, 0.02 + 0.001 * len(out))
            out.append(p)
        return [p for p in out if not p.trial_id.startswith("baseline")]

    searched = proposals(BoundSimulator(AnalyticSimulator(), spec, cluster))
    assert searched
    for p in searched:
        expected = float(AnalyticSimulator().predict([p.strategy], spec, cluster)[0])
        assert p.predicted == pytest.approx(expected, rel=1e-9) and p.predicted > 0
    from synctune.search import RandomSampler
    from synctune.simulator import Domain

    strategies = RandomSampler(spec, cluster, seed=0).sample_many(24)
    ctx = DomainContext(spec, cluster)
    trained = LinearSimulator(epochs=5).fit([Domain(ctx, strategies, AnalyticSimulator().predict(strategies, spec,
                                                                                                 cluster))])
    ranker = BoundSimulator(trained, spec, cluster, transfer=True)
    searched = proposals(ranker)
    assert searched and all(p.predicted is None for p in searched)
