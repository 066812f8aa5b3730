"""The ``ddp`` runtime (plain torch DDP trials) and the interleaved confirmation of a speed-up.

A DDP trial is checked against single-process training of the same model on the same
per-rank batches (the averaged gradient; with the fp16 hook, the averaged gradient rounded as the
hook rounds it, on a probe whose loss shows the rounding); the confirmation against a workload whose DDP arm
is slower by a known sleep, so the measured ratio and its interval have a known side of 1.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from synctune.engine.ddp import DDP_DEFAULT, DDPConfig, ddp_runtime
from synctune.engine.trial import TrialConfig, run_confirm_local, run_trial_local
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy.builders import build_strategy
from synctune.stats import paired_ratio
from synctune.workload import ImportedWorkload, zoo_workload

CLUSTER = cluster_preset("local-1x2")


def _reference_losses(workload, strategy, config: TrialConfig, combine=None) -> list[float]:
    """Rank 0's loss at each iteration when one process trains on the mean of every rank's
    gradient (what data-parallel SGD computes); with ``combine``, on ``combine(gradients)`` of
    each parameter's per-rank gradients instead (a compressed all-reduce, rounding included)."""
    torch.manual_seed(config.seed)
    model = workload.build_model()
    batches = [workload.make_batch(size, rank=r, device=torch.device("cpu"),
                                   generator=torch.Generator().manual_seed(config.seed * 100_003 + r))
               for r, size in enumerate(strategy.batch_split)]
    params = list(model.parameters())
    opt = workload.make_optimizer(params, name=config.optimizer, lr=config.lr)
    out = []
    for _ in range(config.warmup + config.iters):
        losses = [workload.loss(model, b) for b in batches]
        out.append(float(losses[0].detach()))
        if combine is None:
            (sum(losses) / len(losses)).backward()
        else:
            per_rank = [torch.autograd.grad(loss, params) for loss in losses]
            for p, grads in zip(params, zip(*per_rank)):
                p.grad = combine(list(grads))
        opt.step()
        opt.zero_grad()
    return out


#: A job whose loss is linear in the weights: every step's gradient (each rank's mean input) does
#: not depend on them, so fp16's rounding of it moves the weights by a fixed amount that later
#: steps neither amplify nor damp, and a reference can follow the rounding exactly.
_LINEAR_PROBE = textwrap.dedent('''
    import torch
    import synctune.workload as sw

    def workload():
        return sw.define(name="linear-probe", model=lambda: torch.nn.Linear(64, 1), batch_size=16,
                         batch=lambda n, rank, g: (torch.randn(n, 64, generator=g),),
                         loss=lambda model, batch: model(batch[0]).mean())
''')


def _exact_mean(grads):
    return sum(grads) / len(grads)


def _linear_probe(tmp_path):
    """The linear probe as a workload file under ``tmp_path``, its strategy and a trial short
    enough to be cheap and long enough (two steps before the last loss) to show the rounding."""
    (tmp_path / "linear_probe.py").write_text(_LINEAR_PROBE)
    workload = ImportedWorkload(f"{tmp_path / 'linear_probe.py'}:workload")
    return workload, build_strategy("allreduce", workload.spec(), CLUSTER), TrialConfig(warmup=1, iters=2, lr=1.0)


def _fp16_references(workload, strategy, trial, rounded_mean) -> tuple[float, float, float]:
    """The last loss of training on ``rounded_mean`` of the per-rank gradients, that of the
    exact fp32 mean, and a tolerance that tells them apart (asserted)."""
    rounded = _reference_losses(workload, strategy, trial, combine=rounded_mean)[-1]
    exact = _reference_losses(workload, strategy, trial, combine=_exact_mean)[-1]
    tol = 1e-6 * abs(exact)  # ~8 float32 steps of the loss; the rounding moves it ~30x that
    assert abs(rounded - exact) > 10 * tol  # the probe can tell the two apart
    return rounded, exact, tol


