"""The modelled pick (what a model-only tool would deploy, untested): the candidate the
training-free simulator predicts fastest among those the memory model says fit.

Every expectation is worked out here independently of :func:`modelled_pick`: each candidate priced
on its own by the replay simulator itself (not through the bound scorer's batches), each judged
by the memory model's own ``fits``/``peaks``. The domain is a tiny Hugging Face Llama built from
a config (no download; Megatron's pairs in its two blocks) on the four devices of local-2x2, so
that Megatron's plans and the sampler's tensor-parallel draws are in the pool; the memory budgets
are written by hand (activation figures given, not probed)."""

from __future__ import annotations

import numpy as np
import pytest

from synctune.run.confirm import Arm
from synctune.run.modelled import (MODELLED_LABEL, Candidate, candidate_pool, context_pick, megatron_candidates,
                                   modelled_arm, modelled_pick)
from synctune.search.algorithm import StrategySearch
from synctune.search.experiment import Experiment
from synctune.simulator import AnalyticSimulator, BoundSimulator, ReplaySimulator
from synctune.simulator.memory import GIB, MIB, ActivationFigures, MemoryBudget
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import build_strategy, validate

CLUSTER = cluster_preset("local-2x2")
DRAWS, SEED = 40, 3


@pytest.fixture(scope="module")
def llama():
    from _tp_workers import workload_of

    workload = workload_of("hf-llama")
    return workload, workload.spec()


def _exp(spec, **search) -> Experiment:
    return Experiment.from_dict({"name": "modelled", "domain": {"model": spec.name, "cluster": CLUSTER.name},
                                 "search": {"budget": 4, "simulator": "replay", **search}})


def _budget(spec, gib: float = 1.0) -> MemoryBudget:
    return MemoryBudget(spec, CLUSTER, gib=gib, headroom=0.0, optimizer="adam",
                        probe=ActivationFigures({spec.batch_size: [2 * MIB]}), tensor_parallel=True)


def _pool(spec, simulator=None) -> list[Candidate]:
    search = StrategySearch(spec, CLUSTER, _exp(spec), simulator or BoundSimulator(ReplaySimulator(), spec, CLUSTER),
                            memory=None, shard_prob=0.5, tp_prob=0.5)
    return candidate_pool(search, draws=DRAWS, seed=SEED)


def _seconds(spec, pool: list[Candidate]) -> np.ndarray:
    """Each candidate's iteration time, priced on its own by the replay simulator itself."""
    replay = ReplaySimulator()
    return np.array([float(replay.predict([c.strategy], spec, CLUSTER)[0]) for c in pool])


def _best(times: np.ndarray, keep) -> tuple[float, set[int]]:
    """The least time among the candidates ``keep`` admits, and those of them within 1e-9 of it
    (a tie: equal candidates a batch and a single pricing may order either way)."""
    admitted = [i for i in range(len(times)) if keep(i)]
    least = min(times[i] for i in admitted)
    return least, {i for i in admitted if times[i] <= least * (1 + 1e-9)}


def _assert_pick(pick, pool: list[Candidate], times: np.ndarray, keep) -> None:
    least, tied = _best(times, keep)
    assert pick.strategy.hash in {pool[i].strategy.hash for i in tied}
    assert pick.predicted_s == pytest.approx(least, rel=1e-9)
    # the candidates priced faster, all refused (with the ties on either side of the pick)
    assert sum(times < least * (1 - 1e-9)) <= pick.passed_over <= sum(times <= least * (1 + 1e-9)) - 1


@pytest.fixture(scope="module")
def scene(llama):
    _workload, spec = llama
    pool = _pool(spec)
    return spec, pool, _seconds(spec, pool)


def test_the_pool_holds_the_builders_megatron_and_the_search_samplers_draws(scene):
    spec, pool, _times = scene
    origins = [c.origin for c in pool]
    assert origins[0] == "builder allreduce"  # the experiment's builders first, in its order
    assert {"builder allreduce", "builder ps-lb"} <= set(origins)
    megatron = [c for c in pool if c.origin.startswith("megatron")]
    assert megatron and all(c.strategy.tensor_parallel is not None for c in megatron)
    assert {c.strategy.tensor_parallel.sequence_parallel for c in megatron} == {False, True}
    assert any(c.strategy.checkpoint for c in megatron)
    draws = [c.strategy for c in pool if c.origin == "sampler"]
    assert 0.5 * DRAWS <= len(draws) <= DRAWS
    assert any(s.tensor_parallel is not None for s in draws)  # the search's tp_prob
    assert any(s.frees_parameters or any(p.shards[0].synchronizer.kind == "shard" for p in s.plans)
               for s in draws if s.tensor_parallel is None)  # and its shard_prob
    assert len({c.strategy.hash for c in pool}) == len(pool)
    for c in pool:
        validate(c.strategy, spec, CLUSTER)
    again = _pool(spec)
    assert [c.strategy.hash for c in again] == [c.strategy.hash for c in pool]  # seeded


