"""The simulator-only searches (AutoDDL §4.4 coordinate descent, TAG §4.2.2 Monte-Carlo tree
search): checked against exhaustive enumeration of small spaces, for fixed points, for valid
strategies, and as the search's round policies and autodist's proposal generators (deterministic,
resumable, never re-measuring). Scores come from the analytic model; whether the searches win
on real runs is measured in experiments/findings/, not here."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.search import ChoiceSpace, coordinate_descent, mcts
from synctune.search.algorithm import StrategySearch
from synctune.search.experiment import Experiment
from synctune.search.local_search import canonical_groups
from synctune.simulator import AnalyticSimulator, BoundSimulator
from synctune.spec import ClusterSpec, ModelSpec, SpecError, VariableSpec, cluster_preset
from synctune.strategy import validate


def _calibrated(cluster: ClusterSpec, gflops: list[float]) -> ClusterSpec:
    return dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, compute_gflops=g)
                                                    for n, g in zip(cluster.nodes, gflops)))


CLUSTER = _calibrated(cluster_preset("lab-b10c"), [33.0, 15.6])
SMALL = ModelSpec(name="three", batch_size=16, variables=(
    VariableSpec(name="emb", shape=(4096, 64), sparse=True),
    VariableSpec(name="w", shape=(512, 512)),
    VariableSpec(name="b", shape=(512,)),
))


def _score(model, cluster):
    return BoundSimulator(AnalyticSimulator(), model, cluster).score


def _exhaustive(space: ChoiceSpace, root, coordinates) -> tuple[float, object]:
    """Every strategy reachable by one choice per coordinate, in order, from ``root``."""
    score = _score(space.model, space.cluster)
    level = {root.hash: root}
    if space.has_split:
        level = {s.hash: s for s in space.splits(root)}
    for coordinate in coordinates:
        level = {s.hash: s for parent in level.values() for s in [parent] + space.neighbours(parent, coordinate)}
    strategies = list(level.values())
    values = score(strategies)
    return float(values.max()), strategies[int(np.argmax(values))]


def _closure(space: ChoiceSpace, root) -> list:
    """Every strategy any sequence of coordinate changes reaches from ``root`` (small spaces)."""
    seen, frontier = {root.hash: root}, [root]
    while frontier:
        nxt = []
        for s in frontier:
            for n in [x for c in space.coordinates() for x in space.neighbours(s, c)] + space.splits(s):
                if n.hash not in seen:
                    seen[n.hash] = n
                    nxt.append(n)
        frontier = nxt
    return list(seen.values())


def test_coordinate_descent_reaches_the_exhaustive_optimum_of_a_small_space():
    """AutoDDL §4.4 reports a gap under 3% to exhaustive search; on three variables, where the
    whole choice space is enumerated independently (every strategy any sequence of choices
    reaches), coordinate descent with restarts does at least as well as the best of them."""
    space = ChoiceSpace(SMALL, CLUSTER, lossy=False)
    everything = _closure(space, space.data_parallel())
    assert len(everything) > 100
    best = float(_score(SMALL, CLUSTER)(everything).max())
    found = coordinate_descent(space, _score(SMALL, CLUSTER), [space.data_parallel()], rng=random.Random(0),
                               evaluations=3000)
    assert found.scores[0] >= best - 1e-12
    assert found.evaluations <= 3000 + 64


def test_coordinate_descent_stops_at_fixed_points_and_proposes_valid_strategies():
    model = model_spec("ncf-small")
    space = ChoiceSpace(model, CLUSTER)
    score = _score(model, CLUSTER)
    dp = space.data_parallel()
    found = coordinate_descent(space, score, [dp], rng=random.Random(3), evaluations=4000, max_sweeps=50)
    for strategy in found.strategies[:10]:
        validate(strategy, model, CLUSTER)
    assert len({s.hash for s in found.strategies}) == len(found.strategies)
    assert found.scores == sorted(found.scores, reverse=True)
    best = found.strategies[0]
    # A fixed point: no single coordinate (a variable's choice, the batch split) does better.
    neighbours = [n for c in space.coordinates() for n in space.neighbours(best, c)] + space.splits(best)
    assert score(neighbours).max() <= found.scores[0] + 1e-12
    # It beats data parallelism and every builder the analytic model knows of on this sparse model.
    assert found.scores[0] > score([dp])[0]


def test_mcts_finds_the_optimum_of_its_tree_and_beats_data_parallel():
    """TAG §4.2.2: the tree's levels are the batch split and groups of variables; with enough
    evaluations the search reaches the best leaf that exhaustive enumeration of the same tree finds."""
    model = model_spec("ncf-small")
    space = ChoiceSpace(model, CLUSTER, lossy=False)
    runs = space.coordinates(3)
    runs.sort(key=lambda run: -sum(space.variables[i].num_bytes for i in run))
    best, _ = _exhaustive(space, space.data_parallel(), runs)
    found = mcts(space, _score(model, CLUSTER), rng=random.Random(0), levels=3, evaluations=5000)
    assert found.scores[0] == pytest.approx(best, rel=1e-9)
    dp = _score(model, CLUSTER)([space.data_parallel()])[0]
    assert found.scores[0] > dp
    for strategy in found.strategies[:5]:
        validate(strategy, model, CLUSTER)


def test_the_budget_bounds_the_work_and_the_trace_records_progress():
    model = model_spec("bert-tiny")
    space = ChoiceSpace(model, CLUSTER)
    for search in (lambda: coordinate_descent(space, _score(model, CLUSTER), [space.data_parallel()],
                                              rng=random.Random(0), evaluations=600),
                   lambda: mcts(space, _score(model, CLUSTER), rng=random.Random(0), evaluations=600)):
        found = search()
        assert 600 <= found.evaluations < 600 + 200  # the last scored batch may overshoot
        best = [b for _e, _s, b in found.trace]
        assert best == sorted(best) and best[-1] == pytest.approx(found.scores[0])


def test_canonical_groups_makes_equal_groupings_hash_equal():
    model = model_spec("cnn-small")
    space = ChoiceSpace(model, CLUSTER)
    dp = space.data_parallel()
    renumbered = dataclasses.replace(dp, plans=tuple(
        dataclasses.replace(p, shards=tuple(dataclasses.replace(
            s, synchronizer=dataclasses.replace(s.synchronizer, group=7)) for s in p.shards)) for p in dp.plans))
    assert renumbered.hash != dp.hash and canonical_groups(renumbered).hash == dp.hash


def test_the_choice_space_takes_its_compressors_from_the_registry(monkeypatch):
    """A compressor added to the registry is offered without touching the search: a lossless
    one (a test-only identity under another name) on new all-reduce groups and on PS servers
    whether lossy or not, beside the shipped ones (lossy ones only where lossy: every one on
    all-reduce, PowerSGD at ranks 1 and 4; the first on a PS); what it builds validates."""
    from synctune.strategy.compressors import COMPRESSORS, CompressorInfo

    monkeypatch.setitem(COMPRESSORS._items, "ident2", CompressorInfo(name="ident2", lossless=True,
                                                                     description="test-only identity"))

    def offered(lossy: bool):
        space = ChoiceSpace(SMALL, CLUSTER, lossy=lossy)
        dp = space.data_parallel()
        choices = space.choices(dp, [1])  # "w", dense
        for choice in choices:
            validate(space.apply(dp, [1], choice), SMALL, CLUSTER)
        new_groups = {(c.compressor, c.rank) for c in choices if c.kind == "ar" and c.group is None
                      and c.algorithm == "flat"}
        return new_groups, {c.compressor for c in choices if c.kind == "ps" and not c.local}

    assert offered(False) == ({("none", 0), ("ident2", 0)}, {"none", "ident2"})
    assert offered(True) == ({("none", 0), ("fp16", 0), ("bf16", 0), ("powersgd", 1), ("powersgd", 4),
                              ("ident2", 0)}, {"none", "fp16", "ident2"})


def _experiment(algorithm: str, generator: str = "sampler", budget: int = 12) -> Experiment:
    return Experiment.from_keys(name="t", model="ncf-small", cluster="lab-b10c", budget=budget, algorithm=algorithm,
                                generator=generator, proposals=40, candidates=3, sim_evaluations=800, seed=2,
                                baselines=("allreduce", "ps-lb"))


def _truth(strategy) -> float:
    """A stand-in cluster: the analytic model plus a cost per PS shard it does not know of."""
    t = -_score(model_spec("ncf-small"), CLUSTER)([strategy])[0]
    return float(t * (1 + 0.01 * sum(s.synchronizer.kind == "ps" for p in strategy.plans for s in p.shards)))


def _drive(algo: StrategySearch, stop_after: int | None = None) -> list[str]:
    hashes = []
    while (p := algo.ask()) is not None:
        validate(p.strategy, algo.model, algo.cluster)
        hashes.append(p.strategy.hash)
        algo.tell(p.trial_id, _truth(p.strategy))
        if stop_after is not None and len(algo.trials) >= stop_after:
            break
    return hashes


@pytest.mark.parametrize("algorithm,generator", [("coordinate-descent", "sampler"), ("mcts", "sampler"),
                                                 ("autodist", "coordinate-descent"), ("autodist", "mcts")])
def test_the_searches_run_in_the_search_shell_deterministically_and_resume_exactly(algorithm, generator):
    model = model_spec("ncf-small")
    exp = _experiment(algorithm, generator)
    sim = lambda: BoundSimulator(AnalyticSimulator(), model, CLUSTER)  # noqa: E731
    first = StrategySearch(model, CLUSTER, exp, sim())
    hashes = _drive(first)
    assert len(hashes) == exp.search.budget and len(set(hashes)) == len(hashes)  # nothing measured twice
    assert {t.origin for t in first.trials[2:]} <= {algorithm, f"{algorithm}+split", f"{algorithm}+incumbent"}
    assert _drive(StrategySearch(model, CLUSTER, exp, sim())) == hashes
    # Interrupted after 7 trials (mid-round) and rebuilt from its finished trials: the same search.
    interrupted = StrategySearch(model, CLUSTER, exp, sim())
    _drive(interrupted, stop_after=7)
    resumed = StrategySearch.from_state(interrupted.state(), model, CLUSTER, exp, sim())
    assert [t.strategy.hash for t in resumed.trials] + _drive(resumed) == hashes
    summary = first.summary()
    assert summary.speedup > 1.0


def test_experiment_checks_generator_and_simulator_budget():
    with pytest.raises(SpecError, match="generator: mcts feeds algorithm autodist, not random"):
        Experiment.from_keys(name="t", model="ncf-small", cluster="lab-b10c", budget=4, algorithm="random",
                             generator="mcts")
    with pytest.raises(SpecError, match="generator: expected one of sampler, coordinate-descent, mcts"):
        Experiment.from_keys(name="t", model="ncf-small", cluster="lab-b10c", budget=4, generator="tabu")
    with pytest.raises(SpecError, match="sim_evaluations: expected an integer from 100"):
        Experiment.from_keys(name="t", model="ncf-small", cluster="lab-b10c", budget=4, sim_evaluations=5)
