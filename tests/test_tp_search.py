"""Tensor parallelism in the search's space: the guided sampler's split draws (Megatron's plan per
block, with sequence parallelism or without) are valid strategies, under a memory budget only
what the memory model admits is proposed and a budget only a split fits is searched with splits,
the growth of a sharded draw takes tensor parallelism with sequence parallelism as a step, the
local searches' tensor-parallel coordinate, a budget nothing fits refused before any trial with
the levers tried, and a search that cannot propose or score splits refused naming its key.

The memory budgets here are written by hand (activation figures given, not probed), on bert-tiny
(16.9 MiB of float32 weights, Adam: parameters, gradients and two moments are about 68 MiB per
replica) over the two devices of local-1x2."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.run.prepare import check_budget, check_tensor_parallel, tp_rate
from synctune.search import GuidedSampler
from synctune.search.draw import DrawContext
from synctune.search.experiment import Experiment
from synctune.search.local_search import ChoiceSpace
from synctune.search.moves import global_moves
from synctune.search.tp_draw import grow_split
from synctune.simulator.memory import GIB, MIB, ActivationFigures, MemoryBudget
from synctune.spec import ClusterSpec, ComputeProfile, ModelSpec, VariableSpec, cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import StrategyColumns, build_strategy, validate
from synctune.strategy.tensor_parallel import tp_key

ACTIVATIONS = 8 * MIB  # a rank's activations, batch and temporaries at bert-tiny's batch of 8


def _budget(mib: float, *, tensor_parallel: bool = True, model: str = "bert-tiny", cluster: str = "local-1x2",
            split: dict | None = None, spec: ModelSpec | None = None) -> MemoryBudget:
    spec = spec or model_spec(model)
    return MemoryBudget(spec, cluster_preset(cluster), gib=mib * MIB / GIB, headroom=0.0, optimizer="adam",
                        probe=ActivationFigures({spec.batch_size: [ACTIVATIONS]}), tensor_parallel=tensor_parallel,
                        split=split or {})


def _emb_lm() -> ModelSpec:
    """The spec of the tiny language model of ``_tp_workers`` (embedding, two MLP blocks, a final
    norm, an output layer of its own; 65 KiB of weights), whose sequence-parallel plan with its
    embedding split row-wise runs (``test_tensor_parallel``)."""
    from _tp_workers import workload_of

    return workload_of("emb-lm").spec()


def _only_a_split_fits(budget: MemoryBudget) -> None:
    """The scenario's premise: neither replicated training nor any sharding the builders make fits,
    the megatron builder's plan with its token embedding split does."""
    spec, cluster = budget.model, budget.cluster
    assert not budget.fits(build_strategy("allreduce", spec, cluster))
    for depth in (1, 2, 3, 4):
        for reshard in (True, False):
            assert not budget.fits(build_strategy("shard", spec, cluster, depth=depth, reshard=reshard))
    assert budget.fits(build_strategy("megatron", spec, cluster, embedding="rowwise"))


def test_split_draws_are_valid_strategies_that_round_trip_through_columns():
    for model, cluster in (("bert-tiny", "local-2x2"), ("transformer-small", "local-1x4")):
        spec, cl = model_spec(model), cluster_preset(cluster)
        cols = GuidedSampler(spec, cl, seed=1, tp_prob=0.5, shard_prob=0.3, checkpoint_prob=0.3).sample_columns(120)
        strategies = [cols.strategy(i) for i in range(cols.size)]
        split = [s for s in strategies if s.tensor_parallel is not None]
        assert 30 <= len(split) <= 90, len(split)  # about half the draws
        # sequence parallelism only where the builder writes it: transformer-small has none (its
        # output is computed outside a module, on its embedding's tied weight)
        assert any(s.tensor_parallel.sequence_parallel for s in split) == (model == "bert-tiny")
        assert any(not s.tensor_parallel.sequence_parallel for s in split)
        assert len({s.tensor_parallel.degree for s in split}) == (1 if cluster == "local-2x2" else 2)
        for s in strategies:
            validate(s, spec, cl)
        again = StrategyColumns.from_strategies(spec, cl, strategies)
        assert (again.digests() == cols.digests()).all()


