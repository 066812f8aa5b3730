"""The samplers and local searches propose sharding: sharded draws of the guided
sampler validate, its ``fsdp`` draws are what torch FSDP2 runs (the fsdp runtime's own check on
the zoo model built on the meta device), its ``zero2`` draws never reshard (the engine's part),
about ``shard_prob`` of its draws are sharded, and with ``shard_prob`` 0 every stream is the one
recorded (the column draw's as main drew it before sharding existed, commit 3e0e098, on the
homogeneous domains);
the choice space's ``shard`` choices and the all-shard global moves validate; and coordinate
descent scored by the memory model (negated predicted peak with Adam) ends with the large
variables sharded, each worth sharding by that model's own account. No trials: the specs only."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import random

import numpy as np
import pytest

from synctune.engine.fsdp_plans import FSDP_PLANS
from synctune.models.zoo import model_spec
from synctune.search.local_search import ChoiceSpace, coordinate_descent, mcts
from synctune.search.moves import crossover, global_moves
from synctune.search.sampler import GuidedSampler
from synctune.simulator.memory import predict_memory
from synctune.spec import cluster_preset
from synctune.strategy.builders import ShardOptions, build_strategy
from synctune.strategy.schema import AllReduceSynchronizer, ShardSynchronizer
from synctune.strategy.validate import validate
from synctune.workload import zoo_workload


def _hetero():
    """lab-b10c with one node half as fast (replica subsets and batch splits get drawn)."""
    c = cluster_preset("lab-b10c")
    return dataclasses.replace(c, nodes=tuple(dataclasses.replace(n, compute_gflops=s)
                                              for n, s in zip(c.nodes, [17.0, 34.0])))


LOCAL4 = cluster_preset("local-2x2")
DOMAINS = {"bert-tiny@local-2x2": ("bert-tiny", LOCAL4), "cnn-small@B1": ("cnn-small", cluster_preset("B1")),
           "transformer-small@hetero": ("transformer-small", _hetero())}

#: Per domain: the first 8 hashes (16 hex digits each) of ``GuidedSampler(seed=7).sample_many(8)``
#: and of 8 calls of ``sample()``, recorded when the column sampler became the only sampler
#: (objects are made of columns: numpy's stream, not Python's; the object sampler's distribution
#: is compared with it in tests/test_sampler_distributions.py); the digest of ``sample_columns(16)``
#: from a fresh sampler, recorded on main (3e0e098) before sharding existed (the homogeneous
#: domains draw it unchanged; on nodes of different speeds the column draw now draws replica
#: subsets too, recorded with the object hashes); and the digest of ``ChoiceSpace``'s neighbours
#: of data parallelism on its first and last variable, recorded on main (3e0e098).
MAIN = {
    "bert-tiny@local-2x2": (
        ["f61a3e9e7a75bd81", "1aef9cdfa4387c59", "9be79cc5fab6b37c", "27ca84c7beccc571", "737085202385c658",
         "7ed98fec1fe943b3", "3a7ff60e0afc5a98", "6fed832a5a9e1110"],
        ["9839759e966e7b74", "967c980990f6ce60", "fdbeed043a6f4514", "58766e587376ea8d", "937ca6621796184f",
         "8c9635433941a18e", "5c21b42c108ca2a1", "39085b8c752c43e5"], "597d2c4f6a141482", (23, "e3f23e09b8579df7")),
    "cnn-small@B1": (
        ["a3d5529bb6068c8e", "1de8d84fea018474", "7d11281718d77da6", "1b069ccb479609c8", "be7298b1be77eabc",
         "0264d70be3390e2a", "5d7563d0d3c1260f", "ba79d48149bf2ada"],
        ["88d5ea34241f870e", "a23810059f4a0585", "8fd7ba4d630b7496", "52a64899e4d9b882", "433e40a2e11b8194",
         "5d7563d0d3c1260f", "aa0088d33836232f", "471d721b87618a0c"], "e4f121eda53e29c9", (20, "a2f91ef13af44239")),
    "transformer-small@hetero": (
        ["04c9b21e607ad485", "105942c0270f1492", "4f567736f1dc33e2", "0c85451f237c7a9a", "43cade668efd6d35",
         "7d0ba821eaba3e75", "01839fb951762e1b", "17ec7f92d1203878"],
        ["2c5eff854fd636fb", "355189f415839413", "2a69caa8e9b62039", "af8dc66858de070e", "ed632d0712cd4752",
         "8c87f149dbd7db35", "def2c038df2c628c", "e4dcd6ffb8297f24"], "02ba3298e4f1af2c", (22, "c89375821a2433af")),
}


def _syncs(strategy):
    return [sh.synchronizer for p in strategy.plans for sh in p.shards]


def _shards(strategy):
    return [s for s in _syncs(strategy) if isinstance(s, ShardSynchronizer)]


def _all_shard(strategy) -> bool:
    return all(isinstance(s, ShardSynchronizer) for s in _syncs(strategy))


@pytest.mark.parametrize("domain", list(MAIN))
def test_without_shard_every_stream_is_the_recorded_one(domain):
    name, cluster = DOMAINS[domain]
    spec = model_spec(name)
    many, single, columns, (count, neighbours) = MAIN[domain]
    for shard_prob in (None, 0.0):  # shard_prob 0 draws nothing more: the default sampler's stream
        kwargs = {} if shard_prob is None else {"shard_prob": shard_prob}
        assert [s.hash[:16] for s in GuidedSampler(spec, cluster, seed=7, **kwargs).sample_many(8)] == many
        sampler = GuidedSampler(spec, cluster, seed=7, **kwargs)
        assert [sampler.sample().hash[:16] for _ in range(8)] == single
    cols = GuidedSampler(spec, cluster, seed=7, shard_prob=0.0).sample_columns(16)
    assert hashlib.sha256(cols.digests().tobytes()).hexdigest()[:16] == columns
    space = ChoiceSpace(spec, cluster)
    dp = space.data_parallel()
    found = space.neighbours(dp, [0]) + space.neighbours(dp, [len(space.variables) - 1])
    assert (len(found), hashlib.sha256("".join(s.hash for s in found).encode()).hexdigest()[:16]) == (count, neighbours)


def _units_canonical(strategy) -> None:
    """Unit ids 0.. by first appearance in plan order."""
    seen = list(dict.fromkeys(s.unit for s in _shards(strategy)))
    assert seen == list(range(len(seen)))


def _one_draw(strategy) -> None:
    """A sampled strategy: canonical units, one shard group and one reduce dtype."""
    _units_canonical(strategy)
    assert len({s.group for s in _shards(strategy)}) == 1
    assert len({s.reduce_dtype for s in _shards(strategy)}) == 1
    assert len({s.reduce_dtype for s in _shards(strategy)}) == 1


def _fsdp2_runs(runtime, strategy, spec, cluster, workload) -> bool:
    """Whether FSDP2 expresses ``strategy`` (module units, one mesh); what it may refuse in a
    sampler's draw is what the spec does not say: a unit whose module is a ModuleList (no forward
    of its own), or a resharded unit holding a tied weight (the search's filter drops both)."""
    from synctune.spec import SpecError

    try:
        runtime.check(strategy, spec, cluster, workload)
    except SpecError as err:
        assert "with no forward of its own" in str(err) or "(a tied weight)" in str(err), str(err)
        return False
    return True


@pytest.mark.parametrize("domain", list(DOMAINS))
def test_sharded_draws_validate_and_fsdp_ones_are_what_fsdp2_runs(domain):
    name, cluster = DOMAINS[domain]
    spec, workload = model_spec(name), zoo_workload(name)
    runtime = FSDP_PLANS
    sampler = GuidedSampler(spec, cluster, seed=11, shard_prob=1.0)
    seen = collections.Counter()
    for _ in range(40):
        strategy = sampler.sample()
        validate(strategy, spec, cluster)
        assert _shards(strategy), "a sharded draw shards something"
        _one_draw(strategy)
        if _all_shard(strategy):
            seen["all shard"] += _fsdp2_runs(runtime, strategy, spec, cluster, workload)
        seen["reshard"] += any(s.reshard for s in _shards(strategy))
        seen["hsdp"] += _shards(strategy)[0].group > 0
    for _ in range(40):  # FSDP2 runs about a third on bert-tiny (the rest cut a module with no forward)
        strategy = sampler.sharded(sampler.sample(), mode="fsdp")
        validate(strategy, spec, cluster)
        assert _all_shard(strategy)
        _one_draw(strategy)
        seen["fsdp mode"] += _fsdp2_runs(runtime, strategy, spec, cluster, workload)
    assert seen["all shard"] and seen["reshard"] and seen["fsdp mode"] >= 5
    assert seen["hsdp"]  # every node holds 2 or 4 devices: HSDP over the nodes is drawn too


def _partition(strategy) -> set[frozenset[str]]:
    units: dict[int, set[str]] = {}
    for p in strategy.plans:
        for sh in p.shards:
            if isinstance(sh.synchronizer, ShardSynchronizer):
                units.setdefault(sh.synchronizer.unit, set()).add(p.variable)
    return {frozenset(names) for names in units.values()}


def test_units_are_the_shard_builders_modules_at_one_depth():
    """The reference is the ``shard`` builder (FSDP2's usual wrapping, one unit per module at a
    depth): every fsdp draw's units are the builder's at some depth."""
    spec = model_spec("bert-tiny")
    by_depth = {d: _partition(build_strategy("shard", spec, LOCAL4, ShardOptions(depth=d))) for d in range(1, 6)}
    sampler = GuidedSampler(spec, LOCAL4, seed=5, shard_prob=1.0)
    depths = set()
    for _ in range(30):
        units = _partition(sampler.sharded(sampler.sample(), mode="fsdp"))
        match = [d for d, reference in by_depth.items() if units == reference]
        assert match, sorted(map(sorted, units))
        depths.add(match[0])
    assert len(depths) > 1


def test_zero2_draws_never_reshard():
    """ZeRO-2 runs in the engine, which refuses reshard: no draw with a plan beside the shard units
    (and none on a model with sparse variables, where only zero2 is drawn) reshards."""
    count = 0
    for name, cluster in (("ncf-small", LOCAL4), ("bert-tiny", LOCAL4), ("transformer-small", _hetero())):
        spec = model_spec(name)
        sampler = GuidedSampler(spec, cluster, seed=2, shard_prob=1.0)
        for _ in range(60):
            strategy = sampler.sample()
            if not _all_shard(strategy):
                count += 1
                assert not any(s.reshard or s.prefetch for s in _shards(strategy)), strategy.summary()
        plain = GuidedSampler(spec, cluster, seed=2)
        for _ in range(10):
            strategy = sampler.sharded(plain.sample(), mode="zero2")
            validate(strategy, spec, cluster)
            assert not any(s.reshard or s.prefetch for s in _shards(strategy))
    assert count > 60
    with pytest.raises(ValueError, match="item_embedding|user_embedding"):
        GuidedSampler(model_spec("ncf-small"), LOCAL4, shard_prob=1.0).sharded(
            GuidedSampler(model_spec("ncf-small"), LOCAL4).sample(), mode="fsdp")


def test_the_share_of_sharded_draws_is_shard_prob():
    spec = model_spec("transformer-small")
    modes = collections.Counter()
    for prob in (0.2, 0.6):
        sampler = GuidedSampler(spec, LOCAL4, seed=1, shard_prob=prob)
        draws = [sampler.sample() for _ in range(400)]
        sharded = [s for s in draws if _shards(s)]
        sd = (400 * prob * (1 - prob)) ** 0.5
        assert abs(len(sharded) - 400 * prob) < 4 * sd, (prob, len(sharded))
        for s in sharded:
            modes["fsdp" if any(x.reshard for x in _shards(s)) else "zero2" if not _all_shard(s) else "either"] += 1
    assert modes["fsdp"] > 50 and modes["zero2"] > 50


def test_bf16_only_when_lossy_and_columns_draw_shard_units():
    spec = model_spec("bert-tiny")
    sampler = GuidedSampler(spec, LOCAL4, seed=3, lossy=False, shard_prob=1.0)
    assert {s.reduce_dtype for _ in range(40) for s in _shards(sampler.sample())} == {"fp32"}
    lossy = GuidedSampler(spec, LOCAL4, seed=3, shard_prob=1.0)
    assert {s.reduce_dtype for _ in range(40) for s in _shards(lossy.sample())} == {"fp32", "bf16"}
    # Columns are the one sampler: their shard rows are the units of the strategies made of them.
    cols = GuidedSampler(spec, LOCAL4, seed=3, shard_prob=0.5).sample_columns(40)
    made = [cols.strategy(i) for i in range(cols.size)]
    assert 0 < sum(bool(_shards(s)) for s in made) < 40
    assert int((cols.shard_group >= 0).sum()) == sum(len(_shards(s)) for s in made)
    with pytest.raises(ValueError, match="shard_prob"):
        GuidedSampler(spec, LOCAL4, shard_prob=1.5)


def test_hsdp_only_where_nodes_hold_as_many_devices():
    """B9 is a 1-device node beside a 4-device one, local-4x1 four 1-device nodes: never HSDP;
    on local-2x2 both groups appear."""
    spec = model_spec("cnn-small")
    for name in ("B9", "local-4x1"):
        cluster = cluster_preset(name)
        uneven = GuidedSampler(spec, cluster, seed=4, shard_prob=1.0)
        draws = [uneven.sample() for _ in range(40)]
        for s in draws:
            validate(s, spec, cluster)
        assert {s.group for d in draws for s in _shards(d)} == {0}
    even = GuidedSampler(spec, LOCAL4, seed=4, shard_prob=1.0)
    assert {s.group for _ in range(40) for s in _shards(even.sample())} == {0, 2}


def test_choice_space_offers_zero2_shard_choices_that_validate():
    spec = model_spec("bert-tiny")
    for lossy, dtypes in ((True, {"fp32", "bf16"}), (False, {"fp32"})):
        space = ChoiceSpace(spec, LOCAL4, lossy=lossy, shard=True)
        assert not any(c.kind == "shard" for c in ChoiceSpace(spec, LOCAL4, lossy=lossy).choices(
            space.data_parallel(), [0]))
        current = space.data_parallel()
        coords = space.coordinates(6)
        assert len(coords) > 1
        for coord in coords:
            shard = [c for c in space.choices(current, coord) if c.kind == "shard" and c.unit is None]
            assert {(c.group, c.reduce_dtype) for c in shard} == {(g, d) for g in (0, 2) for d in dtypes}
            for c in shard:
                candidate = space.apply(current, coord, c)
                validate(candidate, spec, LOCAL4)
                _units_canonical(candidate)
                names = {space.variables[i].name for i in coord}
                new = [p.variable for p in candidate.plans if isinstance(p.shards[0].synchronizer, ShardSynchronizer)
                       and p.variable in names]
                assert set(new) == names  # bert-tiny: every variable shardable, one unit per coordinate
                assert not any(s.reshard for s in _shards(candidate))
            current = space.apply(current, coord, shard[0])
        assert len({s.unit for s in _shards(current)}) == len(coords)
        # Joining the neighbour's unit: one unit of both coordinates, still valid.
        coords = space.coordinates()
        first = next(c for c in space.choices(space.data_parallel(), coords[0]) if c.kind == "shard")
        step = space.apply(space.data_parallel(), coords[0], first)
        join = [c for c in space.choices(step, coords[1]) if c.kind == "shard" and c.unit is not None]
        assert join
        joined = space.apply(step, coords[1], join[0])
        validate(joined, spec, LOCAL4)
        assert {s.unit for s in _shards(joined)} == {0} and len(_shards(joined)) == 2


def test_global_moves_of_an_all_shard_strategy():
    spec, workload = model_spec("transformer-small"), zoo_workload("transformer-small")
    space = ChoiceSpace(spec, LOCAL4, shard=True)
    base = build_strategy("shard", spec, LOCAL4)
    moves = global_moves(base, space)
    assert len(moves) == 3
    runtime = FSDP_PLANS
    for m in moves:
        validate(m, spec, LOCAL4)
        runtime.check(m, spec, LOCAL4, workload)
    reshard, bf16, hsdp = moves
    assert all(s.reshard and s.prefetch == 1 for s in _shards(reshard))
    assert all(s.reduce_dtype == "bf16" for s in _shards(bf16))
    assert {s.group for s in _shards(hsdp)} == {2}
    assert {s.group for s in _shards(global_moves(hsdp, space)[-1])} == {0}
    assert len(global_moves(base, ChoiceSpace(spec, LOCAL4, lossy=False, shard=True))) == 2


def test_crossover_of_sharded_parents_keeps_units_apart():
    spec = model_spec("bert-tiny")
    sampler = GuidedSampler(spec, LOCAL4, seed=9, shard_prob=1.0)
    parents = [sampler.sharded(sampler.sample(), mode="zero2") for _ in range(4)]
    for child in crossover(parents, 20, random.Random(0), GuidedSampler(spec, LOCAL4, seed=1)):
        validate(child, spec, LOCAL4)


def test_under_a_budget_sharded_draws_grow_until_they_fit():
    """With ``fits`` (here the memory model's peak with Adam against a limit between ZeRO-2 over
    every module and replicated training: an independent predicate, not the sampler's), a draw
    that fits as drawn is returned unchanged and the stream is the plain sampler's; one that
    does not is grown (its units kept, more modules sharded, the largest first) until it fits;
    ZeRO-2 draws that can fit without resharding never reshard; below every ZeRO-2 layout the
    draws reshard; below everything they are returned unfitting, for the search to drop."""
    spec = model_spec("bert-tiny")

    def peak(s) -> int:
        return max(r.peak_bytes for r in predict_memory(s, spec, LOCAL4, optimizer_state_multiplier="adam",
                                                        fsdp=any(x.reshard for x in _shards(s))))

    zero2 = peak(build_strategy("shard", spec, LOCAL4, depth=2, reshard=False))
    replicated = peak(build_strategy("allreduce", spec, LOCAL4))
    assert zero2 < replicated
    limit = (zero2 + replicated) // 2
    fits = lambda s: peak(s) <= limit  # noqa: E731
    plain = GuidedSampler(spec, LOCAL4, seed=5, shard_prob=1.0)
    grown = GuidedSampler(spec, LOCAL4, seed=5, shard_prob=1.0, fits=fits)
    changed = 0
    for _ in range(40):
        a, b = plain.sample(), grown.sample()
        validate(b, spec, LOCAL4)
        assert fits(b), b.summary()
        if fits(a):
            assert a.hash == b.hash
            continue
        changed += 1
        units_a = {p.variable for p in a.plans if isinstance(p.shards[0].synchronizer, ShardSynchronizer)}
        units_b = {p.variable for p in b.plans if isinstance(p.shards[0].synchronizer, ShardSynchronizer)}
        assert units_a <= units_b
        if units_a == units_b:  # every module already a unit: one shard group, then reshard
            assert (sum(x.reshard for x in _shards(b)) > sum(x.reshard for x in _shards(a))
                    or {x.group for x in _shards(b)} == {0} != {x.group for x in _shards(a)})
        if not any(x.reshard for x in _shards(a)) and not any(x.group for x in _shards(a)):
            # A ZeRO-2 draw over every replica: every ZeRO-2 layout at depth 2 fits, so no reshard.
            depth2 = all(len(p.variable.split(".")) <= 3 for p in b.plans)
            if depth2:
                assert not any(x.reshard for x in _shards(b)), b.summary()
    assert changed >= 10
    # Below every ZeRO-2 layout (the smallest one, at the deepest cut): the draws reshard to fit.
    deepest = min(peak(build_strategy("shard", spec, LOCAL4, depth=d, reshard=False)) for d in range(1, 6))
    tight = GuidedSampler(spec, LOCAL4, seed=5, shard_prob=1.0, fits=lambda s: peak(s) < deepest)
    draws = [tight.sample() for _ in range(20)]
    fitted = [s for s in draws if peak(s) < deepest]
    # Resharded, but for a ZeRO-2 draw whose other plans hold less than a shard would (a PS keeps
    # its optimizer state on one server): the object sampler draws those too, now and then.
    assert all(any(x.reshard for x in _shards(s)) or not _all_shard(s) for s in fitted)
    assert sum(any(x.reshard for x in _shards(s)) for s in fitted) >= 10
    # Below everything: returned as drawn and grown as far as it goes, still over the limit.
    hopeless = GuidedSampler(spec, LOCAL4, seed=5, shard_prob=1.0, fits=lambda s: False)
    s = hopeless.sample()
    validate(s, spec, LOCAL4)
    assert all(x.reshard for x in _shards(s)) and len(_shards(s)) == len(spec.variables)


def test_coordinate_descent_on_the_memory_model_shards_the_large_variables():
    """The reference is the memory model: scored by its negated peak (Adam), coordinate descent
    from data parallelism ends with every variable of 64 KiB or more sharded, and the model says
    each of them, put back on an all-reduce, would raise the peak."""
    spec = model_spec("bert-tiny")

    def peak(s) -> int:
        return max(r.peak_bytes for r in predict_memory(s, spec, LOCAL4, optimizer_state_multiplier="adam"))

    space = ChoiceSpace(spec, LOCAL4, shard=True)
    dp = space.data_parallel()
    result = coordinate_descent(space, lambda ss: np.array([-peak(s) for s in ss], float), [dp],
                                rng=random.Random(0), evaluations=1500, max_sweeps=1)
    best = result.strategies[0]
    validate(best, spec, LOCAL4)
    assert peak(best) < 0.8 * peak(dp)
    large = [v for v in spec.variables if v.num_bytes >= 64 * 1024]
    assert large
    for v in large:
        plan = best.plan_for(v.name)
        assert isinstance(plan.shards[0].synchronizer, ShardSynchronizer), v.name
        i = space.index[v.name]
        back = dataclasses.replace(best, plans=best.plans[:i] + (dp.plans[i],) + best.plans[i + 1:])
        gid = 1 + max((s.group for s in _syncs(best) if isinstance(s, AllReduceSynchronizer)), default=-1)
        back = dataclasses.replace(back, plans=tuple(
            dataclasses.replace(p, shards=(dataclasses.replace(p.shards[0], synchronizer=AllReduceSynchronizer(
                group=gid)),)) if p.variable == v.name else p for p in back.plans))
        validate(back, spec, LOCAL4)
        assert peak(back) > peak(best), v.name


def test_mcts_on_the_memory_model_shards_the_embedding():
    """TAG's tree search gets the shard choice too: on bert-tiny, whose word embedding is most of
    its bytes, the memory model's best strategy found shards it and lowers the peak."""
    spec = model_spec("bert-tiny")

    def peak(s) -> int:
        return max(r.peak_bytes for r in predict_memory(s, spec, LOCAL4, optimizer_state_multiplier="adam"))

    space = ChoiceSpace(spec, LOCAL4, shard=True)
    result = mcts(space, lambda ss: np.array([-peak(s) for s in ss], float), rng=random.Random(0), evaluations=800)
    best = result.strategies[0]
    validate(best, spec, LOCAL4)
    assert isinstance(best.plan_for("word_embeddings.weight").shards[0].synchronizer, ShardSynchronizer)
    assert peak(best) < 0.8 * peak(space.data_parallel())
