"""What the engine adds to a model's iteration beyond the plain loop a compute profile times.

A compute profile (``synctune sim profile``, :mod:`synctune.engine.profile`) times forward,
backward and the optimizer's step of plain PyTorch; a trial runs the same model through the
engine, whose hooks, units and step cost host time of their own. With one replica nothing
travels, so what remains is that cost: if it differed much from model to model, a profile that
left it out would put each unseen model at a level of its own (the replay's unseen-model error on
release v0.3 is such a level: cnn-small replays 0.74-0.87 of its measured time on every cluster,
ncf-small 1.12-1.20, transformer-small 1.07-1.25).

Each of ``--workers`` processes (the contention of that many workers sharing this machine's
cores, as a lab preset's) is a process group of one that trains each model twice from the same
seed, plainly and through the engine with each builder's strategy, iteration by iteration
interleaved (the order alternating), and keeps the median of the per-iteration differences.
Printed per model and builder: the medians over the workers of the plain and the engine
iteration and of the difference.

    python experiments/findings/engine_overhead.py [--models cnn-small,ncf-small] [--builders allreduce,ps]
        [--workers 4] [--iters 50]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from queue import Empty

MODELS = ("cnn-small", "ncf-small", "lm-small", "transformer-small", "bert-tiny")


def _one_worker(models: list[str], builders: list[str], warmup: int, iters: int, out) -> None:
    """One process group of one: per (model, builder), medians of plain, engine and difference (ms)."""
    import torch
    import torch.distributed as dist

    from synctune.engine.core import StrategyEngine
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy
    from synctune.workload.zoo import zoo_workload

    torch.set_num_threads(1)  # as a trial's worker
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cluster = cluster_preset("local-1x1")  # one CPU device: nothing travels
    rows = {}
    try:
        for name in models:
            workload = zoo_workload(name)
            spec = workload.spec()
            for builder in builders:
                torch.manual_seed(0)
                plain, through = workload.build_model(), workload.build_model()
                params = dict(plain.named_parameters())
                opt = workload.make_optimizer([params[v.name] for v in spec.variables], name="sgd", lr=0.01)
                engine = StrategyEngine(through, build_strategy(builder, spec, cluster), spec, cluster,
                                        lambda ps: workload.make_optimizer(ps, name="sgd", lr=0.01))
                batch = workload.make_batch(spec.batch_size, rank=0, generator=torch.Generator().manual_seed(1),
                                            device=torch.device("cpu"))

                def alone() -> None:
                    workload.loss(plain, batch).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                def engined() -> None:
                    workload.loss(through, batch).backward()  # the engine hooks the module itself
                    engine.step()
                    engine.zero_grad()

                times: dict[str, list[float]] = {"plain": [], "engine": []}
                for it in range(warmup + iters):
                    # Alternate which goes first: the second of a pair runs on warmer caches.
                    pair = (("plain", alone), ("engine", engined)) if it % 2 else (("engine", engined), ("plain", alone))
                    for key, fn in pair:
                        t0 = time.perf_counter()
                        fn()
                        if it >= warmup:
                            times[key].append(time.perf_counter() - t0)
                engine.close()
                diff = [e - p for p, e in zip(times["plain"], times["engine"])]
                rows[(name, builder)] = (statistics.median(times["plain"]), statistics.median(times["engine"]),
                                         statistics.median(diff), len(spec.variables))
    finally:
        dist.destroy_process_group()
    out.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--builders", default="allreduce,ps")
    ap.add_argument("--workers", type=int, default=4, help="processes at once (a 4-worker preset's contention)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    models, builders = args.models.split(","), args.builders.split(",")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_one_worker, args=(models, builders, args.warmup, args.iters, queue))
             for _ in range(args.workers)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Empty:
            # A worker that died (its traceback is on stderr) would leave the others' results waiting.
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"engine_overhead: a worker failed (exit status {failed[0]}); see its error above")
    for p in procs:
        p.join()
    print(f"{args.workers} workers at once, each a process group of one; {args.iters} interleaved pairs "
          f"after {args.warmup} warm-up; medians over the workers (ms)\n")
    print("| model | variables | builder | plain iteration | engine iteration | engine - plain (paired) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in [(m, b) for m in models for b in builders]:
        plain, eng, diff = (statistics.median(r[key][i] for r in results) * 1e3 for i in range(3))
        print(f"| {key[0]} | {results[0][key][3]} | {key[1]} | {plain:.2f} | {eng:.2f} | {diff:+.2f} |")


if __name__ == "__main__":
    main()