def test_without_tp_prob_the_sampler_draws_no_split_and_its_stream_is_unchanged():
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-2x2")
    a = GuidedSampler(spec, cl, seed=4, shard_prob=0.5).sample_columns(50)
    b = GuidedSampler(spec, cl, seed=4, shard_prob=0.5, tp_prob=0.0).sample_columns(50)
    assert a.tp_degree is None and (a.digests() == b.digests()).all()
    with pytest.raises(ValueError, match="tp_prob: expected a probability"):
        GuidedSampler(spec, cl, tp_prob=1.5)


def test_under_a_budget_only_a_split_fits_the_sampler_draws_splits_that_fit():
    budget = _budget(60)
    _only_a_split_fits(budget)
    spec, cl = budget.model, budget.cluster
    cols = GuidedSampler(spec, cl, seed=2, shard_prob=1.0, tp_prob=0.5, fits=budget.fits).sample_columns(40)
    strategies = [cols.strategy(i) for i in range(cols.size)]
    fitting = [s for s in strategies if budget.fits(s)]
    assert len(fitting) >= 30  # the split draws, and the sharded draws grown into splits
    for s in fitting:
        validate(s, spec, cl)
        assert s.tensor_parallel is not None and s.tensor_parallel.degree == 2


def test_without_tensor_parallelism_in_the_space_nothing_drawn_fits_that_budget():
    budget = _budget(60, tensor_parallel=False)
    cols = GuidedSampler(budget.model, budget.cluster, seed=2, shard_prob=1.0, fits=budget.fits).sample_columns(20)
    assert not any(budget.fits(cols.strategy(i)) for i in range(cols.size))


def test_the_growth_step_splits_with_sequence_parallelism_where_that_is_what_fits():
    """A tiny language model (65 KiB of weights): where the memory measured for the
    sequence-parallel plan (its own split figures: 1 MiB where the unsplit model holds 8) is what
    brings a sharded draw under the budget, the growth step splits with it; where nothing fits,
    there is no step."""
    spec, cl = _emb_lm(), cluster_preset("local-1x2")
    sequence = build_strategy("megatron", spec, cl, sequence_parallel=True, embedding="rowwise",
                              loss_parallel=True).tensor_parallel
    figures = {tp_key(sequence): ActivationFigures({spec.batch_size: [1 * MIB]})}
    tight = _budget(5, spec=spec, split=figures)
    sharded = build_strategy("shard", spec, cl, depth=2, reshard=True)
    assert not tight.fits(sharded)
    assert not tight.fits(build_strategy("megatron", spec, cl, embedding="rowwise"))  # pairs alone are not enough
    ctx = DrawContext(model=spec, cluster=cl, rng=np.random.default_rng(0), lossy=True, rate=1.0, fits=tight.fits)
    grown = grow_split(ctx, sharded)
    assert grown is not None and tight.fits(grown)
    assert grown.tensor_parallel == sequence
    validate(grown, spec, cl)
    nothing = _budget(1, spec=spec, split=figures)
    assert grow_split(dataclasses.replace(ctx, fits=nothing.fits), sharded) is None
    # The sampler's sharded draws grow into that split (its only fit), none left over the budget
    # that a split would have brought under it.
    cols = GuidedSampler(spec, cl, seed=3, shard_prob=1.0, tp_prob=0.2, fits=tight.fits).sample_columns(20)
    made = [cols.strategy(i) for i in range(cols.size)]
    assert all(tight.fits(s) and s.tensor_parallel == sequence for s in made)


def test_the_local_searches_tensor_parallel_coordinate():
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-2x2")
    space = ChoiceSpace(spec, cl, split=True)
    plain = build_strategy("allreduce", spec, cl)
    unsplit = space.tensor_parallelism(plain)
    assert unsplit and all(s.tensor_parallel is not None for s in unsplit)
    assert {s.tensor_parallel.sequence_parallel for s in unsplit} == {True, False}
    split = build_strategy("megatron", spec, cl, dp="allreduce")
    moves = space.tensor_parallelism(split)
    assert any(m.tensor_parallel is None for m in moves)  # the split dropped
    assert any(m.tensor_parallel is not None and len(m.tensor_parallel.styles) < len(split.tensor_parallel.styles)
               for m in moves)  # one block's pairs removed
    for m in moves + unsplit:
        validate(m, spec, cl)
    # The other kinds' moves of a split strategy keep only what still runs split.
    for m in global_moves(split, space):
        validate(m, spec, cl)
    for coordinate in space.coordinates(4):
        for m in space.neighbours(split, coordinate):
            validate(m, spec, cl)
    assert ChoiceSpace(spec, cl).tensor_parallelism(plain) == []  # not in the space


