"""Conformance of every synchronizer x compressor on known gradients (4 gloo processes).

Each rank's gradient of the probe is its own input, so the synchronized gradient must be
their mean. Lossless compressors must give it bit-exactly (inputs are small integers, so
every summation order is exact); lossy ones stay within their declared tolerance; PowerSGD
is exact on gradients of rank <= its rank (a shared column space)."""

from __future__ import annotations

import pytest
import torch

from _engine_workers import conformance_worker
from synctune.engine.local import run_local
from synctune.spec import ModelSpec, VariableSpec, cluster_preset
from synctune.strategy import (
    COMPRESSORS,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    ShardPlan,
    Strategy,
    VariablePlan,
    validate,
)

CLUSTER = cluster_preset("local-2x2")
WORLD = CLUSTER.num_devices
SHAPES = {"m": (12, 8), "v": (10,)}
SYNCS = {
    "allreduce": lambda: AllReduceSynchronizer(group=0),
    "ps": lambda: PSSynchronizer(placement="node1:0"),
    "ps-local": lambda: PSSynchronizer(placement="node1:1", local_aggregation=True),
}


def _strategy(sync: str, compressor: Compressor, partition: bool) -> Strategy:
    spec = ModelSpec(name="probe", variables=tuple(VariableSpec(name=k, shape=s) for k, s in SHAPES.items()),
                     batch_size=1)
    plans = []
    for name, shape in SHAPES.items():
        parts = (3,) + (1,) * (len(shape) - 1) if partition else (1,) * len(shape)
        comp = compressor if (compressor.kind != "powersgd" or len(shape) == 2) else Compressor()
        group_shift = 0 if comp == compressor else 1
        shards = []
        for _ in range(parts[0]):
            s = SYNCS[sync]()
            if isinstance(s, AllReduceSynchronizer):
                s = AllReduceSynchronizer(group=group_shift)
            shards.append(ShardPlan(synchronizer=s, compressor=comp))
        plans.append(VariablePlan(variable=name, partition=parts, shards=tuple(shards)))
    strategy = Strategy(model={"name": spec.name, "hash": spec.hash}, cluster={"name": CLUSTER.name, "hash": CLUSTER.hash},
                        replicas=CLUSTER.devices, batch_split=(1,) * WORLD, plans=tuple(plans))
    validate(strategy, spec, CLUSTER)
    return strategy


def _inputs(kind: str, steps: int, seed: int) -> list[list[list[torch.Tensor]]]:
    """inputs[rank][step] = one tensor per probe parameter."""
    gen = torch.Generator().manual_seed(seed)
    out = [[[] for _ in range(steps)] for _ in range(WORLD)]
    basis = torch.randn(SHAPES["m"][0], 2, generator=gen)  # shared column space for PowerSGD
    for r in range(WORLD):
        for step in range(steps):
            for name, shape in SHAPES.items():
                if kind == "integer":
                    x = torch.randint(-8, 9, shape, generator=gen).float()
                elif kind == "lowrank" and name == "m":
                    x = basis @ torch.randn(2, shape[1], generator=gen)
                else:
                    x = torch.randn(shape, generator=gen)
                out[r][step].append(x)
    return out


CASES = []
for sync in SYNCS:
    for partition in (False, True):
        CASES.append((sync, Compressor(), partition, "integer", 0.0))
        for lossy in ("fp16", "bf16"):
            CASES.append((sync, Compressor(kind=lossy), partition, "normal", COMPRESSORS.get(lossy).tolerance))
CASES.append(("allreduce", Compressor(kind="powersgd", rank=2), False, "lowrank", 1e-4))


@pytest.fixture(scope="module")
def results():
    steps = 2
    cases = []
    for i, (sync, comp, partition, kind, _tol) in enumerate(CASES):
        cases.append({"shapes": SHAPES, "strategy": _strategy(sync, comp, partition).to_dict(),
                      "cluster": CLUSTER.to_dict(), "inputs": _inputs(kind, steps, seed=i)})
    return cases, run_local(conformance_worker, WORLD, (cases,), timeout_s=600, threads=1)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{s}-{c.label}-{'partitioned' if p else 'whole'}" for s, c, p, _k, _t in CASES])
def test_synchronizer_conformance(index, results):
    cases, outputs = results
    sync, comp, _partition, _kind, tol = CASES[index]
    case = cases[index]
    for step in range(len(case["inputs"][0])):
        for j, name in enumerate(SHAPES):
            exact = torch.stack([case["inputs"][r][step][j].double() for r in range(WORLD)]).mean(0)
            got = [outputs[r][index]["steps"][step][name] for r in range(WORLD)]
            for r in range(1, WORLD):
                assert torch.equal(got[r], got[0]), f"rank {r} holds other values than rank 0"
            if comp.lossless:
                assert torch.equal(got[0], exact.float()), f"{name}: lossless {sync} is not bit-exact"
            elif step == 0 or comp.kind != "powersgd":
                err = (got[0].double() - exact).abs().max() / exact.abs().max()
                assert err <= tol, f"{name}: relative error {err:.2e} above the declared {tol:.0e}"


def test_lossy_compressors_are_lossy_for_real(results):
    """The fp16 path must actually round: some fp32 values do not survive it unchanged."""
    cases, outputs = results
    index = next(i for i, c in enumerate(CASES) if c[0] == "allreduce" and c[1].kind == "fp16" and not c[2])
    exact = torch.stack([cases[index]["inputs"][r][0][0].double() for r in range(WORLD)]).mean(0).float()
    assert not torch.equal(outputs[0][index]["steps"][0]["m"], exact)
