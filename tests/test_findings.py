"""The findings scripts' shared measurement (experiments/findings/_common.py), on loopback: the
lab's figures in experiments/findings/README.md come from it, so it must report each arm under
its own times and a real difference as one; and repeat_noise.py's speed probe, which must give
every trial its probe without moving a result to another trial."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "findings"))

from _common import interleaved_arms  # noqa: E402

from synctune.spec import cluster_preset  # noqa: E402
from synctune.strategy import build_strategy  # noqa: E402
from synctune.workload import zoo_workload  # noqa: E402


def test_interleaved_arms_finds_the_arm_known_to_be_fastest_and_its_margin():
    # The independent reference: an arm computing 8x the batch per replica is slower by far
    # more than the noise, whatever the machine; the fast arm sits between two slow ones so
    # that a mix-up of arm order, or a ratio taken the wrong way round, shows.
    cluster = cluster_preset("local-1x2")
    workload = zoo_workload("cnn-small")
    fast = build_strategy("allreduce", workload.spec(), cluster, chunk=4)
    slow = dataclasses.replace(fast, batch_split=tuple(8 * b for b in fast.batch_split))
    for arms, best in (([slow, fast, slow], 1), ([fast, slow], 0)):
        got = interleaved_arms(arms, cluster, workload=workload, rounds=3, per_round=2, warmup=1)
        assert got.best == best, got
        assert all(len(t) == 3 for t in got.times_s)
        for i in range(len(arms)):
            if i == best:
                continue
            r = got.relative(i)
            assert r.low > 1.5 and r.ratio > 2, (i, r)
            assert abs(r.ratio - got.mean_ms(i) / got.mean_ms(best)) < 1e-9 * r.ratio
            assert "(no difference)" not in got.cell(i)
        assert got.cell(best).endswith("1 (best)")


def test_round_medians_splits_measure_output_into_consecutive_rounds():
    # engine_overhead.measure runs round after round of interleaved iterations: round r is the
    # r-th block, and a split by stride would pair iterations of different rounds.
    from _common import load_benchmark

    bench = load_benchmark("engine_overhead")
    out = {"synctune": [1.0, 2.0, 9.0, 10.0, 11.0, 30.0], "ddp": [5.0, 4.0, 3.0, 2.0, 1.0, 0.5]}
    assert bench.round_medians(out, 2) == {"synctune": [2.0, 11.0], "ddp": [4.0, 1.0]}
    assert bench.round_medians(out, 3) == {"synctune": [1.5, 9.5, 20.5], "ddp": [4.5, 2.5, 0.75]}
    with pytest.raises(ValueError, match="do not split into 4 rounds"):
        bench.round_medians(out, 4)


def test_speed_probe_times_every_trial_and_leaves_each_result_with_its_trial():
    # repeat_noise.probing swaps the engine's local launcher for one whose workers time a CPU
    # probe around each trial: every trial gets its probe, each result stays with its own trial
    # (the slow arm, 8x the batch, is the middle one) and the engine's launcher is back after.
    import repeat_noise

    import synctune.engine.local as local
    from synctune.engine.trial import TrialConfig, run_trials_local

    cluster = cluster_preset("local-1x2")
    workload = zoo_workload("cnn-small")
    fast = build_strategy("allreduce", workload.spec(), cluster, chunk=4)
    slow = dataclasses.replace(fast, batch_split=tuple(8 * b for b in fast.batch_split))
    plain = local.run_local
    with repeat_noise.probing({}) as probes:
        got = run_trials_local([fast, slow, fast], cluster, TrialConfig(warmup=1, iters=3), workload=workload)
    assert local.run_local is plain
    assert sorted(probes) == [0, 1, 2] and all(0 < p < 10 for p in probes.values()), probes
    assert all(r.ok for r in got)
    assert got[1].median_s > 2 * max(got[0].median_s, got[2].median_s)


def test_means_of_two_sets_one_trial_against_a_mean_of_two_from_either_run(tmp_path, capsys):
    # Two runs' rows of the same two strategies; by hand: one trial against one is 2/11 and 2/9
    # (run a), 0 and 0 (run b), median 1/11 (between 0 and 2/11); a mean of two, one trial from
    # each run, against the other: (10 + 10) / 2 = 10 against (12 + 10) / 2 = 11 -> 1/10.5, and
    # (8 + 4) / 2 = 6 against (10 + 4) / 2 = 7 -> 1/6.5; median (1/10.5 + 1/6.5) / 2.
    import pyarrow as pa
    import pyarrow.parquet as pq
    import repeat_noise

    runs = {"a": {"s-pass0": 10.0, "s-pass1": 12.0, "t-pass0": 8.0, "t-pass1": 10.0},
            "b": {"s-pass0": 10.0, "s-pass1": 10.0, "t-pass0": 4.0, "t-pass1": 4.0}}
    for name, rows in runs.items():
        (tmp_path / name / "dataset").mkdir(parents=True)
        pq.write_table(pa.table({"trial_id": list(rows), "model_name": ["m"] * 4, "cluster_name": ["c"] * 4,
                                 "median_s": list(rows.values()), "status": ["ok"] * 4}),
                       tmp_path / name / "dataset" / "part.parquet")
    repeat_noise.means_of_two([str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "2 strategies" in out
    assert f"one trial against one: median {1 / 11:.1%}" in out
    assert f"another: median {(1 / 10.5 + 1 / 6.5) / 2:.1%}" in out


def test_readiness_shares_count_the_bytes_ready_late_and_the_largest_gradient():
    # Worked by hand: backward takes 1 s; a gradient ready 0.05 s before its end is late (last
    # tenth), one ready 0.1 s before is on the boundary (late), one 0.5 s before is not.
    from _common import load_benchmark

    shares = load_benchmark("engine_overhead").readiness_shares
    ready = {"backward_s": 1.0, "params": [(60, 0.05), (10, 0.1), (30, 0.5)]}
    assert shares(ready) == pytest.approx((0.7, 0.6))
    assert shares({"backward_s": 1.0, "params": [(50, 1.0), (50, 0.9)]}) == (0.0, 0.5)


def test_search_vs_modelled_reads_domains_and_names_the_first_malformed_one():
    from search_vs_modelled import Domain, parse_domains

    assert parse_domains("transformer-small@lab-2x2, hf_llama@lab-b10c:0.05") == [
        Domain("transformer-small", "lab-2x2", None), Domain("hf_llama", "lab-b10c", 0.05)]
    assert str(Domain("cnn-small", "lab-2x2", 0.5)) == "cnn-small@lab-2x2:0.5"
    for text, named in (("cnn-small", "'cnn-small': expected model@preset"),
                        ("cnn-small@lab-2x2,", "'': expected model@preset"),
                        ("@lab-2x2", "'@lab-2x2': expected"), ("cnn-small@:1", "'cnn-small@:1': expected"),
                        ("cnn-small@lab-2x2:0", "the memory budget '0' is not a positive number"),
                        ("cnn-small@lab-2x2:many", "the memory budget 'many' is not a positive number"),
                        ("cnn-small@lab-2x2:nan", "the memory budget 'nan'")):
        with pytest.raises(ValueError, match=f"^--domains: (.*: )?{re.escape(named)}"):
            parse_domains(text)


def test_tp_search_oracle_grid_holds_every_setting_users_tune_that_the_budget_admits():
    """The oracle's grid against an enumeration of its own: DDP's defaults, FSDP2's layouts times
    every checkpointing mode, Megatron's plan at every setting its builder writes (the modelled
    pick's own enumeration, ``megatron_candidates``); then only what the budget's judgement admits."""
    from tp_search import grid

    from synctune.engine.ddp import DDPRuntime
    from synctune.engine.fsdp import FSDP_CHECKPOINT, FSDPRuntime, fsdp_layouts
    from synctune.engine.megatron import MegatronRuntime
    from synctune.run.modelled import megatron_candidates

    workload = zoo_workload("transformer-small")
    spec, cluster = workload.spec(), cluster_preset("local-2x2")
    skeleton = build_strategy("allreduce", spec, cluster)
    module = workload.build_model()

    @dataclasses.dataclass
    class Context:  # what grid reads of a prepared search
        admits: object
        model = spec
        cluster = cluster_preset("local-2x2")
        skeleton = build_strategy("allreduce", spec, cluster_preset("local-2x2"))

        def runtime_fits(self, runtime):
            runtime.plans_of(self.skeleton, lambda: module, self.model)  # refuses a plan its builder cannot write
            return self.admits(runtime)

    every = grid(Context(lambda runtime: True))
    kinds = [type(rt) for _s, rt, _o in every]
    layouts = fsdp_layouts(spec, cluster)
    megatron = megatron_candidates(spec, cluster)
    assert megatron and layouts
    assert kinds.count(DDPRuntime) == 1
    assert kinds.count(FSDPRuntime) == len(layouts) * len(FSDP_CHECKPOINT)
    assert kinds.count(MegatronRuntime) == len(megatron)
    assert {rt.plans_of(skeleton, lambda: module, spec).hash for _s, rt, _o in every
            if isinstance(rt, MegatronRuntime)} == {c.strategy.hash for c in megatron}
    assert all(s.hash == skeleton.hash for s, _rt, _o in every)
    checkpointed = grid(Context(lambda runtime: getattr(runtime.config, "checkpoint", "none") != "none"))
    assert checkpointed and all(rt.config.checkpoint != "none" for _s, rt, _o in checkpointed)
    assert len(checkpointed) == len(every) - 1 - len(layouts) - sum(c.strategy.checkpoint == () for c in megatron)
