"""A plan kind with cost terms of its own, defined outside the package: a tree all-reduce.

Its merge group is reduced up a binomial tree and broadcast back down, 2·ceil(log2 N) steps each
sending the whole message, where the ring all-reduce sends 2(N-1)/N of it. It is not priced as
another kind (its ``priced_as`` is None): it registers its own analytic and feature terms
(:data:`synctune.simulator.kinds.FEATURE_KINDS`) and replay terms
(:data:`synctune.simulator.kinds.REPLAY_KINDS`), and the simulators run it through them. ``python
tests/_own_terms_kind.py`` prints as JSON what the replay, the analytic model and the features made
of a strategy of it, and what the simulators say of a kind registered without terms; it registers
kinds, so it runs in a process of its own (tests/test_kind_terms.py runs this file).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synctune.simulator.kinds import (FeatureKind, MemoryKind, ReplayKind, register_feature_kind,  # noqa: E402
                                      register_memory_kind, register_replay_kind)
from synctune.strategy.errors import StrategyError  # noqa: E402
from synctune.strategy.kinds import Synchronizer, column_row, register_synchronizer  # noqa: E402

KIND = "tree-allreduce"


@dataclass(frozen=True, kw_only=True)
class TreeAllReduce(Synchronizer):
    """All-reduce of a merge ``group`` of dense gradients up and down a binomial tree."""

    group: int = 0
    kind: str = KIND
    json_keys: ClassVar[tuple[str, ...]] = ("group",)
    merge_field: ClassVar[str] = "group"
    merge_groups: ClassVar[bool] = True

    def check(self, ctx) -> None:
        if ctx.variable.sparse:
            raise StrategyError(f"{ctx.where}.synchronizer: {KIND} takes dense gradients only")

    def column_values(self, node_of) -> tuple:
        return column_row(group=self.group)

    @classmethod
    def from_columns(cls, row, servers) -> "TreeAllReduce":
        return cls(group=int(row["group"]))


def _steps(nn):
    """Steps up and down a binomial tree of ``nn`` replicas: 2 ceil(log2 N)."""
    return 2 * np.ceil(np.log2(np.maximum(nn, 1)))


def _collective(nn, ring, c):
    """Each step sends the whole message; a kernel latency per shard."""
    return _steps(nn) / ring, c.delta


def _predefined(f, rows) -> None:
    """The shard's bytes sent at every step, as the ring all-reduce's transfer feature."""
    sid = f.b.sid[rows]
    f.out[rows, f.col["ar_transfer"]] = _steps(f.t["N"][sid]) * f.wire[rows] / f.t["ring_bw"][sid]


def _durations(rb, rows, units, state) -> None:
    """Each step pays alpha and sends the group's bytes over the ring's slowest flow."""
    tree = units[rb.unn[units] > 1]
    rb.dur[tree] = _steps(rb.unn[tree]) * (rb.alpha + rb.ubytes[tree] / rb.ring[tree])


def _count(tally, units, ctx) -> None:
    """Every member's optimizer state on every rank, and the group's bucket."""
    for unit in units:
        for member in unit.members:
            ctx.everyone_owns(tally, member)
        used = sum(math.prod(ctx.shard_shape(m)) * ctx.item(m) for m in unit.members)
        for r in range(tally.world):
            tally.buffers[r] += used


@dataclass(frozen=True, kw_only=True)
class Unpriced(Synchronizer):
    """A kind that registers no cost terms and names no kind to be priced as."""

    kind: str = "unpriced"


def main() -> dict:
    from test_replay import _cluster, _model, _replay  # the replay's case worked by hand

    from synctune.simulator.features import DomainContext, analytic_time, encode, per_shard_inputs, shard_features
    from synctune.spec import SpecError
    from synctune.strategy import ShardPlan, Strategy, VariablePlan, validate

    register_synchronizer(TreeAllReduce)
    register_memory_kind(KIND, MemoryKind(count=_count, reference=True))
    register_feature_kind(KIND, FeatureKind(one_hot="is_ar", family="ar", collective=_collective,
                                            predefined=_predefined))
    register_replay_kind(KIND, ReplayKind(densifies=True, step_cost="ar_unit_s", counted_as="ar",
                                          durations=_durations))
    out: dict = {}
    # Two nodes of one device each, 8 Gbit/s links (1e9 bytes/s); one merge group of two variables.
    small, two = _model(), _cluster()
    one = Strategy.over(small, two, [VariablePlan(variable=v.name, partition=(1,), shards=(ShardPlan(
        synchronizer=TreeAllReduce(group=0)),)) for v in small.variables])
    validate(one, small, two)
    (replayed,), sim = _replay(small, two, [one])
    out["replay_s"] = float(replayed)
    ctx = DomainContext(small, two)
    batch = encode([one], ctx)
    out["analytic_s"] = float(analytic_time(batch, ctx)[0])
    out["t_comp"] = float(ctx.t_comp)
    pre, _wire = shard_features(batch, ctx)
    out["ar_transfer"] = pre[:, 4].tolist()
    x, _g = per_shard_inputs(batch, ctx)
    out["is_ar"] = x[:, 1].tolist()

    # A kind with no terms of its own and no priced_as: the simulators refuse its rows, naming
    # the registry.
    register_synchronizer(Unpriced)
    data = one.to_dict()
    data["plans"][0]["shards"][0]["synchronizer"] = {"kind": "unpriced"}
    unpriced = Strategy.from_dict(data)
    for name, score in (("replay", lambda: sim.predict([unpriced], small, two)),
                        ("analytic", lambda: analytic_time(encode([unpriced], ctx), ctx))):
        try:
            score()
            out[f"unpriced_{name}"] = ""
        except SpecError as exc:
            out[f"unpriced_{name}"] = str(exc)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
