"""Hand-optimised strategy builders: (model spec, cluster spec) -> strategy (AutoDist §3.1).

Each reproduces a known system with the defaults of the AutoDist reference implementation:
AllReduce(chunk=128), Horovod-like fusion (64 MiB), PS on one server, load-balanced PS
(greedy least bytes, "TF-PS-LB"), partitioned PS (axis 0, smallest divisor > 1), uneven
partitioned PS (smallest non-divisor), partitioned and random-axis partitioned AllReduce,
and Parallax (sparse -> load-balanced PS, dense -> AllReduce).

PS servers are one per node, on the node's first device (AutoDist puts them on each node's
CPU; in a PyTorch process group the server is a rank). Sparse gradients under all-reduce
builders go through all-gather, as Horovod does with ``IndexedSlices``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..spec.checks import is_int
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec, VariableSpec
from ..spec.registry import Registry
from .compressors import COMPRESSORS
from .schema import (
    ALLREDUCE_ALGORITHMS,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    REDUCE_DTYPES,
    ShardPlan,
    ShardSynchronizer,
    Strategy,
    StrategyError,
    VariablePlan,
)

__all__ = [
    "BuilderInfo",
    "BUILDERS",
    "build_strategy",
    "baseline_strategy",
    "parse_baseline",
    "TUNED_BASELINES",
    "parse_builder_options",
    "megatron_block_styles",
    "tp_batch_split",
    "without_tensor_parallel",
    "megatron_choices",
    "TP_BLOCK_PLANS",
    "AllReduceOptions",
    "HorovodOptions",
    "PSOptions",
    "HierarchicalPSOptions",
    "PartitionedPSOptions",
    "PartitionedAllReduceOptions",
    "RandomAxisOptions",
    "ParallaxOptions",
    "ShardOptions",
    "MegatronOptions",
    "megatron_styles",
    "token_embedding",
    "SPLITTING_BUILDERS",
    "megatron_over",
]

MIB = 1024**2


def _positive(value: Any, field: str, builder: str) -> None:
    if not (is_int(value) and value > 0):
        raise StrategyError(f"builder {builder}: option {field}: expected a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AllReduceOptions:
    """``chunk`` adjacent variables (backward order) share one merge group (AutoDist Fig. 7)."""

    chunk: int = 128
    algorithm: str = "flat"
    compressor: str = "none"
    powersgd_rank: int = 4

    def __post_init__(self) -> None:
        _positive(self.chunk, "chunk", "allreduce")
        _positive(self.powersgd_rank, "powersgd_rank", "allreduce")
        if self.algorithm not in ALLREDUCE_ALGORITHMS:
            raise StrategyError(f"builder allreduce: option algorithm: expected one of {ALLREDUCE_ALGORITHMS}, "
                                f"got {self.algorithm!r}")
        usable = [n for n, i in COMPRESSORS.items() if "allreduce" in i.synchronizers]
        if self.compressor not in usable:
            raise StrategyError(f"builder allreduce: option compressor: expected one of {', '.join(usable)}, "
                                f"got {self.compressor!r}")


@dataclass(frozen=True, kw_only=True)
class HorovodOptions:
    """Tensor fusion: adjacent gradients are fused until the buffer would exceed the threshold."""

    fusion_threshold_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        _positive(self.fusion_threshold_bytes, "fusion_threshold_bytes", "horovod")


@dataclass(frozen=True, kw_only=True)
class PSOptions:
    """``local_aggregation`` reduces dense gradients within each node before going to the server
    (sparse rows go to the server directly: the engine aggregates dense shards only)."""

    local_aggregation: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.local_aggregation, bool):
            raise StrategyError(f"builder ps: option local_aggregation: expected true or false, "
                                f"got {self.local_aggregation!r}")


@dataclass(frozen=True, kw_only=True)
class PartitionedPSOptions:
    """``max_shards`` caps the shard count when the first axis has no small divisor (a prime row count)."""

    local_aggregation: bool = False
    max_shards: int = 16

    def __post_init__(self) -> None:
        _positive(self.max_shards, "max_shards", "partitioned-ps")
        if not isinstance(self.local_aggregation, bool):
            raise StrategyError(f"builder partitioned-ps: option local_aggregation: expected true or false, "
                                f"got {self.local_aggregation!r}")


@dataclass(frozen=True, kw_only=True)
class HierarchicalPSOptions:
    """Variables of at least ``threshold_bytes`` are cut along axis 0 into one shard per node;
    ``local_aggregation`` reduces dense gradients within a node first (AutoDist §3.1's PS)."""

    threshold_bytes: int = MIB
    local_aggregation: bool = True

    def __post_init__(self) -> None:
        _positive(self.threshold_bytes, "threshold_bytes", "ps-hierarchical")
        if not isinstance(self.local_aggregation, bool):
            raise StrategyError(f"builder ps-hierarchical: option local_aggregation: expected true or false, "
                                f"got {self.local_aggregation!r}")


@dataclass(frozen=True, kw_only=True)
class PartitionedAllReduceOptions:
    """Shards (counted in backward order) are merged ``chunk`` at a time; ``max_shards`` as for PS."""

    chunk: int = 128
    max_shards: int = 16

    def __post_init__(self) -> None:
        _positive(self.chunk, "chunk", "partitioned-allreduce")
        _positive(self.max_shards, "max_shards", "partitioned-allreduce")


@dataclass(frozen=True, kw_only=True)
class RandomAxisOptions:
    """The axis is drawn per variable from a generator seeded with ``seed`` (reproducible)."""

    chunk: int = 128
    seed: int = 0
    max_shards: int = 16

    def __post_init__(self) -> None:
        _positive(self.chunk, "chunk", "random-axis-allreduce")
        _positive(self.max_shards, "max_shards", "random-axis-allreduce")
        if not is_int(self.seed):
            raise StrategyError(f"builder random-axis-allreduce: option seed: expected an integer, got {self.seed!r}")


@dataclass(frozen=True, kw_only=True)
class ParallaxOptions:
    """Dense variables all-reduce in chunks of ``chunk``; sparse ones go to load-balanced PS."""

    chunk: int = 128

    def __post_init__(self) -> None:
        _positive(self.chunk, "chunk", "parallax")


@dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """FSDP2's usual wrapping: one ``shard`` unit per module at ``depth`` (``blocks.0`` of
    ``blocks.0.attn.q.weight`` at depth 2), shard groups of ``group`` replicas (0: all; HSDP
    otherwise), ``reshard`` after forward (ZeRO-3; the FSDP2 runtime runs it) with ``prefetch``,
    gradients reduced in ``reduce_dtype``."""

    depth: int = 2
    group: int = 0
    reshard: bool = False
    #: Default: 1 with reshard (FSDP2's own), 0 without.
    prefetch: int | None = None
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _positive(self.depth, "depth", "shard")
        if not (is_int(self.group) and self.group >= 0):
            raise StrategyError(f"builder shard: option group: expected 0 or a shard-group size, got {self.group!r}")
        if not isinstance(self.reshard, bool):
            raise StrategyError(f"builder shard: option reshard: expected true or false, got {self.reshard!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise StrategyError(f"builder shard: option reduce_dtype: expected one of {REDUCE_DTYPES}, "
                                f"got {self.reduce_dtype!r}")
        if self.prefetch is None:
            object.__setattr__(self, "prefetch", 1 if self.reshard is True else 0)
        try:
            ShardSynchronizer(reshard=self.reshard, prefetch=self.prefetch, group=self.group)
        except StrategyError as exc:
            raise StrategyError(f"builder shard: option {exc}") from None


@dataclass(frozen=True, kw_only=True)
class BuilderInfo:
    """A registered builder: its function, its options type and what it reproduces."""

    name: str
    fn: Callable[[ModelSpec, ClusterSpec, Any], Strategy]
    options: type
    description: str


BUILDERS: Registry[BuilderInfo] = Registry("builder")


def _register(name: str, options: type, description: str):
    def deco(fn):
        BUILDERS.register(name, BuilderInfo(name=name, fn=fn, options=options, description=description))
        return fn

    return deco


# ---------------------------------------------------------------------------------------- helpers


_strategy = Strategy.over


def _unpartitioned(var: VariableSpec, shard: ShardPlan) -> VariablePlan:
    return VariablePlan(variable=var.name, partition=(1,) * len(var.shape), shards=(shard,))


def _servers(cluster: ClusterSpec) -> list[str]:
    return [node.devices[0] for node in cluster.nodes]


class _GreedyLoads:
    """Least-loaded server placement by bytes, ties broken by server order (TF's GreedyLoadBalancer)."""

    def __init__(self, servers: list[str]) -> None:
        self.loads = {s: 0.0 for s in servers}

    def place(self, num_bytes: float, count: int = 1) -> list[str]:
        order = sorted(self.loads, key=self.loads.__getitem__)
        # More shards than servers: round-robin in greedy order, as the reference builder does.
        chosen = [order[i % len(order)] for i in range(count)]
        for s in chosen:
            self.loads[s] += num_bytes / count
        return chosen


def _smallest_divisor(n: int, max_shards: int) -> int:
    """Smallest d > 1 dividing n, if one is at most ``max_shards``; else 0."""
    for d in range(2, min(n, max_shards) + 1):
        if n % d == 0:
            return d
    return 0


def _even_shards(n: int, max_shards: int, fallback: int) -> int:
    """Shard count for partitioned builders: smallest divisor of ``n`` > 1 (reference behaviour),
    else (prime or divisor above ``max_shards``) an uneven split into ``fallback`` pieces."""
    if n < 2:
        return 1
    d = _smallest_divisor(n, max_shards)
    return d if d else max(2, min(n, fallback, max_shards))


def _is_norm(var: VariableSpec) -> bool:
    lowered = var.name.lower()
    return "norm" in lowered or ".bn" in lowered or lowered.startswith("bn")


def _dense_or_gather(var: VariableSpec, group: int, opts: AllReduceOptions | None = None) -> ShardPlan:
    if var.sparse:
        return ShardPlan(synchronizer=AllGatherSynchronizer())
    algorithm = opts.algorithm if opts else "flat"
    comp = Compressor()
    if opts and opts.compressor != "none":
        info = COMPRESSORS.get(opts.compressor)
        # The compressor applies where it fits this variable (PowerSGD: matrices, rank clipped).
        rank = info.fit(var.shape, opts.powersgd_rank)
        if rank is not None:
            comp = Compressor(kind=opts.compressor, rank=rank if "rank" in info.params else None)
    return ShardPlan(synchronizer=AllReduceSynchronizer(group=group, algorithm=algorithm), compressor=comp)


# --------------------------------------------------------------------------------------- builders


@_register("allreduce", AllReduceOptions, "AllReduce(chunk): every `chunk` adjacent variables form one merge group")
def _allreduce(model: ModelSpec, cluster: ClusterSpec, opts: AllReduceOptions) -> Strategy:
    plans = []
    # A merge group is one collective with one encoding, so chunks are split further by the
    # encoding each variable can take (PowerSGD leaves vectors uncompressed, clips its rank).
    group_ids: dict[tuple[int, str], int] = {}
    for i, var in enumerate(model.variables):
        shard = _dense_or_gather(var, 0, opts)
        if shard.synchronizer.merge_id is not None:  # an all-reduce: it joins its chunk's merge group
            gid = group_ids.setdefault((i // opts.chunk, shard.compressor.label), len(group_ids))
            shard = dataclasses.replace(shard, synchronizer=dataclasses.replace(shard.synchronizer, group=gid))
        plans.append(_unpartitioned(var, shard))
    return _strategy(model, cluster, plans)


@_register("horovod", HorovodOptions, "Horovod-like: tensor fusion of adjacent gradients up to a byte threshold")
def _horovod(model: ModelSpec, cluster: ClusterSpec, opts: HorovodOptions) -> Strategy:
    plans = []
    group, filled = 0, 0
    for var in model.variables:
        if var.sparse:
            plans.append(_unpartitioned(var, _dense_or_gather(var, 0)))
            continue
        if filled and filled + var.num_bytes > opts.fusion_threshold_bytes:
            group, filled = group + 1, 0
        filled += var.num_bytes
        plans.append(_unpartitioned(var, _dense_or_gather(var, group)))
    return _strategy(model, cluster, plans)


@_register("ps", PSOptions, "PS: every variable on one parameter server (the first node)")
def _ps(model: ModelSpec, cluster: ClusterSpec, opts: PSOptions) -> Strategy:
    server = _servers(cluster)[0]
    return _strategy(model, cluster, [_unpartitioned(v, ShardPlan(synchronizer=PSSynchronizer(
        placement=server, local_aggregation=opts.local_aggregation and not v.sparse))) for v in model.variables])


@_register("ps-lb", PSOptions, "TF-PS-LB: each variable to the least-loaded server (one per node), by bytes")
def _ps_lb(model: ModelSpec, cluster: ClusterSpec, opts: PSOptions) -> Strategy:
    loads = _GreedyLoads(_servers(cluster))
    plans = []
    for var in model.variables:
        (server,) = loads.place(var.num_bytes)
        sync = PSSynchronizer(placement=server, local_aggregation=opts.local_aggregation and not var.sparse)
        plans.append(_unpartitioned(var, ShardPlan(synchronizer=sync)))
    return _strategy(model, cluster, plans)


def _partitioned_ps(model: ModelSpec, cluster: ClusterSpec, opts: PartitionedPSOptions, shards_of) -> Strategy:
    servers = _servers(cluster)
    loads = _GreedyLoads(servers)
    plans = []
    for var in model.variables:
        n = var.shape[0] if var.shape else 1
        k = 1 if (not var.shape or _is_norm(var)) else shards_of(n, len(servers))
        placements = loads.place(var.num_bytes, k)
        shard_plans = tuple(
            ShardPlan(synchronizer=PSSynchronizer(placement=p, local_aggregation=opts.local_aggregation and not var.sparse))
            for p in placements
        )
        partition = (k,) + (1,) * (len(var.shape) - 1) if var.shape else ()
        plans.append(VariablePlan(variable=var.name, partition=partition, shards=shard_plans))
    return _strategy(model, cluster, plans)


@_register("partitioned-ps", PartitionedPSOptions,
           "Partitioned PS: axis 0 cut by its smallest divisor > 1, shards placed greedily by bytes")
def _partitioned_ps_even(model: ModelSpec, cluster: ClusterSpec, opts: PartitionedPSOptions) -> Strategy:
    return _partitioned_ps(model, cluster, opts, lambda n, servers: _even_shards(n, opts.max_shards, servers))


@_register("uneven-partitioned-ps", PartitionedPSOptions,
           "Uneven partitioned PS: axis 0 cut by its smallest non-divisor (uneven shards); no cut on one node")
def _partitioned_ps_uneven(model: ModelSpec, cluster: ClusterSpec, opts: PartitionedPSOptions) -> Strategy:
    def shards_of(n: int, servers: int) -> int:
        if servers < 2 or n < 2:
            return 1
        for d in range(2, min(n, opts.max_shards) + 1):
            if n % d:
                return d
        return min(n, opts.max_shards)

    return _partitioned_ps(model, cluster, opts, shards_of)


def _partitioned_allreduce(model: ModelSpec, cluster: ClusterSpec, chunk: int, axis_of, max_shards: int) -> Strategy:
    plans = []
    counter = 0
    for var in model.variables:
        axis = axis_of(var)
        k = 1 if axis is None else _even_shards(var.shape[axis], max_shards, len(cluster.nodes))
        shards = tuple(_dense_or_gather(var, (counter + i) // chunk) for i in range(k))
        counter += k
        partition = tuple(k if a == axis else 1 for a in range(len(var.shape)))
        plans.append(VariablePlan(variable=var.name, partition=partition, shards=shards))
    return _strategy(model, cluster, plans)


@_register("ps-hierarchical", HierarchicalPSOptions,
           "AutoDist's strong PS: reduce within each node first, variables over a size threshold cut into one "
           "shard per node, shards spread evenly over the nodes' servers")
def _ps_hierarchical(model: ModelSpec, cluster: ClusterSpec, opts: HierarchicalPSOptions) -> Strategy:
    # AutoDist §3.1, builder (5): hierarchical reduce/broadcast on multi-device nodes (Li et al.
    # 2014); variables above a hand-tuned threshold partitioned into #nodes shards, evenly placed.
    servers = _servers(cluster)
    loads = _GreedyLoads(servers)
    plans = []
    for var in model.variables:
        local = opts.local_aggregation and not var.sparse
        rows = var.shape[0] if var.shape else 1
        k = min(len(servers), rows) if (var.num_bytes >= opts.threshold_bytes and not _is_norm(var)) else 1
        if k > 1:
            # Shard i on node i: every node serves 1/k of each large variable.
            placements = servers[:k]
            for s in placements:
                loads.loads[s] += var.num_bytes / k
        else:
            placements = loads.place(var.num_bytes)
        shards = tuple(ShardPlan(synchronizer=PSSynchronizer(placement=p, local_aggregation=local)) for p in placements)
        partition = (k,) + (1,) * (len(var.shape) - 1) if var.shape else ()
        plans.append(VariablePlan(variable=var.name, partition=partition, shards=shards))
    return _strategy(model, cluster, plans)


@_register("partitioned-allreduce", PartitionedAllReduceOptions,
           "Partitioned AllReduce: axis 0 cut by its smallest divisor, shards all-reduced in chunks")
def _partitioned_ar(model: ModelSpec, cluster: ClusterSpec, opts: PartitionedAllReduceOptions) -> Strategy:
    return _partitioned_allreduce(model, cluster, opts.chunk,
                                  lambda v: 0 if v.shape and v.shape[0] > 1 else None, opts.max_shards)


@_register("random-axis-allreduce", RandomAxisOptions,
           "Random-axis partitioned AllReduce: a random axis of length > 1 (axis 0 if sparse) per variable")
def _random_axis_ar(model: ModelSpec, cluster: ClusterSpec, opts: RandomAxisOptions) -> Strategy:
    rng = random.Random(opts.seed)

    def axis_of(var: VariableSpec) -> int | None:
        candidates = [a for a, d in enumerate(var.shape) if d > 1]
        if not candidates:
            return None
        if var.sparse:
            return 0 if var.shape[0] > 1 else None
        return rng.choice(candidates)

    return _partitioned_allreduce(model, cluster, opts.chunk, axis_of, opts.max_shards)


@_register("parallax", ParallaxOptions, "Parallax: sparse variables on load-balanced PS, dense ones AllReduce")
def _parallax(model: ModelSpec, cluster: ClusterSpec, opts: ParallaxOptions) -> Strategy:
    loads = _GreedyLoads(_servers(cluster))
    plans = []
    for i, var in enumerate(model.variables):
        if var.sparse:
            (server,) = loads.place(var.num_bytes)
            plans.append(_unpartitioned(var, ShardPlan(synchronizer=PSSynchronizer(placement=server))))
        else:
            plans.append(_unpartitioned(var, _dense_or_gather(var, i // opts.chunk)))
    return _strategy(model, cluster, plans)


def _shardable(var: VariableSpec) -> bool:
    return not var.sparse and bool(var.shape) and var.dtype == "float32"


@_register("shard", ShardOptions, "FSDP/ZeRO: one shard unit per module (sparse: all-gather; scalars: all-reduce)")
def _shard(model: ModelSpec, cluster: ClusterSpec, opts: ShardOptions) -> Strategy:
    units: dict[str, int] = {}
    plans = []
    for var in model.variables:
        if not _shardable(var):
            plans.append(_unpartitioned(var, _dense_or_gather(var, 0)))
            continue
        module = ".".join(var.name.split(".")[:-1][:opts.depth])
        unit = units.setdefault(module, len(units))
        plans.append(_unpartitioned(var, ShardPlan(synchronizer=ShardSynchronizer(
            unit=unit, group=opts.group, reshard=opts.reshard, prefetch=opts.prefetch,
            reduce_dtype=opts.reduce_dtype))))
    return _strategy(model, cluster, plans)


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """Megatron-LM's plan (Shoeybi et al. 2019) on TP groups of ``degree`` devices of a node (0:
    the devices of the smallest node), the data-parallel axis ``dp``: ``shard`` (FSDP2 over the
    TP groups as torchtitan wraps a transformer: one unit per block, ``reshard`` after forward,
    and the rest of the model in the root's unit, kept), ``allreduce``, or ``auto``: shard where
    there is more than one TP group, else all-reduce (nothing to shard over one).
    ``sequence_parallel``: also split the sequence between the pairs (:func:`sequence_styles`);
    ``loss_parallel``: split the output layer over the vocabulary and compute the loss on the
    shards (:func:`output_layer`); ``embedding``: ``whole`` (the token embedding kept whole on
    every device) or ``rowwise`` (its vocabulary split, :func:`token_embedding`; with
    ``sequence_parallel`` its output is reduce-scattered onto the sequence in place of the
    ``scatter`` module, torchtitan's practice)."""

    degree: int = 0
    dp: str = "auto"
    reshard: bool = True
    sequence_parallel: bool = False
    loss_parallel: bool = False
    embedding: str = "whole"

    def __post_init__(self) -> None:
        if not isinstance(self.loss_parallel, bool):
            raise StrategyError(f"builder megatron: option loss_parallel: expected true or false, got "
                                f"{self.loss_parallel!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise StrategyError(f"builder megatron: option sequence_parallel: expected true or false, got "
                                f"{self.sequence_parallel!r}")
        if not (is_int(self.degree) and (self.degree == 0 or self.degree >= 2)):
            raise StrategyError(f"builder megatron: option degree: expected 0 (a node's devices) or a TP degree of 2 "
                                f"or more, got {self.degree!r}")
        if self.dp not in ("auto", "shard", "allreduce"):
            raise StrategyError(f"builder megatron: option dp: expected auto, shard or allreduce, got {self.dp!r}")
        if not isinstance(self.reshard, bool):
            raise StrategyError(f"builder megatron: option reshard: expected true or false, got {self.reshard!r}")
        if self.embedding not in ("whole", "rowwise"):
            raise StrategyError(f"builder megatron: option embedding: expected whole or rowwise, got {self.embedding!r}")


#: Module names (their last parts) Megatron's plan splits column-wise in attention and in the MLP,
#: and row-wise after them, as common PyTorch and Hugging Face models name them.
_ATTENTION_IN = ("query", "key", "value", "q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "wq", "wk", "wv")
_ATTENTION_OUT = ("output", "output.dense", "o_proj", "out_proj", "wo", "dense")
_MLP_IN = ("intermediate", "intermediate.dense", "fc1", "up_proj", "gate_proj", "w1", "w3", "lin1", "wi")
_MLP_OUT = ("output", "output.dense", "fc2", "down_proj", "w2", "lin2", "wo")


def _ends(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.endswith("." + n) for n in names)


def megatron_styles(model: ModelSpec, degree: int) -> dict[str, str]:
    """Per block of ``model`` (a numbered layer), Megatron's split of its linear layers: attention's
    query, key and value column-wise with its output row-wise, the MLP's first linear(s)
    column-wise with its last row-wise; a pair is split only where both sides are found and
    ``degree`` divides their split dimensions. Modules are recognised by name (``_ATTENTION_*``,
    ``_MLP_*``): an attention is the module of the block whose name holds ``attention`` or
    ``attn`` (a decoder's self- and cross-attention are two)."""
    from .checkpoint import block_of

    linears: dict[str, VariableSpec] = {}
    for var in model.variables:
        module, _, leaf = var.name.rpartition(".")
        if leaf == "weight" and len(var.shape) == 2 and not var.sparse and block_of(var.name).split(".")[-1].isdigit():
            linears[module] = var
    groups: dict[tuple[str, str], dict[str, list[str]]] = {}
    for module in linears:
        block = block_of(module + ".weight")
        inner = module[len(block) + 1:]
        parts = inner.split(".")
        at = next((i for i, p in enumerate(parts) if "attention" in p or "attn" in p), None)
        attention = block + "." + ".".join(parts[:at + 1]) if at is not None else None
        if attention and _ends(inner, _ATTENTION_IN):
            groups.setdefault((attention, "attention"), {}).setdefault("colwise", []).append(module)
        elif attention and _ends(inner, _ATTENTION_OUT):
            groups.setdefault((attention, "attention"), {}).setdefault("rowwise", []).append(module)
        elif _ends(inner, _MLP_IN):
            groups.setdefault((block, "mlp"), {}).setdefault("colwise", []).append(module)
        elif _ends(inner, _MLP_OUT):
            groups.setdefault((block, "mlp"), {}).setdefault("rowwise", []).append(module)
    styles: dict[str, str] = {}
    for (_block, _part), sides in groups.items():
        cols, rows = sides.get("colwise", []), sides.get("rowwise", [])
        if len(rows) != 1 or not cols:
            continue
        if all(linears[m].shape[0] % degree == 0 for m in cols) and linears[rows[0]].shape[1] % degree == 0:
            styles.update({m: "colwise" for m in cols})
            styles[rows[0]] = "rowwise"
    return styles


def _is_norm_module(module: str, variables: list[VariableSpec]) -> bool:
    """A norm by its name (``LayerNorm``, ``input_layernorm``, ``ln_f``, ``norm``) with parameters
    of one dimension at most."""
    leaf = module.rpartition(".")[2].lower()
    return ("norm" in leaf or leaf.startswith("ln")) and all(len(v.shape) <= 1 for v in variables)


def sequence_styles(model: ModelSpec, styles: Mapping[str, str]) -> dict[str, str]:
    """Sequence parallelism around Megatron's ``styles`` (Korthikanti et al. 2022): the norms of the
    numbered blocks ``sequence``; before the first block, the last norm (else the last module, the
    embedding) ``scatter``; after the last block, its leading norms ``sequence`` and every other
    module with a weight ``gather``. Refused where a linear layer inside the blocks is not split
    (it would get a sequence slice), and where no module with a weight follows the last block (the
    output would be computed on the split sequence outside any module, against whole tensors: an
    output layer tied to the embedding, as transformer-small's)."""
    from .checkpoint import block_of

    forward = list(model.variables)[::-1]  # the spec lists variables in backward order
    modules: dict[str, list[VariableSpec]] = {}
    for var in forward:
        module = var.name.rpartition(".")[0]
        if module:
            modules.setdefault(module, []).append(var)
    in_block = [block_of(m + ".x").split(".")[-1].isdigit() for m in modules]
    if not any(in_block):
        raise StrategyError(f"builder megatron: option sequence_parallel: model {model.name!r} has no numbered blocks "
                            f"whose norms could run on sequence slices")
    first, last = in_block.index(True), len(in_block) - 1 - in_block[::-1].index(True)
    names = list(modules)
    out: dict[str, str] = {}
    for module in names[first:last + 1]:
        own = modules[module]
        if _is_norm_module(module, own):
            out[module] = "sequence"
        elif module not in styles and any(len(v.shape) == 2 for v in own):
            raise StrategyError(f"builder megatron: option sequence_parallel: module {module!r} of a block is a layer "
                                f"the plan does not split, which would get a slice of the sequence; split it or set "
                                f"sequence_parallel=false")
    before = names[:first]
    entry = next((m for m in reversed(before) if _is_norm_module(m, modules[m])), before[-1] if before else None)
    if entry is None:
        raise StrategyError(f"builder megatron: option sequence_parallel: model {model.name!r} has no module before "
                            f"its first block (an embedding) where the sequence could be split")
    out[entry] = "scatter"
    after = names[last + 1:]
    if not any(len(v.shape) == 2 for m in after for v in modules[m]):
        # Nothing to gather at: the model computes its output from the last block's sequence-split
        # DTensor outside any module (transformer-small's projection on its embedding's tied
        # weight), where it meets plain tensors and the tp runtime's workers refuse the plan.
        block = block_of(names[last] + ".x")
        raise StrategyError(f"builder megatron: option sequence_parallel: model {model.name!r} has no module with a "
                            f"weight after its last block {block!r} where the split sequence could be gathered whole "
                            f"(its output is computed outside a module, e.g. on a weight tied to its embedding); set "
                            f"sequence_parallel=false")
    leading = True
    for module in after:
        own = modules[module]
        if leading and _is_norm_module(module, own):
            out[module] = "sequence"
            continue
        leading = False
        if any(len(v.shape) == 2 for v in own):
            out[module] = "gather"
    return out


def output_layer(model: ModelSpec, degree: int) -> str:
    """The output layer of ``model`` for a loss over vocabulary-split logits: after the last
    numbered block, the linear layer with a weight of its own shaped as the token embedding's
    (vocabulary x hidden: the embedding before the first block with the most rows), whose rows
    ``degree`` divides."""
    from .checkpoint import block_of

    forward = list(model.variables)[::-1]
    blocks = [i for i, v in enumerate(forward) if block_of(v.name).split(".")[-1].isdigit()]
    if not blocks:
        raise StrategyError(f"builder megatron: option loss_parallel: model {model.name!r} has no numbered blocks")
    embeddings = [tuple(v.shape) for v in forward[:blocks[0]] if len(v.shape) == 2]
    vocabulary = max(embeddings, default=None)  # the token embedding: the most rows
    heads = [v for v in forward[blocks[-1] + 1:] if v.name.endswith(".weight") and tuple(v.shape) == vocabulary]
    if not heads:
        raise StrategyError(f"builder megatron: option loss_parallel: model {model.name!r} has no output layer of its "
                            f"own after its last block shaped as its embedding (one tied to the embedding is the "
                            f"embedding's variable); set loss_parallel=false")
    head = heads[-1]
    if head.shape[0] % degree:
        raise StrategyError(f"builder megatron: option loss_parallel: the vocabulary of {head.name!r} "
                            f"({head.shape[0]}) is not divisible by a degree of {degree}")
    return head.name.rpartition(".")[0]


def token_embedding(model: ModelSpec, degree: int) -> str:
    """The token embedding of ``model`` to split row-wise: of the ``nn.Embedding`` modules the spec
    lists (its ``embeddings``) outside the numbered blocks, the one with the most rows (the
    vocabulary); refused where it is tied to another module (an output layer sharing its weight)
    or ``degree`` does not divide its vocabulary."""
    from .checkpoint import block_of

    found = []
    for module, tied in model.embeddings:
        if block_of(module + ".weight").split(".")[-1].isdigit():
            continue
        # a tied weight is one variable, named after the module that registered it first
        variable = next((n for n in (f"{module}.weight", *tied) if n in model), None)
        if variable is not None and len(model[variable].shape) == 2:
            found.append((model[variable].shape[0], module, tied))
    if not found:
        raise StrategyError(f"builder megatron: option embedding: model {model.name!r} has no nn.Embedding outside its "
                            f"blocks (the spec's embeddings); set embedding=whole")
    rows, module, tied = max(found, key=lambda f: (f[0], f[1]))
    if tied:
        raise StrategyError(f"builder megatron: option embedding: the token embedding {module!r} of model "
                            f"{model.name!r} is tied to {tied[0]!r} (an output layer sharing its weight); splitting it "
                            f"would untie them and train two copies: set embedding=whole")
    if rows % degree:
        raise StrategyError(f"builder megatron: option embedding: the vocabulary of {module!r} ({rows} rows) is not "
                            f"divisible by a degree of {degree}; set embedding=whole, or pad the vocabulary to a "
                            f"multiple of {degree}")
    return module


#: A block's tensor-parallel plan as strategy columns hold it
#: (:attr:`~synctune.strategy.columns.StrategyColumns.tp_blocks`, code = index): left whole,
#: Megatron's pairs split (:func:`megatron_styles`), or the pairs with sequence parallelism
#: between them (:func:`sequence_styles`).
TP_BLOCK_PLANS = ("none", "pairs", "sequence")


def megatron_block_styles(model: ModelSpec, degree: int, blocks: Mapping[str, str], *, loss_parallel: bool = False,
                  embedding: str = "whole") -> dict[str, str]:
    """The tensor-parallel styles of Megatron's plan on some blocks: ``blocks`` maps a numbered
    block (:func:`~synctune.strategy.checkpoint.block_of`) to its plan of :data:`TP_BLOCK_PLANS`
    (a block left out: ``none``); each ``pairs`` or ``sequence`` block gets its attention and MLP
    pairs split (:func:`megatron_styles` at ``degree``); ``sequence`` (every split block, or
    none: the sequence is split from the first block to the last) adds sequence parallelism
    around them (:func:`sequence_styles`); ``embedding`` ``rowwise`` splits the token embedding
    (:func:`token_embedding`), ``loss_parallel`` the output layer (:func:`output_layer`). The
    ``megatron`` builder's plan is this with every block that has pairs; strategy columns
    rebuild a plan from these choices (:func:`megatron_choices` is the inverse). Refused, naming
    the block and the fix, where a split block has no pair the degree divides or the plans mix
    ``sequence`` with others."""
    from .checkpoint import block_of

    field = "strategy: tensor_parallel"
    unknown = next(((b, p) for b, p in blocks.items() if p not in TP_BLOCK_PLANS), None)
    if unknown is not None:
        raise StrategyError(f"{field}: block {unknown[0]!r}: expected a plan of {', '.join(TP_BLOCK_PLANS)}, got "
                            f"{unknown[1]!r}")
    split = {b: p for b, p in blocks.items() if p != "none"}
    found = megatron_styles(model, degree)
    styles = {m: style for m, style in found.items() if block_of(m + ".weight") in split}
    have = {block_of(m + ".weight") for m in styles}
    missing = next((b for b in split if b not in have), None)
    if missing is not None:
        raise StrategyError(f"{field}: block {missing!r}: model {model.name!r} has no attention or MLP pair of linear "
                            f"layers there whose features a degree of {degree} divides; leave the block whole (plan "
                            f"none) or use a degree that divides its features")
    if not styles:
        raise StrategyError(f"{field}: no block is split (every block's plan is none); leave tensor_parallel out "
                            f"instead")
    plans = set(split.values())
    if "sequence" in plans:
        if len(plans) > 1:
            mixed = next(b for b, p in split.items() if p != "sequence")
            raise StrategyError(f"{field}: block {mixed!r}: plan {split[mixed]!r} beside sequence-parallel blocks; "
                                f"sequence parallelism splits the sequence from the first block to the last, so "
                                f"every split block is 'sequence', or none is")
        styles.update(sequence_styles(model, styles))
    if embedding == "rowwise":
        module = token_embedding(model, degree)
        scatter = [m for m, style in styles.items() if style == "scatter"]
        if scatter and scatter != [module]:
            raise StrategyError(f"builder megatron: option embedding: with sequence_parallel the sequence enters the "
                                f"split region at {scatter[0]!r}, after the token embedding {module!r} (whose "
                                f"output a row-wise split would reduce-scatter onto the sequence): set "
                                f"embedding=whole or sequence_parallel=false")
        styles[module] = "rowwise"
    elif embedding != "whole":
        raise StrategyError(f"{field}: embedding: expected whole or rowwise, got {embedding!r}")
    if loss_parallel:
        styles[output_layer(model, degree)] = "logits"
    return styles


def megatron_choices(model: ModelSpec, tp: Any) -> tuple[dict[str, str], bool, str]:
    """The choices :func:`megatron_block_styles` makes ``tp`` (a
    :class:`~synctune.strategy.tensor_parallel.TensorParallel`) of: each split block's plan,
    whether the loss is parallel, the embedding's split (``whole`` or ``rowwise``). Refused,
    naming the first module whose style differs, where ``tp`` is not such a plan (a
    hand-written one): what strategy columns cannot hold."""
    from .checkpoint import block_of
    from .tensor_parallel import is_embedding

    plan = "sequence" if tp.sequence_parallel else "pairs"
    blocks: dict[str, str] = {}
    embedding = "whole"
    for module, style in tp.styles:
        if style in ("colwise", "rowwise") and is_embedding(model, module):
            embedding = "rowwise" if style == "rowwise" else "colwise"
        elif style in ("colwise", "rowwise"):
            blocks[block_of(module + ".weight")] = plan
    field = "strategy: tensor_parallel"
    how = ("strategy columns hold Megatron's plan per block (none, pairs, sequence), the token embedding whole or "
           "row-wise and the loss parallel or not (the megatron builder's plans); run this strategy as a trial "
           "(synctune trial) instead of searching it")
    try:
        rebuilt = megatron_block_styles(model, tp.degree, blocks, loss_parallel=tp.loss_parallel, embedding=embedding)
    except StrategyError as exc:
        raise StrategyError(f"{field}: modules: not Megatron's plan on some blocks ({exc}); {how}") from None
    if tuple(sorted(rebuilt.items())) != tuple(tp.styles):
        own = dict(tp.styles)
        module = next(m for m in sorted(set(own) | set(rebuilt)) if own.get(m) != rebuilt.get(m))
        raise StrategyError(f"{field}: modules: {module!r} is {own.get(module, 'whole')!r} where Megatron's plan on "
                            f"the same blocks makes it {rebuilt.get(module, 'whole')!r}; {how}")
    return blocks, tp.loss_parallel, embedding


#: Builders whose strategies split modules (``tensor_parallel``): trials run them; a search does
#: not trial them as builder baselines, it tunes Megatron's plan as a baseline of its own (the
#: ``megatron`` runtime, listed as ``megatron`` in an experiment's baselines).
SPLITTING_BUILDERS = ("megatron",)


@_register("megatron", MegatronOptions,
           "Megatron-LM TP inside nodes (attention qkv/MLP-in column-wise, their outputs row-wise) + FSDP2 across")
def _megatron(model: ModelSpec, cluster: ClusterSpec, opts: MegatronOptions) -> Strategy:
    degree = opts.degree or min(n.num_devices for n in cluster.nodes)
    if degree < 2:
        raise StrategyError(f"builder megatron: option degree: cluster {cluster.name!r} has a node of one device, so "
                            f"a TP group of a node's devices splits nothing; give degree (2 or more) where nodes hold "
                            f"that many devices")
    base = _strategy(model, cluster, [_unpartitioned(v, ShardPlan(synchronizer=AllReduceSynchronizer(group=0)))
                                      for v in model.variables])
    return megatron_over(model, base, dataclasses.replace(opts, degree=degree))


def megatron_over(model: ModelSpec, base: Strategy, opts: MegatronOptions) -> Strategy:
    """Megatron's plan (:class:`MegatronOptions`, ``degree`` given: 2 or more) over the replicas,
    global batch and checkpointing of ``base``, its plans replaced: what the ``megatron`` builder
    writes for a cluster, and what the tuned Megatron baseline runs on a search's skeleton (its
    runtime knows the strategy, not the cluster). The global batch is ``base``'s (:func:`tp_batch_split`):
    a TP group trains the samples its replicas would, so that its time per iteration compares
    with data parallelism's at the same work."""
    degree = opts.degree
    if degree < 2:
        raise StrategyError(f"builder megatron: option degree: expected a TP degree of 2 or more, got {degree!r}")
    base = dataclasses.replace(base, batch_split=tp_batch_split(base, degree))
    styles = megatron_styles(model, degree)
    if not styles:
        raise StrategyError(f"builder megatron: model {model.name!r} has no attention or MLP pair of linear layers "
                            f"(named as {', '.join(_ATTENTION_IN[:3])} ... and {', '.join(_MLP_IN[:3])} ...) whose "
                            f"features a degree of {degree} divides")
    dp = opts.dp if opts.dp != "auto" else ("shard" if len(base.replicas) > degree else "allreduce")
    if dp == "shard":
        scalar = next((v.name for v in model.variables if not _shardable(v)), None)
        if scalar is not None:
            raise StrategyError(f"builder megatron: option dp: variable {scalar!r} cannot be sharded by FSDP2 (sparse, "
                                f"a scalar or not float32); use dp=allreduce")
        from .checkpoint import block_of

        units: dict[str, int] = {"": 0}
        plans = []
        for var in model.variables:
            block = block_of(var.name)
            block = block if block.split(".")[-1].isdigit() else ""
            unit = units.setdefault(block, len(units))
            reshard = opts.reshard and bool(block)
            plans.append(_unpartitioned(var, ShardPlan(synchronizer=ShardSynchronizer(
                unit=unit, reshard=reshard, prefetch=1 if reshard else 0))))
    else:
        plans = [_unpartitioned(v, ShardPlan(synchronizer=AllReduceSynchronizer(group=0))) for v in model.variables]
    base = dataclasses.replace(base, plans=tuple(plans), tensor_parallel=None)
    from .checkpoint import block_of

    plan = "sequence" if opts.sequence_parallel else "pairs"
    styles = megatron_block_styles(model, degree, {block_of(m + ".weight"): plan for m in styles},
                                   loss_parallel=opts.loss_parallel, embedding=opts.embedding)
    return dataclasses.replace(base, tensor_parallel={"degree": degree, "modules": styles})


def tp_batch_split(base: Strategy, degree: int) -> tuple[int, ...]:
    """The batch split of ``base``'s global batch over TP groups of ``degree`` consecutive
    replicas: each rank of a group holds the group's batch (its ranks train one batch), the sum
    of what its replicas train in ``base`` (for a ``base`` already split,
    :func:`without_tensor_parallel`'s). Refused where the replicas do not fill whole groups."""
    n = len(base.replicas)
    if n % degree:
        raise StrategyError(f"builder megatron: option degree: {n} replicas do not form TP groups of {degree}")
    per_replica = without_tensor_parallel(base).batch_split
    groups = [sum(per_replica[g:g + degree]) for g in range(0, n, degree)]
    return tuple(b for b in groups for _ in range(degree))


def without_tensor_parallel(strategy: Strategy) -> Strategy:
    """``strategy`` with no module split, at its global batch: each TP group's batch spread over
    its replicas (as evenly as it divides, the first replicas one sample more), so that each
    replica trains its own; ``strategy`` itself where it splits nothing."""
    tp = strategy.tensor_parallel
    if tp is None:
        return strategy
    t = tp.degree
    split = []
    for b in strategy.batch_split[::t]:
        if b < t:
            raise StrategyError(f"batch_split: a TP group's batch of {b} cannot give each of its {t} replicas a sample")
        split += [b // t + (1 if i < b % t else 0) for i in range(t)]
    return dataclasses.replace(strategy, tensor_parallel=None, batch_split=tuple(split))


# ------------------------------------------------------------------------------------------ entry


def parse_builder_options(builder: str, raw: Mapping[str, str]) -> Any:
    """Turn ``{"chunk": "64"}`` (CLI text) into the builder's options dataclass, typed."""
    info = BUILDERS.get(builder)
    fields = {f.name: f for f in dataclasses.fields(info.options)}
    values: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in fields:
            valid = ", ".join(fields) or "none"
            raise StrategyError(f"builder {builder}: unknown option {key!r}; valid: {valid}")
        default = fields[key].default
        try:
            if isinstance(default, bool):
                lowered = str(text).lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                values[key] = lowered in ("true", "1", "yes")
            elif isinstance(default, int) or (default is None and str(fields[key].type).startswith("int")):
                values[key] = int(text)
            else:
                values[key] = str(text)
        except ValueError:
            raise StrategyError(
                f"builder {builder}: option {key}: expected "
                f"{'int' if default is None else type(default).__name__}, got {text!r}"
            ) from None
    return info.options(**values)


def build_strategy(builder: str, model: ModelSpec, cluster: ClusterSpec, options: Any = None, **kwargs: Any) -> Strategy:
    """Run builder ``builder`` (a name from :data:`BUILDERS`) on a model and a cluster.

    ``options`` is the builder's options dataclass; keyword arguments build one instead.
    """
    info = BUILDERS.get(builder)
    if options is None:
        try:
            options = info.options(**kwargs)
        except TypeError as exc:
            raise StrategyError(f"builder {builder}: {exc}") from None
    elif kwargs:
        raise TypeError("pass either options or keyword options, not both")
    if not isinstance(options, info.options):
        raise TypeError(f"builder {builder} takes {info.options.__name__}, got {type(options).__name__}")
    return info.fn(model, cluster, options)


#: The papers' baselines with their settings swept (AutoDist §3.3: "related hyperparameters ...
#: hand-tuned and the best performance is reported"): AllReduce chunks and its hierarchical
#: form, Horovod fusion thresholds, the PS family with AutoDist's strong hierarchical PS at three
#: partitioning thresholds. ``baselines: [tuned]`` in an experiment stands for this list; equal
#: strategies (a small model collapses many chunk sizes) are measured once.
TUNED_BASELINES = (
    "allreduce:chunk=1", "allreduce:chunk=8", "allreduce:chunk=32", "allreduce", "allreduce:algorithm=hierarchical",
    f"horovod:fusion_threshold_bytes={4 * MIB}", f"horovod:fusion_threshold_bytes={16 * MIB}", "horovod",
    "ps-lb", "partitioned-ps", "parallax",
    f"ps-hierarchical:threshold_bytes={MIB // 4}", "ps-hierarchical", f"ps-hierarchical:threshold_bytes={4 * MIB}",
)


def parse_baseline(entry: str) -> tuple[str, Any]:
    """``builder`` or ``builder:option=value,option=value`` -> (builder name, its options)."""
    if not isinstance(entry, str) or not entry:
        raise StrategyError(f"baseline: expected 'builder' or 'builder:option=value,...', got {entry!r}")
    name, _sep, rest = entry.partition(":")
    info = BUILDERS.get(name)
    raw: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise StrategyError(f"baseline {entry[:80]!r}: expected option=value, got {item[:40]!r}")
        raw[key.strip()] = value.strip()
    return info.name, parse_builder_options(name, raw)


def baseline_strategy(entry: str, model: ModelSpec, cluster: ClusterSpec) -> Strategy:
    """The strategy of a baseline entry (see :func:`parse_baseline`)."""
    name, options = parse_baseline(entry)
    return build_strategy(name, model, cluster, options)
