"""Engine overhead: our composed all-reduce vs torch DDP vs the raw collectives, side by side.

On the same worker processes, model, data and bucket size, per-iteration time of
  (a) synctune's engine running the Horovod-like builder (fusion threshold = bucket size),
  (b) torch DistributedDataParallel with bucket_cap_mb = bucket size,
  (c) the raw collectives alone: all-reduce of the same buckets, no compute,
  (d) compute alone: forward + backward + SGD step, no synchronization,
and, where the cluster has several nodes of several devices, hierarchical PS (TF-PS-LB with
local aggregation) with its stages
  (e) chained: the cross-node reduce starts as soon as the node's reduce completed, during backward,
  (f) blocking: the cross-node reduces run one by one inside step (the engine before chaining).
Configurations are interleaved iteration by iteration, so drift on a shared machine hits all alike.
Buffers are broadcast alike: by both (DDP before each forward, the engine after each step) with
several processes, by neither with one. With one process nothing is communicated: (a)/(b) is then
the hooks' overhead only, and the output says so.
Goals: (a)/(b) <= 1.00 with the paired interval's upper end <= 1.02; (e)/(f) <= 0.95, printed beside
what bounds it, compute alone, (d)/(f), and what it has to gain from (:func:`readiness_shares`: a
gradient ready when backward ends has nothing to overlap with).
``--model`` is a zoo model or a workload file (``experiments/workloads/hf_gpt2.py:workload``,
a Hugging Face GPT-2 built from a config), as ``synctune trial --model`` takes it.

    python benchmarks/engine_overhead.py [--model bert-tiny] [--cluster local-1x2] [--bucket-mb 25] [--device cuda]
        [--breakdown [--breakdown-iters 20] [--trace DIR]]

``--breakdown`` adds, after the timing and on the same processes, where each iteration's time
goes for (a) and (b): ``--breakdown-iters`` more iterations of each, interleaved, under
``torch.profiler`` (host activity). The engine marks its step's phases as ``synctune.*`` ranges
(:data:`synctune.engine.core.PROFILE_PHASES`, on for these iterations only); DDP's come from
torch's own events (the reducer's ``mul_out`` and ``copy_bucket_to_grad``, ``c10d::*``,
``Optimizer.step#*``) and three ranges the benchmark puts around DDP's ``_pre_forward``,
``_post_forward`` and ``_sync_buffers`` on its instance. Every microsecond of an iteration's main thread goes to one
item (:data:`BREAKDOWN_ITEMS`); the table gives each item's median per iteration (every rank's
iterations pooled), engine, DDP and their difference. ``--trace DIR`` also writes a Chrome trace
(chrome://tracing, Perfetto) of each side's profiled iterations per rank:
``DIR/synctune-rank<r>.json`` and ``DIR/ddp-rank<r>.json``.

A lab preset (``--cluster lab-2x2``, after ``synctune lab up lab-2x2``) runs it over shaped links.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import resource
import statistics
import time


def _worker(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from synctune.engine.core import StrategyEngine
    from synctune.spec import resolve_cluster
    from synctune.strategy import build_strategy
    from synctune.workload.source import model_source

    workload = model_source(args["model"], root=args["root"]).workload()
    cluster = resolve_cluster(args["cluster"])
    spec = workload.spec()
    device = torch.device("cpu")
    if args["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    bucket = int(args["bucket_mb"] * 2**20)
    strategy = build_strategy("horovod", spec, cluster, fusion_threshold_bytes=bucket)
    batch = workload.make_batch(workload.batch_size, rank=rank, generator=torch.Generator().manual_seed(rank),
                                device=device)

    def loss_of(module):
        return workload.loss(module, batch)

    def model():
        torch.manual_seed(0)
        with torch.device(device):
            return workload.build_model()

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-3)

    ours_model = model()
    engine = StrategyEngine(ours_model, strategy, spec, cluster, sgd)
    # DDP broadcasts buffers before every forward even with one process, where the engine skips
    # it: the same work on both sides, or the ratio times a broadcast only one side does.
    # torch 2.13 calls the switch forward_sync_buffers; before it, broadcast_buffers did the same.
    switch = "forward_sync_buffers"
    if switch not in inspect.signature(DDP).parameters:
        switch = "broadcast_buffers"
    ddp_model = DDP(model(), bucket_cap_mb=args["bucket_mb"], **{switch: buffers_broadcast(world)})
    if getattr(ddp_model, switch) != (engine.broadcast_buffers and world > 1):
        raise RuntimeError("DDP and the engine broadcast buffers differently: the ratio would time one side's extra work")
    ddp_opt = sgd(ddp_model.parameters())
    alone_model = model()
    alone_opt = sgd(alone_model.parameters())
    sizes: dict[int, int] = {}
    for plan in strategy.plans:
        g = plan.shards[0].synchronizer.group
        sizes[g] = sizes.get(g, 0) + spec[plan.variable].num_elements
    buffers = [torch.zeros(n, device=device) for _g, n in sorted(sizes.items())]

    # Every loop zeroes its gradients first, then forward, backward, step: the same loop on each
    # side. The engine's zero_grad at the end of its iteration instead measured 1-2% slower on
    # GPT-2 (paired in one run, CPU too), DDP's position made no difference.
    def engine_step(module, eng):
        def run():
            eng.zero_grad()
            loss_of(module).backward()
            eng.step()

        return run

    ours = engine_step(ours_model, engine)

    def ddp():
        ddp_opt.zero_grad()
        loss_of(ddp_model).backward()
        ddp_opt.step()

    def raw():
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()

    def compute():
        alone_opt.zero_grad()
        loss_of(alone_model).backward()
        alone_opt.step()

    configs = {"synctune": ours, "ddp": ddp, "raw": raw, "compute": compute}
    if args.get("twins"):
        # A/A controls: each side again, on a model and optimizer of its own in the same
        # processes. Identical work, so their ratio to the original shows what placement alone
        # (where each instance's memory landed) moves a ratio by.
        twin_model = model()
        configs["synctune_twin"] = engine_step(twin_model, StrategyEngine(twin_model, strategy, spec, cluster, sgd))
        twin_ddp = DDP(model(), bucket_cap_mb=args["bucket_mb"], **{switch: buffers_broadcast(world)})
        twin_opt = sgd(twin_ddp.parameters())

        def ddp_twin():
            twin_opt.zero_grad()
            loss_of(twin_ddp).backward()
            twin_opt.step()

        configs["ddp_twin"] = ddp_twin
    if len(cluster.nodes) > 1 and any(n.num_devices > 1 for n in cluster.nodes):
        hps = build_strategy("ps-lb", spec, cluster, local_aggregation=True)
        for key, overlap in (("hps_chained", True), ("hps_blocking", False)):
            module = model()
            configs[key] = engine_step(module, StrategyEngine(module, hps, spec, cluster, sgd, overlap=overlap))
    times: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    faults: dict[str, list[int]] = {k: [] for k in configs}
    for fn in configs.values():
        for _ in range(args["warmup"]):
            fn()
    # Interleaved iteration by iteration: load drift on a shared machine hits every configuration
    # alike. Each iteration runs the configurations in an order drawn afresh (the same seed on every
    # rank): a configuration that ran after the same other one would carry what that one leaves
    # behind (the hierarchical PS's broadcasts still draining, the memory it freed, the caches it
    # filled) into every one of its iterations, and rotating one order does not change who comes
    # before whom.
    rng = random.Random(0)
    for _ in range(args["rounds"] * args["iters"]):
        order = list(configs)
        rng.shuffle(order)
        for key in order:
            fn = configs[key]
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
            faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    gathered = [None] * world
    dist.all_gather_object(gathered, (times, cpu, faults))
    # An iteration ends when the slowest rank is done; the CPU it took is every rank's, all threads.
    slowest = {k: [max(g[0][k][i] for g in gathered) for i in range(len(times[k]))] for k in configs}
    spent = {k: [sum(g[1][k][i] for g in gathered) for i in range(len(cpu[k]))] for k in configs}
    faulted = {k: [sum(g[2][k][i] for g in gathered) for i in range(len(faults[k]))] for k in configs}
    readiness = None
    if "hps_chained" in configs:
        readiness = _readiness(alone_model, alone_opt, loss_of, args["iters"])
    breakdown = {}
    if args.get("breakdown_iters"):
        mine = _profiled(rank, args, device, loss_of, ours_model, engine, ddp_model, ddp_opt)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        breakdown = {k: [it for b in everyone for it in b[k]] for k in mine}
    return {"times": slowest, "cpu": spent, "faults": faulted, "breakdown": breakdown, "readiness": readiness}


def _readiness(module, optimizer, loss_of, iters: int) -> dict:
    """When each gradient is ready in this rank's backward (no synchronization, the compute-alone
    model): ``{"backward_s": median backward time, "params": [(bytes, seconds from ready to the end
    of backward, median), ...]}`` over ``iters`` passes. A gradient ready at the very end leaves
    nothing to overlap its communication with (:func:`readiness_shares`)."""
    import torch

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    stamps: dict[str, float] = {}
    handles = [p.register_post_accumulate_grad_hook(lambda _p, n=n: stamps.__setitem__(n, time.perf_counter()))
               for n, p in params]
    windows: dict[str, list[float]] = {n: [] for n, _ in params}
    spans = []
    try:
        for _ in range(max(iters, 1)):
            optimizer.zero_grad()
            stamps.clear()
            loss = loss_of(module)
            t0 = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            spans.append(end - t0)
            for n, t in stamps.items():
                windows[n].append(end - t)
            optimizer.step()
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        sizes = {n: p.numel() * p.element_size() for n, p in params}
    return {"backward_s": statistics.median(spans),
            "params": [(sizes[n], statistics.median(w)) for n, w in windows.items() if w]}


def readiness_shares(readiness: dict) -> tuple[float, float]:
    """(the share of the gradient bytes ready in the last tenth of backward, the largest single
    gradient's share of the bytes), from :func:`_readiness`. Chained stages gain over blocking
    ones by starting a gradient's cross-node stage while backward still runs and by running
    several gradients' stages at once: the first needs bytes ready early, the second bytes spread
    over several gradients."""
    backward = readiness["backward_s"]
    params = readiness["params"]
    total = sum(b for b, _w in params) or 1
    late = sum(b for b, w in params if w <= 0.1 * backward) / total
    return late, max((b for b, _w in params), default=0) / total


def _profiled(rank: int, args: dict, device, loss_of, module, engine, ddp_model, ddp_opt) -> dict[str, list[dict]]:
    """The engine's and DDP's iterations again, interleaved, under torch.profiler (host activity),
    each phase a range; per side, each profiled iteration's items (:func:`breakdown_of`), the
    first iteration of each side dropped (the profiler's own warm-up). With ``args["trace"]``
    each side's iterations are written as a Chrome trace of this rank."""
    import functools
    import os

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import synctune.engine.core as core

    def settle():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ours():
        with record_function(ITERATION_RANGES["synctune"]):
            with record_function("zero_grad"):
                engine.zero_grad()
            with record_function("forward"):
                loss = loss_of(module)
            with record_function("backward"):
                loss.backward()
            with record_function("step"):
                engine.step()
            settle()

    def ddp():
        with record_function(ITERATION_RANGES["ddp"]):
            with record_function("zero_grad"):
                ddp_opt.zero_grad()
            with record_function("forward"):
                loss = loss_of(ddp_model)
            with record_function("backward"):
                loss.backward()
            with record_function("step"):
                ddp_opt.step()
            settle()

    def ranged(name, fn):
        @functools.wraps(fn)
        def call(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return call

    # DDP's own work before and after the module's forward (the reducer's preparation, the buffer
    # broadcast) has no range of its own: one each, on this instance only, for these iterations.
    # The wrapper's range, DistributedDataParallel.forward, also holds the module's own Python.
    wrapped = ("_pre_forward", "_post_forward", "_sync_buffers")
    for attr in wrapped:
        setattr(ddp_model, attr, ranged(f"ddp.{attr.lstrip('_')}", getattr(ddp_model, attr)))
    core.PROFILE_PHASES = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args["breakdown_iters"] + 1):
                # Which side goes first alternates: neither always runs right after the other.
                for fn in ((ours, ddp) if i % 2 == 0 else (ddp, ours)):
                    dist.barrier()
                    fn()
    finally:
        core.PROFILE_PHASES = False
        for attr in wrapped:
            delattr(ddp_model, attr)
    events = [(e.name, e.thread, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()]
    if args.get("trace"):
        os.makedirs(args["trace"], exist_ok=True)
        whole = os.path.join(args["trace"], f"both-rank{rank}.json")
        prof.export_chrome_trace(whole)
        split_trace(whole, {side: os.path.join(args["trace"], f"{side}-rank{rank}.json") for side in ITERATION_RANGES})
        os.remove(whole)
    return {side: iterations[1:] for side, iterations in breakdown_of(events).items()}


#: The range around each profiled iteration of each side (a key of :func:`breakdown_of`'s result).
ITERATION_RANGES = {"synctune": "synctune iteration", "ddp": "ddp iteration"}

#: The items an iteration's main-thread time is split into (key, label), in the table's order;
#: every microsecond of an iteration goes to exactly one. Below them, not summed (they overlap
#: the items): ``in_flight``, ``exposed`` and ``total``.
BREAKDOWN_ITEMS = (
    ("forward", "forward compute"),
    ("ddp_forward", "DDP forward bookkeeping"),
    ("buffer_broadcast", "buffer broadcast"),
    ("backward", "backward compute"),
    ("hooks", "gradient hooks: dispatch"),
    ("copy_in", "bucket copy in + scale"),
    ("launch", "collective launch (c10d op)"),
    ("wait", "wait for collectives"),
    ("copy_out", "bucket copy out / set grads"),
    ("verdict", "refusal verdict"),
    ("optimizer", "optimizer step"),
    ("step_other", "step: other host work"),
    ("zero_grad", "zero_grad"),
    ("other", "other (loop)"),
)
_INFO_ITEMS = (
    ("in_flight", "all-reduce in flight (gloo thread)"),
    ("exposed", "last hook -> last all-reduce done"),
    ("total", "iteration (profiled)"),
)
_HOOK = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
_NAMED = {"forward": "forward", "backward": "backward", "zero_grad": "zero_grad", "step": "step_other",
          "ddp.pre_forward": "ddp_forward", "ddp.post_forward": "ddp_forward", "ddp.sync_buffers": "buffer_broadcast",
          "synctune.buffer_broadcast": "buffer_broadcast", "synctune.wait": "wait", "synctune.finish": "copy_out",
          "synctune.verdict": "verdict", "torch.distributed.ddp.reducer::copy_bucket_to_grad": "copy_out"}
_COPIES = ("aten::copy_", "aten::mul_", "aten::mul", "aten::div_", "torch::distributed::reducer::mul_out",
           "torch::distributed::reducer::copy_")


def _item(name: str, inherited: str) -> str:
    """The item an event's own time goes to, given the item of the range it runs in."""
    if name in _NAMED:
        return _NAMED[name]
    if name.startswith("Optimizer.step#"):
        return "optimizer"
    if name.startswith("Optimizer.zero_grad#"):
        return "zero_grad"
    if name.startswith(_HOOK):
        return "hooks"
    if inherited in ("hooks", "wait"):  # what a hook (or the engine's wait, for late members) does
        if name.startswith("c10d::"):
            return "launch"
        if name in _COPIES:
            return "copy_in"
    return inherited


def breakdown_of(events: list[tuple[str, int, float, float]]) -> dict[str, list[dict[str, float]]]:
    """Per side of :data:`ITERATION_RANGES`, per profiled iteration, milliseconds per item of
    :data:`BREAKDOWN_ITEMS` (and the informative ``in_flight``, ``exposed``, ``total``).

    ``events``: (name, thread, start µs, end µs) from torch.profiler. On the thread that ran the
    iteration ranges, events nest: each event's own time (its span less its children's) goes to
    the item its name says (:func:`_item`), else to the item of the range it runs in (DDP's
    ``_pre_forward`` and ``_post_forward`` are ranges in these iterations). The backward
    range's own time after the last autograd function is the wait for collectives (DDP waits
    for its buckets inside backward, in the reducer's final callback). ``in_flight`` sums the
    ``gloo:all_reduce`` spans (enqueued to done, on gloo's threads) that start in the
    iteration; ``exposed`` is from the end of the iteration's last gradient hook to the end of
    its last all-reduce."""
    ranges = {name: side for side, name in ITERATION_RANGES.items()}
    roots = sorted((e for e in events if e[0] in ranges), key=lambda e: e[2])
    out: dict[str, list[dict[str, float]]] = {side: [] for side in ITERATION_RANGES}
    if not roots:
        return out
    main = roots[0][1]
    ordered = sorted((e for e in events if e[1] == main), key=lambda e: (e[2], -e[3]))
    others = [e for e in events if e[1] != main and e[0].startswith("gloo:all_reduce")]
    for root in roots:
        _name, _thread, lo, hi = root
        inside = [e for e in ordered if lo <= e[2] and e[3] <= hi and e is not root]
        items = dict.fromkeys([k for k, _ in BREAKDOWN_ITEMS] + [k for k, _ in _INFO_ITEMS], 0.0)
        _attribute(root, inside, items)
        hooks = [e[3] for e in inside if e[0].startswith(_HOOK)]
        flights = [e for e in others if lo <= e[2] <= hi]
        items["in_flight"] = sum(e[3] - e[2] for e in flights)
        if hooks and flights:
            items["exposed"] = max(0.0, max(e[3] for e in flights) - max(hooks))
        items["total"] = hi - lo
        out[ranges[root[0]]].append({k: v / 1e3 for k, v in items.items()})
    return out


def _attribute(root, inside, items: dict[str, float]) -> None:
    """Add each event's own time under ``root`` (``inside``: sorted by start, longest first) to
    ``items``."""
    children: dict[int, list] = {id(root): []}
    item_of = {id(root): "other"}
    passed = {id(root): "other"}  # the item a range's children inherit
    stack = [root]
    for e in inside:
        while len(stack) > 1 and e[2] >= stack[-1][3]:
            stack.pop()
        parent = stack[-1]
        e = (e[0], e[1], e[2], min(e[3], parent[3]))  # clock rounding: never past the parent
        item = _item(e[0], passed[id(parent)])
        item_of[id(e)] = item
        passed[id(e)] = item
        children[id(parent)].append(e)
        children[id(e)] = []
        stack.append(e)
    for node in [root] + [e for kids in children.values() for e in kids]:
        kids = children[id(node)]
        gaps, at = [], node[2]
        for k in kids:
            gaps.append((at, max(at, k[2])))
            at = max(at, k[3])
        gaps.append((at, max(at, node[3])))
        item = item_of[id(node)]
        if node[0] == "backward":
            last = max((k[3] for k in kids if k[0].startswith("autograd::engine::evaluate_function")), default=None)
            for a, b in gaps:
                items["wait" if last is not None and a >= last else "backward"] += b - a
        else:
            items[item] += sum(b - a for a, b in gaps)


def split_trace(path: str, into: dict[str, str]) -> None:
    """Write, per side, the Chrome trace at ``path`` cut to that side's iteration ranges (events
    of every thread that start in one), with the trace's metadata."""
    import json

    with open(path) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    for side, target in into.items():
        windows = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("name") == ITERATION_RANGES[side]]
        kept = [e for e in events if e.get("ph") == "M" or any(a <= e.get("ts", -1) <= b for a, b in windows)]
        with open(target, "w") as f:
            json.dump({**trace, "traceEvents": kept}, f)


def buffers_broadcast(world: int) -> bool:
    """Whether both sides broadcast buffers each iteration: the engine does only across several
    processes, so DDP is configured to match."""
    return world > 1


def measure(model: str, cluster_name: str, *, bucket_mb: float = 25.0, warmup: int = 5, iters: int = 20,
            rounds: int = 3, device: str = "cpu", twins: bool = False) -> dict[str, list[float]]:
    """Per configuration, the per-iteration times (slowest rank) of the interleaved runs, in
    order: ``rounds`` consecutive blocks of ``iters`` (:func:`round_medians`). A lab cluster's
    workers run in the lab's namespaces (the lab must be up with that preset)."""
    return measure_with_breakdown(model, cluster_name, bucket_mb=bucket_mb, warmup=warmup, iters=iters,
                                  rounds=rounds, device=device, twins=twins)[0]


def measure_with_breakdown(model: str, cluster_name: str, *, bucket_mb: float = 25.0, warmup: int = 5,
                           iters: int = 20, rounds: int = 3, device: str = "cpu", breakdown_iters: int = 0,
                           trace: str | None = None, twins: bool = False
                           ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[int]],
                                      dict[str, list[dict]], dict | None]:
    """:func:`measure`'s times; per configuration and iteration, the CPU seconds every rank's
    process spent on it, all threads (its main thread, gloo's, torch's intra-op ones): with more
    processes than cores, what an iteration's wall time follows; the minor page faults of every
    rank's process in it (fresh pages the allocator asked the kernel for: glibc's malloc returns
    the top of its heap to the kernel and hands out large blocks from fresh mappings, and which
    configuration's iterations pay for faulting them back in depends on the heap's layout);
    and, with ``breakdown_iters``,
    that many profiled iterations more of the engine and of DDP on the same processes: per side,
    every rank's iterations' items (:func:`breakdown_of`); ``trace``: a folder for each side's
    Chrome trace per rank; with ``twins``, the A/A controls ``synctune_twin`` and ``ddp_twin`` (each
    side again on an instance of its own); where hierarchical PS runs, when each gradient is ready in rank 0's
    backward (:func:`_readiness`, for :func:`readiness_shares`), else None."""
    from synctune.engine.local import rank_networks, run_local
    from synctune.spec import resolve_cluster
    from synctune.spec.cluster import is_lab_cluster

    cluster = resolve_cluster(cluster_name)
    nets = None
    if is_lab_cluster(cluster):
        from synctune.lab import lab_attach

        nets = rank_networks(cluster, cluster.devices, lab_attach(cluster))
    args = {"model": model, "root": os.getcwd(), "cluster": cluster_name, "bucket_mb": bucket_mb, "warmup": warmup,
            "iters": iters,
            "rounds": rounds, "device": device, "breakdown_iters": breakdown_iters,
            "trace": None if trace is None else os.path.abspath(trace), "twins": twins}
    backend = "gloo"
    if device == "cuda":
        from synctune.engine.trial import GPU_BACKEND

        backend = GPU_BACKEND
    out = run_local(_worker, cluster.num_devices, (args,), timeout_s=3600, nets=nets, backend=backend)[0]
    return out["times"], out["cpu"], out["faults"], out["breakdown"], out["readiness"]


def round_medians(out: dict[str, list[float]], rounds: int) -> dict[str, list[float]]:
    """Per configuration, the median of each round's iterations (what :func:`measure` returned,
    split into ``rounds`` equal consecutive blocks): the per-round figures that pair round by
    round across configurations, as the iterations of one round ran interleaved."""
    out_rounds = {}
    for key, times in out.items():
        if rounds < 1 or len(times) % rounds:
            raise ValueError(f"round_medians: {len(times)} iterations of {key!r} do not split into {rounds} rounds")
        n = len(times) // rounds
        out_rounds[key] = [statistics.median(times[r * n:(r + 1) * n]) for r in range(rounds)]
    return out_rounds


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of the per-iteration ratios a_i / b_i (iterations are interleaved, so pairs share the
    machine's state) with a 95% bootstrap interval of that median."""
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return statistics.median(ratios), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-tiny",
                        help="a zoo model, or a workload: path/to/file.py:factory (e.g. a library model's)")
    parser.add_argument("--cluster", default="local-1x2")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: models on the GPUs (ranks share them round-robin), NCCL for CUDA tensors")
    parser.add_argument("--breakdown", action="store_true",
                        help="after the timing, where each iteration's time goes, engine vs DDP (torch.profiler)")
    parser.add_argument("--breakdown-iters", type=int, default=20,
                        help="profiled iterations of each side for --breakdown")
    parser.add_argument("--twins", action="store_true",
                        help="also time each side again on an instance of its own (A/A controls: what placement "
                             "alone moves a ratio by)")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="with --breakdown: write each side's Chrome trace per rank into DIR")
    args = parser.parse_args()
    if args.trace and not args.breakdown:
        parser.error("--trace needs --breakdown")

    from synctune.spec import resolve_cluster

    world = resolve_cluster(args.cluster).num_devices
    out, cpu, faults, breakdown, readiness = measure_with_breakdown(
        args.model, args.cluster, bucket_mb=args.bucket_mb, warmup=args.warmup, iters=args.iters,
        rounds=args.rounds, device=args.device, breakdown_iters=args.breakdown_iters if args.breakdown else 0,
        trace=args.trace, twins=args.twins)
    import torch

    med = {k: statistics.median(v) for k, v in out.items()}
    device = f"cuda {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu"
    print(f"model {args.model}, cluster {args.cluster} ({world} processes, {device}), torch {torch.__version__}, "
          f"bucket {args.bucket_mb:g} MiB, {args.rounds * args.iters} interleaved iterations of each configuration")
    print(f"buffers broadcast each iteration: {'by both' if buffers_broadcast(world) else 'by neither'}")
    what = "hook overhead, no communication" if world == 1 else "synchronization"
    if world == 1:
        print("world size 1: hook overhead, no communication (nothing crosses a process boundary)")
    print(f"{'configuration':<34}{'median ms':>12}{'mean ms':>12}")
    labels = {"synctune": "(a) synctune all-reduce (horovod)", "ddp": "(b) torch DDP",
              "raw": "(c) raw collectives only", "compute": "(d) compute only (no sync)",
              "hps_chained": "(e) hierarchical PS, chained", "hps_blocking": "(f) hierarchical PS, blocking"}
    for key, label in labels.items():
        if key not in out:
            continue
        print(f"{label:<34}{med[key] * 1e3:>12.3f}{statistics.fmean(out[key]) * 1e3:>12.3f}")
    r, lo, hi = paired_ratio(out["synctune"], out["ddp"])
    print(f"ratio (a)/(b) = {med['synctune'] / med['ddp']:.3f}   paired per iteration {r:.3f} [95% {lo:.3f}, {hi:.3f}]"
          f"   (goal <= 1.00, upper end <= 1.02; {what})")
    if args.twins:
        for twin, key, name in (("synctune_twin", "synctune", "engine"), ("ddp_twin", "ddp", "DDP")):
            r, lo, hi = paired_ratio(out[twin], out[key])
            print(f"A/A control: {name} twin / {name} paired per iteration {r:.3f} [95% {lo:.3f}, {hi:.3f}]   "
                  f"(the same work on another instance)")
    print(f"ratio (a)/(c) = {med['synctune'] / med['raw']:.3f}   ratio (b)/(c) = {med['ddp'] / med['raw']:.3f}")
    print(f"sync overhead over compute: (a) {med['synctune'] - med['compute']:.4f} s, "
          f"(b) {med['ddp'] - med['compute']:.4f} s")
    r, lo, hi = paired_ratio(cpu["synctune"], cpu["ddp"])
    print(f"CPU per iteration, every rank's process, all threads: (a) {statistics.median(cpu['synctune']) * 1e3:.3f} ms, "
          f"(b) {statistics.median(cpu['ddp']) * 1e3:.3f} ms, (d) {statistics.median(cpu['compute']) * 1e3:.3f} ms; "
          f"(a)/(b) paired {r:.3f} [95% {lo:.3f}, {hi:.3f}]   ({os.cpu_count()} CPUs)")
    print(f"minor page faults per iteration, every rank's process (median): (a) {statistics.median(faults['synctune']):g}, "
          f"(b) {statistics.median(faults['ddp']):g}, (d) {statistics.median(faults['compute']):g}")
    if "hps_chained" in med:
        r, lo, hi = paired_ratio(out["hps_chained"], out["hps_blocking"])
        print(f"ratio (e)/(f) = {med['hps_chained'] / med['hps_blocking']:.3f}   paired per iteration {r:.3f} "
              f"[95% {lo:.3f}, {hi:.3f}]   (goal <= 0.95: chained stages overlap backward)")
        r, lo, hi = paired_ratio(out["compute"], out["hps_blocking"])
        print(f"ratio (d)/(f) = {r:.3f} [95% {lo:.3f}, {hi:.3f}] paired: the floor of (e)/(f), chained stages still "
              f"computing everything (the goal is out of reach where it is above 0.95)")
        late, largest = readiness_shares(readiness)
        print(f"gradient bytes ready in the last tenth of backward: {late:.0%}; the largest gradient holds "
              f"{largest:.0%} of them (chained stages need bytes ready early, or spread over several gradients, to gain)")
    if breakdown:
        print()
        print(breakdown_table(breakdown))
        if args.trace:
            print(f"Chrome traces: {args.trace}/synctune-rank<r>.json, {args.trace}/ddp-rank<r>.json")


