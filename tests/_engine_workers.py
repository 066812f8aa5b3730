"""Worker functions for the engine tests (run inside spawned gloo processes) and the
single-process references they are compared with."""

from __future__ import annotations

import random

import torch

from synctune.models import build_model, make_batch, model_spec
from synctune.spec import ClusterSpec
from synctune.workload.base import Workload
from synctune.strategy import (
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardSynchronizer,
    ShardPlan,
    Strategy,
    VariablePlan,
)


def batches(model: str, split, step: int, seed: int = 0, device="cpu"):
    """The per-rank batches of one step: rank r's batch depends on (seed, step, r) only (drawn on
    the CPU, then moved: the same numbers on any device)."""
    out = []
    for r, n in enumerate(split):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + r)
        out.append(tuple(t.to(device) for t in make_batch(model, n, generator=gen)))
    return out


def _device(case: dict, rank: int) -> torch.device:
    """The case's device for this rank: ``cuda`` shares the GPUs round-robin (two processes may
    share one GPU over gloo)."""
    if case.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def case_model(case: dict, rank: int):
    """A training case's (strategy, cluster, model name, device, freshly built model on it), the
    model seeded with the case's seed as on every rank."""
    strategy = Strategy.from_dict(case["strategy"])
    cluster = ClusterSpec.from_dict(case["cluster"])
    name = strategy.model["name"]
    device = _device(case, rank)
    torch.manual_seed(case.get("seed", 0))
    return strategy, cluster, name, device, build_model(name).to(device)


