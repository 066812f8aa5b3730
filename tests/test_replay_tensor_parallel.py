"""The replay of strategies with ``tensor_parallel`` (Megatron-LM's split; dPRO §4.3's timeline,
AutoDDL's alpha-beta costs): a timeline worked by hand on a tiny profiled model (split compute
over the degree, the TP collectives of known bytes on the intra-node link, the data-parallel
all-reduce over the groups on the local shapes after backward), the direction a split moves a
prediction, calibration of the TP collectives' own cost, and the class in the replay's error
table and in ``sim eval``."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from synctune.simulator import CalibratedReplay, DomainContext, ReplayConstants, ReplaySimulator
from synctune.simulator.base import Domain
from synctune.simulator.kinds.tensor_parallel import tp_collectives
from synctune.spec import ClusterSpec, ComputeProfile, ModelSpec, VariableSpec
from synctune.strategy import Strategy, build_strategy

# Version 5: the event model without version 6's CPU-worker bound (worked on its own in test_replay).
K = ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4, replay_version=5)
GB = 1e9  # bytes/s of an 8 Gbit/s link
SEQ, HIDDEN, FFN, BATCH = 16, 4, 8, 8
ROOT = Path(__file__).resolve().parents[1]


def _cluster(intra_gbps: float = 8.0) -> ClusterSpec:
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": 2,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": intra_gbps}
    return ClusterSpec.from_dict({"name": "two-by-two", "nodes": [{"name": "n0", **node}, {"name": "n1", **node}]})


def _model() -> ModelSpec:
    """One MLP block, backward order: its row-wise output layer, its column-wise input layer, a norm."""
    return ModelSpec(name="mlp-block", batch_size=BATCH, variables=(
        VariableSpec(name="block.down.weight", shape=(HIDDEN, FFN)),
        VariableSpec(name="block.up.weight", shape=(FFN, HIDDEN)),
        VariableSpec(name="norm.weight", shape=(HIDDEN,))))


def _profile(model: ModelSpec, io: bool = True) -> ComputeProfile:
    return ComputeProfile(model=model.name, device="cpu", workers=4, batch_size=BATCH, forward_s=0.010,
                          backward_s=0.016, step_s=0.002, ready_s=(0.004, 0.012, 0.014),
                          io_elements={"block.up": (SEQ * HIDDEN, SEQ * FFN), "block.down": (SEQ * FFN, SEQ * HIDDEN),
                                       "norm": (SEQ * HIDDEN, SEQ * HIDDEN)} if io else None)


def _plain(model, cluster) -> Strategy:
    return build_strategy("allreduce", model, cluster)


def _split(model, cluster, *, sequence: bool = False) -> Strategy:
    modules = {"block.up": "colwise", "block.down": "rowwise"}
    if sequence:
        modules.update({"norm": "scatter"})
    return dataclasses.replace(_plain(model, cluster), tensor_parallel={"degree": 2, "modules": modules})


def _sim(model, constants=K, io: bool = True) -> ReplaySimulator:
    sim = ReplaySimulator({}, constants)
    sim.add_profile(_profile(model, io))
    return sim


def _ring(nbytes: float, n: int, bw: float, rounds: int = 2, k=K) -> float:
    """A ring collective over n devices: rounds x (n-1) steps of alpha + bytes / (n beta), plus a launch."""
    return rounds * (n - 1) * (k.alpha_s + nbytes / (n * bw)) + k.unit_s


def test_a_tp_iteration_worked_by_hand():
    model, cluster = _model(), _cluster()
    strategy = _split(model, cluster)
    (predicted,) = _sim(model).predict([strategy], model, cluster)
    # Backward per variable from the profile: 4, 8 and 2 ms, then 2 ms to its end; the split
    # modules' (down, up) halve. Forward shrinks by their share of backward (12 of 16 ms), halved.
    backward = 0.004 / 2 + 0.008 / 2 + 0.002 + 0.002
    forward = 0.010 * (1 - 0.75 * 0.5)
    # The row-wise module all-reduces its output in forward, the column-wise one its input's
    # gradient in backward: the group's batch x 16 positions x 4 features x 4 bytes each.
    activation = BATCH * SEQ * HIDDEN * 4
    tp = _ring(activation, 2, GB)
    # The groups' all-reduce after backward: the local shapes (4x4, 4x4 and 4 floats), across the nodes.
    dp = _ring((16 + 16 + 4) * 4, 2, GB)
    step = 0.002 * 36 / 68  # the optimizer over a device's share of the parameters
    assert predicted == pytest.approx(forward + tp + backward + tp + dp + step + K.iteration_s, rel=1e-9)


def test_sequence_parallel_gathers_and_scatters_in_place_of_all_reduces_worked_by_hand():
    model, cluster = _model(), _cluster()
    strategy = _split(model, cluster, sequence=True)
    collectives, unmeasured = tp_collectives(strategy.tensor_parallel, model, _profile(model).io_elements)
    assert not unmeasured
    assert sorted((c.module, c.op, c.phase) for c in collectives) == [
        ("block.down", "all-gather", "backward"), ("block.down", "reduce-scatter", "forward"),
        ("block.up", "all-gather", "forward"), ("block.up", "reduce-scatter", "backward"),
        ("norm", "all-gather", "backward")]
    sim = _sim(model)
    (predicted,) = sim.predict([strategy], model, cluster)
    # The scatter module (norm) is not split: it keeps its compute and all-gathers its output's
    # gradient in backward; each other collective moves (t-1)/t of the data once.
    half = _ring(BATCH * SEQ * HIDDEN * 4, 2, GB, rounds=1)
    backward = 0.004 / 2 + 0.008 / 2 + 0.002 + 0.002 + 3 * half
    forward = 0.010 * (1 - 0.75 * 0.5) + 2 * half
    dp = _ring((16 + 16 + 4) * 4, 2, GB)
    assert predicted == pytest.approx(forward + backward + dp + 0.002 * 36 / 68 + K.iteration_s, rel=1e-9)


def test_a_split_moves_the_prediction_the_way_physics_says():
    model = _model()
    fast, slow = _cluster(intra_gbps=1e4), _cluster(intra_gbps=0.001)
    for cluster in (fast, slow):
        sim = _sim(model)
        ctx = DomainContext(model, cluster)
        split = sim.tp_timeline(_split(model, cluster), ctx)
        plain = sim.timeline(*_encoded(model, cluster))
        # Less compute on a device: its backward (without the TP collectives) is shorter.
        assert split["backward_end"][0] - split["tp_forward_s"][0] - split["tp_backward_s"][0] < plain["backward_end"][0]
        assert split["tp_forward_s"][0] > 0 and split["tp_backward_s"][0] > 0
    # More collectives on the critical path: a slow intra-node link makes the split slower than
    # plain data parallelism, a fast one faster (the compute it saves is larger than its messages).
    (split_fast, plain_fast) = _sim(model).predict([_split(model, fast), _plain(model, fast)], model, fast)
    (split_slow, plain_slow) = _sim(model).predict([_split(model, slow), _plain(model, slow)], model, slow)
    assert split_fast < plain_fast
    assert split_slow > plain_slow


def _encoded(model, cluster):
    from synctune.simulator import encode

    ctx = DomainContext(model, cluster)
    return encode([_plain(model, cluster)], ctx), ctx


def test_without_measured_activations_the_replay_says_so():
    model, cluster = _model(), _cluster()
    sim = _sim(model, io=False)
    sim.predict([_split(model, cluster)], model, cluster)
    assert sim.unmeasured_activations == {"mlp-block@two-by-two"}


def test_calibration_fits_the_tp_collectives_cost_on_split_strategies_only():
    from synctune.simulator.replay import calibrate_replay

    model, cluster = _model(), _cluster()
    plain = [build_strategy("allreduce", model, cluster, chunk=c) for c in (1, 2, 3)] * 3
    split = [_split(model, cluster), _split(model, cluster, sequence=True)] * 2
    planted = dataclasses.replace(K, tp_collective_s=0.003)
    truth = ReplaySimulator({}, planted)
    truth.add_profile(_profile(model))
    ctx = DomainContext(model, cluster)
    fields = ("tp_collective_s",)
    # Without split strategies nothing moves the term: it stays where it was.
    plain_only = Domain(ctx, plain, truth.predict(plain, model, cluster))
    assert calibrate_replay(_sim(model), [plain_only], fields=fields).tp_collective_s == 0.0
    # With them, the fit finds the cost that generated their times (2 and 5 collectives each),
    # and the plain strategies' times do not change with it.
    both = Domain(ctx, plain + split, truth.predict(plain + split, model, cluster))
    fitted = calibrate_replay(_sim(model), [both], fields=fields)
    assert fitted.tp_collective_s == pytest.approx(0.003, rel=1e-3)
    moved = ReplaySimulator({}, fitted)
    moved.add_profile(_profile(model))
    assert moved.predict(plain, model, cluster) == pytest.approx(_sim(model).predict(plain, model, cluster), rel=1e-12)


def _replay_errors():
    spec = importlib.util.spec_from_file_location("replay_errors", ROOT / "experiments/findings/replay_errors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_errors_classes_split_strategies():
    model, cluster = _model(), _cluster()
    classes = _replay_errors().classes
    assert "tensor parallel" in classes(_split(model, cluster), model, cluster.num_devices)
    assert "+sp" in classes(_split(model, cluster, sequence=True), model, cluster.num_devices)
    assert "tensor parallel" not in classes(_plain(model, cluster), model, cluster.num_devices)


def _dataset(tmp_path) -> tuple[Path, Path]:
    """A dataset of the tiny model's trials (15 plain, 2 split, timed by the replay itself) and a
    data folder holding its profile."""
    from synctune.data import TrialDataset, TrialRecord

    model, cluster = _model(), _cluster()
    plain = [build_strategy("allreduce", model, cluster, chunk=c) for c in (1, 2, 3)] * 5
    split = [_split(model, cluster), _split(model, cluster, sequence=True)]
    times = _sim(model).predict(plain + split, model, cluster)
    result = {"status": "ok", "iteration_times_s": [0.1], "mean_s": 0.1, "median_s": 0.1, "std_s": 0.0,
              "samples_per_s": 80.0, "backend": "gloo", "device_kind": "cpu", "launcher": "local", "warmup": 1,
              "iters": 1}
    records = [TrialRecord.from_trial({**result, "mean_s": float(t)}, s, model, cluster, origin="test",
                                      runtime="tp" if s.tensor_parallel else "engine")
               for s, t in zip(plain + split, times)]
    TrialDataset(tmp_path / "dataset").append(records)
    home = tmp_path / "home"
    (home / "profiles").mkdir(parents=True)
    (home / "profiles" / "mlp-block@cpu-w4.json").write_text(json.dumps(_profile(model).to_dict()))
    return tmp_path / "dataset", home


def _table_rows(text: str) -> set[tuple[str, ...]]:
    return {tuple(c.strip() for c in line.strip("|").split("|")) for line in text.splitlines() if line.startswith("|")}


def test_replay_errors_prints_the_tensor_parallel_classes_beside_the_others(tmp_path):
    import os
    import subprocess
    import sys

    data, home = _dataset(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    out = subprocess.run([sys.executable, str(ROOT / "experiments/findings/replay_errors.py"), "--data", str(data),
                          "--home", str(home), "--held-out", "0.5", "--seed", "3"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {r[1]: int(r[2]) for r in _table_rows(out.stdout) if r[0] == "mlp-block" and r[2].isdigit()}
    # The held-out trials, as the split (sim eval's) draws them: every measurement of a strategy.
    from synctune.data import TrialDataset
    from synctune.simulator import domains_from_records, split_domains

    _train, (test,) = split_domains(domains_from_records(TrialDataset(data).records(), tensor_parallel=True), 0.5, seed=3)
    split = [s for s in test.strategies if s.tensor_parallel is not None]
    assert split, "the split holds a strategy with tensor_parallel out (seed 3)"
    assert f"({len(split)} of them tensor parallel)" in out.stdout
    assert rows["tensor parallel"] == len(split)
    assert rows.get("+sp", 0) == sum(s.tensor_parallel.sequence_parallel for s in split)
    assert rows["all"] == len(test.strategies) > len(split)


def test_sim_eval_scores_split_strategies_with_the_replay_only(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from synctune.cli import cli

    data, home = _dataset(tmp_path)
    monkeypatch.setenv("SYNCTUNE_HOME", str(home))
    result = CliRunner().invoke(cli, ["sim", "eval", "--data", str(data), "--protocol", "held-out", "--train",
                                      "replay", "--train", "residual", "--epochs", "2"])
    assert result.exit_code == 0, result.output
    assert "2 tensor-parallel trials: only the replay predicts strategies that split modules" in result.output
    split = [line for line in result.output.splitlines() if line.strip().startswith("mlp-block@two-by-two")
             and " 2 " in line and "%" in line and "held-out" in line]
    simulators = {s for s in ("replay (calibrated)", "replay ") if any(s in line for line in split)}
    assert simulators == {"replay (calibrated)", "replay "}, result.output
    assert not any("residual" in line for line in split)


def test_a_profile_records_each_modules_activation_sizes_per_sample():
    import torch

    from synctune.engine.profile import io_elements

    class _Workload:
        @staticmethod
        def loss(model, batch):
            return model(batch[0]).sum()

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    batch = (torch.randn(5, 6, 4),)  # 5 samples of 6 positions
    assert io_elements(_Workload(), model, batch, 5) == {"0": [6 * 4, 6 * 8], "2": [6 * 8, 6 * 3]}
    profile = dataclasses.replace(_profile(_model()), io_elements={"0": [24, 48]})
    assert ComputeProfile.from_dict(json.loads(json.dumps(profile.to_dict()))).io_elements == {"0": (24.0, 48.0)}
