"""Conformance of every synchronizer x compressor on known gradients (4 gloo processes; the dense
cases also with CUDA tensors in the gpu tier).

Each rank's gradient of the probe is its own input, so the synchronized gradient must be
their mean. Lossless compressors must give it bit-exactly (inputs are small integers, so
every summation order is exact); lossy ones stay within their declared tolerance; PowerSGD
is exact on gradients of rank <= its rank (a shared column space)."""

from __future__ import annotations

import pytest
import torch

from _engine_workers import conformance_worker, sfb_conformance_worker, sparse_conformance_worker
from synctune.engine.local import run_local
from synctune.spec import ModelSpec, VariableSpec, cluster_preset
from synctune.strategy import (
    COMPRESSORS,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardPlan,
    ShardSynchronizer,
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
    # Both probe variables in one unit: 10 rows of v leave the four ranks 3, 3, 3 and 1 of them.
    "shard": lambda: ShardSynchronizer(unit=0),
    "shard-hsdp": lambda: ShardSynchronizer(unit=0, group=2),
    "shard-bf16": lambda: ShardSynchronizer(unit=0, reduce_dtype="bf16"),
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
    if sync.startswith("shard"):  # shard slices the whole variable itself, with no compressor
        bf16 = sync.endswith("bf16")
        CASES.append((sync, Compressor(), False, "normal" if bf16 else "integer",
                      COMPRESSORS.get("bf16").tolerance if bf16 else 0.0))
        continue
    for partition in (False, True):
        CASES.append((sync, Compressor(), partition, "integer", 0.0))
        for lossy in ("fp16", "bf16"):
            CASES.append((sync, Compressor(kind=lossy), partition, "normal", COMPRESSORS.get(lossy).tolerance))
CASES.append(("allreduce", Compressor(kind="powersgd", rank=2), False, "lowrank", 1e-4))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def results(request):
    """The suite's runs: on the CPU, and (the gpu tier) with every tensor on CUDA, the 4 processes
    sharing the GPUs over gloo (NCCL refuses two ranks on one device; gloo reduces, gathers and
    broadcasts CUDA tensors), so a one-GPU machine runs the same 4-rank suite."""
    steps = 2
    cases = []
    for i, (sync, comp, partition, kind, _tol) in enumerate(CASES):
        cases.append({"shapes": SHAPES, "strategy": _strategy(sync, comp, partition).to_dict(),
                      "cluster": CLUSTER.to_dict(), "inputs": _inputs(kind, steps, seed=i), "device": request.param})
    return cases, run_local(conformance_worker, WORLD, (cases,), timeout_s=600, threads=1)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{s}-{c.label}-{'partitioned' if p else 'whole'}" for s, c, p, _k, _t in CASES])
def test_synchronizer_conformance(index, results):
    cases, outputs = results
    sync, comp, _partition, _kind, tol = CASES[index]
    case = cases[index]
    assert all(out[index]["device"] == {case["device"]} for out in outputs), [out[index]["device"] for out in outputs]
    for step in range(len(case["inputs"][0])):
        for j, name in enumerate(SHAPES):
            exact = torch.stack([case["inputs"][r][step][j].double() for r in range(WORLD)]).mean(0)
            got = [outputs[r][index]["steps"][step][name] for r in range(WORLD)]
            for r in range(1, WORLD):
                assert torch.equal(got[r], got[0]), f"rank {r} holds other values than rank 0"
            if tol == 0.0:
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


# ------------------------------------------------------------------------------- sparse gradients

SPARSE = ModelSpec(name="sparse-probe", variables=(VariableSpec(name="emb.weight", shape=(20, 6), sparse=True),),
                   batch_size=1)
SPARSE_SYNCS = {
    "allgather": lambda i: AllGatherSynchronizer(),
    "ps": lambda i: PSSynchronizer(placement=("node1:0", "node0:1", "node1:1")[i % 3]),
    "allreduce": lambda i: AllReduceSynchronizer(group=0),  # the sparse gradient travels dense
}
SPARSE_CASES = [(sync, shards) for sync in SPARSE_SYNCS for shards in (1, 3)]


def _sparse_strategy(sync: str, shards: int) -> Strategy:
    plan = VariablePlan(variable="emb.weight", partition=(shards, 1),
                        shards=tuple(ShardPlan(synchronizer=SPARSE_SYNCS[sync](i)) for i in range(shards)))
    strategy = Strategy.over(SPARSE, CLUSTER, [plan], batch_split=(1,) * WORLD)
    validate(strategy, SPARSE, CLUSTER)
    return strategy


def _sparse_inputs(steps: int, seed: int):
    """inputs[rank][step] = (row indices with repeats, integer row values): exact in any order."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, 20, (9,), generator=gen), torch.randint(-8, 9, (9, 6), generator=gen).float())
             for _ in range(steps)] for _ in range(WORLD)]


@pytest.fixture(scope="module")
def sparse_results():
    cases = [{"spec": SPARSE.to_dict(), "strategy": _sparse_strategy(sync, shards).to_dict(),
              "cluster": CLUSTER.to_dict(), "inputs": _sparse_inputs(2, seed=100 + i)}
             for i, (sync, shards) in enumerate(SPARSE_CASES)]
    return cases, run_local(sparse_conformance_worker, WORLD, (cases,), timeout_s=600, threads=1)


@pytest.mark.parametrize("index", range(len(SPARSE_CASES)),
                         ids=[f"sparse-{s}-{n}shard" for s, n in SPARSE_CASES])
def test_sparse_synchronizer_conformance(index, sparse_results):
    """All-gather, parameter server and (densified) all-reduce of a sparse gradient, whole and
    cut into uneven row shards placed on different servers: every rank ends bit-exactly at the
    mean of the ranks' scattered gradients."""
    cases, outputs = sparse_results
    case = cases[index]
    for step in range(2):
        exact = torch.zeros(20, 6, dtype=torch.float64)
        for r in range(WORLD):
            idx, x = case["inputs"][r][step]
            exact.index_add_(0, idx, x.double() / WORLD)
        for r in range(WORLD):
            assert torch.equal(outputs[r][index]["steps"][step], exact.float()), f"rank {r}, step {step}"


def test_powersgd_error_feedback_recovers_what_one_round_loses():
    """A constant full-rank gradient, compressed to rank 1 every step: one round loses much of it,
    but error feedback carries what was lost into the next rounds, so the average of the applied
    updates converges to the true mean gradient (it would stay at the rank-1 approximation
    without error feedback)."""
    steps = 160
    gen = torch.Generator().manual_seed(7)
    per_rank = [[torch.randn(SHAPES[name], generator=gen) for name in SHAPES] for _ in range(WORLD)]
    inputs = [[list(per_rank[r]) for _ in range(steps)] for r in range(WORLD)]
    case = {"shapes": SHAPES, "strategy": _strategy("allreduce", Compressor(kind="powersgd", rank=1), False).to_dict(),
            "cluster": CLUSTER.to_dict(), "inputs": inputs}
    outputs = run_local(conformance_worker, WORLD, ([case],), timeout_s=600, threads=1)
    exact = torch.stack([per_rank[r][0].double() for r in range(WORLD)]).mean(0)
    applied = torch.stack([outputs[0][0]["steps"][t]["m"].double() for t in range(steps)])
    for r in range(1, WORLD):
        assert all(torch.equal(outputs[r][0]["steps"][t]["m"], outputs[0][0]["steps"][t]["m"]) for t in range(steps))

    def rel(x):
        return float((x - exact).abs().max() / exact.abs().max())

    assert rel(applied[0]) > 0.3  # one round of rank 1 loses a lot of a full-rank 12x8 gradient
    assert rel(applied[:20].mean(0)) > rel(applied[:80].mean(0)) > rel(applied.mean(0))
    assert rel(applied.mean(0)) < 0.1  # error feedback: the average converges to the truth


# ---------------------------------------------------------------- sufficient-factor broadcasting

SFB_SPLIT = (1, 1, 2, 4)  # batch weights 1/8, 1/8, 2/8, 4/8: exact in binary


def _sfb_strategy() -> Strategy:
    spec = ModelSpec(name="linear-probe", batch_size=1, factor_rows=(1, None),
                     variables=(VariableSpec(name="fc.weight", shape=(12, 8)), VariableSpec(name="fc.bias", shape=(12,))))
    strategy = Strategy(model={"name": spec.name, "hash": spec.hash}, cluster={"name": CLUSTER.name, "hash": CLUSTER.hash},
                        replicas=CLUSTER.devices, batch_split=SFB_SPLIT, plans=(
                            VariablePlan(variable="fc.weight", partition=(1, 1),
                                         shards=(ShardPlan(synchronizer=SFBSynchronizer()),)),
                            VariablePlan(variable="fc.bias", partition=(1,),
                                         shards=(ShardPlan(synchronizer=AllReduceSynchronizer(group=0)),))))
    validate(strategy, spec, CLUSTER)
    return strategy


def _sfb_inputs(steps: int, seed: int):
    """inputs[rank][step] = two micro-batches of (x1, x2, c1, c2), rank r with SFB_SPLIT[r] rows
    (uneven: the gathered factors are padded), small integers (every sum is exact)."""
    gen = torch.Generator().manual_seed(seed)

    def ints(*shape):
        return torch.randint(-3, 4, shape, generator=gen).float()

    return [[[(ints(n, 8), ints(n, 3, 8), ints(n, 12), ints(n, 3, 12)) for _micro in range(2)] for _ in range(steps)]
            for n in SFB_SPLIT]


SFB_MODES = ("plain", "retain", "discard")
SFB_MISUSES = (0, 1)


@pytest.fixture(scope="module")
def sfb_results():
    """The SFB cases of the tests below, every mode and then every misuse, in one start of the 4
    workers (each case builds its own engine, one after another on every rank; the refusals
    last): ``{case name: (case, every rank's output of it)}``."""
    named = [(mode, {"strategy": _sfb_strategy().to_dict(), "cluster": CLUSTER.to_dict(),
                     "inputs": _sfb_inputs(steps=2, seed=7), "retain": mode == "retain",
                     "discard": mode == "discard"}) for mode in SFB_MODES]
    named += [(f"misuse-{m}", {"strategy": _sfb_strategy().to_dict(), "cluster": CLUSTER.to_dict(),
                               "inputs": _sfb_inputs(2, 3), "misuse": True, "misuse_from": m}) for m in SFB_MISUSES]
    outputs = run_local(sfb_conformance_worker, WORLD, ([case for _n, case in named],), timeout_s=600, threads=1)
    return {n: (case, [[out[i]] for out in outputs]) for i, (n, case) in enumerate(named)}


@pytest.mark.parametrize("mode", SFB_MODES)
def test_sfb_conformance(mode, sfb_results):
    """SFB gives the weight's gradient sum_r w_r sum(dY_r^T X_r) bit-exactly on every rank, with an
    uneven split (padded factors), a 3-D input, a layer called twice, a call no loss uses, and
    gradient accumulation under no_sync; ``retain``: the last micro-batch backpropagated twice
    (its dY counts twice); ``discard``: a micro-batch dropped by zero_grad first (its factors go
    too). The reference is worked out here from the inputs."""
    case, outputs = sfb_results[mode]
    inputs = case["inputs"]
    weights = [n / sum(SFB_SPLIT) for n in SFB_SPLIT]
    for step in range(2):
        w_ref = torch.zeros(12, 8, dtype=torch.float64)
        b_ref = torch.zeros(12, dtype=torch.float64)
        for r in range(WORLD):
            for k, (x1, x2, c1, c2) in enumerate(inputs[r][step]):
                times = 2 if (mode == "retain" and k == 1) else 1
                x = torch.cat([x1, x2.reshape(-1, 8)]).double()
                c = torch.cat([c1, c2.reshape(-1, 12)]).double()
                w_ref += times * weights[r] * c.t() @ x
                b_ref += times * weights[r] * c.sum(0)
        for r in range(WORLD):
            got = outputs[r][0]["steps"][step]
            assert torch.equal(got["fc.weight"], w_ref.float()), f"rank {r}, step {step}: sfb weight gradient"
            assert torch.equal(got["fc.bias"], b_ref.float()), f"rank {r}, step {step}: bias gradient"
    assert outputs[0][0]["steps"][0]["fc.weight"].abs().sum() > 0


@pytest.mark.parametrize("misuse_from", SFB_MISUSES)
def test_sfb_refuses_a_weight_used_outside_its_layer(misuse_from, sfb_results):
    """A weight also passed to F.linear has a gradient part the factors do not carry: the step it
    starts (the first, or a later one) refuses on every rank together, naming the variable and the
    fix, instead of training on a wrong gradient."""
    _case, outputs = sfb_results[f"misuse-{misuse_from}"]
    for r in range(WORLD):
        error = outputs[r][0].get("error", "")
        assert "SynchronizationError" in error and "'fc.weight'" in error and "use allreduce or ps" in error, error