def test_a_budget_nothing_fits_is_refused_with_the_smallest_peak_in_mib_and_the_levers_tried():
    for tp in (False, True):
        budget = _budget(10, tensor_parallel=tp)
        with pytest.raises(SpecError) as err:
            check_budget(budget, "tight.yaml")
        line = str(err.value)
        assert "\n" not in line
        assert line.startswith("tight.yaml: search.memory_gib: nothing fits 0.00976562 GiB per device (10.0 MiB "
                               "per rank): the smallest predicted peak is ")
        peak, name, _fits = budget.smallest()
        assert f"{peak / MIB:.1f} MiB per rank ({name})" in line
        assert "tried sharding (FSDP2 at module depths 1-4, resharded or not)" in line
        if tp:
            assert name.startswith("megatron:degree=2")
            assert "tensor parallelism (Megatron, degree 2, with and without sequence parallelism)" in line
        else:
            assert name.startswith("shard:")
            assert ("tensor parallelism not tried (not in the search's space; search.tensor_parallel: true puts it "
                    "there)") in line
    # The split's smallest peak is below sharding's: the levers tried change the figure.
    assert _budget(10, tensor_parallel=True).smallest()[0] < _budget(10, tensor_parallel=False).smallest()[0]
    # A budget a split fits is not refused once tensor parallelism is in the space.
    check_budget(_budget(60, tensor_parallel=True), "ok.yaml")
    with pytest.raises(SpecError, match="nothing fits"):
        check_budget(_budget(60, tensor_parallel=False), "ok.yaml")


def test_on_nodes_of_one_device_the_refusal_says_why_tensor_parallelism_was_not_tried():
    budget = _budget(10, cluster="local-2x1")
    with pytest.raises(SpecError, match=r"tensor parallelism not tried \(cluster 'local-2x1' has a node of 1 "
                                        r"device\(s\), too few for a TP group\)"):
        check_budget(budget, "x.yaml")


def _experiment(**search) -> Experiment:
    return Experiment.from_dict({"name": "t", "domain": {"model": "bert-tiny", "cluster": "local-1x2"},
                                 "search": {"budget": 3, **search}})


def test_the_search_setting_and_what_it_refuses_before_any_trial():
    with pytest.raises(SpecError, match="search.tensor_parallel: expected auto, true or false"):
        _experiment(tensor_parallel="yes")
    assert _experiment().search.tensor_parallel is False  # opt-in
    skeleton = build_strategy("allreduce", model_spec("bert-tiny"), cluster_preset("local-1x2"))
    roomy, tight = _budget(4096), _budget(60)
    assert tp_rate(_experiment(tensor_parallel="auto"), roomy, skeleton) == 0.0
    assert tp_rate(_experiment(tensor_parallel="auto"), tight, skeleton) == 0.5
    assert tp_rate(_experiment(tensor_parallel=True), roomy, skeleton) == 0.5
    assert tp_rate(_experiment(tensor_parallel=False), tight, skeleton) == 0.0
    with pytest.raises(SpecError, match=r"search.simulator: pretrained does not price tensor parallelism .* use "
                                        r"simulator: replay, or set search.tensor_parallel: false"):
        check_tensor_parallel(_experiment(tensor_parallel=True), tight, 0.5, "x.yaml")
    check_tensor_parallel(_experiment(tensor_parallel=True, simulator="replay"), tight, 0.5, "x.yaml")
    check_tensor_parallel(_experiment(tensor_parallel=True, algorithm="random-guided"), tight, 0.5, "x.yaml")
    ones = _budget(60, cluster="local-2x1")
    with pytest.raises(SpecError, match=r"search.tensor_parallel: true, but cluster 'local-2x1' has a node of 1 "
                                        r"device\(s\), too few for a TP group; set search.tensor_parallel: false"):
        check_tensor_parallel(_experiment(tensor_parallel=True, simulator="replay"), ones, 0.0, "x.yaml")


