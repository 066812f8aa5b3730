"""The tuned Megatron baseline: Megatron-style tensor parallelism with FSDP2 across, tuned by
Optuna's TPE through Ray Tune as torch DDP's and FSDP2's baselines are.

- its runtime writes the ``megatron`` builder's plan on the replicas it is handed, and the
  builder's own output is that plan;
- its tuning space admits exactly the points the memory model, with the activation figures
  measured on one TP group, says fit, and never a plan the ``tp`` runtime refused when the
  search was prepared; every suggestion of the searcher is admitted;
- the searcher draws megatron settings that validate, over the degrees and sequence settings the
  domain has;
- an experiment lists it as ``megatron`` in its baselines; a form it cannot run, or a domain it
  cannot run in, is refused in one line naming the setting and the fix;
- the ledger screens its fastest trial as a kind of its own, and a summary can recommend it;
- the memory model learns from its trials in the layout it predicts their plan in;
- a real search on ``local-2x2`` runs it as trials, recorded, screened and summarised."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from _searches import ROOT, search_env
from synctune.engine.megatron import (MEGATRON_DEFAULT, MegatronConfig, MegatronRuntime, megatron_degrees,
                                      megatron_plan, megatron_refusal)
from synctune.engine.runtimes import as_runtime, runtime_from_options, runtime_from_record
from synctune.engine.tuning import NothingToTune
from synctune.models import model_spec
from synctune.run.baselines import BaselineTrial, tuned_searcher
from synctune.search.experiment import Experiment
from synctune.simulator.memory import GIB
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import ShardSynchronizer, build_strategy, validate
from synctune.strategy.checkpoint import checkpoint_blocks
from synctune.strategy.tensor_parallel import tp_key

CLUSTER4 = cluster_preset("local-2x2")


def _exp(**keys) -> Experiment:
    base = {"name": "t", "domain": {"model": "transformer-small", "cluster": CLUSTER4.name}, "search": {"budget": 4}}
    return Experiment.from_dict({**base, **keys})


def _grid(degrees, sequence=(False, True)) -> list[dict]:
    return [{"degree": d, "sequence_parallel": sp, "reshard": r, "checkpoint": c}
            for d, sp, r, c in itertools.product(degrees, sequence, (True, False), ("none", "selective", "full"))]


def _suggest(searcher, n: int) -> list[dict]:
    points = []
    for i in range(n):
        point = searcher.suggest(f"t{i}")
        points.append(point)
        searcher.on_trial_complete(f"t{i}", {"mean_s": 0.1 + 0.01 * ((i * 7) % 5)})
    return points


@pytest.mark.parametrize("model", ["transformer-small", "bert-tiny"])
@pytest.mark.parametrize("cluster", ["local-2x2", "local-1x2"])
def test_the_runtime_runs_the_builders_plan_on_the_replicas_it_is_handed(model, cluster):
    spec, cl = model_spec(model), cluster_preset(cluster)
    skeleton = build_strategy("allreduce", spec, cl)
    for reshard in (True, False):
        config = MegatronConfig(degree=2, reshard=reshard)
        plan = MegatronRuntime(config).plans_of(skeleton, lambda: None, spec)
        assert plan == build_strategy("megatron", spec, cl, degree=2, reshard=reshard)
        validate(plan, spec, cl)
        # FSDP2 across where there are two TP groups, an all-reduce over the one group otherwise
        sharded = {isinstance(s.synchronizer, ShardSynchronizer) for _p, _i, s in plan.iter_shards()}
        assert sharded == {len(cl.devices) > 2}
    full = MegatronRuntime(MegatronConfig(checkpoint="full"))
    blocks = checkpoint_blocks(v.name for v in spec.variables)
    assert full.checkpoint_of(skeleton, spec) == tuple(sorted((b, "full") for b in blocks)) and blocks
    assert full.batch_rank(skeleton, 3) == 1  # a TP group's replicas train one batch
    own = dataclasses.replace(skeleton, checkpoint=((blocks[0], "selective"),))
    with pytest.raises(SpecError, match="megatron config: checkpoint: 'full' beside the strategy's own checkpoint"):
        full.plans_of(own, lambda: None, spec)


def test_the_runtimes_settings_travel_as_plain_data():
    runtime = MegatronRuntime(MegatronConfig(degree=2, sequence_parallel=True, reshard=False, checkpoint="selective"))
    assert as_runtime(runtime.to_dict()) == runtime
    assert runtime_from_record("megatron", runtime.config_json()) == runtime
    assert runtime.summary() == "tp 2, sp, keep, checkpoint selective"
    assert runtime_from_options("megatron", {"sequence_parallel": "true", "checkpoint": "full"}) == MegatronRuntime(
        MegatronConfig(sequence_parallel=True, checkpoint="full"))
    assert runtime_from_options("megatron", {}) == MegatronRuntime(MEGATRON_DEFAULT)
    trial = BaselineTrial(trial_id="megatron-0", runtime=runtime, origin="megatron-tuned", mean_s=0.1)
    assert trial.label == "tuned Megatron: tp 2, sp, keep, checkpoint selective"
    for bad, message in (({"degree": 1}, "megatron config: degree: expected a TP degree from 2"),
                         ({"reshard": "yes"}, "megatron config: reshard: expected true or false"),
                         ({"checkpoint": "most"}, "megatron config: checkpoint: expected one of none, selective, full"),
                         ({"units": "blocks"}, r"megatron config: unknown key\(s\) \['units'\]")):
        with pytest.raises(SpecError, match=message):
            MegatronConfig.from_dict({**MEGATRON_DEFAULT.to_dict(), **bad})


def test_a_megatron_trial_row_records_the_plan_it_executed(tmp_path):
    """A tuned Megatron trial runs on the search's all-reduce skeleton, but executes its config's
    plan: its dataset row carries that plan (TP degree, split blocks, sequence parallelism,
    checkpointing), as the builder writes it for the same settings, not the skeleton's
    ``tp_degree`` of 1; the recorded plan, planned again (a resumed search teaching its memory
    model), is itself."""
    from synctune.data import TrialDataset
    from synctune.engine.measure import TrialResult
    from synctune.run import record_result
    from synctune.strategy import Strategy
    from synctune.strategy.columns import StrategyColumns

    spec, cluster = model_spec("bert-tiny"), cluster_preset("local-1x4")
    skeleton = build_strategy("allreduce", spec, cluster)
    runtime = MegatronRuntime(MegatronConfig(degree=2, sequence_parallel=True, reshard=False, checkpoint="full"))
    result = TrialResult(status="ok", warmup=1, iters=1, iteration_times_s=(0.1,), mean_s=0.1, median_s=0.1,
                         std_s=0.0)
    record_result(result, skeleton, spec, cluster, dataset=TrialDataset(tmp_path), logger=None,
                  origin="megatron-tuned", runtime=runtime, trial_id="megatron-0")
    [row] = TrialDataset(tmp_path).records()
    recorded = Strategy.from_json(row.strategy_json)
    built = build_strategy("megatron", spec, cluster, degree=2, sequence_parallel=True, reshard=False)
    blocks = checkpoint_blocks(v.name for v in spec.variables)
    assert row.runtime == "megatron" and row.tp_degree == 2
    assert recorded.tensor_parallel == built.tensor_parallel and recorded.tensor_parallel.sequence_parallel
    assert recorded.plans == built.plans  # FSDP2 over the two TP groups, kept after forward
    assert recorded.checkpoint == tuple(sorted((b, "full") for b in blocks))
    assert row.strategy_hash == recorded.hash != skeleton.hash
    columns = StrategyColumns.from_strategies(spec, cluster, [recorded])
    assert columns.tp_degree.tolist() == [2] and set(columns.tp_blocks[0].tolist()) == {2}  # every block: sequence
    assert runtime.plans_of(recorded, lambda: None, spec) == recorded


def test_the_tuning_never_draws_a_sequence_parallel_plan_the_builder_refuses():
    """transformer-small has no sequence-parallel Megatron plan (the builder refuses it): its
    tuning space holds no such point even before any memory probe, and a run configured with
    one is refused before any worker, naming the module, the option and the fix."""
    spec = model_spec("transformer-small")
    space = MegatronRuntime.tuning_space(spec, CLUSTER4, lossy=True)
    assert space.params["sequence_parallel"].choices == (False,)
    assert not any(space.admits(p) for p in _grid([2], (True,)))
    skeleton = build_strategy("allreduce", spec, CLUSTER4)
    with pytest.raises(SpecError, match=r"^megatron config: builder megatron: option sequence_parallel: model "
                                        r"'transformer-small' .*'decoder\.1'.*set sequence_parallel=false$"):
        MegatronRuntime(MegatronConfig(sequence_parallel=True)).check(skeleton, spec, CLUSTER4)


def test_domains_without_a_megatron_plan_are_named():
    assert megatron_degrees(model_spec("bert-tiny"), cluster_preset("local-1x4")) == [2, 4]
    assert megatron_refusal(model_spec("bert-tiny"), cluster_preset("local-1x4")) is None
    # a node of one device: no TP group lies inside every node
    assert "no TP degree of 2 or more divides every node's devices" in megatron_refusal(
        model_spec("transformer-small"), cluster_preset("B12"))
    # no numbered blocks with attention or MLP pairs
    for model in ("cnn-small", "ncf-small"):
        why = megatron_refusal(model_spec(model), CLUSTER4)
        assert f"model {model!r} has no numbered blocks with an attention or MLP pair" in why
        with pytest.raises(NothingToTune, match="tuned megatron: nothing to tune: model"):
            MegatronRuntime.tuning_space(model_spec(model), CLUSTER4, lossy=True)


def test_the_searcher_draws_megatron_settings_that_validate():
    """On one node of four devices bert-tiny has TP degrees 2 and 4, each with and without
    sequence parallelism; every draw is a plan that validates and the tp runtime's checks pass."""
    spec, cluster = model_spec("bert-tiny"), cluster_preset("local-1x4")
    space = MegatronRuntime.tuning_space(spec, cluster, lossy=True)
    assert space.first == {"degree": 4, "sequence_parallel": False, "reshard": True, "checkpoint": "none"}
    skeleton = build_strategy("allreduce", spec, cluster)
    points = _suggest(tuned_searcher(space, seed=0, budget=12, done=[]), 12)
    assert points[0] == space.first
    for point in points:
        assert sorted(point) == sorted(MegatronRuntime.tuning.params) and space.holds(point)
        runtime = MegatronRuntime.from_tuned(point)
        runtime.check(skeleton, spec, cluster)  # validation and the tp runtime's checks of the plan
        plan = runtime.plans_of(skeleton, lambda: None, spec)
        assert plan.tensor_parallel.degree == point["degree"]
        assert plan.tensor_parallel.sequence_parallel == point["sequence_parallel"]
    assert {p["degree"] for p in points} == {2, 4}
    assert {p["sequence_parallel"] for p in points} == {False, True}
    assert len({p["checkpoint"] for p in points}) > 1