def make_optimizer(name: str, params, lr: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def reference_training(model: str, split, optimizer: str, lr: float, steps: int, seed: int = 0,
                       fixed_batch: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Single-process training on the concatenation of every rank's batch (``fixed_batch``:
    the step-0 batches every step, a memorisation task); ``dtype`` float64 gives the exact
    training that float32 runs round."""
    torch.manual_seed(seed)
    module = build_model(model).to(dtype)
    opt = make_optimizer(optimizer, module.parameters(), lr)
    for step in range(steps):
        parts = batches(model, split, 0 if fixed_batch else step, seed)
        joined = [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
        joined = [t.to(dtype) if t.is_floating_point() else t for t in joined]
        opt.zero_grad()
        module(*joined).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train every case with the engine (and, when asked, with torch DDP) on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from synctune.engine.core import StrategyEngine

    out = []
    for case in cases:
        strategy, cluster, name, device, module = case_model(case, rank)
        if case.get("channels_last"):
            module = module.to(memory_format=torch.channels_last)  # 4-d weights no longer contiguous
        engine = StrategyEngine(module, strategy, model_spec(name), cluster,
                                lambda ps: make_optimizer(case["optimizer"], ps, case["lr"]))
        for step in range(case["steps"]):
            batch = batches(name, strategy.batch_split, 0 if case.get("fixed_batch") else step,
                            case.get("seed", 0), device)[rank]
            module(*batch).backward()
            engine.step()
            engine.zero_grad()
        engine.close()
        result = {"params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
        if case.get("ddp"):
            torch.manual_seed(case.get("seed", 0))
            plain = build_model(name).to(device)
            ddp = DDP(plain, bucket_cap_mb=case.get("bucket_cap_mb", 25))
            opt = make_optimizer(case["optimizer"], ddp.parameters(), case["lr"])
            for step in range(case["steps"]):
                batch = batches(name, strategy.batch_split, step, case.get("seed", 0), device)[rank]
                opt.zero_grad()
                ddp(*batch).backward()
                opt.step()
            result["ddp"] = {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}
        out.append(result)
    return out


def sfb_strategy(model: str, cluster: ClusterSpec, split: tuple[int, ...]) -> Strategy:
    """The all-reduce builder's strategy of a zoo model with every linear weight moved to
    sufficient-factor broadcasting, on batch split ``split``."""
    import dataclasses

    from synctune.strategy import build_strategy

    spec = model_spec(model)
    linear = {v.name for v, r in zip(spec.variables, spec.factor_rows or ()) if r}
    base = build_strategy("allreduce", spec, cluster)
    plans = tuple(VariablePlan(variable=p.variable, partition=p.partition, shards=(ShardPlan(
        synchronizer=SFBSynchronizer()),)) if p.variable in linear else p for p in base.plans)
    return dataclasses.replace(base, plans=plans, batch_split=split)


def random_strategy(model, cluster: ClusterSpec, rng: random.Random, compressors=("none",),
                    shard: bool = False) -> Strategy:
    """A random valid composed strategy of a zoo model (by name) or a model spec: partitions on
    random axes, mixed PS (with and without local aggregation) / all-reduce groups (odd groups
    hierarchical) / all-gather / sufficient-factor broadcasting of linear weights, uneven batch
    split; with ``shard``, also dense variables in shard units (one shard-group size per unit,
    drawn among the divisors of the replicas that fit the nodes)."""
    spec = model_spec(model) if isinstance(model, str) else model
    devices = cluster.devices
    plans = []
    sizes = [0] + [k for k in range(2, len(devices)) if len(devices) % k == 0
                   and all(n.num_devices % k == 0 for n in cluster.nodes)]
    unit_group: dict[int, int] = {}
    for i, var in enumerate(spec.variables):
        if shard and not var.sparse and var.shape and var.dtype == "float32" and rng.random() < 0.5:
            unit = rng.randint(0, 2)
            group = unit_group.setdefault(unit, rng.choice(sizes))
            plans.append(VariablePlan(variable=var.name, partition=(1,) * len(var.shape), shards=(ShardPlan(
                synchronizer=ShardSynchronizer(unit=unit, group=group)),)))
            continue
        partition = [1] * len(var.shape)
        axes = [a for a, d in enumerate(var.shape) if d > 1 and (a == 0 or not var.sparse)]
        if axes and rng.random() < 0.5:
            axis = rng.choice(axes)
            partition[axis] = rng.randint(2, min(3, var.shape[axis]))
        if spec.factor_rows and spec.factor_rows[i] and rng.random() < 0.4:
            # Sufficient-factor broadcasting for a whole linear weight.
            plans.append(VariablePlan(variable=var.name, partition=(1,) * len(var.shape),
                                      shards=(ShardPlan(synchronizer=SFBSynchronizer()),)))
            continue
        shards = []
        for _ in range(max(1, int(torch.tensor(partition).prod()))):
            roll = rng.random()
            if var.sparse and roll < 0.4:
                sync = AllGatherSynchronizer()
            elif roll < 0.6:
                server = rng.choice(devices)
                local = rng.random() < 0.5
                sync = PSSynchronizer(placement=server, local_aggregation=local and not var.sparse)
            else:
                # Sparse and dense gradients never share a merge group.
                group = rng.randint(0, 2) + (10 if var.sparse else 0)
                sync = AllReduceSynchronizer(group=group, algorithm="hierarchical" if group % 2 else "flat")
            comp = Compressor()
            if (not var.sparse and isinstance(sync, AllReduceSynchronizer) and sync.algorithm == "flat"
                    and "fp16" in compressors):
                comp = Compressor(kind="fp16")
            shards.append(ShardPlan(synchronizer=sync, compressor=comp))
        plans.append(VariablePlan(variable=var.name, partition=tuple(partition), shards=tuple(shards)))
    split = tuple(rng.randint(1, 4) for _ in devices)
    return Strategy(model={"name": spec.name, "hash": spec.hash}, cluster={"name": cluster.name, "hash": cluster.hash},
                    replicas=devices, batch_split=split, plans=tuple(plans))


class Probe(torch.nn.Module):
    """Parameters of given shapes; the loss is sum(p * x_p), so each parameter's gradient on a
    rank is exactly that rank's input x_p (the conformance suite's known gradients)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.names = list(shapes)
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, *xs):
        return sum((getattr(self, n) * x).sum() for n, x in zip(self.names, xs))


