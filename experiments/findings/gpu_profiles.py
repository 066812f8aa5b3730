"""GPU compute profiles of the zoo's GPU models, and the replay against a measured single-GPU
iteration (dPRO §4.1-4.3: the replay's compute input is a profile of the real device).

For each model: its compute profile on this machine's first GPU (one worker, CUDA events; filed
under the GPU's name, the ``device_model`` a cluster spec's node of that type carries), then a
real single-GPU trial of the all-reduce builder (the engine, ``local-1x1``-shaped, NCCL, the
device synchronized at the end of every timed iteration), then the replay's prediction of that
trial from the profile alone. One GPU: no communication, so the replay's iteration is the
profile's forward, backward and step plus the engine's fixed costs, and the comparison says how
well a profile measured once stands for the engine's iteration. Beside them, in the same process
as the profile's model, ``torch alone``: the plain loop (forward, backward, SGD step) timed on the
host clock to the device's synchronization, and ``launch``, when its last call returned (a launch
time close to the iteration says the host, not the GPU, sets the pace). Trials measure to a 95%
interval of ±``--target-ci`` around their median (``TrialConfig.target_ci``). The profiles are written to
``--out`` (one JSON per model, ``model-<GPU name, spaces as _>-w1.json``, what ``synctune dataset push``
carries in a release's ``profiles/``).

    python experiments/findings/gpu_profiles.py [--models bert-base,bert-large,resnet50,vgg16,transformer]
        [--out DIR] [--warmup 5] [--iters 20] [--repeats 3] [--target-ci 0.02]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert-base,bert-large,resnet50,vgg16,transformer")
    parser.add_argument("--out", default="gpu-profiles")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="trials per model (median of their medians)")
    parser.add_argument("--target-ci", type=float, default=0.02,
                        help="each trial measures until the 95%% interval of its median is within this (0: --iters)")
    args = parser.parse_args()

    import torch

    from synctune.engine.profile import profile_compute
    from synctune.engine.trial import TrialConfig, run_trial_local
    from synctune.simulator import ReplaySimulator
    from synctune.spec.cluster import ClusterSpec
    from synctune.strategy import build_strategy
    from synctune.workload.zoo import zoo_workload

    if not torch.cuda.is_available():
        print("no CUDA device here: this experiment profiles a GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = ClusterSpec.from_dict({"name": "gpu-1x1", "nodes": [
        {"instance_type": "this-machine", "device_kind": "gpu", "device_model": name, "num_devices": 1,
         "nic_gbps": 100.0, "single_flow_gbps": 100.0, "intra_node_gbps": 100.0}]})
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; {args.warmup} warm-up and {args.iters} "
          f"timed iterations per profile and per trial, {args.repeats} trials per model, SGD")
    print(HEADER, flush=True)
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        workload = zoo_workload(model)
        spec = workload.spec()
        t0 = time.perf_counter()
        profile = profile_compute(workload, workers=1, device="cuda", warmup=args.warmup, iters=args.iters,
                                  timeout_s=900)
        (out / f"{model}-{name.replace(' ', '_')}-w1.json").write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
        strategy = build_strategy("allreduce", spec, cluster)
        alone, launch = torch_alone(workload, spec, warmup=args.warmup, iters=args.iters)
        medians, halves = [], []
        for _ in range(args.repeats):
            config = TrialConfig(warmup=args.warmup, iters=args.iters, target_ci=args.target_ci,
                                 max_iters=max(args.iters, 300), max_timed_s=15.0, timeout_s=900)
            result = run_trial_local(strategy, cluster, config, workload=workload)
            if not result.ok:
                print(f"{model}: trial {result.status}: {result.error[:300]}", file=sys.stderr)
                break
            medians.append(result.median_s)
            half = (result.extra.get("measure") or {}).get("median_ci_rel")
            halves.append(half if half is not None else float("nan"))
        if not medians:
            continue
        measured = statistics.median(medians)
        predicted = float(ReplaySimulator({f"{model}@{name}-w1": profile}).predict([strategy], spec, cluster)[0])
        # The same replay without the host's path: the device's figures alone.
        device_only = dataclasses.replace(profile, launch_s=None, hook_s=None)
        on_device = float(ReplaySimulator({f"{model}@{name}-w1": device_only}).predict([strategy], spec, cluster)[0])
        rows.append((model, spec.batch_size, profile.forward_s, profile.backward_s, profile.step_s, measured,
                     min(medians), max(medians), predicted, predicted / measured - 1, len(spec.variables), alone,
                     launch, max(halves), profile.host_s() or 0.0, profile.hook_s or 0.0, on_device,
                     time.perf_counter() - t0))
        print(_row(rows[-1]), f"  ({rows[-1][-1]:.0f} s)", flush=True)  # each row as it comes: a cut run keeps it
    print()
    print(HEADER)
    for r in rows:
        print(_row(r))
    within = sum(abs(r[9]) <= 0.05 for r in rows)
    print(f"\nreplay within 5% of the measured single-GPU iteration: {within} of {len(rows)} models")
    return 0


HEADER = ("| model | batch | variables | forward ms | backward ms | step ms | host path ms (hooks us/variable) "
          "| torch alone ms (launch ms) | measured iteration ms (median of trials; min-max; widest ±) "
          "| replay ms (device only) | replay error (device only) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def _row(r: tuple) -> str:
    return (f"| {r[0]} | {r[1]} | {r[10]} | {r[2] * 1e3:.1f} | {r[3] * 1e3:.1f} | {r[4] * 1e3:.1f} | "
            f"{r[14] * 1e3:.1f} ({r[15] * 1e6:.0f}) | {r[11] * 1e3:.1f} ({r[12] * 1e3:.1f}) | "
            f"{r[5] * 1e3:.1f} ({r[6] * 1e3:.1f}-{r[7] * 1e3:.1f}; {r[13]:.1%}) | "
            f"{r[8] * 1e3:.1f} ({r[16] * 1e3:.1f}) | {r[9]:+.1%} ({r[16] / r[5] - 1:+.1%}) |")


def torch_alone(workload, spec, *, warmup: int, iters: int) -> tuple[float, float]:
    """The plain loop on this process's GPU: medians of the iteration (host clock, to the device's
    synchronization) and of the time its last call returned (the host's launch time)."""
    import torch

    torch.manual_seed(0)
    model = workload.build_model().to("cuda")
    params = dict(model.named_parameters())
    optimizer = workload.make_optimizer([params[v.name] for v in spec.variables], name="sgd", lr=0.01)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = workload.make_batch(spec.batch_size, rank=0, generator=gen, device=torch.device("cuda"))
    walls, launches = [], []
    for it in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        workload.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if it >= warmup:
            walls.append(time.perf_counter() - t0)
            launches.append(t1 - t0)
    del model, optimizer, batch
    torch.cuda.empty_cache()
    return statistics.median(walls), statistics.median(launches)


if __name__ == "__main__":
    sys.exit(main())