def test_the_space_admits_only_what_the_measured_budget_fits(tmp_path, monkeypatch):
    """The search's own preparation: the activation figures of each Megatron plan measured on one
    TP group (transformer-small has no sequence-parallel plan: the builder refuses it, so there is
    nothing for the tp runtime to refuse), and a budget
    between the plans' predicted peaks. The space admits a point exactly where the memory model
    says its plan fits and the runtime ran it; every suggestion is admitted; a budget under every
    plan leaves nothing to tune."""
    from synctune.run.prepare import SearchContext, megatron_baseline, memory_budget
    from synctune.workload.zoo import zoo_workload

    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path))
    spec, workload = model_spec("transformer-small"), zoo_workload("transformer-small")
    exp = _exp(baselines=["megatron"])
    budget = memory_budget(exp, spec, CLUSTER4, workload)
    refused = megatron_baseline(exp, spec, CLUSTER4, workload, budget)
    skeleton = build_strategy("allreduce", spec, CLUSTER4)
    plain = megatron_plan(MegatronConfig(degree=2), skeleton, spec).tensor_parallel
    with pytest.raises(SpecError, match="megatron config: builder megatron: option sequence_parallel"):
        megatron_plan(MegatronConfig(degree=2, sequence_parallel=True), skeleton, spec)
    assert refused == {}  # every plan the builder writes runs
    assert set(budget.split) == {tp_key(plain)}  # measured on one TP group of two processes
    assert budget.split[tp_key(plain)](spec.batch_size) < budget.probe(spec.batch_size)  # a device's share
    ctx = SearchContext(exp=exp, model=spec, cluster=CLUSTER4, workload=workload, search_id="t", memory=budget,
                        shard_prob=0.0, trial_config=None, node_net=None, horovod_entries=(), done=(), dataset=None,
                        logger=None, parent_run="", refused_plans=refused)

    def peak(point) -> int:
        return max(budget.peaks(megatron_plan(MegatronRuntime.from_tuned(point).config, skeleton, spec)))

    grid = _grid([2], (False,))
    peaks = sorted({peak(p) for p in grid})
    assert len(peaks) >= 3, peaks  # checkpointing and resharding each hold less
    budget.headroom = 0.0
    budget.gib = peaks[len(peaks) // 2] / GIB
    limit = min(x for x in budget.limits(skeleton))
    space = MegatronRuntime.tuning_space(spec, CLUSTER4, lossy=True, fits=ctx.runtime_fits)
    assert space.params["sequence_parallel"].choices == (False,)  # no sequence-parallel plan: out of the space
    fitting = [p for p in grid if peak(p) <= limit]
    assert 0 < len(fitting) < len(grid)
    for point in _grid([2]):
        assert space.admits(point) == (point in fitting), point
    assert space.first in fitting
    if peak({"degree": 2, "sequence_parallel": False, "reshard": True, "checkpoint": "none"}) > limit:
        assert space.first["checkpoint"] != "none"  # the default does not fit: the nearest that does
    points = _suggest(tuned_searcher(space, seed=1, budget=10, done=[]), 10)
    assert all(p in fitting for p in points), points
    budget.gib = peaks[0] / GIB * 0.9
    with pytest.raises(NothingToTune, match="no Megatron plan fits the memory budget"):
        MegatronRuntime.tuning_space(spec, CLUSTER4, lossy=True, fits=ctx.runtime_fits)


def test_an_experiment_lists_the_tuned_megatron_baseline():
    exp = _exp(baselines={"builders": ["tuned", "megatron"]})
    assert "megatron" not in exp.baselines.expanded_builders and "megatron" not in exp.baselines.explicit_builders
    assert exp.baselines.tuned_trials("megatron") == 8
    assert exp.num_trials == 4 + 8 + 8  # the budget, tuned DDP's default and the Megatron baseline's
    flat = Experiment.from_keys(name="t", model="bert-tiny", cluster="local-2x2", budget=4,
                                baselines=["allreduce", "megatron", "hvd"], megatron_trials=3)
    assert flat.baselines.builders == ("allreduce", "megatron") and flat.baselines.horovod == ("hvd",)
    assert flat.baselines.tuned_trials("megatron") == 3
    assert _exp().baselines.tuned_trials("megatron") == 0  # not listed: not run
    assert _exp(baselines={"megatron_trials": 2}).baselines.tuned_trials("megatron") == 2


@pytest.mark.parametrize("baselines, message", [
    ({"builders": ["megatron:sequence_parallel=true"]},
     "baselines.builders: 'megatron:sequence_parallel=true': the Megatron baseline is tuned .* list it as megatron, "
     "or measure this plan with synctune trial --builder megatron --option sequence_parallel=true$"),
    ({"builders": ["megatron"], "megatron_trials": 0},
     "baselines.builders lists megatron .* and baselines.megatron_trials is 0; drop one of them$"),
    ({"megatron_trials": "many"}, "baselines.megatron_trials: expected auto or an integer from 0 to"),
])
def test_an_experiment_refuses_a_megatron_baseline_it_cannot_tune(baselines, message):
    with pytest.raises(SpecError, match=message) as err:
        _exp(baselines=baselines)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model, cluster, why", [
    ("ncf-small", "local-2x2", "model 'ncf-small' has no numbered blocks with an attention or MLP pair"),
    ("transformer-small", "local-1x1", "cluster 'local-1x1' has nodes of 1 device"),
])
def test_a_search_refuses_a_megatron_baseline_its_domain_cannot_run(model, cluster, why):
    from synctune.run.prepare import megatron_baseline
    from synctune.workload.zoo import zoo_workload

    exp = Experiment.from_keys(name="t", model=model, cluster=cluster, budget=4, baselines=["megatron"])
    with pytest.raises(SpecError) as err:
        megatron_baseline(exp, model_spec(model), cluster_preset(cluster), zoo_workload(model), None)
    text = str(err.value)
    assert text.startswith("experiment: baselines.megatron_trials: the tuned Megatron baseline cannot run here: ")
    assert why in text and text.endswith("drop megatron from baselines (or set baselines.megatron_trials: 0)")
    assert "\n" not in text