def conformance_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case, one SGD step (lr=1, from zero) of the probe with known per-rank gradients:
    the resulting parameters are minus the synchronized mean gradient."""
    from synctune.engine.core import StrategyEngine
    from synctune.spec import ModelSpec, VariableSpec

    out = []
    for case in cases:
        shapes = {k: tuple(v) for k, v in case["shapes"].items()}
        spec = ModelSpec(name="probe", variables=tuple(VariableSpec(name=k, shape=s) for k, s in shapes.items()),
                         batch_size=1)
        strategy = Strategy.from_dict(case["strategy"])
        cluster = ClusterSpec.from_dict(case["cluster"])
        device = _device(case, rank)
        module = Probe(shapes).to(device)
        engine = StrategyEngine(module, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=1.0))
        results = []
        for step, xs in enumerate(case["inputs"][rank]):
            module(*(x.to(device) for x in xs)).backward()
            engine.step()
            engine.zero_grad()
            results.append({k: -v.detach().cpu().clone() for k, v in module.state_dict().items()})
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
        engine.close()
        # Where the parameters (so their gradients) lived: a CUDA run that fell back to the CPU fails.
        out.append({"steps": results, "device": {p.device.type for p in module.parameters()}})
    return out


class LinearProbe(torch.nn.Module):
    """One ``nn.Linear(8, 12)`` called on a batch of vectors and on a batch of 3-token sequences,
    and once more on an output no loss uses; the loss is sum(y * c), so dY is exactly the input
    c and the weight's gradient is cᵀx summed over both calls (sfb's known gradients).
    ``misuse`` also passes the weight to F.linear outside the layer (a part sfb cannot carry)."""

    def __init__(self, misuse: bool = False):
        super().__init__()
        self.fc = torch.nn.Linear(8, 12)
        self.misuse = misuse
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()

    def forward(self, x1, x2, c1, c2):
        self.fc(x1)  # never backpropagated: adds nothing
        loss = (self.fc(x1) * c1).sum() + (self.fc(x2) * c2).sum()
        if self.misuse:
            loss = loss + (torch.nn.functional.linear(x1, self.fc.weight) * c1).sum()
        return loss


def sfb_conformance_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case, steps of SGD (lr=1, from zero) of the linear probe, each step two
    micro-batches, the first inside ``no_sync`` (``retain``: the second backpropagated twice;
    ``discard``: a micro-batch dropped by ``zero_grad`` first; ``misuse`` from step
    ``misuse_from``): the parameters are minus the synchronized gradient. A case whose engine
    refuses returns the message."""
    from synctune.engine.core import StrategyEngine
    from synctune.spec import ModelSpec, VariableSpec

    out = []
    for case in cases:
        spec = ModelSpec(name="linear-probe", batch_size=1, factor_rows=(1, None),
                         variables=(VariableSpec(name="fc.weight", shape=(12, 8)), VariableSpec(name="fc.bias",
                                                                                                shape=(12,))))
        strategy = Strategy.from_dict(case["strategy"])
        module = LinearProbe(case.get("misuse", False))
        engine = StrategyEngine(module, strategy, spec, ClusterSpec.from_dict(case["cluster"]),
                                lambda ps: torch.optim.SGD(ps, lr=1.0))
        results = []
        try:
            for step, micro in enumerate(case["inputs"][rank]):
                module.misuse = step >= case.get("misuse_from", 0) and case.get("misuse", False)
                if case.get("discard"):  # a micro-batch thrown away: its factors must go too
                    with engine.no_sync():
                        module(*micro[1]).backward()
                    engine.zero_grad()
                with engine.no_sync():
                    module(*micro[0]).backward()
                    if case.get("retain"):  # two backward passes through the same outputs
                        loss = module(*micro[1])
                        loss.backward(retain_graph=True)
                if case.get("retain"):
                    loss.backward()
                else:
                    module(*micro[1]).backward()
                engine.step()
                engine.zero_grad()
                results.append({k: -v.detach().clone() for k, v in module.state_dict().items()})
                with torch.no_grad():
                    for p in module.parameters():
                        p.zero_()
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            engine.close()
        out.append({"steps": results})
    return out


def hang_worker(rank: int, world: int, sleep_s: float) -> int:
    """Rank 1 never joins the collective the others wait in (a hung peer)."""
    import time

    import torch.distributed as dist

    if rank == 1:
        time.sleep(sleep_s)
        return rank
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank


def failing_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise MemoryError("simulated allocation failure")
    return rank