# ------------------------------------------------------------------ scoring split strategies

HIDDEN, FFN, SEQ, BATCH = 4, 8, 16, 8


def _mlp() -> tuple[ModelSpec, ClusterSpec]:
    """One numbered block with an MLP pair named as Megatron's plan finds it (backward order)."""
    model = ModelSpec(name="mlp-block", batch_size=BATCH, variables=(
        VariableSpec(name="layers.0.fc2.weight", shape=(HIDDEN, FFN)),
        VariableSpec(name="layers.0.fc1.weight", shape=(FFN, HIDDEN)),
        VariableSpec(name="norm.weight", shape=(HIDDEN,))))
    return model, cluster_preset("local-1x2")


def test_the_bound_replay_scores_split_columns_as_it_replays_them_and_others_refuse():
    from synctune.simulator import AnalyticSimulator, ReplaySimulator
    from synctune.simulator.bound import BoundSimulator

    model, cluster = _mlp()
    profile = ComputeProfile(model=model.name, device="cpu", workers=2, batch_size=BATCH, forward_s=0.010,
                             backward_s=0.016, step_s=0.002, ready_s=(0.004, 0.012, 0.014),
                             io_elements={"layers.0.fc1": (SEQ * HIDDEN, SEQ * FFN),
                                          "layers.0.fc2": (SEQ * FFN, SEQ * HIDDEN),
                                          "norm": (SEQ * HIDDEN, SEQ * HIDDEN)})
    replay = ReplaySimulator({})
    replay.add_profile(profile)
    strategies = [build_strategy("allreduce", model, cluster), build_strategy("megatron", model, cluster)]
    assert strategies[1].tensor_parallel is not None
    cols = StrategyColumns.from_strategies(model, cluster, strategies)
    bound = BoundSimulator(replay, model, cluster)
    expected = -replay.predict(strategies, model, cluster)
    assert np.allclose(bound.score_columns(cols), expected)
    assert np.allclose(bound.score(strategies), expected)
    assert expected[0] != expected[1]  # the split one is not priced as its data-parallel part
    analytic = BoundSimulator(AnalyticSimulator(), model, cluster)
    with pytest.raises(SpecError, match="the analytic simulator does not price tensor parallelism.*simulator: replay"):
        analytic.score_columns(cols)
    assert np.isfinite(analytic.score_columns(cols.take(0, 1))).all()  # unsplit columns score as before