def test_a_search_runs_the_tuned_megatron_baseline(tmp_path):
    """A real search (Ray Tune, 4 local workers): the tuned Megatron baseline's trials run before
    the search, only among the plans the tp runtime runs, are recorded with their settings,
    screened with the other baselines before the confirmation, and named in the summary and the
    result file."""
    from synctune.data import TrialDataset

    exp = tmp_path / "tp.yaml"
    exp.write_text("name: tpbase\nmodel: transformer-small\ncluster: local-2x2\nbudget: 2\nalgorithm: random-guided\n"
                   "warmup: 1\niters: 3\nbaselines: [allreduce, megatron]\nddp_trials: 1\nmegatron_trials: 3\n"
                   "confirm_rounds: 2\nconfirm_iters: 2\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tuning Megatron-style TP with FSDP2: 3 trial(s)" in out.stderr
    rows = TrialDataset(home / "dataset").records()
    tuned = [r for r in rows if r.runtime == "megatron"]
    assert [r.trial_id for r in tuned] == ["megatron-0", "megatron-1", "megatron-2"]
    assert all(r.origin == "megatron-tuned" and r.status == "ok" for r in tuned), [r.error for r in tuned]
    configs = [json.loads(r.runtime_json) for r in tuned]
    assert configs[0] == {"degree": 2, "sequence_parallel": False, "reshard": True, "checkpoint": "none"}
    # transformer-small has no sequence-parallel plan (the builder refuses it): never drawn
    assert not any(c["sequence_parallel"] for c in configs)
    for r, config in zip(tuned, configs):
        assert json.loads(r.extra_json)["megatron_params"] == config
        assert len([m for m in r.memory_breakdown if m.get("peak_bytes")]) == 4
    screening = next(line for line in out.stderr.splitlines() if "screening the" in line)
    assert "tuned Megatron: tp 2" in screening
    summary = out.stdout
    assert any(line.startswith("Megatron ") and "best of 3 tuned Megatron-style TP + FSDP2 trials" in line
               for line in summary.splitlines()), summary
    result = json.loads(next((home / "searches").glob("*-best-result.json")).read_text())
    assert result["megatron_trials"] == 3 and result["megatron_best_config"] in configs
    # screened beside the others on the same processes: every arm measured in each of the first
    # look's 2 rounds, the contenders up to the screening's cap (4: half the confirmation's)
    confirmed = result["confirmed"]
    assert any(b.startswith("tuned Megatron: tp 2") for b in confirmed["screened_baselines"]), confirmed
    timed = [len(times) for times in confirmed["screen_s"]]
    assert len(timed) == 4 and all(2 <= n <= 4 for n in timed), timed
    assert timed[confirmed["picked"]] == max(timed), confirmed


def test_an_oom_megatron_trial_teaches_the_layout_its_plan_is_predicted_in():
    """The runtime declares FSDP2's layout, but its plan over one TP group all-reduces: the memory
    model is taught in the layout it predicts the plan in, so the plan is refused from then on."""
    from synctune.simulator.memory import ActivationFigures, MemoryBudget, split_layout

    model, cluster = model_spec("transformer-small"), cluster_preset("local-1x2")
    skeleton = build_strategy("allreduce", model, cluster)
    runtime = MegatronRuntime(MEGATRON_DEFAULT)
    plan = runtime.plans_of(skeleton, lambda: None, model)
    assert runtime.fsdp_layout and not split_layout(plan)
    probe = ActivationFigures({model.batch_size: [1 << 20]})
    peak = max(MemoryBudget(model, cluster, gib=1.0, headroom=0.0, probe=probe).peaks(plan))
    budget = MemoryBudget(model, cluster, gib=1.25 * peak / GIB, headroom=0.0, probe=probe)
    assert budget.fits(plan)
    measured = int(1.5 * peak)
    budget.observe(plan, runtime.fsdp_layout, [{"peak_bytes": measured}] * 2, oom=True)
    assert budget.corrections == {False: measured - peak, True: 0}
    assert max(budget.peaks(plan)) == measured and not budget.fits(plan)


def test_a_resumed_search_is_told_the_megatron_points_it_measured():
    """A resumed search rebuilds its ledger from the rows (the runtime and its tuned point read
    back) and tells the tuner the points still in the space: one whose plan the budget no longer
    admits is left out."""
    from types import SimpleNamespace

    spec, cluster = model_spec("bert-tiny"), cluster_preset("local-1x4")
    points = [{"degree": 2, "sequence_parallel": True, "reshard": False, "checkpoint": "none"},
              {"degree": 4, "sequence_parallel": False, "reshard": True, "checkpoint": "full"}]
    rows = [SimpleNamespace(trial_id=f"megatron-{i}", runtime="megatron", origin="megatron-tuned", status="ok",
                            mean_s=0.2 + i / 10, runtime_json=MegatronRuntime.from_tuned(p).config_json(),
                            extra_json=json.dumps({"megatron_params": p}))
            for i, p in enumerate(points)]
    trials = [BaselineTrial.from_record(r) for r in rows]
    assert [t.runtime for t in trials] == [MegatronRuntime.from_tuned(p) for p in points]
    assert [t.params for t in trials] == points
    space = MegatronRuntime.tuning_space(spec, cluster, lossy=True,
                                         fits=lambda runtime: runtime.config.degree == 2)
    assert space.params["degree"].choices == (2,)  # no point of degree 4 fits: out of the space
    searcher = tuned_searcher(space, seed=0, budget=4, done=[(t.params, t.mean_s) for t in trials])
    told = [t.params for t in searcher._ot_study.trials if t.state.name == "COMPLETE"]
    assert told == [points[0]]
    assert all(p["degree"] == 2 for p in _suggest(searcher, 4))


def test_a_search_whose_domain_has_no_megatron_plan_is_refused_before_any_trial(tmp_path):
    exp = tmp_path / "dense.yaml"
    exp.write_text("name: dense\nmodel: ncf-small\ncluster: local-1x2\nbudget: 2\nsimulator: analytic\n"
                   "baselines: [allreduce, megatron]\nddp_trials: 0\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, lines
    assert lines[0] == (f"synctune: error: {exp}: baselines.megatron_trials: the tuned Megatron baseline cannot run "
                        f"here: model 'ncf-small' has no numbered blocks with an attention or MLP pair of linear "
                        f"layers (query, key, value ... then an output; fc1, up_proj ... then fc2, down_proj) whose "
                        f"features a TP degree of 2 divides; drop megatron from baselines (or set "
                        f"baselines.megatron_trials: 0)")
    assert not list(home.rglob("*.parquet"))  # no trial ran, nothing was recorded


def test_the_fastest_megatron_trial_is_a_baseline_arm_and_can_be_recommended():
    """Kept in the ledger beside tuned DDP, the Megatron baseline is screened as its own kind (its
    fastest trial), runs on the skeleton under its settings, and is recommended as a baseline when
    nothing confirmed beats it, with the tp training file's plan."""
    from synctune.engine.ddp import DDPRuntime
    from synctune.run.baselines import BaselineLedger
    from synctune.run.confirm import confirmation_arms
    from synctune.run.summary import SearchSummary, recommend
    from synctune.search.interface import SearchTrial

    spec = model_spec("transformer-small")
    skeleton = build_strategy("allreduce", spec, CLUSTER4)
    slow, fast = (MegatronRuntime(MegatronConfig(checkpoint=c)) for c in ("full", "none"))
    ledger = BaselineLedger([BaselineTrial(trial_id="ddp-0", runtime=DDPRuntime(), origin="ddp-tuned", mean_s=0.05),
                             BaselineTrial(trial_id="megatron-0", runtime=slow, origin="megatron-tuned", mean_s=0.04),
                             BaselineTrial(trial_id="megatron-1", runtime=fast, origin="megatron-tuned", mean_s=0.03)])
    searched = [SearchTrial(trial_id="r1-0", strategy=skeleton, origin="autodist", predicted=None, mean_s=0.06)]
    _candidates, bases = confirmation_arms(searched, ledger, skeleton, candidates=1, baselines=2)
    assert [(a.runtime, a.label) for a in bases] == [(fast, "tuned Megatron: tp 2, reshard"),
                                                     (DDPRuntime(), f"tuned DDP: {DDPRuntime().summary()}")]
    assert all(a.strategy == skeleton for a in bases)
    summary = SearchSummary(search_id="s", trials=1, failed=0, best_mean_s=0.06, best_origin="autodist",
                            best_strategy=skeleton, best_baseline_s=0.03, speedup_over_best_baseline=0.5,
                            hit_rate=0.0, trials_to_1_1x=None, trials_to_1_2x=None, best_builder_baseline_s=None,
                            best_baseline_strategy=None, best_baseline_origin=None, baselines=tuple(ledger.trials))
    chosen = recommend(summary, skeleton)
    assert chosen.kind == "baseline" and chosen.runtime == fast and chosen.name == "tuned Megatron: tp 2, reshard"
    assert chosen.to_dict()["megatron"] == fast.config_dict() and chosen.to_dict()["ddp"] is None
    assert summary.to_dict()["megatron_trials"] == 2 and summary.to_dict()["megatron_best_s"] == 0.03
    assert chosen.runtime.training_format(skeleton) == "tp"
    assert chosen.runtime.plans_of(skeleton, lambda: None, spec).tensor_parallel.degree == 2