class SlowStepWorkload(Workload):
    """cnn-small whose optimizer step sleeps on one rank at given steps (warm-up steps count):
    a delay no other rank waits for inside that iteration (an all-reduce strategy has no
    collective after the update), so only "the slowest rank's time" reports it."""

    def __init__(self, sleepy_rank: int, sleep_steps: tuple[int, ...], sleep_s: float) -> None:
        from synctune.workload import zoo_workload

        self.zoo = zoo_workload("cnn-small")
        self.name, self.batch_size, self.source = "cnn-small", self.zoo.batch_size, "tests:slow-step"
        self.sleepy_rank, self.sleep_steps, self.sleep_s = sleepy_rank, sleep_steps, sleep_s

    def build_model(self):
        return self.zoo.build_model()

    def make_batch(self, batch_size, *, rank, generator, device):
        return self.zoo.make_batch(batch_size, rank=rank, generator=generator, device=device)

    def loss(self, model, batch):
        return model(*batch)

    def spec(self):
        return self.zoo.spec()

    def make_optimizer(self, params, *, name="sgd", lr=0.01):
        import time

        import torch.distributed as dist

        workload = self

        class Sleepy(torch.optim.SGD):
            steps = 0

            def step(self, closure=None):
                out = super().step(closure)
                if dist.get_rank() == workload.sleepy_rank and Sleepy.steps in workload.sleep_steps:
                    time.sleep(workload.sleep_s)
                Sleepy.steps += 1
                return out

        return Sleepy(params, lr=lr)


class HungryWorkload(SlowStepWorkload):
    """cnn-small whose loss allocates (and touches) 8 MB per sample of its batch: a trial's peak
    memory grows with its batch."""

    def __init__(self) -> None:
        super().__init__(-1, (), 0.0)

    def loss(self, model, batch):
        scratch = torch.ones(len(batch[0]) * 2_000_000)
        return model(*batch) + scratch.sum() * 0.0


class SparseProbe(torch.nn.Module):
    """An embedding with sparse gradients; the loss is sum(emb(idx) * x), so a rank's gradient
    is x scattered to the rows idx (repeated rows add up): a known sparse gradient."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, width, sparse=True)
        torch.nn.init.zeros_(self.emb.weight)

    def forward(self, idx, x):
        return (self.emb(idx) * x).sum()


def sparse_conformance_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Like :func:`conformance_worker`, for the sparse synchronizers: per step, the parameters
    after one SGD step (lr=1, from zero) are minus the synchronized mean gradient."""
    from synctune.engine.core import StrategyEngine
    from synctune.spec import ModelSpec

    out = []
    for case in cases:
        spec = ModelSpec.from_dict(case["spec"])
        strategy = Strategy.from_dict(case["strategy"])
        cluster = ClusterSpec.from_dict(case["cluster"])
        rows, width = spec.variables[0].shape
        module = SparseProbe(rows, width)
        engine = StrategyEngine(module, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=1.0))
        results = []
        for idx, x in case["inputs"][rank]:
            module(idx, x).backward()
            engine.step()
            engine.zero_grad()
            results.append(-module.emb.weight.detach().clone())
            with torch.no_grad():
                module.emb.weight.zero_()
        engine.close()
        out.append({"steps": results})
    return out


