"""A plan kind defined outside the package: an all-reduce that also counts its calls.

Everything the layers need of it is here and registered from here (:func:`register`), through
the registries each layer keeps: the strategy layer's synchronizer registry, the engine's units,
the memory model's tally, the simulators' pricing (as an all-reduce), and the search's part (a
column draw that turns a drawn strategy's uncompressed flat dense all-reduce groups into the toy
kind's, and a local-search choice). ``python tests/_toy_kind.py`` runs it through validation,
the columns, the engine (2 processes, against single-process training), the memory model, the
replay and the guided sampler, and prints what it found as JSON:
registering a kind changes the vocabulary saved simulators record, so it is never registered in
the test runner's own process (tests/test_plan_kinds.py runs this file).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from synctune.engine.compress import make_compressor  # noqa: E402
from synctune.engine.kinds import EngineKind, register_engine_kind  # noqa: E402
from synctune.engine.units import AllReduceUnit  # noqa: E402
from synctune.search.draw import edited  # noqa: E402
from synctune.search.kinds import Choice, SearchKind, register_search_kind  # noqa: E402
from synctune.simulator.kinds import MemoryKind, register_memory_kind  # noqa: E402
from synctune.strategy import ShardPlan, VariablePlan  # noqa: E402
from synctune.strategy.errors import StrategyError  # noqa: E402
from synctune.strategy.kinds import (KIND_CODES, SPARSE_GROUP_BASE, SYNCHRONIZERS, Synchronizer,  # noqa: E402
                                     column_row, register_synchronizer, renumber_units)

KIND = "counted-allreduce"


@dataclass(frozen=True, kw_only=True)
class CountedAllReduce(Synchronizer):
    """All-reduce of a merge ``group`` of dense gradients, whose engine unit counts its calls."""

    group: int = 0
    kind: str = KIND
    json_keys: ClassVar[tuple[str, ...]] = ("group",)
    merge_field: ClassVar[str] = "group"
    merge_groups: ClassVar[bool] = True
    priced_as: ClassVar[str] = "allreduce"

    def check(self, ctx) -> None:
        if ctx.variable.sparse:
            raise StrategyError(f"{ctx.where}.synchronizer: {KIND} takes dense gradients only; use allreduce")

    def unit_terms(self, ctx) -> tuple:
        return (ctx.compressor.label,)

    def column_values(self, node_of) -> tuple:
        return column_row(group=self.group)

    @classmethod
    def from_columns(cls, row, servers) -> "CountedAllReduce":
        return cls(group=int(row["group"]))


class CountingUnit(AllReduceUnit):
    """An all-reduce merge group that counts how often its collectives ran."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def pipeline(self):
        self.calls += 1
        yield from super().pipeline()


def _build(ctx, unit, members):
    comp = make_compressor(unit.compressor, counter=ctx.counter)
    return CountingUnit(members, ctx.weight, comp, ctx.device, members[0].view.dtype)


def _count(tally, units, ctx) -> None:
    """Every member's optimizer state on every rank, and the group's bucket (all its members)."""
    for unit in units:
        used = 0
        for member in unit.members:
            var = ctx.model[member.variable]
            item = var.num_bytes // var.num_elements
            for r in range(tally.world):
                tally.own(r, var.num_elements, item)
            used += var.num_bytes
        for r in range(tally.world):
            tally.buffers[r] += used


def _draw(ctx, cols):
    """The sampler's draw of the kind: in a share ``ctx.rate`` of the drawn strategies, every
    dense all-reduce row that is flat and uncompressed (what the toy kind runs) becomes the toy
    kind's, in the same merge group; ids then numbered by first appearance per kind."""
    chosen = ctx.rng.random(cols.size) < ctx.rate
    rows = (chosen[cols.sid] & (cols.kind == KIND_CODES["allreduce"]) & (cols.group < SPARSE_GROUP_BASE)
            & (cols.comp == 0) & ~cols.hier)
    return edited(cols, at=np.flatnonzero(rows), values={"kind": KIND_CODES[KIND]}, renumber=chosen)


def _choices(space, strategy, coordinate):
    """A new toy merge group for a coordinate of dense variables."""
    return [Choice(KIND)] if all(not space.variables[i].sparse for i in coordinate) else []


def _apply(space, strategy, coordinate, choice):
    groups = [sh.synchronizer.group for p in strategy.plans for sh in p.shards if sh.synchronizer.kind == KIND]
    sync = CountedAllReduce(group=1 + max(groups, default=-1))
    plans = list(strategy.plans)
    for i in coordinate:
        var = space.variables[i]
        plans[i] = VariablePlan(variable=var.name, partition=(1,) * len(var.shape),
                                shards=(ShardPlan(synchronizer=sync),))
    return renumber_units(dataclasses.replace(strategy, plans=tuple(plans)))