def breakdown_table(breakdown: dict[str, list[dict[str, float]]]) -> str:
    """The breakdown as a table: per item, the median ms per iteration of the engine and of DDP
    (every rank's profiled iterations pooled), engine minus DDP, and the difference of the means
    (means add up: the items' mean differences sum to the iterations'); then the sum of the item
    medians and the informative rows (not part of the sum)."""
    ours, ddp = breakdown["synctune"], breakdown["ddp"]
    lines = [f"breakdown per iteration, median ms over {len(ours)} engine and {len(ddp)} DDP profiled iterations "
             f"(all ranks), host time under torch.profiler",
             f"{'item':<38}{'engine':>10}{'DDP':>10}{'engine-DDP':>12}{'mean diff':>11}"]

    def row(key, label):
        a = statistics.median(it[key] for it in ours)
        b = statistics.median(it[key] for it in ddp)
        mean = statistics.fmean(it[key] for it in ours) - statistics.fmean(it[key] for it in ddp)
        lines.append(f"{label:<38}{a:>10.3f}{b:>10.3f}{a - b:>+12.3f}{mean:>+11.3f}")
        return a, b

    sums = [0.0, 0.0]
    for key, label in BREAKDOWN_ITEMS:
        a, b = row(key, label)
        sums[0] += a
        sums[1] += b
    lines.append(f"{'sum of the item medians':<38}{sums[0]:>10.3f}{sums[1]:>10.3f}{sums[0] - sums[1]:>+12.3f}")
    lines.append("not in the sum (they overlap the items above):")
    for key, label in _INFO_ITEMS:
        row(key, label)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