def ddp_apply_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case trained twice on this rank: with the engine running the strategy, and with plain
    torch DDP configured by ``synctune apply``'s DDP configuration of that strategy; ``settings``
    is the bucket cap, comm hook and bucket view that DDP says it was given."""
    from synctune.engine.core import StrategyEngine
    from synctune.run.apply import wrap_ddp

    out = []
    for case in cases:
        strategy = Strategy.from_dict(case["strategy"])
        cluster = ClusterSpec.from_dict(case["cluster"])
        name = strategy.model["name"]
        states = {}
        for mode in ("engine", "ddp"):
            torch.manual_seed(0)
            module = build_model(name)
            if mode == "engine":
                engine = StrategyEngine(module, strategy, model_spec(name), cluster,
                                        lambda ps: make_optimizer("sgd", ps, case["lr"]))
            else:
                ddp = wrap_ddp(module, case["config"])
                # torch's own record of how it configured this DDP (its usage logging), not ours
                logged = ddp._get_ddp_logging_data()
                states["settings"] = {"bucket_cap_bytes": logged["bucket_cap_bytes"],
                                      "comm_hook": logged.get("comm_hook", ""),
                                      "gradient_as_bucket_view": bool(logged["gradient_as_bucket_view"])}
                opt = make_optimizer("sgd", ddp.parameters(), case["lr"])
            for step in range(case["steps"]):
                batch = batches(name, strategy.batch_split, step)[rank]
                if mode == "engine":
                    module(*batch).backward()
                    engine.step()
                    engine.zero_grad()
                else:
                    opt.zero_grad()
                    ddp(*batch).backward()
                    opt.step()
            states[mode] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out.append(states)
    return out


def cpu_cgroup_of(rank: int, world: int) -> str:
    """The cgroup v1 ``cpu`` controller path of this worker (lab CPU-quota tests)."""
    for line in open("/proc/self/cgroup").read().splitlines():
        _id, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


class _NotLinear(torch.nn.Module):
    """A dense embedding (2-D weight, not a linear layer) and a linear layer tied to it; the
    shared weight is named after whichever registers first (``linear_first``: the linear)."""

    def __init__(self, linear_first: bool):
        super().__init__()
        if linear_first:
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.emb = torch.nn.Embedding(10, 4)
            self.emb.weight = self.out.weight
        else:
            self.emb = torch.nn.Embedding(10, 4)
            self.out = torch.nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(self.emb(idx)).sum()


def sfb_refusal_worker(rank: int, world: int, variable: str) -> str:
    """The engine's message for an sfb plan on ``variable`` of :class:`_NotLinear` (a spec that
    wrongly marks it as a linear weight), or '' when it builds."""
    from synctune.engine.core import StrategyEngine
    from synctune.spec import ModelSpec, VariableSpec, cluster_preset

    cluster = cluster_preset("local-1x1")
    module = _NotLinear(linear_first=variable.startswith("out."))
    spec = ModelSpec(name="not-linear", batch_size=1, factor_rows=(1,),
                     variables=(VariableSpec(name=variable, shape=(10, 4)),))
    from synctune.strategy import SFBSynchronizer as Sfb

    strategy = Strategy.over(spec, cluster, [VariablePlan(variable=variable, partition=(1, 1),
                                                          shards=(ShardPlan(synchronizer=Sfb()),))], batch_split=(1,))
    try:
        StrategyEngine(module, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=1.0))
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {exc}"
    return ""


def backend_worker(rank: int, world: int, device_kind: str) -> dict:
    """The process group as a rank sees it for ``device_kind`` tensors: the configured backend
    string, the backend that really serves that device, and an all-reduce of ``rank + 1`` on a
    tensor of that device (its value and where it stayed)."""
    import torch.distributed as dist

    device = _device({"device": device_kind}, rank)
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    served_by = dist.distributed_c10d._get_default_group()._get_backend(device).name()
    return {"configured": str(dist.get_backend()), "served_by": served_by, "sum": t.cpu().tolist(),
            "device": t.device.type}


def affinity_worker(rank: int, world: int) -> list[int]:
    """The CPUs this worker may run on."""
    import os

    return sorted(os.sched_getaffinity(0))


def environment_worker(rank: int, world: int, name: str) -> dict:
    """This worker's value of the variable ``name`` (None when unset) and its parent's process id."""
    import os

    return {"value": os.environ.get(name), "parent": os.getppid()}


def cpus_worker(rank: int, world: int) -> dict:
    """The CPUs this worker may run on and its parent's process id."""
    import os

    return {"cpus": sorted(os.sched_getaffinity(0)), "parent": os.getppid()}


def run_case_groups(worker, world: int, groups: dict) -> dict:
    """Every group's cases in one start of ``world`` local workers (``worker(cases)`` returns one
    output per case on each rank): {group name: (its cases, per rank the outputs of those cases)}."""
    from synctune.engine.local import run_local

    cases = [c for g in groups.values() for c in g]
    outputs = run_local(worker, world, (cases,), timeout_s=900, threads=1)
    split, start = {}, 0
    for name, group in groups.items():
        split[name] = (group, [out[start:start + len(group)] for out in outputs])
        start += len(group)
    return split