def _assert_fp16_rounded(tmp_path, runtime, rounded_mean) -> None:
    """A trial of ``runtime`` on the linear probe ends at the loss of training on
    ``rounded_mean`` of the per-rank gradients (its fp16 all-reduce), and not at the loss of the
    exact fp32 mean: a compression that is ignored, or not undone, fails one of the two."""
    workload, strategy, trial = _linear_probe(tmp_path)
    result = run_trial_local(strategy, CLUSTER, trial, workload=workload, runtime=runtime)
    assert result.status == "ok", result.error
    rounded, exact, tol = _fp16_references(workload, strategy, trial, rounded_mean)
    assert result.extra["final_loss"] == pytest.approx(rounded, rel=0, abs=tol)
    assert abs(result.extra["final_loss"] - exact) > 10 * tol


@pytest.mark.parametrize("config", [DDP_DEFAULT, DDPConfig(bucket_cap_mb=1.0, first_bucket_mb=0.25)],
                         ids=["defaults", "small-buckets"])
def test_ddp_trial_trains_as_single_process_sgd(config):
    workload = zoo_workload("cnn-small")
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    trial = TrialConfig(warmup=2, iters=3, lr=0.05)
    result = run_trial_local(strategy, CLUSTER, trial, workload=workload, runtime=ddp_runtime(config))
    assert result.status == "ok", result.error
    assert len(result.iteration_times_s) == 3 and result.comm_bytes_per_iter is None  # DDP's bytes are not counted
    reference = _reference_losses(workload, strategy, trial)
    assert reference[-1] < reference[0]  # it trained: a frozen model would pass the comparison too
    assert result.extra["final_loss"] == pytest.approx(reference[-1], rel=1e-5, abs=1e-6)


def test_ddp_trial_with_the_fp16_hook_rounds_as_fp16(tmp_path):
    """torch's fp16_compress_hook: each rank's bucket cast to fp16 and divided by the world size,
    summed in fp16 by the all-reduce, cast back."""
    _assert_fp16_rounded(tmp_path, ddp_runtime(DDPConfig(bucket_cap_mb=4.0, comm_hook="fp16")),
                         lambda grads: sum(g.half() / len(grads) for g in grads).float())


def test_ddp_runtime_refuses_what_ddp_would_run_differently():
    workload = zoo_workload("cnn-small")
    spec = workload.spec()
    even = build_strategy("allreduce", spec, CLUSTER)
    uneven = dataclasses.replace(even, batch_split=(even.batch_split[0] + 2, even.batch_split[1] - 2))
    with pytest.raises(SpecError, match="batch split is uneven"):
        run_trial_local(uneven, CLUSTER, workload=workload, runtime=ddp_runtime(DDP_DEFAULT))
    with pytest.raises(SpecError, match="bf16 needs CUDA"):
        run_trial_local(even, CLUSTER, workload=workload, runtime=ddp_runtime(DDPConfig(comm_hook="bf16")))
    with pytest.raises(SpecError, match="first_bucket_mb"):
        DDPConfig(comm_hook="powersgd", powersgd_rank=2, first_bucket_mb=1.0)
    with pytest.raises(SpecError, match="powersgd_rank"):
        DDPConfig(comm_hook="powersgd")
    with pytest.raises(SpecError, match="unknown key"):
        DDPConfig.from_dict({"bucket_mb": 4})
    sparse = zoo_workload("ncf-small")
    s = build_strategy("allreduce", sparse.spec(), CLUSTER)
    with pytest.raises(SpecError, match="sparse gradients"):
        run_trial_local(s, CLUSTER, workload=sparse, runtime=ddp_runtime(DDPConfig(comm_hook="fp16")))


