"""The tuned FSDP2/HSDP baseline and what the memory budget judges it by.

- :func:`strategy_of_config` is FSDP2's own plan written in the strategy language: it validates,
  and :func:`plan_from_strategy` of it (the runtime's reading of shard plans) gives back the same
  ``fully_shard`` modules, parameters, reshard flags and mesh as :func:`plan_from_config` on the
  real zoo models (built on the meta device);
- a real 4-process HSDP trial of a tuned point holds, rank by rank, the rows that strategy says
  (torch's DTensor shards, measured by the trial);
- :func:`fsdp_layouts` keeps exactly what ``fits`` accepts; the searcher starts at FSDP2's
  default where it fits, else at a fitting layout, and every suggestion fits;
- a model with sparse gradients is refused with the runtime's own message, and has no layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from synctune.engine.fsdp import (FSDP_DEFAULT, FSDPConfig, FSDPRuntime, fsdp_config_of, fsdp_layout, fsdp_layouts,
                                  plan_from_config, plan_from_strategy, strategy_of_config)
from synctune.engine.runtimes import tuned_runtimes
from synctune.models import build_model, model_spec
from synctune.run.baselines import tuned_searcher
from synctune.search.experiment import Experiment
from synctune.spec import ClusterSpec, cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import ShardSynchronizer, build_strategy, validate
from synctune.strategy.checkpoint import checkpoint_blocks

CLUSTER4 = cluster_preset("local-2x2")
CONFIGS = [FSDP_DEFAULT, FSDPConfig(reshard_after_forward=False), FSDPConfig(units="root"),
           FSDPConfig(group=2, reshard_after_forward=False), FSDPConfig(group=2, prefetch=2, reduce_dtype="bf16"),
           FSDPConfig(group=4, prefetch=0), FSDPConfig(checkpoint="selective"),
           FSDPConfig(units="root", checkpoint="full")]


def _meta(name: str):
    with torch.device("meta"):
        return build_model(name)


def _units(plan) -> list[tuple]:
    return [(u.module, u.reshard_after_forward, frozenset(u.variables)) for u in plan.units if u.variables]


@pytest.mark.parametrize("model", ["bert-tiny", "transformer-small", "ncf-dense"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.summary())
def test_strategy_of_config_is_fsdp2s_own_plan(model, config):
    spec, module = model_spec(model), _meta(model)
    base = build_strategy("ps", spec, CLUSTER4)  # not all-reduce: nothing but replicas and split may carry over
    strategy = strategy_of_config(module, config, base, spec)
    validate(strategy, spec, CLUSTER4)
    assert (strategy.replicas, strategy.batch_split) == (base.replicas, base.batch_split)
    assert {p.variable for p in strategy.plans} == {v.name for v in spec.variables}
    expected = plan_from_config(module, config, base)
    got = plan_from_strategy(module, strategy, spec)
    assert len(expected.units) > (1 if config.units == "blocks" else 0)
    assert _units(got) == _units(expected)
    assert got.mesh_shape == expected.mesh_shape and got.forward_order == expected.forward_order
    for p in strategy.plans:
        sync = p.shards[0].synchronizer
        assert isinstance(sync, ShardSynchronizer) and sync.reduce_dtype == config.reduce_dtype
        assert sync.group == (0 if config.group in (0, 4) else config.group)
        assert sync.prefetch == (max(1, config.prefetch) if sync.reshard else 0)
    # what the trial checkpoints, which the memory model reads: every block in the setting's mode
    blocks = checkpoint_blocks(v.name for v in spec.variables)
    assert strategy.checkpoint == (() if config.checkpoint == "none" else
                                   tuple(sorted((b, config.checkpoint) for b in blocks)))


def test_a_strategys_own_checkpoint_is_kept_without_the_setting():
    spec, module = model_spec("transformer-small"), _meta("transformer-small")
    base = build_strategy("allreduce", spec, CLUSTER4)
    own = dataclasses.replace(base, checkpoint=(("decoder.1", "selective"), ("encoder.0", "full")))
    runtime = FSDPRuntime()
    assert runtime.plans_of(own, lambda: module, spec).checkpoint == own.checkpoint
    assert runtime.checkpoint_of(own, spec) == own.checkpoint
    full = FSDPRuntime(FSDPConfig(checkpoint="full"))
    assert full.checkpoint_of(base, spec) == tuple(sorted((b, "full") for b in ("encoder.0", "encoder.1", "decoder.0",
                                                                               "decoder.1")))
    assert full.plans_of(base, lambda: module, spec).checkpoint == full.checkpoint_of(base, spec)


def test_an_int_reshard_counts_as_kept_parameters():
    """Resharding to groups of 2 after forward holds more than full resharding: counted as kept
    (whole parameters, the upper bound), never as the smaller ZeRO-3 figure."""
    spec, module = model_spec("transformer-small"), _meta("transformer-small")
    base = build_strategy("allreduce", spec, CLUSTER4)
    strategy = strategy_of_config(module, FSDPConfig(reshard_after_forward=2), base, spec)
    validate(strategy, spec, CLUSTER4)
    assert not any(p.shards[0].synchronizer.reshard for p in strategy.plans)
    kept = strategy_of_config(module, FSDPConfig(reshard_after_forward=False), base, spec)
    assert strategy.plans == kept.plans


def test_a_tuned_hsdp_trial_holds_the_rows_its_strategy_says():
    """One real FSDP2 trial of a tuned HSDP point (bert-tiny, 4 gloo processes on local-2x2,
    shard groups of 2 = the nodes): between steps each rank holds, as DTensor local shards
    (measured by the trial's memory probe from torch's storages), exactly the rows that
    :func:`strategy_of_config`'s shard groups give it (``shard_rows``: torch.chunk's cut), for
    parameters and gradients alike."""
    from synctune.engine.trial import TrialConfig, run_trial_local
    from synctune.strategy.partition import shard_rows
    from synctune.workload import zoo_workload

    workload = zoo_workload("bert-tiny")
    spec = workload.spec()
    base = build_strategy("allreduce", spec, CLUSTER4)
    runtime = FSDPRuntime.from_tuned({"layout": "blocks/g2/reshard", "prefetch": 2, "reduce_dtype": "fp32"})
    result = run_trial_local(base, CLUSTER4, TrialConfig(warmup=1, iters=1, optimizer="adam"), workload=workload,
                             runtime=runtime)
    assert result.ok, result.error
    strategy = strategy_of_config(_meta("bert-tiny"), runtime.config, base, spec)
    world = len(strategy.replicas)
    rows = [0] * world
    for p in strategy.plans:
        var, sync = spec[p.variable], p.shards[0].synchronizer
        size = sync.group or world
        cut = shard_rows(var.shape[0], size)
        for r in range(world):
            rows[r] += (cut[r % size].stop - cut[r % size].start) * (var.num_bytes // var.shape[0])
    measured = result.extra["memory"]
    assert measured["params_bytes"] == rows and measured["grads_bytes"] == rows, (measured, rows)
    assert sum(rows) == 2 * sum(v.num_bytes for v in spec.variables)  # two shard groups, each the model once


def test_layouts_keep_what_fits():
    spec = model_spec("transformer-small")
    every = fsdp_layouts(spec, CLUSTER4)
    assert every == ["blocks/g0/reshard", "blocks/g0/keep", "blocks/g2/reshard", "blocks/g2/keep", "root/g0/keep",
                     "root/g2/keep"]
    # One node: no HSDP; nodes of different sizes: no HSDP either.
    assert fsdp_layouts(spec, cluster_preset("local-1x2")) == ["blocks/g0/reshard", "blocks/g0/keep", "root/g0/keep"]
    data = CLUSTER4.to_dict()
    data["nodes"] = [data["nodes"][0], dict(data["nodes"][1], num_devices=1)]
    assert all("/g0/" in lay for lay in fsdp_layouts(spec, ClusterSpec.from_dict(data)))
    seen = []

    def resharded_only(config: FSDPConfig) -> bool:
        seen.append(config)
        return config.reshard_after_forward is True and config.units != "root"

    assert fsdp_layouts(spec, CLUSTER4, resharded_only) == ["blocks/g0/reshard", "blocks/g2/reshard"]
    # each layout at its least memory
    assert all(c.prefetch == 1 and c.reduce_dtype == "fp32" and c.checkpoint == "full" for c in seen)
    assert fsdp_layouts(spec, CLUSTER4, lambda c: False) == []
    for layout in every:  # a layout's config names it back
        assert fsdp_layout(fsdp_config_of({"layout": layout, "prefetch": 1, "reduce_dtype": "fp32"})) == layout
    with pytest.raises(SpecError, match="tuned fsdp: layout: expected"):
        fsdp_config_of({"layout": "blocks/g0", "prefetch": 1, "reduce_dtype": "fp32"})


def _exp(lossy: bool = True) -> Experiment:
    return Experiment.from_keys(name="t", model="transformer-small", cluster=CLUSTER4.name, budget=4, lossy=lossy)


def fsdp_searcher(exp: Experiment, spec, cluster, done, fits=None):
    """The tuned-FSDP2 searcher a search makes (8 trials: ``fsdp_trials: auto`` where it shards),
    ``fits`` judging FSDP2 configurations."""
    space = FSDPRuntime.tuning_space(spec, cluster, lossy=exp.search.lossy,
                                     fits=None if fits is None else (lambda runtime: fits(runtime.config)))
    return tuned_searcher(space, seed=exp.seed, budget=8, done=done)


def _suggest(searcher, n: int) -> list[dict]:
    points = []
    for i in range(n):
        point = searcher.suggest(f"t{i}")
        points.append(point)
        searcher.on_trial_complete(f"t{i}", {"mean_s": 0.1 + 0.01 * ((i * 7) % 5)})
    return points


def test_first_point_is_fsdp2s_default_and_every_point_fits():
    spec = model_spec("transformer-small")
    first = _suggest(fsdp_searcher(_exp(), spec, CLUSTER4, []), 1)[0]
    assert fsdp_config_of(first) == FSDPConfig(prefetch=1)  # FSDP2's default (prefetch 1 is its implicit one)
    assert sorted(first) == sorted(FSDPRuntime.tuning.params)

    # A budget that ZeRO-3 at prefetch 1 and fp32 only meets, on one HSDP mesh or the other:
    # no default, and no draw of prefetch 2, bf16 or a kept layout may come back.
    def tight(config: FSDPConfig) -> bool:
        return (config.reshard_after_forward is True and config.units == "blocks" and config.prefetch == 1
                and config.reduce_dtype == "fp32" and config.group == 2)

    points = _suggest(fsdp_searcher(_exp(), spec, CLUSTER4, [], fits=tight), 10)
    assert points[0] == {"layout": "blocks/g2/reshard", "prefetch": 1, "reduce_dtype": "fp32", "checkpoint": "none"}
    assert all(tight(fsdp_config_of(p)) for p in points), points
    # Tighter: only with every block fully checkpointed. The first point checkpoints (the least
    # that fits), and so does every draw.
    tighter = lambda c: tight(c) and c.checkpoint == "full"  # noqa: E731
    points = _suggest(fsdp_searcher(_exp(), spec, CLUSTER4, [], fits=tighter), 10)
    assert points[0] == {"layout": "blocks/g2/reshard", "prefetch": 1, "reduce_dtype": "fp32", "checkpoint": "full"}
    assert all(tighter(fsdp_config_of(p)) for p in points), points
    # Selective or full: a drawn none gives way to selective, the nearest that fits.
    saving = lambda c: c.checkpoint != "none"  # noqa: E731
    points = _suggest(fsdp_searcher(_exp(), spec, CLUSTER4, [], fits=saving), 10)
    assert points[0]["checkpoint"] == "selective" and all(saving(fsdp_config_of(p)) for p in points), points
    # Looser: resharded layouts only, any settings: the draws vary and all fit.
    loose = lambda c: c.reshard_after_forward is True and c.units == "blocks"  # noqa: E731
    points = _suggest(fsdp_searcher(_exp(), spec, CLUSTER4, [], fits=loose), 10)
    assert all(loose(fsdp_config_of(p)) for p in points), points
    assert len({tuple(sorted(p.items())) for p in points}) > 2
    assert {p["checkpoint"] for p in points} > {"none"}, points  # checkpointing is drawn too
    # Not lossy: never a bf16 reduce.
    points = _suggest(fsdp_searcher(_exp(lossy=False), spec, CLUSTER4, []), 10)
    assert {p["reduce_dtype"] for p in points} == {"fp32"}


def test_a_resumed_search_is_told_what_it_measured():
    spec = model_spec("transformer-small")
    done = [({"layout": "blocks/g0/keep", "prefetch": 2, "reduce_dtype": "fp32"}, 0.2),
            ({"layout": "root/g2/keep", "prefetch": 1, "reduce_dtype": "fp32"}, 0.3)]
    searcher = fsdp_searcher(_exp(), spec, CLUSTER4, done, fits=lambda c: c.units == "blocks")
    told = [t for t in searcher._ot_study.trials if t.state.name == "COMPLETE"]
    assert [t.params["layout"] for t in told] == ["blocks/g0/keep"]  # root no longer fits: dropped
    # recorded before checkpointing was tuned: told as what ran, no checkpointing
    assert [t.params["checkpoint"] for t in told] == ["none"]


def test_a_model_with_sparse_gradients_has_no_fsdp2():
    workload_spec = model_spec("ncf-small")
    assert any(v.sparse for v in workload_spec.variables)
    strategy = build_strategy("allreduce", workload_spec, CLUSTER4)
    with pytest.raises(SpecError) as runtime_err:
        FSDPRuntime().check(strategy, workload_spec, CLUSTER4)
    with pytest.raises(SpecError) as err:
        strategy_of_config(_meta("ncf-small"), FSDP_DEFAULT, strategy, workload_spec)
    assert str(err.value) == str(runtime_err.value)
    assert fsdp_layouts(workload_spec, CLUSTER4) == []
    with pytest.raises(SpecError, match="tuned fsdp: nothing to tune: the model has sparse gradients"):
        fsdp_searcher(_exp(), workload_spec, CLUSTER4, [])
    with pytest.raises(SpecError, match="tuned fsdp: nothing to tune: no FSDP2 layout fits"):
        fsdp_searcher(_exp(), model_spec("transformer-small"), CLUSTER4, [], fits=lambda c: False)


def test_every_tuner_searcher_takes_the_same_context():
    spec = model_spec("transformer-small")
    for cls in tuned_runtimes():
        space = cls.tuning_space(spec, CLUSTER4, lossy=True, fits=lambda runtime: True)
        point = tuned_searcher(space, seed=0, budget=4, done=[]).suggest("a")
        assert sorted(point) == sorted(cls.tuning.params)
        assert cls.from_tuned(point).name == cls.name
