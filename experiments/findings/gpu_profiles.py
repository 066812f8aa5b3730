"""GPU compute profiles of the zoo's GPU models, and the replay against a measured single-GPU
iteration (dPRO §4.1-4.3: the replay's compute input is a profile of the real device).

For each model: its compute profile on this machine's first GPU (one worker, CUDA events; filed
under the GPU's name, the ``device_model`` a cluster spec's node of that type carries), then a
real single-GPU trial of the all-reduce builder (the engine, ``local-1x1``-shaped, NCCL, the
device synchronized at the end of every timed iteration), then the replay's prediction of that
trial from the profile alone. One GPU: no communication, so the replay's iteration is the
profile's forward, backward and step plus the engine's fixed costs, and the comparison says how
well a profile measured once stands for the engine's iteration. The profiles are written to
``--out`` (one JSON per model, ``model-<GPU name, spaces as _>-w1.json``, what ``synctune dataset push``
carries in a release's ``profiles/``).

    python experiments/findings/gpu_profiles.py [--models bert-base,bert-large,resnet50,vgg16,transformer]
        [--out DIR] [--warmup 5] [--iters 20]
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--repeats", type=int, default=5, help="trials per model (median of their medians)")
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
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        workload = zoo_workload(model)
        spec = workload.spec()
        t0 = time.perf_counter()
        profile = profile_compute(workload, workers=1, device="cuda", warmup=args.warmup, iters=args.iters,
                                  timeout_s=900)
        (out / f"{model}-{name.replace(' ', '_')}-w1.json").write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
        strategy = build_strategy("allreduce", spec, cluster)
        medians = []
        for _ in range(args.repeats):
            result = run_trial_local(strategy, cluster, TrialConfig(warmup=args.warmup, iters=args.iters,
                                                                    timeout_s=900), workload=workload)
            if not result.ok:
                print(f"{model}: trial {result.status}: {result.error[:300]}", file=sys.stderr)
                break
            medians.append(result.median_s)
        if not medians:
            continue
        measured = statistics.median(medians)
        predicted = float(ReplaySimulator({f"{model}@{name}-w1": profile}).predict([strategy], spec, cluster)[0])
        rows.append((model, spec.batch_size, profile.forward_s, profile.backward_s, profile.step_s, measured,
                     min(medians), max(medians), predicted, predicted / measured - 1, time.perf_counter() - t0))
        print(f"  {model}: {rows[-1][-1]:.0f} s", flush=True)
    print()
    print("| model | batch | forward ms | backward ms | step ms | measured iteration ms (median of trials; min-max) "
          "| replay ms | replay error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2] * 1e3:.1f} | {r[3] * 1e3:.1f} | {r[4] * 1e3:.1f} | {r[5] * 1e3:.1f} "
              f"({r[6] * 1e3:.1f}-{r[7] * 1e3:.1f}) | {r[8] * 1e3:.1f} | {r[9]:+.1%} |")
    within = sum(abs(r[9]) <= 0.05 for r in rows)
    print(f"\nreplay within 5% of the measured single-GPU iteration: {within} of {len(rows)} models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
