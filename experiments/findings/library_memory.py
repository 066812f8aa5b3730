"""Does a memory budget hold for models nobody here wrote, and does the search still win under it?

Three library models built from configs, no weights downloaded (``experiments/workloads/``: a
Hugging Face GPT-2 and BERT, each with tied embeddings, and a Hugging Face ViT; AdamW, synthetic
data), each on a lab preset under three budgets set from the memory model's own predictions
(the probe every search starts with), so that each class holds by the model's account:

- ``replicated``: 15% above replicated training's predicted peak (everything fits);
- ``sharding``: halfway between the smallest peak of a sharded strategy without checkpointing
  and replicated training's (sharding fits, replicated training does not);
- ``checkpointing``: halfway between the smallest peak with every block checkpointed and the
  smallest without (only checkpointing, with or without sharding, fits).

Per domain and seed, one real search (``run_search``: tuned DDP where it fits, FSDP2 tuned over
layout, prefetch and checkpointing mode, the builders that fit, Algorithm 1 with the replay
simulator, the confirmation against the best baseline). Table per domain: the recommendation,
its confirmed speed-up over the best baseline [95%], its peak per rank predicted (the memory
model as the search ended) and measured, against the budget; the share of ``oom`` trials, the
trials until the first one within the budget; and the memory model's error over every trial
that measured its memory: median |predicted - measured| / measured, and the largest amount a
trial predicted to fit measured over its prediction (both from the probe alone, before any trial
taught the model: the model's first judgement).

    python experiments/findings/library_memory.py                              # 3 models x 3 budgets x 3 seeds
    python experiments/findings/library_memory.py --models hf_gpt2 --classes checkpointing --seeds 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, lab, markdown_table, use_data_folder  # noqa: E402

#: workload file (experiments/workloads/NAME.py:workload) -> lab preset.
MODELS = {"hf_gpt2": "lab-2x2", "hf_bert": "lab-2x2", "hf_vit": "lab-2x2"}
CLASSES = ("replicated", "sharding", "checkpointing")


def budgets(workload, spec, cluster) -> dict[str, float | None]:
    """Per class, the budget in MiB per device (None where the model's figures leave no room for
    it), from the memory model's predictions on the probe a search starts with."""
    import dataclasses

    from synctune.run.prepare import memory_budget
    from synctune.search import Experiment
    from synctune.strategy import build_strategy
    from synctune.strategy.checkpoint import checkpoint_blocks

    model = memory_budget(Experiment.from_keys(name="probe", model="bert-tiny", cluster=cluster.name, budget=1,
                                               memory_gib=1.0, memory_headroom=0.0), spec, cluster, workload)
    replicated = max(model.peaks(build_strategy("allreduce", spec, cluster)))
    depth = max(v.name.count(".") for v in spec.variables)
    sharded = [build_strategy("shard", spec, cluster, depth=d, reshard=r) for d in range(1, depth + 1)
               for r in (True, False)]
    smallest_plain = min(max(model.peaks(s)) for s in sharded)
    blocks = checkpoint_blocks(v.name for v in spec.variables)
    every = [dataclasses.replace(s, checkpoint=tuple((b, "full") for b in blocks))
             for s in sharded + [build_strategy("allreduce", spec, cluster)]]
    smallest = min(max(model.peaks(s)) for s in every)
    mib = 2 ** 20
    return {"replicated": 1.15 * replicated / mib,
            "sharding": (smallest_plain + replicated) / 2 / mib if smallest_plain < 0.95 * replicated else None,
            "checkpointing": (smallest + smallest_plain) / 2 / mib if smallest < 0.95 * smallest_plain else None}


def one_search(path: str, spec, cluster, node_net, mib: float, klass: str, seed: int, args) -> dict:
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.search import run_search
    from synctune.search import Experiment
    from synctune.workload import resolve_workload

    exp = Experiment.from_keys(name=f"lib-{spec.name}-{klass}", workload=path, cluster=cluster.name,
                               budget=args.budget, algorithm="autodist", simulator="replay", proposals=300,
                               candidates=3, warmup=args.warmup, iters=args.iters, memory_gib=mib / 1024,
                               memory_headroom=0.0, ddp_trials=4, fsdp_trials=6, confirm_rounds=10, confirm_iters=5,
                               timeout_s=240, seed=seed)
    workload = resolve_workload(path)
    start = time.monotonic()
    summary = run_search(exp, spec, cluster, workload=workload, node_net=node_net,
                         on_phase=lambda m: print(f"    {m}", flush=True))
    rows = sorted(TrialDataset(dataset_dir()).records(search_id=f"{exp.name}-seed{seed}"),
                  key=lambda r: (r.created_at, r.record_id))
    return {"seed": seed, "summary": summary, "wall": time.monotonic() - start, "rows": rows}


