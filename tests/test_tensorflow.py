"""Keras models and the ``tensorflow`` runtime, against TensorFlow itself.

The spec of a Keras model is checked against the model (reverse creation order, embeddings
sparse, touched rows counted from the batch's ids); the packing of merge groups against
TensorFlow's own ``group_by_size``; a TensorFlow trial's loss against one process training on
the batch-weighted sum of every replica's gradient. Skipped, with the reason, without the
TensorFlow extra; under CI (which installs it) its absence fails instead (tests/_optional.py).
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from _optional import optional_mark, optional_present, require_optional

from synctune.workload.keras import tensorflow_available

pytestmark = optional_mark("TensorFlow", tensorflow_available())

from synctune.engine.tensorflow import (  # noqa: E402
    bytes_per_pack_of, project_to_tensorflow, tensorflow_packs, tensorflow_runtime)
from synctune.engine.trial import TrialConfig, run_trial_local  # noqa: E402
from synctune.spec import cluster_preset  # noqa: E402
from synctune.spec.errors import SpecError  # noqa: E402
from synctune.strategy import parse_builder_options  # noqa: E402
from synctune.strategy.builders import build_strategy  # noqa: E402
from synctune.workload import keras_workload, zoo_workload  # noqa: E402

CLUSTER = cluster_preset("local-1x2")


def test_keras_spec_lists_variables_in_gradient_order_with_measured_sparse_rows():
    import keras

    workload = keras_workload("keras-ncf-small")
    spec = workload.spec()
    keras.backend.clear_session()
    model = workload.build_model()
    expected = [v.path for v in reversed(model.trainable_variables)]
    assert [v.name for v in spec.variables] == expected
    assert [v.shape for v in spec.variables] == [tuple(v.shape) for v in reversed(model.trainable_variables)]
    assert {v.name for v in spec.variables if v.sparse} == {"gmf_user/embeddings", "gmf_item/embeddings",
                                                            "mlp_user/embeddings", "mlp_item/embeddings"}
    (users, items), _labels = workload.make_batch(workload.batch_size, rank=0, seed=0)
    rows = dict(zip((v.name for v in spec.variables), spec.touched_rows))
    assert rows["gmf_user/embeddings"] == rows["mlp_user/embeddings"] == len(np.unique(users))
    assert rows["gmf_item/embeddings"] == len(np.unique(items)) and rows["dense_2/bias"] is None
    assert not any(v.sparse for v in keras_workload("keras-cnn-small").spec().variables)


def test_packs_are_tensorflows_own_packing():
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_utils

    rng = random.Random(0)
    for _ in range(50):
        sizes = [4 * rng.randint(1, 400) for _ in range(rng.randint(1, 12))]
        threshold = rng.choice([0, rng.randint(1, 2000)])
        tensors = [tf.zeros([s // 4]) for s in sizes]
        theirs = cross_device_utils.group_by_size(tensors, threshold)
        expected = [i for i, pack in enumerate(theirs) for _ in pack]
        assert tensorflow_packs(sizes, threshold) == expected, (sizes, threshold)


def test_bytes_per_pack_reproduces_the_strategys_merge_groups_in_tensorflow():
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_utils

    workload = keras_workload("keras-cnn-small")
    spec = workload.spec()
    skeleton = build_strategy("ps-lb", spec, CLUSTER)
    for threshold in (0, 700, 5000, 20000):
        strategy = project_to_tensorflow(skeleton, spec, threshold)
        groups = [p.shards[0].synchronizer.group for p in strategy.plans]
        pack = bytes_per_pack_of(strategy, spec)
        # TensorFlow reverses model.trainable_variables (creation order) before packing: that
        # is the spec's order, so its packs over the spec's variables must be our groups.
        theirs = cross_device_utils.group_by_size([tf.zeros(v.shape) for v in spec.variables], pack)
        assert [i for i, p in enumerate(theirs) for _ in p] == [g - groups[0] for g in groups], threshold
    chunked = build_strategy("allreduce", spec, CLUSTER, parse_builder_options("allreduce", {"chunk": 3}))
    with pytest.raises(SpecError, match="allreduce: group: TensorFlow packs gradients by size"):
        bytes_per_pack_of(chunked, spec)


def _tf_reference(workload, split, config: TrialConfig) -> list[float]:
    """Rank 0's loss per iteration when one process trains on the batch-weighted sum of every
    replica's loss (data-parallel SGD on the whole batch)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(config.seed)
    model = workload.build_model()
    optimizer = keras.optimizers.SGD(config.lr)
    batches = [workload.make_batch(n, rank=r, seed=config.seed) for r, n in enumerate(split)]
    total = sum(split)
    out = []
    for _ in range(config.warmup + config.iters):
        with tf.GradientTape() as tape:
            losses = [workload.loss(model, b) for b in batches]
            weighted = sum(loss * (n / total) for loss, n in zip(losses, split))
        grads = tape.gradient(weighted, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        out.append(float(losses[0]))
    return out


@pytest.mark.parametrize("model, split, threshold", [("keras-cnn-small", None, 0),
                                                     ("keras-cnn-small", (10, 22), 5000),
                                                     ("keras-ncf-small", None, 0)],
                         ids=["one-pack", "uneven-packs", "sparse-allgather"])
def test_tensorflow_trial_trains_as_single_process_sgd(model, split, threshold):
    workload = keras_workload(model)
    spec = workload.spec()
    strategy = project_to_tensorflow(build_strategy("allreduce", spec, CLUSTER), spec, threshold)
    if split:
        strategy = dataclasses.replace(strategy, batch_split=split)
    config = TrialConfig(warmup=2, iters=3, lr=0.1)
    result = run_trial_local(strategy, CLUSTER, config, workload=workload,
                             runtime=tensorflow_runtime(strategy, spec))
    assert result.status == "ok", result.error
    assert len(result.iteration_times_s) == 3 and result.backend.startswith("tensorflow")
    reference = _tf_reference(workload, strategy.batch_split, config)
    assert reference[-1] < reference[0]  # it trained: a frozen model would pass the comparison too
    assert result.extra["final_loss"] == pytest.approx(reference[-1], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("model", ["keras-cnn-small", "keras-ncf-small"])
def test_horovod_tensorflow_binding_trains_keras_as_single_process_sgd(model):
    from synctune.engine.horovod import HOROVOD_DEFAULT, horovod_available, horovod_runtime

    require_optional("Horovod's TensorFlow binding", horovod_available("tensorflow"))
    workload = keras_workload(model)
    strategy = build_strategy("allreduce", workload.spec(), CLUSTER)
    config = TrialConfig(warmup=2, iters=3, lr=0.1)
    result = run_trial_local(strategy, CLUSTER, config, workload=workload, runtime=horovod_runtime(HOROVOD_DEFAULT))
    assert result.status == "ok", result.error
    assert result.backend.startswith("horovod tensorflow")
    reference = _tf_reference(workload, strategy.batch_split, config)
    assert reference[-1] < reference[0]
    assert result.extra["final_loss"] == pytest.approx(reference[-1], rel=1e-4, abs=1e-6)


def test_tensorflow_runtime_refuses_what_tensorflow_would_run_differently():
    workload = keras_workload("keras-ncf-small")
    spec = workload.spec()
    for builder, message in [("ps-lb", "synchronizer: this runtime runs all-reduce only"),
                             ("partitioned-allreduce", "partition: TensorFlow's MultiWorkerMirroredStrategy"),
                             ("parallax", "TensorFlow all-gathers a sparse")]:
        with pytest.raises(SpecError, match=message):
            tensorflow_runtime(build_strategy(builder, spec, CLUSTER), spec)
    fp16 = build_strategy("allreduce", spec, CLUSTER, parse_builder_options("allreduce", {"compressor": "fp16"}))
    with pytest.raises(SpecError, match="compressor: TensorFlow's collectives send gradients uncompressed"):
        tensorflow_runtime(fp16, spec)
    strategy = build_strategy("allreduce", spec, CLUSTER)
    with pytest.raises(SpecError, match="is a Keras model: it runs with the tensorflow runtime"):
        run_trial_local(strategy, CLUSTER, workload=workload)
    torch_model = zoo_workload("cnn-small")
    torch_strategy = build_strategy("allreduce", torch_model.spec(), CLUSTER)
    with pytest.raises(SpecError, match="is a PyTorch model"):
        run_trial_local(torch_strategy, CLUSTER, workload=torch_model,
                        runtime={"kind": "tensorflow", "tensorflow": {"bytes_per_pack": 0, "implementation": "ring"}})


def test_trial_cli_runs_and_records_a_tensorflow_trial(tmp_path):
    from test_runtimes import _cli

    from synctune.data import TrialDataset

    home = tmp_path / "home"
    done = _cli(home, "trial", "--runtime", "tensorflow", "-m", "keras-cnn-small", "-c", "local-1x2", "-b", "allreduce",
                "--warmup", "1", "--iters", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TensorFlow MultiWorkerMirroredStrategy, ring, bytes_per_pack 0" in done.stdout and "status ok" in done.stdout
    (row,) = TrialDataset(home / "dataset").records()
    assert row.runtime == "tensorflow" and json.loads(row.runtime_json) == {"bytes_per_pack": 0, "implementation": "ring"}
    # Refused before anything runs: the CLI in this process (the run above went through
    # `python -m synctune`).
    from click.testing import CliRunner

    from synctune.cli import cli

    bad = CliRunner(env={"SYNCTUNE_HOME": str(home)}).invoke(cli, [
        "trial", "--runtime", "tensorflow", "-m", "keras-cnn-small", "-c", "local-1x2", "-b", "ps-lb", "--no-record"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "synchronizer: this runtime runs all-reduce only" in bad.stderr


def test_a_search_over_a_keras_model_runs_tensorflow_trials(tmp_path):
    import subprocess
    import sys

    from _searches import search_env

    from synctune.data import TrialDataset

    from synctune.engine.horovod import horovod_available

    hvd = optional_present("Horovod's TensorFlow binding", horovod_available("tensorflow"))
    path = tmp_path / "keras.yaml"
    path.write_text("name: keras\nmodel: keras-cnn-small\ncluster: local-1x2\nbudget: 4\nalgorithm: autodist\n"
                    "simulator: analytic\nproposals: 60\ncandidates: 2\nwarmup: 1\niters: 3\n"
                    f"baselines: [allreduce, ps-lb{', hvd' if hvd else ''}]\nddp_trials: 2\nconfirm_rounds: 2\n")
    done = subprocess.run([sys.executable, "-m", "synctune", "search", str(path)], env=search_env(tmp_path / "home"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = TrialDataset(tmp_path / "home" / "dataset").read(search_id="keras-seed0")
    assert (rows["status"] == "ok").all(), rows[["trial_id", "error"]]
    if hvd:  # the real-Horovod baseline of a Keras model runs on Horovod's TensorFlow binding
        assert list(rows.loc[rows["runtime"] == "horovod", "trial_id"]) == ["hvd-0"]
        rows = rows[rows["runtime"] != "horovod"]
    assert len(rows) >= 2 and (rows["runtime"] == "tensorflow").all()
    assert "baseline-allreduce" in set(rows["trial_id"]) and "baseline-ps-lb" not in set(rows["trial_id"])
    assert (rows["origin"] == "autodist").any()  # searched proposals ran too, projected into TF's space
    for row in rows.itertuples():
        assert row.strategy_summary.endswith("unpartitioned | compressors none") and "ps 0 on 0" in row.strategy_summary
    assert "tuned torch DDP skipped" in done.stderr and "confirmation skipped" in done.stderr
    assert "bytes_per_pack=" in done.stderr  # how to train with the result