def test_the_pick_is_the_fastest_candidate_the_budget_fits(scene):
    spec, pool, times = scene
    budget = _budget(spec)
    assert all(budget.fits(c.strategy) for c in pool)  # a budget of 1 GiB holds this tiny model every way
    pick = modelled_pick(pool, model=spec, cluster=CLUSTER, memory=budget,
                         simulator=BoundSimulator(ReplaySimulator(), spec, CLUSTER))
    _assert_pick(pick, pool, times, lambda i: True)
    assert pick.origin == next(c.origin for c in pool if c.strategy.hash == pick.strategy.hash)
    assert pick.peak_bytes == tuple(budget.peaks(pick.strategy))
    assert pick.limit_bytes == (GIB,) * CLUSTER.num_devices
    assert (pick.pool, pick.unpriced, pick.simulator) == (len(pool), (), "replay")


def test_a_budget_that_refuses_the_favourite_gets_the_fastest_that_fits(scene):
    spec, pool, times = scene
    budget = _budget(spec)
    peaks = np.array([max(budget.peaks(c.strategy)) for c in pool])
    _least, favourites = _best(times, lambda i: True)
    below = min(peaks[i] for i in favourites) - 1
    assert peaks.min() <= below  # the premise: something holds less than every favourite
    budget.gib = below / GIB
    fitting = [budget.fits(c.strategy) for c in pool]
    assert not any(fitting[i] for i in favourites) and any(fitting)
    pick = modelled_pick(pool, model=spec, cluster=CLUSTER, memory=budget,
                         simulator=BoundSimulator(ReplaySimulator(), spec, CLUSTER))
    _assert_pick(pick, pool, times, lambda i: fitting[i])
    assert pick.strategy.hash not in {pool[i].strategy.hash for i in favourites}
    assert max(pick.peak_bytes) <= below and pick.passed_over >= len(favourites)


def test_a_budget_nothing_in_the_pool_fits_is_refused_naming_the_setting(scene):
    spec, pool, _times = scene
    budget = _budget(spec)
    smallest = min(max(budget.peaks(c.strategy)) for c in pool)
    budget.gib = (smallest - 1) / GIB
    with pytest.raises(SpecError, match=r"search\.memory_gib: nothing in the modelled pick's pool of \d+ priced "
                                        r"candidates fits .*: the smallest predicted peak is .*; raise "
                                        r"search\.memory_gib"):
        modelled_pick(pool, model=spec, cluster=CLUSTER, memory=budget,
                      simulator=BoundSimulator(ReplaySimulator(), spec, CLUSTER))


def test_a_simulator_that_does_not_price_splits_leaves_them_out_and_says_so(scene):
    spec, pool, _times = scene
    budget = _budget(spec)
    pick = modelled_pick(pool, model=spec, cluster=CLUSTER, memory=budget,
                         simulator=BoundSimulator(AnalyticSimulator(), spec, CLUSTER))
    split = [c for c in pool if c.strategy.tensor_parallel is not None]
    assert len(pick.unpriced) == len(split) and all("does not price tensor parallelism" in u for u in pick.unpriced)
    analytic = AnalyticSimulator()
    plain = [c for c in pool if c.strategy.tensor_parallel is None]
    times = np.array([float(analytic.predict([c.strategy], spec, CLUSTER)[0]) for c in plain])
    _assert_pick(pick, plain, times, lambda i: True)
    with pytest.raises(SpecError, match="search.simulator: the training-free analytic model prices none"):
        modelled_pick(split, model=spec, cluster=CLUSTER, memory=budget,
                      simulator=BoundSimulator(AnalyticSimulator(), spec, CLUSTER))


def test_misuse_is_refused_naming_the_argument(scene):
    spec, pool, _times = scene
    sim = BoundSimulator(ReplaySimulator(), spec, CLUSTER)
    with pytest.raises(ValueError, match="modelled_pick: pool: expected at least one candidate"):
        modelled_pick([], model=spec, cluster=CLUSTER, memory=_budget(spec), simulator=sim)
    other = MemoryBudget(spec, cluster_preset("local-1x2"), gib=1.0)
    with pytest.raises(ValueError, match="modelled_pick: memory: a budget of .* on local-1x2"):
        modelled_pick(pool, model=spec, cluster=CLUSTER, memory=other, simulator=sim)
    search = StrategySearch(spec, CLUSTER, _exp(spec), sim)
    with pytest.raises(ValueError, match="candidate_pool: draws: expected a count"):
        candidate_pool(search, draws=-1, seed=0)