def memory_errors(rows, workload, spec, cluster, limit: int) -> tuple[list[float], list[float]]:
    """Per trial with a measured peak: |predicted - measured| / measured of the probe-only memory
    model (the largest rank's), and, for the trials it predicted to fit, measured over predicted - 1."""
    from synctune.engine.runtimes import runtime_from_record
    from synctune.run.prepare import memory_budget
    from synctune.search import Experiment
    from synctune.strategy import Strategy

    model = memory_budget(Experiment.from_keys(name="probe", model="bert-tiny", cluster=cluster.name, budget=1,
                                               memory_gib=1.0, memory_headroom=0.0), spec, cluster, workload)
    errors, over = [], []
    for r in rows:
        peaks = [m.get("peak_bytes") for m in r.memory_breakdown or [] if m.get("peak_bytes") is not None]
        if not peaks or r.trial_id.startswith("confirm-"):
            continue
        runtime = runtime_from_record(r.runtime, r.runtime_json)
        held = runtime.plans_of(Strategy.from_json(r.strategy_json), workload.build_model, spec)
        predicted = max(model.peaks(held, fsdp=runtime.fsdp_layout))
        errors.append(abs(predicted - max(peaks)) / max(peaks))
        if predicted <= limit:
            over.append(max(peaks) / predicted - 1)
    return errors, over


def table_row(run: dict, klass: str, mib: float, errors: tuple[list[float], list[float]]) -> list[object]:
    s = run["summary"]
    c = s.confirmed
    confirmed = (f"{c.interval.ratio:.3f} [{c.interval.low:.3f}, {c.interval.high:.3f}] ({c.verdict})"
                 if c is not None and c.measured else f"n/a ({c.error if c is not None else 'none'})"[:60])
    rec = s.recommended
    trials = [r for r in run["rows"] if not r.trial_id.startswith("confirm-")]
    limit = mib * 2 ** 20
    first = next((n for n, r in enumerate(trials, 1) if r.status == "ok" and r.memory_breakdown and max(
        m["peak_bytes"] or 0 for m in r.memory_breakdown) <= limit), None)
    ooms = sum(1 for r in trials if r.status == "oom")
    m = s.memory
    mib_of = lambda xs: f"{max(x for x in xs if x is not None) / 2**20:.2f}" if xs else "n/a"  # noqa: E731
    med = f"{statistics.median(errors[0]):.1%}" if errors[0] else "n/a"
    worst = f"{max(errors[1]):+.1%}" if errors[1] else "n/a"
    what = f"{rec.name}" + (f" ({rec.strategy.summary().split(' | ')[-1]})" if rec and rec.strategy.checkpoint else "") \
        if rec else "n/a"
    return [klass, f"{mib:.2f}", run["seed"], what, confirmed,
            f"{mib_of(m.predicted_peak_bytes if m else None)} / {mib_of(m.measured_peak_bytes if m else None)}",
            f"{ooms}/{len(trials)}", first or "-", med, worst, f"{run['wall']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}, comma-separated")
    parser.add_argument("--classes", default=",".join(CLASSES), help=f"of {', '.join(CLASSES)}, comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=16, help="trials of each search (builders included)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--home", help="synctune data folder of this run (default: a new one)")
    args = parser.parse_args()
    use_data_folder(args.home, "synctune-libmem-")

    import ray

    from synctune.workload import resolve_workload

    seeds = [int(x) for x in args.seeds.split(",")]
    tables = []
    for name in args.models.split(","):
        path = str(ROOT / "experiments" / "workloads" / f"{name}.py") + ":workload"
        workload = resolve_workload(path)
        spec = workload.check()
        with lab(MODELS[name]) as (cluster, node_net):
            chosen = budgets(workload, spec, cluster)
            print(f"{spec.name}@{cluster.name}: budgets MiB per device " +
                  ", ".join(f"{k} {v:.2f}" if v else f"{k} n/a" for k, v in chosen.items()), flush=True)
            ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
            rows = []
            try:
                for klass in args.classes.split(","):
                    mib = chosen[klass]
                    if mib is None:
                        rows.append([klass, "n/a", "-", "the model leaves no room for this class"] + ["-"] * 7)
                        continue
                    for seed in seeds:
                        run = one_search(path, spec, cluster, node_net, mib, klass, seed, args)
                        row = table_row(run, klass, mib, memory_errors(run["rows"], workload, spec, cluster,
                                                                       int(mib * 2 ** 20)))
                        print("  " + " | ".join(str(x) for x in row), flush=True)
                        rows.append(row)
            finally:
                ray.shutdown()
        tables.append((f"{spec.name}@{cluster.name}", rows))
    for domain, rows in tables:
        print(f"\n{domain}, AdamW")
        print(markdown_table(["budget class", "MiB per device", "seed", "recommended",
                              "confirmed speed-up over the best baseline [95%]",
                              "peak per rank MiB predicted / measured", "oom trials", "trials to the first fit",
                              "memory error, median", "worst over prediction (predicted to fit)", "wall s"], rows))


if __name__ == "__main__":
    main()
