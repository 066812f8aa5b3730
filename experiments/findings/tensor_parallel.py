"""Tensor parallelism against the data parallelism users run, measured side by side: per library
model and lab preset, the Megatron-style plan (attention and MLP pairs split inside each node,
FSDP2 across the nodes: ``synctune strategy build --builder megatron``) beside torch FSDP2 (one
shard group over every replica), HSDP (shard inside a node, replicate across) and torch DDP, at
the same global batch (a TP group of t devices trains t replicas' samples).

Time: every arm an arm of one interleaved re-measurement on the same processes (rounds rotating
the order), its geometric-mean iteration time and its time relative to the fastest arm with a
paired 95% interval. Memory: one trial per arm, each rank's measured peak (the largest rank's
here), and the memory model's prediction for it (the probe every search starts with; for the TP
arm the split model's own figures, :func:`synctune.run.prepare.memory_budget`'s ``split``).

    python experiments/findings/tensor_parallel.py                         # 2 models x 2 presets (root: the lab)
    python experiments/findings/tensor_parallel.py --models hf_llama --presets lab-2x2 --rounds 4
    python experiments/findings/tensor_parallel.py --stand-in local-2x2     # the code path over loopback, no root
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, interleaved_arms, markdown_table, measured_on  # noqa: E402

MODELS = ("hf_llama", "hf_bert")
PRESETS = ("lab-2x2", "lab-b10c")
MIB = 1 << 20


def arms(spec, cluster):
    """(name, strategy, runtime) of every arm, at one global batch: the model's batch per replica
    for data parallelism, a TP group of t replicas training t times that (the ``megatron``
    builder keeps the replicated strategy's global batch)."""
    from synctune.engine.ddp import DDPRuntime
    from synctune.engine.fsdp import FSDP_DEFAULT, FSDPConfig, FSDPRuntime
    from synctune.engine.runtimes import executor_for
    from synctune.strategy import build_strategy

    plain = build_strategy("allreduce", spec, cluster)
    tp = build_strategy("megatron", spec, cluster, dp="shard")  # at the replicated strategy's global batch
    t = tp.tensor_parallel.degree
    per_node = min(n.num_devices for n in cluster.nodes)
    # Sequence parallelism, and the loss over vocabulary-split logits where the model has an
    # output layer of its own (Llama's lm_head; BERT's decoder is its embedding).
    try:
        sp = build_strategy("megatron", spec, cluster, dp="shard", sequence_parallel=True, loss_parallel=True)
        sp_name = f"TP {t} + SP + loss parallel + FSDP2"
    except Exception:  # noqa: BLE001 - no output layer of its own
        sp = build_strategy("megatron", spec, cluster, dp="shard", sequence_parallel=True)
        sp_name = f"TP {t} + SP + FSDP2"
    return [("DDP", plain, DDPRuntime()), ("FSDP2", plain, FSDPRuntime(FSDP_DEFAULT)),
            (f"HSDP (shard {per_node})", plain, FSDPRuntime(FSDPConfig(group=per_node))),
            (f"TP {t} + FSDP2 (Megatron)", tp, executor_for(tp, spec)),
            (sp_name, sp, executor_for(sp, spec))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--stand-in", help="a non-lab cluster preset to run every domain on (loopback)")
    args = parser.parse_args(argv)

    from synctune.engine.measure import TrialConfig
    from synctune.engine.trial import run_trial_local
    from synctune.run.prepare import memory_budget
    from synctune.search import Experiment
    from synctune.workload import ImportedWorkload

    for name in args.models:
        workload = ImportedWorkload(f"experiments/workloads/{name}.py:workload", str(ROOT))
        spec = workload.check()
        for preset in args.presets:
            with measured_on(preset, args.stand_in, "--stand-in") as (cluster, node_net):
                domain = arms(spec, cluster)
                budget = memory_budget(Experiment.from_keys(name="probe", model="bert-tiny", cluster=cluster.name,
                                                            budget=1, memory_gib=1.0, memory_headroom=0.0),
                                       spec, cluster, workload,
                                       split=[s.tensor_parallel for _n, s, _r in domain if s.tensor_parallel])
                print(f"\n## {spec.name} on {cluster.name} (global batch {domain[0][1].global_batch_size})", flush=True)
                times = interleaved_arms([(s, r) for _n, s, r in domain], cluster, workload=workload,
                                         node_net=node_net, rounds=args.rounds, per_round=args.per_round)
                rows = []
                for i, (label, strategy, runtime) in enumerate(domain):
                    trial = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=2), workload=workload,
                                            runtime=runtime, node_net=node_net)
                    peaks = trial.extra.get("memory", {}).get("peak_bytes") if trial.status == "ok" else None
                    held = runtime.plans_of(strategy, lambda: workload.build_model(), spec)
                    predicted = max(budget.peaks(held, fsdp=runtime.fsdp_layout))
                    measured = max(p for p in peaks if p) if peaks and any(peaks) else None
                    rows.append([label, times.cell(i),
                                 f"{measured / MIB:.1f}" if measured else f"({trial.status})",
                                 f"{predicted / MIB:.1f}" + (f" ({(predicted - measured) / measured:+.1%})"
                                                              if measured else "")])
                print(markdown_table(["arm", "ms per iteration, time relative to the fastest [95%]",
                                      "peak MiB per rank (largest rank)", "predicted MiB (error)"], rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