def test_megatron_candidates_are_the_tuned_baselines_grid_and_none_without_pairs(llama):
    from synctune.engine.megatron import MegatronConfig, megatron_plan
    from synctune.models import model_spec

    _workload, spec = llama
    found = megatron_candidates(spec, CLUSTER)
    skeleton = build_strategy("allreduce", spec, CLUSTER)
    assert found[0].strategy == megatron_plan(MegatronConfig(degree=2), skeleton, spec)
    assert found[0].origin == "megatron (tp 2, reshard)"
    assert len({c.strategy.hash for c in found}) == len(found) >= 6  # sp or not, every checkpointing mode
    assert megatron_candidates(model_spec("cnn-small"), CLUSTER) == []  # no numbered blocks


def _context(workload, spec, budget, exp):
    from synctune.run.prepare import SearchContext

    return SearchContext(exp=exp, model=spec, cluster=CLUSTER, workload=workload, search_id="modelled", memory=budget,
                         shard_prob=0.5, trial_config=None, node_net=None, horovod_entries=(), done=(), dataset=None,
                         logger=None, parent_run="")


def test_a_prepared_search_gives_its_pick_as_a_confirmation_arm_without_a_trial(llama, tmp_path, monkeypatch):
    """From a search context: the search's own filter and training-free simulator, the memory
    model as prepared (what trials taught it is not a model-only tool's), the pick as an arm."""
    from synctune.run.prepare import SearchFilter, search_algorithm

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path))  # no measured profile: the replay's counted compute
    workload, spec = llama
    exp = _exp(spec, tensor_parallel=True, shard=True)

    def pool_of(ctx) -> list[Candidate]:
        return candidate_pool(search_algorithm(ctx, {"trials": []}), draws=DRAWS, seed=SEED)

    # A budget just under what the favourite of a roomy budget's pool holds.
    roomy = pool_of(_context(workload, spec, _budget(spec), exp))
    _least, favourites = _best(_seconds(spec, roomy), lambda i: True)
    below = min(max(_budget(spec).peaks(roomy[i].strategy)) for i in favourites) - 1
    ctx = _context(workload, spec, _budget(spec, gib=below / GIB), exp)
    pick = context_pick(ctx, draws=DRAWS, seed=SEED)
    pool = pool_of(ctx)
    assert any(c.strategy.tensor_parallel is not None for c in pool if c.origin == "sampler")
    check = SearchFilter(ctx)
    fitting = [check.fits(c.strategy) for c in pool]
    assert any(fitting) and not all(fitting)
    _assert_pick(pick, pool, _seconds(spec, pool), lambda i: fitting[i])
    assert pick.passed_over >= 1

    # A trial over the budget teaches the search's memory model that everything is: the pick,
    # made before any trial, does not change.
    skeleton = build_strategy("allreduce", spec, CLUSTER)
    ctx.memory.observe(skeleton, False, [{"peak_bytes": 4 * GIB}] * CLUSTER.num_devices, True)
    assert not ctx.memory.fits(pick.strategy)
    again = context_pick(ctx, draws=DRAWS, seed=SEED)
    assert again == pick

    arm = modelled_arm(ctx, pick)
    assert isinstance(arm, Arm) and arm.label == MODELLED_LABEL == "modelled pick (training-free)"
    assert arm.strategy == pick.strategy and arm.runtime == ctx.executor(pick.strategy)
    assert pick.summary().startswith(f"{MODELLED_LABEL}: {pick.origin}, predicted ")


def test_a_search_that_scores_nothing_has_no_modelled_pick(llama):
    workload, spec = llama
    ctx = _context(workload, spec, _budget(spec), _exp(spec, algorithm="random-guided"))
    with pytest.raises(SpecError, match="search.algorithm: random-guided scores no proposal"):
        context_pick(ctx, draws=4, seed=0)


def test_the_untaught_memory_is_a_copy_that_forgets_the_trials(llama):
    from synctune.run.modelled import untaught_memory

    _workload, spec = llama
    budget = _budget(spec)
    skeleton = build_strategy("allreduce", spec, CLUSTER)
    before = budget.peaks(skeleton)
    budget.observe(skeleton, False, [{"peak_bytes": 4 * GIB}] * CLUSTER.num_devices, True)
    fresh = untaught_memory(budget)
    assert fresh.peaks(skeleton) == before and budget.peaks(skeleton) != before
    assert fresh.probe is budget.probe and (fresh.gib, fresh.headroom) == (budget.gib, budget.headroom)
