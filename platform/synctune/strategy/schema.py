"""The strategy representation of AutoDist §2.2, as plain data.

Graph level: which devices hold a replica and the per-replica batch. Variable level: one
:class:`VariablePlan` per variable: a partition (shards per axis, AutoDist's vector p_i) and,
per shard, a synchronizer (``ps``: reduce to a placement, update there, broadcast back;
``allreduce``: merged by group id; ``allgather``: sparse gradients; ``sfb``: sufficient factors;
``shard``: ZeRO / FSDP, reduce-scatter, sliced update, all-gather) wrapped by a compressor.

Structure is checked here, on construction (types, known kinds); consistency with a model and
a cluster is :func:`synctune.strategy.validate`'s job.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..spec.checks import LIMITS, canonical_json, check_keys, in_range, is_int, sha256_hex, shown
from ..spec.files import parse_json, read_text
from .checkpoint import checkpoint_from_data, checkpoint_label
from .tensor_parallel import TensorParallel, tensor_parallel_from_data, tp_label
from .compressors import COMPRESSORS, CompressorInfo
from .errors import StrategyError, req as _req
from .kinds import (ALLREDUCE_ALGORITHMS, MAX_PREFETCH, REDUCE_DTYPES, SPARSE_GROUP_BASE, SYNCHRONIZER_KINDS,
                    SYNCHRONIZERS, AllGatherSynchronizer, AllReduceSynchronizer, PSSynchronizer, SFBSynchronizer,
                    ShardSynchronizer, Synchronizer, synchronizer_from_dict, synchronizer_from_schema_1)

__all__ = [
    "SCHEMA_VERSION",
    "SPARSE_GROUP_BASE",
    "StrategyError",
    "CompressorInfo",
    "COMPRESSORS",
    "ALLREDUCE_ALGORITHMS",
    "Compressor",
    "PSSynchronizer",
    "AllReduceSynchronizer",
    "AllGatherSynchronizer",
    "SFBSynchronizer",
    "ShardSynchronizer",
    "MAX_PREFETCH",
    "REDUCE_DTYPES",
    "Synchronizer",
    "SYNCHRONIZER_KINDS",
    "ShardPlan",
    "VariablePlan",
    "Strategy",
    "load_strategy",
]

#: Version of the strategy JSON schema; bump on any incompatible change. Schema 3 added the
#: ``shard`` synchronizer, schema 4 activation checkpointing (``checkpoint``), schema 5 tensor
#: parallelism (``tensor_parallel``); schema 1 and 2 files are read and migrated. A strategy is
#: written in the oldest schema that holds it (:attr:`Strategy.schema`): one without ``shard``
#: plans, checkpointing or tensor parallelism stays schema 2, so its canonical form, and the hash
#: of every dataset row measured before, are unchanged, and only a sharded strategy needs a
#: synctune that reads schema 3, a checkpointed one schema 4, a tensor-parallel one schema 5.
SCHEMA_VERSION = 5
#: The schema that added ``checkpoint``.
_SCHEMA_CHECKPOINT = 4
#: The schema that added ``tensor_parallel``.
_SCHEMA_TP = 5
#: The schema of strategies without ``shard`` plans.
_SCHEMA_UNSHARDED = 2


def _check_keys(data: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    return check_keys(data, where, required, optional, StrategyError)


@dataclass(frozen=True, kw_only=True)
class Compressor:
    """How a gradient message is encoded for the wire (AutoDist §2.2 "message encoding")."""

    kind: str = "none"
    rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in COMPRESSORS:
            raise StrategyError(f"unknown compressor {str(self.kind)[:40]!r}; valid: {', '.join(COMPRESSORS)}")
        if "rank" in self.info.params:
            _req(in_range(self.rank, 1, 1 << 20), f"compressor {self.kind}: rank", "a positive integer", self.rank)
        elif self.rank is not None:
            takes = [n for n, i in COMPRESSORS.items() if "rank" in i.params]
            _req(False, f"compressor {self.kind}: rank", f"no rank (only {', '.join(takes)} takes one)", self.rank)

    @property
    def info(self) -> CompressorInfo:
        """The registry entry of this compressor."""
        return COMPRESSORS.get(self.kind)

    @property
    def lossless(self) -> bool:
        """Whether decoding gives back exactly what was encoded."""
        return self.info.lossless

    @property
    def label(self) -> str:
        """Short text form, e.g. ``powersgd(4)``."""
        return f"{self.kind}({self.rank})" if self.rank is not None else self.kind

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``kind``, and ``rank`` for a compressor that takes one."""
        return {"kind": self.kind, "rank": self.rank} if self.rank is not None else {"kind": self.kind}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Compressor":
        """Inverse of :meth:`to_dict`; errors name ``where`` and the key."""
        d = _check_keys(data, where, ("kind",), ("rank",))
        try:
            return cls(kind=d["kind"], rank=d.get("rank"))
        except StrategyError as exc:
            raise StrategyError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class ShardPlan:
    """How one shard (or the whole unpartitioned variable) is synchronized and encoded."""

    synchronizer: Synchronizer
    compressor: Compressor = Compressor()

    def __post_init__(self) -> None:
        _req(SYNCHRONIZERS.holds(self.synchronizer), "shard: synchronizer", f"a {', '.join(SYNCHRONIZERS)} synchronizer", self.synchronizer)
        _req(isinstance(self.compressor, Compressor), "shard: compressor", "a Compressor", self.compressor)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: the synchronizer's and the compressor's."""
        return {"synchronizer": self.synchronizer.to_dict(), "compressor": self.compressor.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "ShardPlan":
        """Inverse of :meth:`to_dict` (a missing compressor is ``none``); errors name ``where``."""
        d = _check_keys(data, where, ("synchronizer",), ("compressor",))
        comp = Compressor.from_dict(d["compressor"], f"{where}.compressor") if "compressor" in d else Compressor()
        return cls(synchronizer=synchronizer_from_dict(d["synchronizer"], f"{where}.synchronizer"), compressor=comp)


@dataclass(frozen=True, kw_only=True)
class VariablePlan:
    """The node config of one variable: its partition (shards per axis) and one plan per shard.

    Shards are numbered in row-major order over the partition grid; along an axis of length
    n cut into k pieces the first ``n % k`` pieces are one longer (``torch.tensor_split``).
    """

    variable: str
    partition: tuple[int, ...]
    shards: tuple[ShardPlan, ...]

    def __post_init__(self) -> None:
        _req(isinstance(self.variable, str) and 0 < len(self.variable) <= 1024, "plan: variable",
             "a variable name (at most 1024 characters)", self.variable)
        where = f"variable {shown(self.variable)}"
        if isinstance(self.partition, list):
            object.__setattr__(self, "partition", tuple(self.partition))
        if isinstance(self.shards, list):
            object.__setattr__(self, "shards", tuple(self.shards))
        _req(isinstance(self.partition, tuple) and len(self.partition) <= 32
             and all(in_range(p, 1, LIMITS["shards"]) for p in self.partition),
             f"{where}: partition", "a list of positive integers (shards per axis)", self.partition)
        _req(self.num_shards <= LIMITS["shards"], f"{where}: partition",
             f"at most {LIMITS['shards']} shards in all", list(self.partition))
        _req(len(self.shards) == self.num_shards, f"{where}: shards",
             f"{self.num_shards} shard plan(s) (product of partition {list(self.partition)})", len(self.shards))

    @property
    def num_shards(self) -> int:
        """Product of the partition vector."""
        return math.prod(self.partition)

    @property
    def is_partitioned(self) -> bool:
        """Whether the variable is cut into more than one shard."""
        return self.num_shards > 1

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: variable, partition and one shard plan per shard."""
        return {"variable": self.variable, "partition": list(self.partition),
                "shards": [s.to_dict() for s in self.shards]}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "VariablePlan":
        """Inverse of :meth:`to_dict`; errors name ``where``, the variable and the field."""
        d = _check_keys(data, where, ("variable", "partition", "shards"))
        name = d["variable"]
        where = f"{where} (variable {shown(name)})"
        _req(isinstance(d["partition"], list), f"{where}: partition", "a list of positive integers", d["partition"])
        _req(isinstance(d["shards"], list), f"{where}: shards", "a list of shard plans", d["shards"])
        shards = tuple(ShardPlan.from_dict(s, f"{where}: shards[{i}]") for i, s in enumerate(d["shards"]))
        try:
            return cls(variable=name, partition=tuple(d["partition"]), shards=shards)
        except StrategyError as exc:
            raise StrategyError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A complete synchronization strategy for one (model, cluster) domain.

    ``model`` and ``cluster`` are references ``{"name", "hash"}`` to the specs it was built
    for; ``replicas`` are device ids; ``batch_split[i]`` is the batch of ``replicas[i]``;
    ``plans`` hold one :class:`VariablePlan` per model variable, in backward order;
    ``checkpoint``: the modules that recompute their forward in backward, as sorted
    ``(module, mode)`` pairs (:mod:`synctune.strategy.checkpoint`; a module not named saves its
    activations); ``tensor_parallel``: the linear layers split across TP groups and how
    (:mod:`synctune.strategy.tensor_parallel`; None: every replica computes every layer whole).
    """

    model: Mapping[str, str]
    cluster: Mapping[str, str]
    replicas: tuple[str, ...]
    batch_split: tuple[int, ...]
    plans: tuple[VariablePlan, ...]
    #: Given only by readers of older files; the written schema is always :attr:`schema`.
    schema: int | None = None
    checkpoint: tuple[tuple[str, str], ...] = ()
    tensor_parallel: TensorParallel | None = None

    def __post_init__(self) -> None:
        for key in ("replicas", "batch_split", "plans"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.checkpoint:
            object.__setattr__(self, "checkpoint", checkpoint_from_data(self.checkpoint))
        _req(self.schema is None or (is_int(self.schema) and 1 <= self.schema <= SCHEMA_VERSION), "strategy: schema",
             f"1..{SCHEMA_VERSION}", self.schema)
        object.__setattr__(self, "schema", max((s.synchronizer.min_schema for p in self.plans if isinstance(
            p, VariablePlan) for s in p.shards), default=_SCHEMA_UNSHARDED))
        if self.tensor_parallel is not None:
            object.__setattr__(self, "tensor_parallel", tensor_parallel_from_data(self.tensor_parallel))
        if self.checkpoint:
            object.__setattr__(self, "schema", _SCHEMA_CHECKPOINT)
        if self.tensor_parallel is not None:
            object.__setattr__(self, "schema", _SCHEMA_TP)
        for key in ("model", "cluster"):
            ref = getattr(self, key)
            _req(isinstance(ref, Mapping) and set(ref) == {"name", "hash"} and all(isinstance(v, str) for v in ref.values()),
                 f"strategy: {key}", "{name, hash} strings", ref)
        _req(len(self.replicas) <= LIMITS["devices"] and all(isinstance(r, str) for r in self.replicas),
             "strategy: replicas", f"a list of at most {LIMITS['devices']} device ids", self.replicas)
        _req(all(is_int(b) and b <= LIMITS["batch"] for b in self.batch_split), "strategy: batch_split",
             f"a list of integers (batch sizes up to {LIMITS['batch']})", self.batch_split)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form; ``json.dumps(sort_keys=True)`` of it is the canonical form."""
        return {
            "schema": self.schema,
            "model": dict(self.model),
            "cluster": dict(self.cluster),
            "replicas": list(self.replicas),
            "batch_split": list(self.batch_split),
            "plans": [p.to_dict() for p in self.plans],
            **({"checkpoint": dict(self.checkpoint)} if self.checkpoint else {}),
            **({"tensor_parallel": self.tensor_parallel.to_dict()} if self.tensor_parallel is not None else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text with sorted keys (indented for people; ``indent=None`` gives the canonical form)."""
        if indent is None:
            return canonical_json(self.to_dict())
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_dict(cls, data: Any, where: str = "strategy") -> "Strategy":
        """Parse plain data; errors name the plan, variable and field."""
        d = _check_keys(data, where, ("schema", "model", "cluster", "replicas", "batch_split", "plans"),
                        ("checkpoint", "tensor_parallel"))
        if d["schema"] == 1 and not isinstance(d["schema"], bool):
            d = _migrate_schema_1(d)
        _req(d["schema"] in (_SCHEMA_UNSHARDED, 3, _SCHEMA_CHECKPOINT, SCHEMA_VERSION)
             and not isinstance(d["schema"], bool),
             f"{where}: schema", f"{SCHEMA_VERSION} (this synctune's strategy schema; 1 to 4 are read and migrated)",
             d["schema"])
        checkpoint = checkpoint_from_data(d.get("checkpoint") or {}, where)
        _req(not checkpoint or d["schema"] >= _SCHEMA_CHECKPOINT, f"{where}: schema",
             f"{_SCHEMA_CHECKPOINT} (the strategy checkpoints modules, new in schema {_SCHEMA_CHECKPOINT})", d["schema"])
        tp = d.get("tensor_parallel")
        tp = None if tp is None else tensor_parallel_from_data(tp, where)
        _req(tp is None or d["schema"] >= _SCHEMA_TP, f"{where}: schema",
             f"{_SCHEMA_TP} (the strategy splits modules with tensor_parallel, new in schema {_SCHEMA_TP})", d["schema"])
        for key in ("replicas", "batch_split", "plans"):
            _req(isinstance(d[key], list), f"{where}: {key}", "a list", type(d[key]).__name__)
        plans = tuple(VariablePlan.from_dict(p, f"{where}: plans[{i}]") for i, p in enumerate(d["plans"]))
        newer = next(((p.variable, s.synchronizer) for p in plans for s in p.shards
                      if s.synchronizer.min_schema > d["schema"]), None)
        if newer is not None:
            name, sync = newer
            _req(False, f"{where}: schema", f"{sync.min_schema} (variable {name!r} has a {sync.kind} synchronizer, new "
                 f"in schema {sync.min_schema})", d["schema"])
        try:
            return cls(model=d["model"], cluster=d["cluster"], replicas=tuple(d["replicas"]),
                       batch_split=tuple(d["batch_split"]), plans=plans, schema=d["schema"], checkpoint=checkpoint,
                       tensor_parallel=tp)
        except StrategyError as exc:
            raise StrategyError(f"{where}: {exc}") from None

    @classmethod
    def from_json(cls, text: str, where: str = "strategy") -> "Strategy":
        """Parse JSON text; malformed JSON is reported with its line and column."""
        return cls.from_dict(parse_json(text, where, StrategyError), where)

    @classmethod
    def over(cls, model: Any, cluster: Any, plans: Any, *, replicas: Any = None,
             batch_split: Any = None) -> "Strategy":
        """The strategy of ``plans`` for (``model``, ``cluster``) specs: by default every device of
        the cluster holds a replica with the model's default batch (AutoDist's graph level)."""
        replicas = tuple(cluster.devices if replicas is None else replicas)
        return cls(model={"name": model.name, "hash": model.hash}, cluster={"name": cluster.name, "hash": cluster.hash},
                   replicas=replicas,
                   batch_split=tuple(model.batch_size for _ in replicas) if batch_split is None else tuple(batch_split),
                   plans=tuple(plans))

    @functools.cached_property
    def hash(self) -> str:
        """``strategy_hash``: sha256 of the canonical form (computed once: a strategy is immutable,
        and searches look a candidate's hash up several times)."""
        return sha256_hex(self.to_dict())

    @property
    def global_batch_size(self) -> int:
        """The batch of one step over every replica (with tensor parallelism, over the TP groups:
        the replicas of one group train the same batch)."""
        if self.tensor_parallel is not None:
            return sum(self.batch_split[::self.tensor_parallel.degree])
        return sum(self.batch_split)

    def plan_for(self, variable: str) -> VariablePlan:
        """The plan of ``variable``; a StrategyError naming it when the strategy has none."""
        for p in self.plans:
            if p.variable == variable:
                return p
        raise StrategyError(f"strategy has no plan for variable {variable!r}")

    @property
    def frees_parameters(self) -> bool:
        """Whether a unit of this strategy frees its parameters after forward and gathers them again
        for backward (ZeRO-3: :attr:`~synctune.strategy.kinds.Synchronizer.frees_parameters`): what
        the engine, which keeps parameters whole, does not execute and torch FSDP2 does."""
        return any(shard.synchronizer.frees_parameters for plan in self.plans for shard in plan.shards)

    def iter_shards(self):
        """Yield ``(plan, shard_index, shard_plan)`` for every shard of every variable."""
        for plan in self.plans:
            for i, shard in enumerate(plan.shards):
                yield plan, i, shard

    def stats(self) -> dict[str, Any]:
        """Summary numbers of the strategy (dataset summary columns, one-line summary)."""
        counts = {SYNCHRONIZERS.get(k).stats_column: 0 for k in SYNCHRONIZER_KINDS if SYNCHRONIZERS.get(k).stats_column}
        groups: set[tuple[str, int]] = set()
        units: set[tuple[str, int]] = set()
        compressors: set[str] = set()
        extra: dict[str, Any] = {"servers": set(), "num_local_aggregation": 0, "max_staleness": 0}
        for _plan, _i, shard in self.iter_shards():
            sync = shard.synchronizer
            if sync.stats_column:
                counts[sync.stats_column] += 1
            compressors.add(shard.compressor.label)
            if sync.merge_id is not None:
                (groups if sync.merge_groups else units).add((sync.kind, sync.merge_id))
            sync.add_stats(extra)
        return {
            "num_replicas": len(self.replicas),
            "global_batch_size": self.global_batch_size,
            "num_variables": len(self.plans),
            "num_partitioned": sum(1 for p in self.plans if p.is_partitioned),
            "num_shards": sum(p.num_shards for p in self.plans),
            **counts,
            "num_shard_units": len(units),
            "num_merge_groups": len(groups),
            "num_ps_servers": len(extra["servers"]),
            "num_local_aggregation": extra["num_local_aggregation"],
            "max_staleness": extra["max_staleness"],
            "compressors": sorted(compressors),
            "tp_degree": self.tensor_parallel.degree if self.tensor_parallel is not None else 1,
        }

    def summary(self) -> str:
        """One line: replicas and batch, synchronizer mix, partitioning, compressors."""
        s = self.stats()
        batch = sorted(set(self.batch_split))
        batch_txt = f"batch {self.batch_split[0]} each" if len(batch) == 1 else f"batch {s['global_batch_size']} uneven"
        parts = [
            f"{self.model['name']} on {self.cluster['name']}: {s['num_replicas']} replicas, {batch_txt}",
            f"ps {s['num_ps_shards']} on {s['num_ps_servers']} server(s)"
            + (f" ({s['num_local_aggregation']} locally aggregated)" if s["num_local_aggregation"] else ""),
            f"allreduce {s['num_allreduce_shards']} in {s['num_merge_groups']} group(s)",
            f"allgather {s['num_allgather_shards']}" + (f", sfb {s['num_sfb_shards']}" if s["num_sfb_shards"] else "")
            + (f", shard {s['num_sharded']} in {s['num_shard_units']} unit(s)" if s["num_sharded"] else ""),
            (f"{s['num_partitioned']} partitioned into {s['num_shards'] - s['num_variables'] + s['num_partitioned']} shards"
             if s["num_partitioned"] else "unpartitioned"),
            "compressors " + ",".join(s["compressors"]),
        ]
        if s["max_staleness"]:
            parts.append(f"staleness<={s['max_staleness']}")
        if self.checkpoint:
            parts.append(checkpoint_label(self.checkpoint))
        if self.tensor_parallel is not None:
            parts.append(tp_label(self.tensor_parallel))
        return " | ".join(parts)


def _migrate_schema_1(data: Mapping[str, Any]) -> dict[str, Any]:
    """A schema-1 strategy in schema 2: each synchronizer as its kind migrates it
    (:func:`~synctune.strategy.kinds.synchronizer_from_schema_1`); nothing else changed."""
    out = dict(data, schema=2)
    plans = []
    for plan in data["plans"] if isinstance(data["plans"], list) else []:
        if isinstance(plan, Mapping) and isinstance(plan.get("shards"), list):
            shards = []
            for shard in plan["shards"]:
                sync = shard.get("synchronizer") if isinstance(shard, Mapping) else None
                migrated = synchronizer_from_schema_1(sync)
                if migrated is not sync:
                    shard = dict(shard, synchronizer=migrated)
                shards.append(shard)
            plan = dict(plan, shards=shards)
        plans.append(plan)
    out["plans"] = plans if isinstance(data["plans"], list) else data["plans"]
    return out


def load_strategy(path: str | Path) -> Strategy:
    """Read a strategy JSON file; errors name the file and the field."""
    return Strategy.from_json(read_text(path, "strategy", StrategyError), where=str(path))
