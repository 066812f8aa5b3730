"""Worker functions for the FSDP2 runtime tests (run inside spawned gloo processes) and the
shard strategies they run."""

from __future__ import annotations

import dataclasses

import torch

from _engine_workers import batches, case_model, make_optimizer
from synctune.models import build_model, model_spec
from synctune.spec import ClusterSpec
from synctune.strategy import ShardPlan, Strategy, VariablePlan, build_strategy
from synctune.strategy.schema import ShardSynchronizer


def block_units(names) -> dict[str, int]:
    """Unit ids of per-block sharding: one unit per child of a ModuleList (``encoder.1.*``, in
    sorted order from 1), every other variable in unit 0."""
    def block(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else ""

    ids = {b: i + 1 for i, b in enumerate(sorted({block(n) for n in names} - {""}))}
    return {n: ids.get(block(n), 0) for n in names}


def shard_strategy(model: str, cluster: ClusterSpec, *, units: dict[str, int] | None = None, split=None,
                   **sync) -> Strategy:
    """The all-reduce builder's strategy of a zoo model with every variable on ``shard``
    (``units``: variable -> unit id, default :func:`block_units`; ``sync`` the other synchronizer
    fields), on ``split``."""
    base = build_strategy("allreduce", model_spec(model), cluster)
    units = units or block_units([p.variable for p in base.plans])
    plans = tuple(VariablePlan(variable=p.variable, partition=p.partition, shards=(
        ShardPlan(synchronizer=ShardSynchronizer(unit=units[p.variable], **sync)),)) for p in base.plans)
    return dataclasses.replace(base, plans=plans, batch_split=tuple(split or base.batch_split))


def full_state(module) -> dict:
    """Every parameter and buffer whole, on the CPU (DTensor shards gathered: every rank takes part)."""
    out = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().cpu().clone()
    return out


def fsdp_train_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train every case with its FSDP2 runtime (``fsdp`` or ``fsdp-plans``) on this rank (its ``prepare``, as a trial does),
    each rank on its own batch of the case's split, ``loss * stepper.loss_scale`` backward as the
    trial's iteration does; returns the whole parameters after the last step."""
    from synctune.engine.runtime import ArmContext
    from synctune.engine.runtimes import as_runtime

    out = []
    for case in cases:
        strategy, cluster, name, device, module = case_model(case, rank)
        runtime = as_runtime(case["runtime"])
        stepper = runtime.prepare(ArmContext(
            rank=rank, model=module, strategy=strategy, spec=model_spec(name), cluster=cluster,
            device=device, seed=0, collective_timeout_s=60.0,
            make_optimizer=lambda ps: make_optimizer(case["optimizer"], ps, case["lr"])))
        for step in range(case["steps"]):
            batch = batches(name, strategy.batch_split, step, device=device)[rank]
            loss = stepper.forward_model(*batch)
            (loss * stepper.loss_scale).backward()
            stepper.step()
        stepper.close()
        out.append({"params": full_state(module),
                    "sharded": sorted(k for k, p in module.named_parameters() if hasattr(p, "full_tensor"))})
    return out


def engine_vs_fsdp_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each shard strategy trained twice on this rank: by the engine (its ``shard`` units) and by
    the fsdp runtime from the same strategy; the whole parameters of both."""
    from synctune.engine.core import StrategyEngine

    fsdp = fsdp_train_cases(rank, world, cases)
    out = []
    for case, by_fsdp in zip(cases, fsdp):
        strategy = Strategy.from_dict(case["strategy"])
        name = strategy.model["name"]
        torch.manual_seed(case.get("seed", 0))
        module = build_model(name)
        engine = StrategyEngine(module, strategy, model_spec(name), ClusterSpec.from_dict(case["cluster"]),
                                lambda ps: make_optimizer(case["optimizer"], ps, case["lr"]))
        for step in range(case["steps"]):
            module(*batches(name, strategy.batch_split, step)[rank]).backward()
            engine.step()
            engine.zero_grad()
        engine.close()
        out.append({"engine": {k: v.detach().clone() for k, v in module.state_dict().items()},
                    "fsdp": by_fsdp["params"]})
    return out


def process_groups_per_pass(rank: int, world: int, cases: list[dict], passes: int) -> list[int]:
    """Run ``cases`` ``passes`` times on this rank, the FSDP2 runtime of cases with a ``runtime``
    and the engine for the others, as a worker runs trial after trial; the number of process
    groups the world holds after each pass."""
    import torch.distributed as dist

    from _engine_workers import train_cases

    counts = []
    for _ in range(passes):
        fsdp_train_cases(rank, world, [c for c in cases if "runtime" in c])
        train_cases(rank, world, [c for c in cases if "runtime" not in c])
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return counts