def test_paired_ratio_matches_students_t_on_log_ratios():
    import math

    from scipy import stats

    base = [1.10, 1.20, 1.15, 1.10, 1.31]
    cand = [1.00, 1.00, 1.00, 1.02, 1.05]
    logs = [math.log(b / c) for b, c in zip(base, cand)]
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=sum(logs) / len(logs), scale=stats.sem(logs))
    got = paired_ratio(base, cand)
    assert got.ratio == pytest.approx(math.exp(sum(logs) / len(logs)))
    assert (got.low, got.high) == (pytest.approx(math.exp(low), rel=1e-3), pytest.approx(math.exp(high), rel=1e-3))
    assert got.verdict == "faster" and paired_ratio(cand, base).verdict == "slower"
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0])


_SLOW_UNDER_DDP = textwrap.dedent('''
    import time

    import torch
    import synctune.workload as sw

    BASE = 0.0


    def _loss(model, batch):
        # The DDP arm pays a known extra 40 ms per iteration: the confirmation must see it. Every
        # arm pays BASE seconds, so that two equal arms are not compared on a millisecond's noise.
        time.sleep(BASE)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            time.sleep(0.04)
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


    def workload():
        return sw.define(name="slow-under-ddp", model=lambda: torch.nn.Linear(8, 2), batch_size=8,
                         batch=lambda n, rank, g: (torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)),
                         loss=_loss)
''')


def test_confirmation_measures_a_known_slowdown_interleaved(tmp_path):
    (tmp_path / "slow_job.py").write_text(_SLOW_UNDER_DDP)
    workload = ImportedWorkload(f"{tmp_path / 'slow_job.py'}:workload")
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    rounds = []
    out = run_confirm_local([(strategy, None), (strategy, ddp_runtime(DDP_DEFAULT))], CLUSTER,
                            TrialConfig(warmup=1, iters=1), workload=workload, rounds=4, per_round=3,
                            on_progress=lambda m: rounds.append(m) if m.get("event") == "confirm_round" else None)
    assert len(out["a_s"]) == len(out["b_s"]) == 4 == out["rounds_used"]
    assert [m["round"] for m in rounds] == [1, 2, 3, 4]
    # Every round the DDP arm (B) took its 40 ms more than the engine arm (A): B/A well above 1.
    assert all(b - a > 0.03 for a, b in zip(out["a_s"], out["b_s"])), out
    assert out["low"] > 1.5 and out["verdict"] == "faster", out
    with pytest.raises(SpecError, match="same replicas"):
        other = build_strategy("allreduce", workload.spec(), cluster_preset("local-1x1"))
        run_confirm_local([(strategy, None), (other, None)], CLUSTER, workload=workload)


def test_screening_picks_the_faster_candidate_and_confirms_it_on_fresh_rounds(tmp_path):
    """Several candidates, the baseline last: the screening must pick the candidate that is
    really faster (the engine arm; the DDP candidate pays 40 ms more), whatever its place, and
    the confirmation then compares that pick with the baseline on rounds of its own."""
    (tmp_path / "slow_job.py").write_text(_SLOW_UNDER_DDP)
    workload = ImportedWorkload(f"{tmp_path / 'slow_job.py'}:workload")
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    slow = ddp_runtime(DDP_DEFAULT)
    events = []
    out = run_confirm_local([(strategy, slow), (strategy, None), (strategy, slow)], CLUSTER,
                            TrialConfig(warmup=1, iters=1), workload=workload, rounds=4, per_round=2,
                            screen_rounds=3, on_progress=events.append)
    assert out["picked"] == 1, out
    assert [len(s) for s in out["screen_s"]] == [3, 3, 3]
    assert [m["round"] for m in events if m.get("event") == "screen_round"] == [1, 2, 3]
    assert len(out["a_s"]) == len(out["b_s"]) == 4
    # Every round the pick (the engine) beat the baseline (DDP, 40 ms more); on a busy machine
    # the engine's few-millisecond rounds vary several-fold, so the interval's bound is loose.
    assert all(b - a > 0.03 for a, b in zip(out["a_s"], out["b_s"])), out
    assert out["ratio"] > 2 and out["verdict"] == "faster", out
    with pytest.raises(SpecError, match="two arms"):
        run_confirm_local([(strategy, slow), (strategy, None), (strategy, slow)], CLUSTER, workload=workload)


