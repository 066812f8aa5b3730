"""The memory model and the replay with activation checkpointing, on a library model (a Hugging
Face GPT-2 built from a config, AdamW): the probe reads the workload's own optimizer, predicts
checkpointed strategies' peaks as real trials measure them, and the replay adds the measured
recomputation to a checkpointed block's backward.

References: AdamW's state as torch documents it (two moments and a step per parameter), the
peaks real 2-process trials measure (their own probe), and the profile's figures written here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from synctune.engine.measure import TrialConfig
from synctune.engine.runtimes import runtime_from_options
from synctune.engine.trial import run_trial_local
from synctune.search.experiment import Experiment
from synctune.spec import cluster_preset
from synctune.spec.profile import ComputeProfile
from synctune.strategy import build_strategy
from synctune.strategy.checkpoint import checkpoint_blocks
from synctune.workload.define import ImportedWorkload

from _searches import ROOT

pytest.importorskip("transformers")
WORKLOAD = f"{ROOT / 'tests' / '_hidden_memory_workload.py'}:plain"


@pytest.fixture(scope="module")
def domain():
    from synctune.run.prepare import memory_budget

    workload = ImportedWorkload(WORKLOAD)
    spec = workload.check()
    cluster = cluster_preset("local-1x2")
    exp = Experiment.from_keys(name="t", model="bert-tiny", cluster=cluster.name, budget=4, memory_gib=1.0,
                               memory_headroom=0.0)
    return workload, spec, cluster, memory_budget(exp, spec, cluster, workload)


def test_the_probe_reads_the_workloads_own_optimizer(domain):
    """The experiment says sgd (the default); the workload brings AdamW, whose state is two
    moments per parameter element and a 4-byte step per tensor (torch.optim.AdamW)."""
    _workload, _spec, _cluster, budget = domain
    assert budget.optimizer == (2.0, 4)


def test_checkpointed_peaks_are_predicted_as_trials_measure_them(domain):
    """Every block none, full and selective, replicated (the engine) and resharded (FSDP2): the
    memory model's peak per rank within 10% of what the trial measured, and checkpointing
    lowers both."""
    workload, spec, cluster, budget = domain
    blocks = checkpoint_blocks(v.name for v in spec.variables)
    measured = {}
    for name, base in (("allreduce", build_strategy("allreduce", spec, cluster)),
                       ("shard", build_strategy("shard", spec, cluster, depth=3, reshard=True))):
        runtime = None if name == "allreduce" else runtime_from_options("fsdp", {}, base)
        for mode in ("none", "full", "selective"):
            strategy = base if mode == "none" else dataclasses.replace(base, checkpoint=tuple((b, mode) for b in blocks))
            result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=1), workload=workload,
                                     runtime=runtime)
            assert result.status == "ok", result.error
            peak = max(result.extra["memory"]["peak_bytes"])
            predicted = max(budget.peaks(strategy, fsdp=runtime is not None))
            assert abs(predicted - peak) / peak <= 0.10, (name, mode, predicted, peak)
            measured[name, mode] = peak
    for name in ("allreduce", "shard"):
        assert measured[name, "full"] < measured[name, "selective"] < measured[name, "none"], measured


def test_the_replay_adds_the_measured_recomputation_to_backward():
    """A profile that says backward takes 10 ms longer with both blocks of bert-tiny checkpointed
    in full: one block costs half of it, both the whole of it, and selective what it says."""
    from synctune.models import model_spec
    from synctune.simulator.replay import ReplaySimulator

    model, cluster = model_spec("bert-tiny"), cluster_preset("local-1x2")
    n = len(model.variables)
    profile = ComputeProfile(model=model.name, device="cpu", workers=2, batch_size=model.batch_size, forward_s=0.01,
                             backward_s=0.02, step_s=0.001, ready_s=tuple(np.linspace(0.001, 0.02, n)),
                             recompute_s={"full": 0.01, "selective": 0.004})
    sim = ReplaySimulator()
    sim.add_profile(profile)
    s = build_strategy("allreduce", model, cluster)
    both = ("layers.0", "layers.1")
    times = sim.predict([s, dataclasses.replace(s, checkpoint=(("layers.0", "full"),)),
                         dataclasses.replace(s, checkpoint=tuple((b, "full") for b in both)),
                         dataclasses.replace(s, checkpoint=tuple((b, "selective") for b in both))], model, cluster)
    base = times[0]
    assert times[1] - base == pytest.approx(0.005, rel=0.05)
    assert times[2] - base == pytest.approx(0.010, rel=0.05)
    assert times[3] - base == pytest.approx(0.004, rel=0.05)


def test_the_profile_measures_recomputation_per_mode(domain):
    """``recompute=True``: the profile says, per mode torch can run, how much longer backward ran
    with every block checkpointed (non-negative seconds); without it, nothing."""
    from synctune.engine.profile import profile_compute

    workload = domain[0]
    with_ = profile_compute(workload, workers=1, warmup=1, iters=3, recompute=True)
    assert set(with_.recompute_s) == {"full", "selective"} and all(v >= 0 for v in with_.recompute_s.values())
    assert profile_compute(workload, workers=1, warmup=1, iters=2).recompute_s is None
    assert ComputeProfile.from_dict(with_.to_dict()) == with_


@pytest.mark.parametrize("search", ["coordinate_descent", "mcts"])
def test_the_local_searches_choose_checkpointing_as_a_coordinate(search):
    """With checkpointing in the space, coordinate descent and MCTS find the strategy a score
    written here prefers: every block checkpointed ``selective`` (bert-tiny's two), the rest of the
    strategy whatever it was; without it in the space, neither proposes any."""
    import random

    from synctune.models import model_spec
    from synctune.search import local_search

    model, cluster = model_spec("bert-tiny"), cluster_preset("local-1x2")
    want = (("layers.0", "selective"), ("layers.1", "selective"))

    def score(strategies):
        return np.array([1.0 if s.checkpoint == want else 0.5 if s.checkpoint else 0.0 for s in strategies])

    for offered in (True, False):
        space = local_search.ChoiceSpace(model, cluster, checkpoint=offered)
        run = getattr(local_search, search)
        kwargs = {"starts": [space.data_parallel()]} if search == "coordinate_descent" else {}
        found = run(space, score, rng=random.Random(0), evaluations=300, **kwargs)
        if offered:
            assert found.strategies[0].checkpoint == want
        else:
            assert all(not s.checkpoint for s in found.strategies)
