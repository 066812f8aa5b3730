"""The gpu tier (``python3 -m pytest -m gpu``): the engine on CUDA tensors. Skipped, with the
reason, where there is no CUDA device; run it on a GPU machine.

- conformance with NCCL (world size 1: every code path on CUDA tensors through NCCL);
- equivalence of 2 processes sharing one GPU over gloo (NCCL refuses two ranks on one device),
  and, with 2+ GPUs, 2 processes on 2 GPUs over NCCL, against single-process CPU training
  (builders, and sufficient-factor broadcasting on an uneven split);
- a trial on a GPU cluster spec: status ok, the CUDA backend, the CUDA peak-memory figure;
- the engine benchmark on CUDA.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _engine_workers import conformance_worker, reference_training, sfb_strategy, train_cases
from synctune.engine.local import run_local
from synctune.engine.trial import GPU_BACKEND, TrialConfig, run_trial_local
from synctune.models import model_spec
from synctune.spec import ClusterSpec, cluster_preset
from synctune.strategy import Compressor, build_strategy
from synctune.workload import zoo_workload

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def gpu_cluster(devices: int) -> ClusterSpec:
    return ClusterSpec.from_dict({"name": f"gpu-1x{devices}", "nodes": [
        {"instance_type": "this-machine", "device_kind": "gpu", "device_model": torch.cuda.get_device_name(0),
         "num_devices": devices, "nic_gbps": 100.0, "single_flow_gbps": 100.0, "intra_node_gbps": 100.0}]})


def test_conformance_on_cuda_with_nccl():
    """World size 1 over NCCL: each synchronizer x compressor gives back the one rank's gradient
    (lossless bit-exactly), with every tensor on the GPU."""
    from synctune.spec import ModelSpec, VariableSpec
    from synctune.strategy import AllReduceSynchronizer, PSSynchronizer, ShardPlan, Strategy, VariablePlan

    from test_engine_conformance import SHAPES, _inputs

    spec = ModelSpec(name="probe", variables=tuple(VariableSpec(name=k, shape=v) for k, v in SHAPES.items()),
                     batch_size=1)
    cluster = cluster_preset("local-1x1")
    cases = []
    for sync in (AllReduceSynchronizer(group=0), PSSynchronizer(placement="node0:0")):
        for comp in (Compressor(), Compressor(kind="fp16")):
            plans = [VariablePlan(variable=k, partition=(2,) + (1,) * (len(v) - 1),
                                  shards=(ShardPlan(synchronizer=sync, compressor=comp),) * 2)
                     for k, v in SHAPES.items()]
            strategy = Strategy.over(spec, cluster, plans, batch_split=(1,))
            cases.append({"shapes": SHAPES, "strategy": strategy.to_dict(), "cluster": cluster.to_dict(),
                          "inputs": [_inputs("integer", 2, seed=1)[0]], "device": "cuda", "lossless": comp.lossless})
    outputs = run_local(conformance_worker, 1, (cases,), backend=GPU_BACKEND, timeout_s=600)
    for case, out in zip(cases, outputs[0]):
        for step, xs in enumerate(case["inputs"][0]):
            for name, x in zip(SHAPES, xs):
                if case["lossless"]:
                    assert torch.equal(out["steps"][step][name], x)
                else:
                    torch.testing.assert_close(out["steps"][step][name], x, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("world, backend", [(2, "gloo"), (2, GPU_BACKEND)])
def test_equivalence_on_cuda(world, backend):
    if backend != "gloo" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    cluster = cluster_preset("local-1x2")
    cases = []
    for builder, options in (("allreduce", {}), ("ps-lb", {}), ("partitioned-ps", {}),
                             ("allreduce", {"algorithm": "hierarchical"})):
        s = build_strategy(builder, model_spec("cnn-small"), cluster, **options)
        cases.append({"label": builder, "strategy": s.to_dict(), "cluster": cluster.to_dict(), "optimizer": "sgd",
                      "lr": 0.1, "steps": 3, "device": "cuda"})
    # Sufficient-factor broadcasting of every linear weight, uneven split (factors on the GPU).
    cases.append({"label": "sfb", "strategy": sfb_strategy("cnn-small", cluster, (3, 5)).to_dict(),
                  "cluster": cluster.to_dict(), "optimizer": "sgd", "lr": 0.1, "steps": 3, "device": "cuda"})
    outputs = run_local(train_cases, world, (cases,), backend=backend, timeout_s=900)
    for c, case in enumerate(cases):
        ref = reference_training("cnn-small", case["strategy"]["batch_split"], "sgd", 0.1, 3)
        for k, v in outputs[0][c]["params"].items():
            # cuDNN convolutions and CPU ones round differently: close, not bit-equal.
            torch.testing.assert_close(v, ref[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{case['label']}: {k}: {m}")
        for r in range(1, world):
            for k, v in outputs[r][c]["params"].items():
                assert torch.equal(v, outputs[0][c]["params"][k]), f"{case['label']}: rank {r} differs on {k}"


def test_trial_on_a_gpu_reports_cuda_peak_memory():
    devices = min(2, torch.cuda.device_count())
    cluster = gpu_cluster(devices)
    workload = zoo_workload("bert-tiny")
    strategy = build_strategy("allreduce", workload.spec(), cluster)
    result = run_trial_local(strategy, cluster, TrialConfig(warmup=2, iters=5), workload=workload)
    assert result.status == "ok", result.error
    assert result.device_kind == "cuda" and "nccl" in result.backend
    assert result.peak_memory_bytes > 0 and result.comm_bytes_per_iter > 0


def test_engine_benchmark_runs_on_cuda():
    cluster = f"local-1x{min(2, torch.cuda.device_count())}"  # NCCL: one rank per GPU
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_overhead.py"), "--device", "cuda",
                           "--cluster", cluster, "--iters", "5", "--rounds", "1", "--warmup", "2"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ratio (a)/(b)" in done.stdout
    print(done.stdout)
