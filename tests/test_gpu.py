"""The gpu tier (``python3 -m pytest -m gpu``): the engine on CUDA tensors, with several processes
even on a one-GPU machine. Each test takes the device as a parameter: the ``cpu`` variant runs
everywhere (the same code, proving the test itself works), the ``cuda`` one is marked ``gpu`` and
skipped, with the reason, where there is no CUDA device.

- the process group's real backend for the device's tensors, and a collective on them;
- equivalence of 2 processes sharing one GPU over gloo (NCCL refuses two ranks on one device),
  and, with 2+ GPUs, 2 processes on 2 GPUs over NCCL, against single-process training
  (builders, and sufficient-factor broadcasting on an uneven split);
- autocast with a GradScaler (fp16 on CUDA, bf16 on the CPU) on 2 processes, a poisoned step
  skipped on every rank, against single-process mixed-precision training on the same device;
- a trial on a GPU cluster spec: status ok, CUDA, the CUDA peak-memory figure;
- the fsdp runtime (torch FSDP2) on CUDA tensors over NCCL (one rank per GPU, so one rank on a
  one-GPU machine), resharded and not, against single-process training, and as a trial;
- the engine benchmark's printed table, read and checked;
- tensor parallelism (the tp runtime) on CUDA tensors, 2 ranks sharing the GPUs over gloo.

The conformance suite's CUDA run (every synchronizer x compressor, 4 processes sharing the GPUs
over gloo) lives with the suite: tests/test_engine_conformance.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _engine_workers import backend_worker, reference_training, sfb_strategy, train_cases
from _habits import habits_worker, reference
from synctune.engine.local import run_local
from synctune.engine.trial import GPU_BACKEND, TrialConfig, run_trial_local
from synctune.models import model_spec
from synctune.spec import ClusterSpec, cluster_preset
from synctune.strategy import build_strategy
from synctune.workload import zoo_workload

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def gpu_cluster(devices: int) -> ClusterSpec:
    return ClusterSpec.from_dict({"name": f"gpu-1x{devices}", "nodes": [
        {"instance_type": "this-machine", "device_kind": "gpu", "device_model": torch.cuda.get_device_name(0),
         "num_devices": devices, "nic_gbps": 100.0, "single_flow_gbps": 100.0, "intra_node_gbps": 100.0}]})


@pytest.mark.parametrize("device", DEVICES)
def test_process_group_serves_the_device_with_its_backend(device):
    """The backend that really carries the device's tensors (not the configured string): gloo for
    CPU tensors; NCCL for CUDA ones under the GPU trials' ``cpu:gloo,cuda:nccl`` (one rank per
    GPU), and an all-reduce of ``rank + 1`` on such a tensor sums on the device."""
    world = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    backend = "gloo" if device == "cpu" else GPU_BACKEND
    outputs = run_local(backend_worker, world, (device,), backend=backend, timeout_s=300)
    for out in outputs:
        assert out["configured"] == backend
        assert out["served_by"] == ("gloo" if device == "cpu" else "nccl"), out
        assert out["device"] == device
        assert out["sum"] == [float(world * (world + 1) // 2)] * 4


@pytest.mark.parametrize("device, world, backend", [
    ("cpu", 2, "gloo"),
    pytest.param("cuda", 2, "gloo", marks=pytest.mark.gpu),
    pytest.param("cuda", 2, GPU_BACKEND, marks=pytest.mark.gpu)])
def test_equivalence(device, world, backend):
    if backend != "gloo" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    cluster = cluster_preset("local-1x2")
    cases = []
    for builder, options in (("allreduce", {}), ("ps-lb", {}), ("partitioned-ps", {}),
                             ("allreduce", {"algorithm": "hierarchical"})):
        s = build_strategy(builder, model_spec("cnn-small"), cluster, **options)
        cases.append({"label": builder, "strategy": s.to_dict(), "cluster": cluster.to_dict(), "optimizer": "sgd",
                      "lr": 0.1, "steps": 3, "device": device})
    # Sufficient-factor broadcasting of every linear weight, uneven split (factors on the device).
    cases.append({"label": "sfb", "strategy": sfb_strategy("cnn-small", cluster, (3, 5)).to_dict(),
                  "cluster": cluster.to_dict(), "optimizer": "sgd", "lr": 0.1, "steps": 3, "device": device})
    outputs = run_local(train_cases, world, (cases,), backend=backend, timeout_s=900)
    for c, case in enumerate(cases):
        split = case["strategy"]["batch_split"]
        ref = reference_training("cnn-small", split, "sgd", 0.1, 3)
        start = reference_training("cnn-small", split, "sgd", 0.0, 1)
        # Training must move the weights well beyond the tolerance, or the comparison proves nothing.
        assert max(float((ref[k] - start[k]).abs().max()) for k in ref) > 1e-2, case["label"]
        for k, v in outputs[0][c]["params"].items():
            # cuDNN convolutions and CPU ones round differently, and so do split batches: close, not bit-equal.
            torch.testing.assert_close(v, ref[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{case['label']}: {k}: {m}")
        for r in range(1, world):
            for k, v in outputs[r][c]["params"].items():
                assert torch.equal(v, outputs[0][c]["params"][k]), f"{case['label']}: rank {r} differs on {k}"


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_with_a_grad_scaler(device):
    """Mixed precision as docs/guides/trials.md shows it (fp16 autocast and a GradScaler on CUDA; bf16 on the
    CPU), 2 processes on one device over gloo, with PS, a random composed strategy, clipping and shard units:
    rank 1 overflows at step 1 and every rank skips that step (the scale halves everywhere); the
    result equals single-process mixed-precision training on the same device."""
    from test_engine_habits import _cases

    cases = [{**c, "device": device} for c in _cases("local-1x2") if c["label"].startswith("amp/")]
    assert len(cases) == 4  # PS, random, clipped PS-LB, shard units in HSDP groups
    outputs = run_local(habits_worker, 2, (cases,), timeout_s=600)
    for c, case in enumerate(cases):
        label = case["label"]
        per_rank = [out[c] for out in outputs]
        assert all(out["device"] == {device} for out in per_rank), (label, [out["device"] for out in per_rank])
        scales = [out["scales"] for out in per_rank]
        assert scales[1] == scales[0], label
        assert scales[0][1] == scales[0][0] / 2, (label, scales[0])  # the poisoned step was skipped
        assert scales[0][0] == 2.0 ** 8, (label, scales[0])  # and no other step overflowed
        for k, v in per_rank[1]["state"].items():
            assert torch.equal(v, per_rank[0]["state"][k]), f"{label}: ranks differ on {k}"
        expected = reference(case)
        for k, v in expected.items():
            # Reduced-precision kernels on a split batch run other shapes than on the whole one.
            torch.testing.assert_close(per_rank[0]["state"][k], v, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, k=k: f"{label}: {k}: {m}")


@pytest.mark.gpu
def test_trial_on_a_gpu_reports_cuda_peak_memory():
    devices = min(2, torch.cuda.device_count())
    cluster = gpu_cluster(devices)
    workload = zoo_workload("bert-tiny")
    strategy = build_strategy("allreduce", workload.spec(), cluster)
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=2, iters=5), workload=workload)
    assert result.status == "ok", result.error
    # device_kind is where the trial's tensors were; backend is the configured process group
    # (test_process_group_serves_the_device_with_its_backend checks what serves CUDA tensors).
    assert result.device_kind == "cuda" and result.backend == GPU_BACKEND
    assert result.peak_memory_bytes > 0 and result.comm_bytes_per_iter > 0


ROW = re.compile(r"^\(([a-f])\) .+?\s+(\d+\.\d+)\s+(\d+\.\d+)$")
RATIO = re.compile(r"^ratio \(a\)/\(b\) = (\d+\.\d+)\s+paired per iteration (\d+\.\d+) "
                   r"\[95% (\d+\.\d+), (\d+\.\d+)\]\s+\(goal <= 1\.00, upper end <= 1\.02; (.+)\)$")


def read_benchmark_table(stdout: str) -> dict:
    """The engine benchmark's printed figures: header, rows {(a)..: (median ms, mean ms)}, the
    (a)/(b) ratio line's numbers and what it says it measures."""
    lines = stdout.splitlines()
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in map(ROW.match, lines) if m}
    ratio = [m.groups() for m in map(RATIO.match, lines) if m]
    assert len(ratio) == 1, stdout
    return {"header": lines[0], "buffers": next(line for line in lines if line.startswith("buffers broadcast")),
            "rows": rows, "ratio": tuple(float(x) for x in ratio[0][:4]), "measures": ratio[0][4], "text": stdout}


