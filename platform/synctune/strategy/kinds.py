"""The synchronizer kinds: one home each in the strategy layer, and the registry that finds them.

A plan kind is a frozen synchronizer class (DESIGN.md "plan kind"). The class holds everything
the strategy layer needs of its kind: its JSON form (:attr:`Synchronizer.json_keys`), the
oldest strategy schema that holds it, how its shards join into communication units (its
``merge_field``: shards of one kind with the same value are one collective), what validation
checks against a model and a cluster (:meth:`Synchronizer.check`,
:meth:`Synchronizer.check_in_strategy`, and what a unit's members must agree on), how it is
written into strategy columns and read back, and what it adds to a strategy's summary numbers.
The layers above register their part of a kind under its name in a registry of their own (the
engine's units: :data:`synctune.engine.kinds.ENGINE_KINDS`; what TensorFlow's runtime makes of it:
:data:`synctune.engine.tensorflow.TENSORFLOW_KINDS`; the memory model's tally, the features' and
the replay's cost terms: :data:`synctune.simulator.kinds.MEMORY_KINDS`,
:data:`~synctune.simulator.kinds.FEATURE_KINDS`, :data:`~synctune.simulator.kinds.REPLAY_KINDS`),
so that no layer asks which class a synchronizer is.

:func:`register_synchronizer` adds a kind; its code in strategy columns and simulator features
is its position in the registry (:data:`SYNCHRONIZER_KINDS`, :data:`KIND_CODES`): the built-in
kinds keep codes 0-4. Registering a kind changes the vocabulary saved simulators record, so a
simulator trained before refuses to score beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from ..spec.checks import LIMITS, check_keys, in_range, shown
from ..spec.registry import Registry
from .errors import StrategyError, req

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "MAX_PREFETCH",
    "REDUCE_DTYPES",
    "SPARSE_GROUP_BASE",
    "KIND_CODES",
    "SYNCHRONIZER_KINDS",
    "SYNCHRONIZERS",
    "ShardContext",
    "Synchronizer",
    "PSSynchronizer",
    "AllReduceSynchronizer",
    "AllGatherSynchronizer",
    "SFBSynchronizer",
    "ShardSynchronizer",
    "PlanUnit",
    "UnitMember",
    "pattern_codes",
    "register_synchronizer",
    "column_row",
    "synchronizer_from_dict",
    "synchronizer_from_schema_1",
    "units_of",
    "renumber_units",
]

#: The merge groups of sparse gradients are numbered from here, so sparse and dense gradients
#: never share a group (samplers, local searches and the compiled kernel number them alike).
SPARSE_GROUP_BASE = 10_000

#: How an all-reduce merge group runs: ``flat``, one collective over every replica (the backend
#: picks its ring or tree); ``hierarchical``, reduce-scatter inside each node, all-reduce of each
#: piece across nodes, all-gather inside each node (Horovod's hierarchical all-reduce).
ALLREDUCE_ALGORITHMS = ("flat", "hierarchical")
#: The dtypes a ``shard`` unit may reduce its gradients in (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``).
REDUCE_DTYPES = ("fp32", "bf16")
#: The most all-gathers a resharded unit may issue ahead (FSDP2 prefetches one by default).
MAX_PREFETCH = 8

#: Schema 1 named all-reduce algorithms the backend never let synctune choose (``auto``, ``ring``,
#: ``tree``); every one of them ran as one flat collective, which schema 2 calls ``flat``.
_SCHEMA_1_ALGORITHMS = ("auto", "ring", "tree")

#: What a strategy column holds off the kinds that use it (:meth:`Synchronizer.column_values`).
_OFF_COLUMNS: dict[str, Any] = {"node": -1, "local": False, "group": -1, "hier": False, "shard_group": -1,
                                "reshard": False, "prefetch": 0, "reduce_dtype": 0}
_OFF_ROW = tuple(_OFF_COLUMNS.values())


def column_row(**values: Any) -> tuple:
    """A shard's kind-specific columns as :meth:`Synchronizer.column_values` gives them: ``values``
    by column name, the rest as :data:`_OFF_COLUMNS` has them."""
    return tuple(values.get(name, off) for name, off in _OFF_COLUMNS.items())


@dataclass(slots=True)
class ShardContext:
    """What validation knows of one shard while it checks the shard's synchronizer: ``where``
    (``variable 'x': shards[0]``, the start of every message), the variable's spec, the plan's
    shard count, this shard's shape and compressor, the specs, the strategy, the replica devices
    and, where nodes hold different numbers of replicas, how they spread (else empty). One
    context serves a whole validation, its shard fields set shard by shard."""

    where: str
    variable: Any
    num_shards: int
    shape: tuple[int, ...]
    compressor: Any
    model: Any
    cluster: Any
    strategy: Any
    replicas: frozenset
    uneven_nodes: str


class Synchronizer:
    """Base of every synchronizer kind (AutoDist §2.2 "synchronizer"); subclasses are frozen,
    keyword-only dataclasses with a ``kind`` field whose default is the kind's name.

    Class attributes a kind sets: ``json_keys`` (the optional keys of its JSON form, besides
    ``kind``), ``min_schema`` (the oldest strategy schema holding it), ``merge_field`` (the field
    whose equal values put shards of this kind into one communication unit; None: every shard
    is a unit of its own), ``merge_groups`` (its units are all-reduce merge groups: numbered in
    strategy columns, counted as ``num_merge_groups``; else they count as ``num_shard_units``),
    ``stats_column`` (the summary column counting its shards), ``priced_as`` (the kind whose
    cost terms the simulators price its shards with, for a kind that communicates as another
    one does, e.g. an all-reduce that also counts its calls; None: its own terms, which a kind
    registers in :data:`synctune.simulator.kinds.FEATURE_KINDS` and
    :data:`synctune.simulator.kinds.REPLAY_KINDS`, as each built-in kind does)."""

    kind: str
    json_keys: ClassVar[tuple[str, ...]] = ()
    min_schema: ClassVar[int] = 2
    merge_field: ClassVar[str | None] = None
    merge_groups: ClassVar[bool] = False
    stats_column: ClassVar[str | None] = None
    priced_as: ClassVar[str | None] = None

    # ----------------------------------------------------------------------- plain data
    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``kind`` and every field of :attr:`json_keys`."""
        return {"kind": self.kind, **{k: getattr(self, k) for k in self.json_keys}}

    @classmethod
    def from_schema_1(cls, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """This kind's JSON form as a schema-1 strategy wrote it, in schema 2 (``data`` is raw JSON,
        checked later): ``data`` itself where the kind means in schema 2 what it meant in schema 1."""
        return data

    # --------------------------------------------------------------------------- units
    @property
    def frees_parameters(self) -> bool:
        """Whether the parameter is freed after forward and gathered again for backward (ZeRO-3):
        the engine keeps parameters whole, so such a strategy runs on FSDP2."""
        return False

    @property
    def merge_id(self) -> int | None:
        """The id of the unit this shard joins (None for a kind whose shards are units of their own)."""
        return None if self.merge_field is None else getattr(self, self.merge_field)

    def merge_space(self) -> int:
        """Where the ids of this shard's units are numbered from when a strategy is renumbered
        (:func:`renumber_units`): units of one kind and space are numbered together."""
        return 0

    def with_merge_id(self, new: int) -> "Synchronizer":
        """This synchronizer in unit ``new``."""
        if self.merge_field is None:
            return self
        return dataclasses.replace(self, **{self.merge_field: new})

    # ---------------------------------------------------------------------- validation
    def tp_refusal(self, groups: int) -> str | None:
        """Why this synchronizer cannot be the data-parallel axis of a strategy with
        ``tensor_parallel`` over ``groups`` TP groups (its field and the fix), or None where the
        ``tp`` runtime runs it."""
        return f"{self.kind} does not compose with tensor_parallel; use allreduce or shard"

    def check(self, ctx: ShardContext) -> None:
        """Checks of this shard against its variable and the cluster, made before its compressor's."""

    def check_in_strategy(self, ctx: ShardContext) -> None:
        """Checks against the rest of the strategy (replicas, nodes), made after the compressor's."""

    def unit_terms(self, ctx: ShardContext) -> tuple | None:
        """What every member of this shard's unit must share (None: nothing, or no unit)."""
        return None

    def unit_conflict(self, ctx: ShardContext, first: tuple, first_variable: str, terms: tuple) -> str:
        """The message when this shard's :meth:`unit_terms` differ from ``first``, its unit's
        terms on ``first_variable``."""
        return (f"{ctx.where}.synchronizer.{self.merge_field}: {self.kind} unit {self.merge_id} has {first} on "
                f"variable {first_variable!r} and {terms} here; one unit's members agree")

    # ------------------------------------------------------------------------ columns
    def column_values(self, node_of: Mapping[str, int]) -> tuple:
        """This shard's kind-specific strategy columns, in the order of :data:`_OFF_COLUMNS`
        (what a kind does not use holds the value there; :func:`column_row` makes one)."""
        return _OFF_ROW

    @classmethod
    def from_columns(cls, row: Mapping[str, Any], servers: Sequence[str]) -> "Synchronizer":
        """The synchronizer of a strategy-column row (``servers``: each node's first device)."""
        return cls()

    # --------------------------------------------------------------------------- stats
    def add_stats(self, stats: dict[str, Any]) -> None:
        """What this shard adds to :meth:`~synctune.strategy.schema.Strategy.stats` beyond its count."""

    @property
    def label(self) -> str:
        """This synchronizer in a few words (``synctune strategy show``'s column)."""
        return self.kind

    @property
    def server(self) -> str | None:
        """The device that receives and updates this shard (a parameter server), if one does."""
        return None

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        """How this shard of ``variable`` departs from torch DDP's way (an all-reduce of the dense
        gradient, a sparse one gathered as rows), as (departure, detail) pairs that
        :func:`~synctune.strategy.explain.differences_from_ddp` words: ``densified`` (detail: the
        merge group), ``gathered``, ``sfb``, ``ps`` (detail: the placement), ``hierarchical``,
        ``sharded`` (detail: the unit, whether it reshards, its shard group)."""
        return []


class _KindRegistry(Registry[type]):
    """Kind name -> synchronizer class; a kind's code is its registration index."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self._classes: set[type] = set()

    def register(self, name: str, item: type) -> type:
        super().register(name, item)
        self._classes.add(item)
        return item

    def holds(self, sync: Any) -> bool:
        """Whether ``sync`` is an instance of a registered class (each class checks its own ``kind``)."""
        return type(sync) in self._classes


#: The synchronizer registry: kind name -> its class, in registration order.
SYNCHRONIZERS: _KindRegistry = _KindRegistry("synchronizer kind")


class _KindNames(Sequence):
    """The registered kind names in registry order (a live view: a kind registered later is in it)."""

    def __getitem__(self, i):
        return SYNCHRONIZERS.names()[i]

    def __len__(self) -> int:
        return len(SYNCHRONIZERS)

    def __iter__(self) -> Iterator[str]:
        return iter(SYNCHRONIZERS.names())

    def __contains__(self, name: object) -> bool:
        return name in SYNCHRONIZERS

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _KindNames)) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class _KindCodes(Mapping):
    """Kind name -> code (its index in :data:`SYNCHRONIZER_KINDS`), a live view."""

    def __getitem__(self, name: str) -> int:
        names = SYNCHRONIZERS.names()
        if name not in names:
            raise KeyError(name)
        return names.index(name)

    def __iter__(self) -> Iterator[str]:
        return iter(SYNCHRONIZERS.names())

    def __len__(self) -> int:
        return len(SYNCHRONIZERS)


#: The synchronizer kinds in registry order; a kind's code in strategy columns and simulator
#: features is its index here.
SYNCHRONIZER_KINDS: Sequence[str] = _KindNames()
#: Synchronizer kind -> the code of its rows (its index in the synchronizer registry).
KIND_CODES: Mapping[str, int] = _KindCodes()


#: :func:`pattern_codes` for the registry as it was at its length (kinds are only ever added).
_PATTERN_CODES: list = [-1, None]


def pattern_codes() -> list[int] | None:
    """Per kind code, the code of the kind that prices it (:attr:`Synchronizer.priced_as`);
    None when every kind prices itself (the simulators then read kind codes as they are). Worked
    out once per registration: the simulators ask for it in every term."""
    if _PATTERN_CODES[0] != len(SYNCHRONIZERS):
        names = SYNCHRONIZERS.names()
        table = [names.index(SYNCHRONIZERS.get(k).priced_as or k) for k in names]
        _PATTERN_CODES[:] = [len(names), None if table == list(range(len(names))) else table]
    return _PATTERN_CODES[1]


def register_synchronizer(cls: type) -> type:
    """Add the synchronizer kind ``cls`` (a frozen dataclass subclassing :class:`Synchronizer`
    whose ``kind`` field defaults to its name) to the registry; usable as a class decorator.
    A second kind of the same name is an error."""
    if not (isinstance(cls, type) and issubclass(cls, Synchronizer) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_synchronizer: expected a dataclass subclassing Synchronizer, got {cls!r}")
    field = cls.__dataclass_fields__.get("kind")
    if field is None or not isinstance(field.default, str):
        raise TypeError(f"register_synchronizer: {cls.__name__} needs a field 'kind' whose default is its name")
    for key in cls.json_keys:
        if key not in cls.__dataclass_fields__:
            raise TypeError(f"register_synchronizer: {cls.__name__}.json_keys names {key!r}, which is no field")
    if cls.priced_as is not None and (cls.priced_as not in SYNCHRONIZERS
                                      or SYNCHRONIZERS.get(cls.priced_as).priced_as is not None):
        raise TypeError(f"register_synchronizer: {cls.__name__}.priced_as: expected a registered kind with terms of "
                        f"its own ({', '.join(k for k in SYNCHRONIZERS if SYNCHRONIZERS.get(k).priced_as is None)}), "
                        f"got {cls.priced_as!r}")
    SYNCHRONIZERS.register(field.default, cls)
    return cls


def synchronizer_from_schema_1(data: Any) -> Any:
    """A synchronizer's raw JSON form in a schema-1 strategy, in schema 2 (its kind's
    :meth:`~Synchronizer.from_schema_1`); ``data`` itself where it names no registered kind (the
    validation that follows names the fault)."""
    if not isinstance(data, Mapping):
        return data
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in SYNCHRONIZERS:
        return data
    return SYNCHRONIZERS.get(kind).from_schema_1(data)


def synchronizer_from_dict(data: Any, where: str) -> Synchronizer:
    """The synchronizer of its JSON form; errors name ``where``, the key and the valid kinds."""
    if not isinstance(data, Mapping):
        raise StrategyError(f"{where}: expected a mapping, got {type(data).__name__}")
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in SYNCHRONIZERS:
        raise StrategyError(f"{where}: kind: expected one of {', '.join(SYNCHRONIZERS)}, got {shown(kind)}")
    cls = SYNCHRONIZERS.get(kind)
    d = check_keys(data, where, ("kind",), cls.json_keys, StrategyError)
    try:
        return cls(**{k: d[k] for k in cls.json_keys if k in d})
    except (StrategyError, TypeError) as exc:
        raise StrategyError(f"{where}: {exc}") from None


# ------------------------------------------------------------------------------ the kinds

@register_synchronizer
@dataclass(frozen=True, kw_only=True)
class PSSynchronizer(Synchronizer):
    """Parameter server: reduce to ``placement``, update there, broadcast back.

    ``local_aggregation`` reduces inside each node first (AutoDist's two-level hierarchy);
    ``staleness`` bounds how many steps the fastest replica may run ahead (0 = synchronous).
    """

    placement: str
    local_aggregation: bool = False
    staleness: int = 0
    kind: str = "ps"
    json_keys: ClassVar[tuple[str, ...]] = ("placement", "local_aggregation", "staleness")
    stats_column: ClassVar[str] = "num_ps_shards"

    def __post_init__(self) -> None:
        req(self.kind == "ps", "synchronizer kind", "'ps'", self.kind)
        req(isinstance(self.placement, str) and bool(self.placement), "ps: placement", "a device id like 'node0:0'",
            self.placement)
        req(isinstance(self.local_aggregation, bool), "ps: local_aggregation", "true or false", self.local_aggregation)
        req(in_range(self.staleness, 0, LIMITS["iterations"]), "ps: staleness", "a non-negative integer",
            self.staleness)

    def check(self, ctx: ShardContext) -> None:
        swhere = ctx.where
        if self.local_aggregation and ctx.variable.sparse:
            raise StrategyError(
                f"{swhere}.synchronizer.local_aggregation: not executed for a sparse gradient (its rows go "
                f"to the server directly); set it to false"
            )
        if not ctx.cluster.has_device(self.placement):
            raise StrategyError(
                f"{swhere}.synchronizer.placement: device {shown(self.placement)} does not exist in cluster "
                f"{ctx.cluster.name!r}"
            )
        if self.placement not in ctx.replicas:
            raise StrategyError(
                f"{swhere}.synchronizer.placement: device {shown(self.placement)} holds no replica; "
                f"a PS placement must be one of the replicas"
            )

    def column_values(self, node_of: Mapping[str, int]) -> tuple:
        return (node_of[self.placement], self.local_aggregation, -1, False, -1, False, 0, 0)

    @classmethod
    def from_columns(cls, row: Mapping[str, Any], servers: Sequence[str]) -> "PSSynchronizer":
        return cls(placement=servers[int(row["node"])], local_aggregation=bool(row["local"]))

    @property
    def label(self) -> str:
        return (f"ps @{self.placement}" + (" local-agg" if self.local_aggregation else "")
                + (f" stale<={self.staleness}" if self.staleness else ""))

    @property
    def server(self) -> str | None:
        return self.placement

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        return [("ps", self.placement)]

    def add_stats(self, stats: dict[str, Any]) -> None:
        stats["servers"].add(self.placement)
        stats["num_local_aggregation"] += self.local_aggregation
        stats["max_staleness"] = max(stats["max_staleness"], self.staleness)


@register_synchronizer
@dataclass(frozen=True, kw_only=True)
class AllReduceSynchronizer(Synchronizer):
    """All-reduce among all replicas; plans with the same ``group`` are fused into one collective."""

    group: int = 0
    algorithm: str = "flat"
    kind: str = "allreduce"
    json_keys: ClassVar[tuple[str, ...]] = ("group", "algorithm")
    merge_field: ClassVar[str] = "group"
    merge_groups: ClassVar[bool] = True
    stats_column: ClassVar[str] = "num_allreduce_shards"

    def tp_refusal(self, groups: int) -> str | None:
        if self.algorithm != "flat":
            return (f"allreduce: algorithm: {self.algorithm} does not compose with tensor_parallel (the data-parallel "
                    f"axis is one ring per TP rank); use flat")
        return None

    def __post_init__(self) -> None:
        req(self.kind == "allreduce", "synchronizer kind", "'allreduce'", self.kind)
        req(in_range(self.group, 0, LIMITS["seed"]), "allreduce: group", "a non-negative integer", self.group)
        req(self.algorithm in ALLREDUCE_ALGORITHMS, "allreduce: algorithm", f"one of {ALLREDUCE_ALGORITHMS}",
            self.algorithm)

    @classmethod
    def from_schema_1(cls, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """Schema 1's all-reduce algorithms (:data:`_SCHEMA_1_ALGORITHMS`) were never executed: every
        group ran flat, so they become ``flat``; another value is left for validation to refuse."""
        if data.get("algorithm", "auto") in _SCHEMA_1_ALGORITHMS:
            return dict(data, algorithm="flat")
        return data

    def merge_space(self) -> int:
        return SPARSE_GROUP_BASE if self.group >= SPARSE_GROUP_BASE else 0

    def check_in_strategy(self, ctx: ShardContext) -> None:
        comp = ctx.compressor
        if self.algorithm == "hierarchical":
            if comp.kind != "none":
                raise StrategyError(
                    f"{ctx.where}.compressor: {comp.label} with a hierarchical all-reduce is not executed; use "
                    f"compressor none, or algorithm flat"
                )
            if ctx.uneven_nodes:
                raise StrategyError(
                    f"{ctx.where}.synchronizer.algorithm: hierarchical needs the same number of replicas on every "
                    f"node, and the replicas are {ctx.uneven_nodes}; use algorithm flat"
                )

    def unit_terms(self, ctx: ShardContext) -> tuple:
        return (self.algorithm, ctx.compressor.label, "sparse" if ctx.variable.sparse else "dense")

    def unit_conflict(self, ctx: ShardContext, first: tuple, first_variable: str, terms: tuple) -> str:
        return (f"{ctx.where}.synchronizer.group: group {self.group} mixes "
                f"(algorithm {terms[0]}, compressor {terms[1]}, {terms[2]}) with "
                f"(algorithm {first[0]}, compressor {first[1]}, {first[2]}) of variable {first_variable!r}; "
                f"a merge group is one collective")

    def column_values(self, node_of: Mapping[str, int]) -> tuple:
        return (-1, False, self.group, self.algorithm == "hierarchical", -1, False, 0, 0)

    @classmethod
    def from_columns(cls, row: Mapping[str, Any], servers: Sequence[str]) -> "AllReduceSynchronizer":
        return cls(group=int(row["group"]), algorithm="hierarchical" if row["hier"] else "flat")

    @property
    def label(self) -> str:
        return f"allreduce group {self.group}" + (f" {self.algorithm}" if self.algorithm != "flat" else "")

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        return (([("densified", self.group)] if variable.sparse else [])
                + ([("hierarchical", None)] if self.algorithm == "hierarchical" else []))


@register_synchronizer
@dataclass(frozen=True, kw_only=True)
class AllGatherSynchronizer(Synchronizer):
    """All-gather of (indices, values) of a sparse gradient, summed locally by every replica."""

    kind: str = "allgather"
    stats_column: ClassVar[str] = "num_allgather_shards"

    def __post_init__(self) -> None:
        req(self.kind == "allgather", "synchronizer kind", "'allgather'", self.kind)

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        return [("gathered", None)] if variable.sparse else []

    def check(self, ctx: ShardContext) -> None:
        if not ctx.variable.sparse:
            raise StrategyError(
                f"{ctx.where}.synchronizer: allgather is for sparse gradients, and this variable's gradient is dense "
                f"(use allreduce or ps)"
            )


@register_synchronizer
@dataclass(frozen=True, kw_only=True)
class SFBSynchronizer(Synchronizer):
    """Sufficient-factor broadcasting (TAG §2.3, §4.2.3; Poseidon's SFB) for the weight of a
    linear layer: replicas all-gather the layer's input activations X and (batch-weighted)
    output gradients dY, 2·N·(H_in + H_out) values for N rows, instead of the H_out·H_in
    gradient, and every replica rebuilds the same gradient Σ dYᵀX. Lossless; the variable must
    be a whole ``nn.Linear`` weight (the model spec's ``factor_rows`` marks them)."""

    kind: str = "sfb"
    stats_column: ClassVar[str] = "num_sfb_shards"

    def __post_init__(self) -> None:
        req(self.kind == "sfb", "synchronizer kind", "'sfb'", self.kind)

    @property
    def label(self) -> str:
        return "sfb (sufficient factors)"

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        return [("sfb", None)]

    def check(self, ctx: ShardContext) -> None:
        model, var = ctx.model, ctx.variable
        if model.factor_rows is None or model.factor_rows[model.position(var.name)] is None:
            raise StrategyError(
                f"{ctx.where}.synchronizer: sfb rebuilds the gradient of a linear layer's weight from its "
                f"inputs and output gradients, and model {model.name!r} does not mark this variable as one "
                f"(its factor_rows entry is empty: not an nn.Linear weight, tied to another module, or a "
                f"spec written without factor_rows); use allreduce or ps"
            )
        if ctx.num_shards > 1:
            raise StrategyError(
                f"{ctx.where}.synchronizer: sfb sends the factors of the whole layer, and this plan cuts the "
                f"variable into {ctx.num_shards} shards; use partition {[1] * len(var.shape)} with sfb"
            )


_UNIT_FIELDS = ("group", "reshard", "prefetch", "reduce_dtype")


@register_synchronizer
@dataclass(frozen=True, kw_only=True)
class ShardSynchronizer(Synchronizer):
    """Sharded data parallelism (ZeRO, Rajbhandari et al. SC'20; FSDP2 ``fully_shard``): the
    gradient is reduce-scattered over a **shard group**, each member updates only its slice of
    rows (so its optimizer state is a slice too), and the updated slices are all-gathered.

    Variables with the same ``unit`` form one communication unit (FSDP2's ``fully_shard`` module
    boundary): one reduce-scatter and one all-gather for all of them, so they must agree on every
    other field. ``group``: 0 shards over every replica; k > 0 over groups of k consecutive
    replicas, the slices then all-reduced across the groups (HSDP, a (replicas/k, k) mesh).
    ``reshard``: also free the parameter after forward and gather it again for backward
    (ZeRO-3, FSDP's ``reshard_after_forward=True``); otherwise parameters stay whole (ZeRO-2).
    ``prefetch``: all-gathers issued ahead of use when resharded. ``reduce_dtype``: the dtype
    the gradient travels and is summed in (``bf16`` halves the bytes; lossy)."""

    unit: int = 0
    group: int = 0
    reshard: bool = False
    prefetch: int = 0
    reduce_dtype: str = "fp32"
    kind: str = "shard"
    json_keys: ClassVar[tuple[str, ...]] = ("unit", "group", "reshard", "prefetch", "reduce_dtype")
    min_schema: ClassVar[int] = 3
    merge_field: ClassVar[str] = "unit"
    stats_column: ClassVar[str] = "num_sharded"

    def tp_refusal(self, groups: int) -> str | None:
        if groups == 1:
            return ("shard: the data-parallel axis is one TP group, so FSDP2 would shard over one device: nothing "
                    "to shard; use allreduce (nothing travels) or more replicas")
        if self.group != 0:
            return (f"shard: group: {self.group} (HSDP) does not compose with tensor_parallel: the shard group is "
                    f"every TP group (0)")
        return None

    def __post_init__(self) -> None:
        req(self.kind == "shard", "synchronizer kind", "'shard'", self.kind)
        req(in_range(self.unit, 0, LIMITS["seed"]), "shard: unit", "a non-negative integer", self.unit)
        req(in_range(self.group, 0, LIMITS["devices"]) and self.group != 1, "shard: group",
            "0 (every replica) or a shard-group size of 2 or more (a group of one shards nothing: use allreduce)",
            self.group)
        req(isinstance(self.reshard, bool), "shard: reshard", "true or false", self.reshard)
        req(in_range(self.prefetch, 0, MAX_PREFETCH), "shard: prefetch", f"an integer from 0 to {MAX_PREFETCH}",
            self.prefetch)
        req(self.prefetch == 0 or self.reshard, "shard: prefetch",
            "0 when reshard is false (the parameters stay gathered: nothing to prefetch)", self.prefetch)
        req(self.reduce_dtype in REDUCE_DTYPES, "shard: reduce_dtype", f"one of {REDUCE_DTYPES}", self.reduce_dtype)

    def ddp_departures(self, variable: Any) -> list[tuple[str, Any]]:
        return [("sharded", (self.unit, self.reshard, self.group))]

    @property
    def frees_parameters(self) -> bool:
        return self.reshard

    @property
    def label(self) -> str:
        return (f"shard unit {self.unit} over " + (f"groups of {self.group}" if self.group else "every replica")
                + (f" reshard prefetch {self.prefetch}" if self.reshard else "")
                + (f" reduce {self.reduce_dtype}" if self.reduce_dtype != "fp32" else ""))

    @property
    def unit_key(self) -> tuple:
        """What every variable of one unit must share."""
        return tuple(getattr(self, name) for name in _UNIT_FIELDS)

    def check(self, ctx: ShardContext) -> None:
        comp = ctx.compressor
        if comp.kind != "none":
            raise StrategyError(
                f"{ctx.where}.compressor: {comp.label} is not executed with shard (its reduce-scatter sums in the "
                f"unit's reduce_dtype); use compressor none, and reduce_dtype bf16 for half the bytes"
            )

    def check_in_strategy(self, ctx: ShardContext) -> None:
        """A dense, unpartitioned float32 variable with rows to slice; a shard group that divides
        the replicas and lies inside one node or spans whole nodes (an HSDP mesh that matches the
        nodes)."""
        swhere, var = ctx.where, ctx.variable
        if var.sparse:
            raise StrategyError(f"{swhere}.synchronizer: shard reduce-scatters a dense gradient, and this variable's "
                                f"gradient is sparse; use allgather or ps")
        if ctx.num_shards > 1:
            raise StrategyError(f"{swhere}.synchronizer: shard slices the whole variable by rows itself, and this plan "
                                f"partitions it into {ctx.num_shards} shards; use partition {[1] * len(var.shape)} "
                                f"with shard")
        if not var.shape:
            raise StrategyError(f"{swhere}.synchronizer: shard slices a variable by rows, and this one is a scalar "
                                f"(shape []); use allreduce")
        if var.dtype != "float32":
            raise StrategyError(f"{swhere}.synchronizer: shard runs float32 variables (reduce_dtype fp32 or bf16), "
                                f"and this one is {var.dtype}; use allreduce")
        strategy, cluster = ctx.strategy, ctx.cluster
        replicas = len(strategy.replicas)
        size = self.group or replicas
        if replicas % size:
            raise StrategyError(f"{swhere}.synchronizer.group: a shard group of {size} does not divide the {replicas} "
                                f"replicas; use a divisor of {replicas} (0 for every replica)")
        nodes = [cluster.node_of(dev).name for dev in strategy.replicas]
        count = {n: nodes.count(n) for n in nodes}
        for start in range(0, replicas, size):
            members = nodes[start:start + size]
            if len(set(members)) > 1 and any(members.count(n) != count[n] for n in set(members)):
                raise StrategyError(
                    f"{swhere}.synchronizer.group: shard group {start // size} (replicas {start}..{start + size - 1}) "
                    f"takes part of node {next(n for n in members if members.count(n) != count[n])!r}'s replicas "
                    f"together with another node's; a shard group lies inside one node or spans whole nodes (an "
                    f"HSDP mesh that matches the nodes)")

    def unit_terms(self, ctx: ShardContext) -> tuple:
        return self.unit_key

    def unit_conflict(self, ctx: ShardContext, first: tuple, first_variable: str, terms: tuple) -> str:
        field = next(n for n, a, b in zip(_UNIT_FIELDS, terms, first) if a != b)
        return (f"{ctx.where}.synchronizer.{field}: unit {self.unit} has {field} "
                f"{dict(zip(_UNIT_FIELDS, first))[field]!r} on variable {first_variable!r} and {getattr(self, field)!r} "
                f"here; a unit is one reduce-scatter and one all-gather, so its variables agree on group, reshard, "
                f"prefetch and reduce_dtype")

    def column_values(self, node_of: Mapping[str, int]) -> tuple:
        return (-1, False, self.unit, False, self.group, self.reshard, self.prefetch,
                REDUCE_DTYPES.index(self.reduce_dtype))

    @classmethod
    def from_columns(cls, row: Mapping[str, Any], servers: Sequence[str]) -> "ShardSynchronizer":
        return cls(unit=int(row["group"]), group=int(row["shard_group"]), reshard=bool(row["reshard"]),
                   prefetch=int(row["prefetch"]), reduce_dtype=REDUCE_DTYPES[int(row["reduce_dtype"])])


# ----------------------------------------------------------------------------- units

@dataclass(frozen=True)
class UnitMember:
    """One shard of a unit: its variable's plan, the shard's index in it and the shard's plan."""

    plan: Any
    index: int
    shard: Any

    @property
    def variable(self) -> str:
        """The member's variable name."""
        return self.plan.variable

    @property
    def synchronizer(self) -> Synchronizer:
        """The member's synchronizer."""
        return self.shard.synchronizer


@dataclass(frozen=True)
class PlanUnit:
    """One communication unit of a strategy: the shards of one kind that share a unit id (an
    all-reduce merge group, a ``shard`` unit) or one shard of a kind that merges nothing. Its
    ``synchronizer`` and ``compressor`` are its first member's (the members agree on what
    matters: validation holds it)."""

    kind: str
    merge_id: int | None
    members: tuple[UnitMember, ...]

    @property
    def synchronizer(self) -> Synchronizer:
        """The first member's synchronizer (the unit's options)."""
        return self.members[0].shard.synchronizer

    @property
    def compressor(self) -> Any:
        """The first member's compressor (the unit's encoding)."""
        return self.members[0].shard.compressor


def units_of(strategy: Any, model: Any = None) -> list[PlanUnit]:
    """The communication units of ``strategy`` in the order of their first member: the plans in
    ``model``'s variable order (backward order) when a model spec is given, else as listed; each
    plan's shards in row-major order. The one place shards are grouped into units."""
    plans = strategy.plans if model is None else sorted(strategy.plans, key=lambda p: model.position(p.variable))
    merged: dict[tuple[str, int], list[UnitMember]] = {}
    order: list[tuple[str, int | None, list[UnitMember]]] = []
    for plan in plans:
        for i, shard in enumerate(plan.shards):
            sync = shard.synchronizer
            member = UnitMember(plan=plan, index=i, shard=shard)
            mid = sync.merge_id
            if mid is None:
                order.append((sync.kind, None, [member]))
                continue
            key = (sync.kind, mid)
            if key not in merged:
                merged[key] = []
                order.append((sync.kind, mid, merged[key]))
            merged[key].append(member)
    return [PlanUnit(kind=kind, merge_id=mid, members=tuple(members)) for kind, mid, members in order]


def renumber_units(strategy: Any, sources: Sequence[Any] | None = None) -> Any:
    """``strategy`` with the unit ids of every merging kind numbered by first appearance in plan
    order, per kind and :meth:`~Synchronizer.merge_space` (dense all-reduce groups from 0, sparse
    ones from :data:`SPARSE_GROUP_BASE`, ``shard`` units from 0): two strategies that group the
    same shards the same way get the same hash. ``sources`` (one per plan: where a plan comes
    from, e.g. a crossover's parent): units of different sources never merge, even under one id.
    A strategy already in that form is returned as it is."""
    tables: dict[tuple[str, int], dict[tuple[Any, int], int]] = {}
    plans, changed = [], False
    for p, plan in enumerate(strategy.plans):
        source = None if sources is None else sources[p]
        shards = []
        for shard in plan.shards:
            sync = shard.synchronizer
            mid = sync.merge_id
            if mid is not None:
                space = sync.merge_space()
                table = tables.setdefault((sync.kind, space), {})
                new = table.setdefault((source, mid), space + len(table))
                if new != mid:
                    shard = dataclasses.replace(shard, synchronizer=sync.with_merge_id(new))
                    changed = True
            shards.append(shard)
        plans.append(dataclasses.replace(plan, shards=tuple(shards)) if changed else plan)
    return dataclasses.replace(strategy, plans=tuple(plans)) if changed else strategy