def test_screening_confirms_against_the_fastest_baseline_until_the_interval_decides(tmp_path):
    """One candidate (the engine), two baselines: DDP, which pays 40 ms more per iteration, and
    the engine itself. The screening must pick the engine baseline, so the confirmation finds
    no real difference (a ratio near 1), where confirming against the slow baseline would have
    claimed a speed-up; the rounds go on past the first look until the interval is narrow or
    the cap is reached, and the result says which. The screening is sequential (2 to 6 rounds):
    the slow baseline stops being timed once shown slower, the two engine arms go on together."""
    from synctune.stats import SequentialRule

    # Equal arms of a few milliseconds differ several-fold on a loaded machine (CI saw a ratio
    # of 1.98 between two identical engine arms); 20 ms of fixed work each makes "equal" testable.
    (tmp_path / "slow_job.py").write_text(_SLOW_UNDER_DDP.replace("BASE = 0.0", "BASE = 0.02"))
    workload = ImportedWorkload(f"{tmp_path / 'slow_job.py'}:workload")
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    rule = SequentialRule(min_rounds=3, max_rounds=6, step=3, width=0.0)
    events = []
    out = run_confirm_local([(strategy, None), (strategy, ddp_runtime(DDP_DEFAULT)), (strategy, None)], CLUSTER,
                            TrialConfig(warmup=1, iters=1), workload=workload, per_round=2, screen_rounds=2,
                            screen_max_rounds=6, rule=rule, candidates=1, on_progress=events.append)
    assert (out["picked"], out["picked_baseline"]) == (0, 2), out
    assert {m["rounds"] for m in events if m.get("event") == "screen_round"} == {6}
    timed = [len(s) for s in out["screen_s"]]
    assert 2 <= timed[1] <= timed[0] == timed[2] <= 6, timed
    assert out["low"] < 1.5 and out["ratio"] < 1.3, out  # against the slow baseline it would be ~3x
    assert out["stopped"] in ("verdict", "cap") and out["rounds"] in (3, 6) and len(out["a_s"]) == out["rounds"]
    assert out["rule"]["max_rounds"] == 6 and out["confidence"] == pytest.approx(1 - 0.05 / 2)


def _cli(home, *args):
    import os
    import subprocess
    import sys

    env = dict(os.environ, SYNCTUNE_HOME=str(home))
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "synctune", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_trial_cli_runs_and_records_a_ddp_trial(tmp_path):
    import json

    from synctune.data import TrialDataset

    home = tmp_path / "home"
    done = _cli(home, "trial", "-m", "cnn-small", "-c", "local-1x2", "--runtime", "ddp", "--ddp", "bucket_cap_mb=2",
                "--ddp", "comm_hook=fp16", "--warmup", "1", "--iters", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torch DDP: ddp bucket 2 MiB, hook fp16" in done.stdout and "status ok" in done.stdout
    (row,) = TrialDataset(home / "dataset").records()
    assert row.runtime == "ddp" and row.origin == "ddp"
    assert json.loads(row.runtime_json)["bucket_cap_mb"] == 2.0 and json.loads(row.runtime_json)["first_bucket_mb"] is None
    for args, message in [(("--ddp", "bucket=3"), "--ddp: unknown key 'bucket'"),
                          (("--ddp", "comm_hook=bf16"), "bf16 needs CUDA"),
                          (("--ddp", "bucket_cap_mb=big"), "bucket_cap_mb: expected a number"),
                          (("-b", "allreduce", "--ddp", "comm_hook=fp16"), None)]:
        runtime = () if message is None else ("--runtime", "ddp")
        bad = _cli(home, "trial", "-m", "cnn-small", "-c", "local-1x2", *runtime, *args, "--no-record")
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert (message or "--ddp applies to --runtime ddp only") in bad.stderr