@pytest.mark.parametrize("device", DEVICES)
def test_engine_benchmark_table(device):
    """The benchmark runs and prints what it measured: the device and torch version, one row per
    configuration with positive times, a ratio that is the rows' ratio, its paired interval around
    the paired median, and at world size 1 the words that say no communication was timed, with
    buffer broadcasting the same on both sides."""
    world = 1 if device == "cpu" else min(2, torch.cuda.device_count())  # NCCL: one rank per GPU
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_overhead.py"), "--device", device,
                           "--cluster", f"local-1x{world}", "--iters", "3", "--rounds", "1", "--warmup", "1"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    table = read_benchmark_table(done.stdout)
    assert f"({world} processes, {device}" in table["header"] and f"torch {torch.__version__}" in table["header"]
    assert set(table["rows"]) == {"a", "b", "c", "d"}, table["text"]
    assert all(median > 0 and mean > 0 for median, mean in table["rows"].values()), table["text"]
    (a, _), (b, _) = table["rows"]["a"], table["rows"]["b"]
    ratio, paired, lo, hi = table["ratio"]
    assert ratio == pytest.approx(a / b, rel=2e-3, abs=2e-3), table["text"]  # the table rounds to 1 µs
    assert lo <= paired <= hi, table["text"]
    if world == 1:
        assert table["measures"] == "hook overhead, no communication", table["text"]
        assert table["buffers"] == "buffers broadcast each iteration: by neither", table["text"]
    else:
        assert table["measures"] == "synchronization" and table["buffers"].endswith("by both"), table["text"]


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_runtime(device):
    """torch FSDP2 through the fsdp runtime on the device's tensors (NCCL for CUDA: one rank per
    GPU, so a one-GPU machine runs one rank): per-block units, resharded and not, an uneven split
    where there are two ranks, against single-process training; then a trial of it, status ok."""
    from _fsdp_workers import fsdp_train_cases
    from synctune.engine.fsdp import FSDPConfig, FSDPRuntime

    world = 2 if device == "cpu" else min(2, torch.cuda.device_count())
    backend = "gloo" if device == "cpu" else GPU_BACKEND
    cluster = cluster_preset("local-1x2") if world == 2 else cluster_preset("local-1x1")
    even = build_strategy("allreduce", model_spec("transformer-small"), cluster)
    uneven = type(even)(**{**even.__dict__, "batch_split": tuple(range(1, world + 1))})
    cases = [{"label": f"{device}/reshard {r}/split {s.batch_split}", "strategy": s.to_dict(), "cluster": cluster.to_dict(),
              "runtime": FSDPRuntime(FSDPConfig(reshard_after_forward=r)).to_dict(), "optimizer": "sgd", "lr": 0.1, "steps": 3,
              "device": device} for r, s in ((True, even), (False, uneven))]
    outputs = run_local(fsdp_train_cases, world, (cases,), backend=backend, timeout_s=900)
    for c, case in enumerate(cases):
        ref = reference_training("transformer-small", case["strategy"]["batch_split"], "sgd", 0.1, 3)
        for k, v in outputs[0][c]["params"].items():
            # CUDA kernels and CPU ones round differently, and so do split batches: close, not bit-equal.
            torch.testing.assert_close(v, ref[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{case['label']}: {k}: {m}")
    trial_cluster = cluster if device == "cpu" else gpu_cluster(world)
    workload = zoo_workload("transformer-small")
    result = run_trial_local(build_strategy("allreduce", workload.spec(), trial_cluster), trial_cluster,
                             TrialConfig(warmup=1, iters=3), workload=workload, runtime=FSDPRuntime())
    assert result.status == "ok", result.error
    assert result.device_kind == device


@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_profile_measures_the_hosts_own_path(device):
    """On a GPU the host returns before the kernels finish: the profile records when its last
    call returned (no later than the iteration the device timed, give or take the event
    records) and the engine's host cost per variable from its probe; a CPU profile has neither
    (its calls return with the work done)."""
    from synctune.engine.profile import profile_compute

    profile = profile_compute(zoo_workload("cnn-small"), workers=1, device=device, warmup=2, iters=5)
    if device == "cpu":
        assert profile.launch_s is None and profile.hook_s is None
        return
    assert profile.launch_s is not None and 0 < profile.launch_s
    assert profile.hook_s is not None and 0 <= profile.hook_s < 1e-3
    assert profile.host_s() >= profile.launch_s


@pytest.mark.gpu
def test_a_gpu_profiles_host_path_is_a_lower_bound_of_the_engines_iteration():
    """The replay ends an iteration no sooner than the profile's host path (``launch_s`` plus the
    engine's hooks, ``hook_s`` per variable): a bound, so it must not exceed what the engine
    measures on the same GPU. resnet50 (161 variables) has a host path close to its device time
    on an H100 or H200. When the launch time was taken from the profiled iterations, whose hooks
    record a CUDA event per gradient, the event records were counted twice and the path read
    32.1 ms against a measured 30.7 on an H200 (bert-large: 65.0 against 61.1)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    from synctune.engine.profile import profile_compute

    workload = zoo_workload("resnet50")
    profile = profile_compute(workload, workers=1, device="cuda", warmup=3, iters=10)
    cluster = gpu_cluster(1)
    result = run_trial_local(build_strategy("allreduce", workload.spec(), cluster), cluster,
                             TrialConfig(warmup=3, iters=20), workload=workload)
    assert result.status == "ok", result.error
    assert profile.host_s() <= result.median_s * 1.02, (profile.launch_s, profile.hook_s, result.median_s)


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_parallelism_on_the_device(device):
    """The tp runtime (DTensor column- and row-wise splits, the model's loss checked split
    against unsplit) on the device's tensors: 2 processes of one TP group sharing the GPUs over
    gloo (NCCL refuses two ranks on one device; gloo all-reduces CUDA tensors, which is all a
    TP group of linear pairs needs), Hugging Face Llama and the zoo's transformer, against
    single-process training; each rank's shards stitched along their split axis."""
    pytest.importorskip("transformers")
    from _tp_workers import reference, tp_train_cases, workload_of

    cluster = cluster_preset("local-1x2")
    cases = []
    for model in ("hf-llama", "transformer-small"):
        spec = workload_of(model).spec()
        strategy = build_strategy("megatron", spec, cluster)
        cases.append({"label": model, "model": model, "strategy": strategy.to_dict(), "cluster": cluster.to_dict(),
                      "spec": spec.to_dict(), "optimizer": "sgd", "lr": 0.1, "steps": 3, "device": device})
    outputs = run_local(tp_train_cases, 2, (cases,), timeout_s=600, threads=1)
    for c, case in enumerate(cases):
        styles = dict(build_strategy("megatron", workload_of(case["model"]).spec(), cluster).tensor_parallel.styles)
        assert "refused" not in outputs[0][c], outputs[0][c]
        if device == "cuda":
            got = {}
            for k, v in outputs[0][c]["local"].items():
                module, _, leaf = k.rpartition(".")
                style = styles.get(module)
                axis = 0 if style == "colwise" else 1 if (style, leaf) == ("rowwise", "weight") else None
                got[k] = v if axis is None else torch.cat([outputs[r][c]["local"][k] for r in range(2)], dim=axis)
        else:
            got = outputs[0][c]["params"]
        ref = reference(case["model"], tuple(case["strategy"]["batch_split"][::2]), "sgd", 0.1, 3)
        for k, v in got.items():
            torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{case['label']}: {k}: {m}")