def test_a_search_with_tensor_parallelism_refuses_a_budget_nothing_fits_before_any_trial(tmp_path):
    """``synctune search`` end to end up to its first trial: the probe measures Megatron's
    sequence-parallel plan on one TP group of two local processes, and a budget that nothing,
    split or not, fits is refused in one line naming the smallest peak in MiB per rank, the
    strategy it belongs to and the levers tried; nothing is recorded."""
    import subprocess
    import sys

    from _searches import ROOT, search_env

    exp = tmp_path / "tight.yaml"
    exp.write_text("name: tight\nmodel: bert-tiny\ncluster: local-1x2\nbudget: 3\nsimulator: replay\n"
                   "memory_gib: 0.01\noptimizer: adam\nddp_trials: 0\ntensor_parallel: true\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=900)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, lines
    line = lines[0]
    assert "search.memory_gib: nothing fits 0.01 GiB per device, less 10% headroom (9.2 MiB per rank)" in line
    # At the same global batch the smallest is whichever the memory model finds (here sharding with
    # every block checkpointed; a split at its group's batch holds more), named with its levers.
    assert re.search(r"the smallest predicted peak is \d+\.\d MiB per rank \((megatron:degree=2,|shard:)", line), line
    assert "tensor parallelism (Megatron, degree 2, with and without sequence parallelism)" in line
    assert "sharding (FSDP2" in line and "checkpointing every block" in line
    assert not list(home.rglob("*.parquet"))


def test_genetic_children_of_split_parents_are_valid():
    import random

    from synctune.search.moves import crossover

    spec, cl = model_spec("bert-tiny"), cluster_preset("local-2x2")
    parents = [build_strategy("megatron", spec, cl, dp="allreduce"), build_strategy("ps", spec, cl),
               build_strategy("megatron", spec, cl, sequence_parallel=True)]
    guided = GuidedSampler(spec, cl, seed=5, tp_prob=0.5)
    children = crossover(parents, 30, random.Random(0), guided)
    for child in children:  # a child whose mixed plans no longer run its parent's split drops it
        validate(child, spec, cl)


def test_checkpointing_under_a_split_saves_the_splits_share_of_each_block():
    """The probe: 8 MiB unsplit, 4 MiB with every block checkpointed in full (each block half of
    the saving); a plan measured at 2 MiB (a quarter of the unsplit figure) saves a quarter of a
    block's 2 MiB for each block it checkpoints: 1.5 MiB with one block, 1 MiB with both (never
    the unsplit saving, which would leave nothing)."""
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")
    tp = build_strategy("megatron", spec, cl, sequence_parallel=True).tensor_parallel
    budget = MemoryBudget(spec, cl, gib=1, probe=ActivationFigures({8: [8 * MIB]}),
                          checkpointed={"full": ActivationFigures({8: [4 * MIB]})},
                          shares={"layers.0": 0.5, "layers.1": 0.5}, split={tp_key(tp): ActivationFigures({8: [2 * MIB]})})
    assert budget.activation_bytes(8, (("layers.0", "full"),), tp) == int(1.5 * MIB)
    assert budget.activation_bytes(8, (("layers.0", "full"), ("layers.1", "full")), tp) == 1 * MIB
    assert budget.activation_bytes(8, (("layers.0", "full"),)) == 6 * MIB  # unsplit: as before


class _Budgeted:
    """The search's memory check as the run layer's filter is, on a budget written here."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget = budget

    def fits(self, strategy) -> bool:
        try:
            validate(strategy, self.budget.model, self.budget.cluster)
        except Exception:  # what no runtime runs is never proposed (the run layer's plans_refusal)
            return False
        return self.budget.fits(strategy)

    def fit(self, strategies, breakdowns) -> None:
        pass

    def state(self) -> dict:
        return {}

    def restore(self, state) -> None:
        pass

    def nothing_fits(self):
        return None


@pytest.mark.parametrize("algorithm", ["random-guided", "autodist", "coordinate-descent", "mcts"])
def test_under_a_budget_only_a_split_fits_every_algorithm_proposes_splits_that_fit(algorithm):
    """A tiny language model on local-1x2 at 5 MiB: only Megatron's sequence-parallel plan with its
    vocabulary split (embedding row-wise, loss on split logits) fits (its measured figures, written here); every proposal of the search,
    scored by the replay (FLOP counts standing in for a profile), is such a split and fits."""
    from synctune.search.algorithm import StrategySearch
    from synctune.simulator import ReplaySimulator
    from synctune.simulator.bound import BoundSimulator

    spec, cl = _emb_lm(), cluster_preset("local-1x2")
    sequence = build_strategy("megatron", spec, cl, sequence_parallel=True, embedding="rowwise",
                              loss_parallel=True).tensor_parallel
    budget = _budget(5, spec=spec, split={tp_key(sequence): ActivationFigures({spec.batch_size: [1 * MIB]})})
    exp = Experiment.from_keys(name="t", model=spec.name, cluster=cl.name, budget=6, algorithm=algorithm,
                               proposals=40, candidates=2, seed=1, sim_evaluations=200, baselines=["allreduce"])
    sim = None if algorithm == "random-guided" else BoundSimulator(ReplaySimulator({}), spec, cl)
    check = _Budgeted(budget)
    search = StrategySearch(spec, cl, exp, sim, memory=check, shard_prob=1.0, tp_prob=0.5)
    assert search.over_budget_baselines == ["allreduce"]
    asked = 0
    while (p := search.ask()) is not None:
        assert p.strategy.tensor_parallel is not None and budget.fits(p.strategy), p.trial_id
        validate(p.strategy, spec, cl)
        search.tell(p.trial_id, 0.01 + 0.001 * asked)
        asked += 1
    assert asked >= 4, asked


def test_a_keras_workload_is_refused_tensor_parallelism():
    with pytest.raises(SpecError, match="tensor parallelism runs on PyTorch workloads only"):
        check_tensor_parallel(_experiment(tensor_parallel=True, simulator="replay"), _budget(60), 0.5, "x.yaml",
                              "tensorflow")


def test_every_split_strategy_trains_the_replicated_strategys_global_batch():
    # Time per iteration compares strategies only at the same work: a TP group trains the samples
    # its replicas would (the reference: the replicated all-reduce strategy's global batch), and a
    # split dropped gives each replica its share back.
    import random

    from synctune.engine.megatron import MEGATRON_DEFAULT, MegatronConfig, megatron_plan
    from synctune.search.moves import crossover
    from synctune.strategy.builders import without_tensor_parallel

    spec, cl = model_spec("bert-tiny"), cluster_preset("local-2x2")
    plain = build_strategy("allreduce", spec, cl)
    total = plain.global_batch_size
    assert total == sum(plain.batch_split) == 4 * spec.batch_size
    built = [build_strategy("megatron", spec, cl, dp=dp, sequence_parallel=sp)
             for dp in ("allreduce", "shard") for sp in (False, True)]
    built += [megatron_plan(MEGATRON_DEFAULT, plain, spec),
              megatron_plan(MegatronConfig(degree=2, sequence_parallel=True, checkpoint="full"), plain, spec)]
    built.append(megatron_plan(MEGATRON_DEFAULT, built[-2], spec))  # planned again from its own row
    cols = GuidedSampler(spec, cl, seed=3, tp_prob=0.6, shard_prob=0.3, checkpoint_prob=0.3).sample_columns(60)
    drawn = [s for s in (cols.strategy(i) for i in range(cols.size)) if s.tensor_parallel is not None]
    space = ChoiceSpace(spec, cl, split=True)
    moved = space.tensor_parallelism(plain) + space.tensor_parallelism(built[0])
    children = crossover([built[0], build_strategy("ps", spec, cl), built[1]], 20, random.Random(0),
                         GuidedSampler(spec, cl, seed=5, tp_prob=0.5))
    assert drawn and any(m.tensor_parallel is None for m in moved)
    for s in built + drawn + moved + children:
        assert s.global_batch_size == total, (s.summary(), s.batch_split)
        validate(s, spec, cl)
    for s in built:
        t = s.tensor_parallel.degree
        assert s.batch_split == (t * spec.batch_size,) * 4  # each rank holds its group's batch
        assert without_tensor_parallel(s).batch_split == plain.batch_split


def test_a_split_strategys_batch_moves_over_its_tp_groups():
    # The replication coordinate on replicas of different speeds: a split strategy's global batch
    # moves between its TP groups (each rank holding its group's), never below a group's share.
    spec = model_spec("bert-tiny")
    cl = cluster_preset("local-2x2")
    split = build_strategy("megatron", spec, cl, dp="allreduce")
    guided = GuidedSampler(spec, cl, seed=1)
    guided.device_speed = {d: (1.0 if i < 2 else 3.0) for i, d in enumerate(cl.devices)}  # node 1 three times faster
    for t in (0.0, 0.5, 1.0):
        moved = guided.split_towards_speed(split, t)
        assert moved.global_batch_size == split.global_batch_size
        assert moved.batch_split[0] == moved.batch_split[1] and moved.batch_split[2] == moved.batch_split[3]
        validate(moved, spec, cl)
    assert guided.split_towards_speed(split, 1.0).batch_split == (8, 8, 24, 24)  # replicas 4, 4, 12, 12
    alone = guided.on_nodes(split, [1])
    assert alone.tensor_parallel == split.tensor_parallel and alone.batch_split == (32, 32)


def test_the_growth_splits_or_checkpoints_first_in_the_share_the_measured_costs_set():
    """Where both a split and checkpointing fit a sharded draw the budget does not hold, the
    sampler's ``split_share`` of its grown draws split first and the rest checkpoint; half each
    way until the search has measured both, then the kind measured faster leads."""
    from synctune.search.draw import takes_turn
    from synctune.search.policies import SPLIT_LEAD, split_share

    assert [takes_turn(k, 0.5) for k in range(4)] == [True, False, True, False]  # the order before shares
    for share in (0.0, 0.25, 0.5, 0.75, 1.0):
        assert sum(takes_turn(k, share) for k in range(100)) == round(100 * share)
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")

    def fits(s):  # sharding alone never fits; a split or one checkpointed block does
        return s.tensor_parallel is not None or bool(s.checkpoint)

    counts = {}
    for share in (0.0, 0.5, SPLIT_LEAD, 1.0):
        cols = GuidedSampler(spec, cl, seed=3, shard_prob=1.0, tp_prob=1e-9, fits=fits,
                             split_share=share).sample_columns(40)
        drawn = [cols.strategy(i) for i in range(cols.size)]
        assert all(fits(s) for s in drawn)
        counts[share] = sum(s.tensor_parallel is not None for s in drawn)
    assert counts == {0.0: 0, 0.5: 20, SPLIT_LEAD: 30, 1.0: 40}
    with pytest.raises(ValueError, match="split_share: expected a probability"):
        GuidedSampler(spec, cl, split_share=1.5)

    skeleton = build_strategy("allreduce", spec, cl)
    split = build_strategy("megatron", spec, cl)
    checkpointed = dataclasses.replace(skeleton, checkpoint=(("encoder.layer.0", "full"),))

    @dataclasses.dataclass
    class Measured:  # what split_share reads of a round's context
        done: list

        def measured(self, upto=None):
            return [s for s, _t in self.done], np.array([t for _s, t in self.done], float)

    assert split_share(Measured([])) == 0.5
    assert split_share(Measured([(split, 0.02), (skeleton, 0.01)])) == 0.5  # no checkpointed one measured
    assert split_share(Measured([(split, 0.02), (checkpointed, 0.03), (checkpointed, 0.05)])) == SPLIT_LEAD
    assert split_share(Measured([(split, 0.04), (checkpointed, 0.03)])) == 1.0 - SPLIT_LEAD


def test_the_search_filter_refuses_a_split_whose_forward_fails_at_a_devices_local_shapes():
    """transformer-small computes its output on its token embedding's weight outside any module:
    with that embedding split over the vocabulary, each device's logits cover half the
    vocabulary and torch's cross-entropy fails on the targets beyond it. Such a plan validates and
    passes the meta-device module checks, so the filter the search proposes through must run the
    forward at local shapes (once per plan) and refuse it, where it used to reach a trial."""
    from synctune.engine.fsdp import meta_model
    from synctune.engine.tensor_parallel import TP_RUNTIME
    from synctune.workload import zoo_workload

    workload = zoo_workload("transformer-small")
    spec, cl = workload.spec(), cluster_preset("local-2x2")
    module = meta_model(workload)
    vocab = build_strategy("megatron", spec, cl, embedding="rowwise")
    assert vocab.tensor_parallel.style_of("embedding") == "rowwise"
    assert TP_RUNTIME.plans_refusal(vocab, cl, module, spec) is None  # what the filter checked before
    why = TP_RUNTIME.plans_refusal(vocab, cl, module, spec, workload)
    assert why is not None and "at a device's local shapes (degree 2)" in why and "out of bounds" in why
    pairs = build_strategy("megatron", spec, cl)
    assert pairs.tensor_parallel.style_of("embedding") is None
    assert TP_RUNTIME.plans_refusal(pairs, cl, module, spec, workload) is None


def test_the_search_filter_admits_a_library_models_split_plans_that_run_at_local_shapes():
    """Hugging Face Llama (built from a config) keeps its output layer of its own, so Megatron's
    plans over it, with sequence parallelism and the loss over vocabulary-split logits, run at a
    device's local shapes: the filter's forward admits them, where transformer-small's
    vocabulary-split embedding is refused (above)."""
    from _tp_workers import workload_of

    from synctune.engine.fsdp import meta_model
    from synctune.engine.tensor_parallel import TP_RUNTIME

    workload = workload_of("hf-llama")
    spec, cl = workload.spec(), cluster_preset("local-2x2")
    module = meta_model(workload)
    for options in ({}, {"sequence_parallel": True, "loss_parallel": True}):
        plan = build_strategy("megatron", spec, cl, **options)
        assert plan.tensor_parallel is not None
        assert TP_RUNTIME.plans_refusal(plan, cl, module, spec, workload) is None, options