def register() -> None:
    """Register the kind in every layer's registry (once per process)."""
    if KIND in SYNCHRONIZERS:
        return
    register_synchronizer(CountedAllReduce)
    register_engine_kind(KIND, EngineKind(build=_build))
    register_memory_kind(KIND, MemoryKind(count=_count, reference=True))
    register_search_kind(KIND, SearchKind(choices=_choices, choice_kinds=(KIND,), apply=_apply, draw=_draw))


def counted_strategy(model: str, cluster, groups: int = 2):
    """Every variable of zoo model ``model`` on the toy kind, in ``groups`` merge groups by position."""
    from synctune.models import model_spec
    from synctune.strategy import ShardPlan, Strategy, VariablePlan

    spec = model_spec(model)
    n = len(spec.variables)
    plans = [VariablePlan(variable=v.name, partition=(1,) * len(v.shape),
                          shards=(ShardPlan(synchronizer=CountedAllReduce(group=i * groups // n)),))
             for i, v in enumerate(spec.variables)]
    return Strategy.over(spec, cluster, plans)


def train_worker(rank: int, world: int, case: dict) -> dict:
    """Train the case's strategy with the engine on this rank; the parameters and each toy unit's calls."""
    register()
    from _engine_workers import batches, case_model, make_optimizer
    from synctune.engine.core import StrategyEngine
    from synctune.models import model_spec

    strategy, cluster, name, device, module = case_model(case, rank)
    engine = StrategyEngine(module, strategy, model_spec(name), cluster,
                            lambda ps: make_optimizer(case["optimizer"], ps, case["lr"]))
    for step in range(case["steps"]):
        module(*batches(name, strategy.batch_split, step, 0, device)[rank]).backward()
        engine.step()
        engine.zero_grad()
    calls = [u.calls for u in engine.units if isinstance(u, CountingUnit)]
    engine.close()
    return {"params": {k: v.detach().clone() for k, v in module.state_dict().items()}, "calls": calls}


def main() -> dict:
    register()
    from _engine_workers import reference_training
    from synctune.engine.local import run_local
    from synctune.models import model_spec
    from synctune.simulator import ReplayConstants, ReplaySimulator
    from synctune.simulator.memory import predict_memory
    from synctune.spec import ClusterSpec, ComputeProfile, ModelSpec, VariableSpec, cluster_preset
    from synctune.strategy import ShardPlan, Strategy, StrategyColumns, VariablePlan, validate

    out: dict = {}
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    strategy = counted_strategy("cnn-small", cluster)
    validate(strategy, spec, cluster)
    again = Strategy.from_json(strategy.to_json())
    out["round_trip"] = again.hash == strategy.hash and again.to_dict() == strategy.to_dict()
    out["schema"] = strategy.schema
    out["stats"] = {k: strategy.stats()[k] for k in ("num_shards", "num_merge_groups", "num_allreduce_shards")}
    cols = StrategyColumns.from_strategies(spec, cluster, [strategy])
    out["columns_round_trip"] = cols.strategy(0).hash == strategy.hash
    out["columns_groups"] = cols.ngroups.tolist()

    # Validation: the kind's own check, and its unit's agreement, with messages naming the field.
    ncf = model_spec("ncf-small")
    sparse = counted_strategy("ncf-small", cluster, groups=1)
    try:
        validate(sparse, ncf, cluster)
        out["sparse_refused"] = ""
    except StrategyError as exc:
        out["sparse_refused"] = str(exc)
    data = strategy.to_dict()
    data["plans"][1]["shards"][0]["compressor"] = {"kind": "fp16"}
    try:
        validate(Strategy.from_dict(data), spec, cluster)
        out["lossy_refused"] = ""
    except StrategyError as exc:
        out["lossy_refused"] = str(exc)

    # The engine, 2 gloo processes, against single-process training on the concatenated batch.
    case = {"strategy": strategy.to_dict(), "cluster": cluster.to_dict(), "optimizer": "sgd", "lr": 0.1, "steps": 3}
    results = run_local(train_worker, 2, (case,), timeout_s=600, threads=1)
    exact = reference_training("cnn-small", strategy.batch_split, "sgd", 0.1, 3, dtype=torch.float64)
    ref = reference_training("cnn-small", strategy.batch_split, "sgd", 0.1, 3)
    worst = 0.0
    for k, v in results[0]["params"].items():
        if v.is_floating_point():
            rounding = 2 * (ref[k].double() - exact[k]).abs().max().item()
            worst = max(worst, (v.double() - exact[k]).abs().max().item() - rounding)
    out["engine_excess_error"] = worst
    out["ranks_equal"] = all(torch.equal(results[0]["params"][k], results[1]["params"][k]) for k in results[0]["params"])
    out["calls"] = [r["calls"] for r in results]

    # The memory model: Adam's two moments and a 4-byte step per tensor, the whole bucket.
    total = sum(v.num_bytes for v in spec.variables)
    ranks = predict_memory(strategy, spec, cluster, optimizer_state_multiplier="adam", activation_bytes=0)
    out["memory"] = [r.to_dict() for r in ranks]
    out["memory_expected"] = {"params_bytes": total, "grads_bytes": total, "comm_buffers_bytes": total,
                              "optimizer_state_bytes": 2 * total + 4 * len(spec.variables)}

    # The replay, priced as an all-reduce: one merge group of two variables on two nodes.
    node = {"instance_type": "local-cpu", "device_kind": "cpu", "device_model": "cpu", "num_devices": 1,
            "nic_gbps": 8.0, "single_flow_gbps": 8.0, "intra_node_gbps": 8.0}
    two = ClusterSpec.from_dict({"name": "two-nodes", "nodes": [{"name": "n0", **node}, {"name": "n1", **node}]})
    small = ModelSpec(name="two", batch_size=8, variables=(VariableSpec(name="b", shape=(1000,), dtype="float32"),
                                                           VariableSpec(name="a", shape=(250_000,), dtype="float32")))
    one = Strategy.over(small, two, [VariablePlan(variable=v.name, partition=(1,), shards=(ShardPlan(
        synchronizer=CountedAllReduce(group=0)),)) for v in small.variables])
    validate(one, small, two)
    sim = ReplaySimulator({}, ReplayConstants(alpha_s=1e-4, unit_s=5e-5, iteration_s=5e-4, replay_version=5))
    sim.add_profile(ComputeProfile(model="two", device="cpu", workers=2, batch_size=8, forward_s=0.010,
                                   backward_s=0.021, step_s=0.003, ready_s=(0.002, 0.020)))
    out["replay_s"] = float(sim.predict([one], small, two)[0])
    out["replay_fallbacks"] = len(sim.fallbacks)
    out.update(sampled())
    return out


def sampled() -> dict:
    """The guided sampler draws the kind at the rate it is given (no file of the package names
    it): how many of 80 drawn strategies hold it, whether they validate and come back the same
    through objects and columns, and the local search's toy choice."""
    from synctune.models import model_spec
    from synctune.search import ChoiceSpace, GuidedSampler
    from synctune.spec import cluster_preset
    from synctune.strategy import StrategyColumns, validate

    spec, cluster = model_spec("cnn-small"), cluster_preset("local-2x2")
    cols = GuidedSampler(spec, cluster, seed=0, kind_rates={KIND: 0.5}).sample_columns(80)
    made = [cols.strategy(i) for i in range(cols.size)]
    holding = [s for s in made if any(sh.synchronizer.kind == KIND for p in s.plans for sh in p.shards)]
    for s in made:
        validate(s, spec, cluster)
    back = StrategyColumns.from_strategies(spec, cluster, made)
    plain = GuidedSampler(spec, cluster, seed=0).sample_columns(80)
    space = ChoiceSpace(spec, cluster)
    dp = space.data_parallel()
    toy = [c for c in space.choices(dp, [0, 1]) if c.kind == KIND]
    moved = space.apply(dp, [0, 1], toy[0])
    validate(moved, spec, cluster)
    import hashlib

    same = [b.hash for b in (back.strategy(i) for i in range(back.size))] == [s.hash for s in made]
    return {"sampled_holding": len(holding), "sampled_validated": len(made),
            "sampled_rows": int((cols.kind == KIND_CODES[KIND]).sum()),
            "sampled_round_trip": same and bool((back.digests() == cols.digests()).all()),
            "sampled_canonical": all(renumber_units(s).hash == s.hash for s in made),
            # Without a rate the kind is never drawn, and the stream is the built-in kinds' own.
            "unsampled_rows": int((plain.kind == KIND_CODES[KIND]).sum()),
            "unsampled_digest": hashlib.sha256(plain.digests().tobytes()).hexdigest(),
            "choice_offered": len(toy),
            "choice_kinds": sorted({sh.synchronizer.kind for p in moved.plans[:2] for sh in p.shards})}


if __name__ == "__main__":
    print(json.dumps(main(), default=float))
