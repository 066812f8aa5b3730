"""Features of (model, cluster, strategy) for the simulator (AutoSync §3.1).

A batch of strategies of one domain is read as columns, flat arrays over their shards
(:class:`~synctune.strategy.columns.StrategyColumns`, as the guided sampler draws them or
:func:`encode` makes them of objects), so features and the analytic estimate are computed with
numpy for thousands of strategies at once; what a shard sends in the domain (:func:`message_sizes`)
and how long the slowest replica computes (:func:`batch_scale`) are worked out from them here.

Predefined per-shard features follow AutoSync Eq. 2 for PS (network transfer to and from the
server over per-flow bandwidth, coefficients of the network overhead phi and kernel latency
delta, plus the server NIC and intra-node terms) and the analogous ring all-reduce (per merge
group) and all-gather costs, honouring single-flow bandwidth, local aggregation, partitioning
and compression. Global features are elementwise max and mean per synchronizer kind. All
times are divided by the domain's reference time (model bytes over the slowest flow) and
counts by the device count, so features do not grow with model or cluster size and learned
models transfer between domains (§3.3).

Each kind's terms are its own (:data:`synctune.simulator.kinds.FEATURE_KINDS`): the functions
here lay out the columns, hand each kind its rows (a row's kind is the one that prices it,
:attr:`~synctune.strategy.columns.StrategyColumns.pattern`) and add up what the kinds wrote.
"""

from __future__ import annotations

import math

import numpy as np

from ..strategy.columns import StrategyColumns
from ..strategy.compressors import COMPRESSORS
from ..strategy.schema import Strategy, StrategyError
from .domain import GBIT, AnalyticConstants, DomainContext, batch_scale, comm_terms
from .kinds import FEATURE_KINDS, AnalyticTerms, FeatureTerms, by_code, priced
from .kinds.shard import SHARD_GLOBAL_NAMES, SHARD_RAW_NAMES, shard_inputs, shard_unit_seconds, shard_units

__all__ = ["AnalyticConstants", "DomainContext", "encode", "message_sizes", "batch_scale", "shard_features",
           "shard_units", "shard_unit_seconds", "shard_inputs", "SHARD_RAW_NAMES", "SHARD_GLOBAL_NAMES",
           "global_features", "analytic_time", "RAW_NAMES", "PRE_NAMES", "GLOBAL_NAMES", "kind_blocks",
           "kind_inputs", "message_rows"]


def encode(strategies: list[Strategy], ctx: DomainContext) -> StrategyColumns:
    """Strategies of ``ctx``'s domain (they must validate against it) as the columns every
    function here reads (:meth:`StrategyColumns.from_strategies`). A strategy that splits
    modules (``tensor_parallel``) is refused: the functions here price rows, the data-parallel
    part alone (the replay prices the rest, :mod:`synctune.simulator.kinds.tensor_parallel`)."""
    split_one = next((s for s in strategies if s.tensor_parallel is not None), None)
    if split_one is not None:
        raise StrategyError(f"strategy {split_one.hash[:12]}: tensor_parallel: strategies that split modules are not "
                            f"priced as columns (their rows are the data-parallel part alone); score them with the "
                            f"replay simulator (simulator: replay), which replays them one by one")
    return StrategyColumns.from_strategies(ctx.model, ctx.cluster, strategies)


def _present(b: StrategyColumns, hook: str) -> list[tuple[int, object, np.ndarray]]:
    """(code, entry, rows) of each kind of ``b`` whose feature entry has ``hook``, in registry order."""
    out = []
    for code, kind in priced(FEATURE_KINDS, b):
        if getattr(kind, hook) is not None and b.pattern_mask(code).any():
            out.append((code, kind, b.pattern_rows(code)))
    return out


def message_rows(b: StrategyColumns) -> list[np.ndarray]:
    """The rows of ``b`` whose kind sends something else than their gradient (their
    :func:`message_sizes` differ from it), one index per such kind ([]: none)."""
    return [rows for _code, _kind, rows in _present(b, "message")]


def message_sizes(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray | None]:
    """Per shard, the bytes its gradient carries (sparse: the rows touched; a kind that sends
    something else, such as SFB's factors padded to the largest replica batch of its strategy:
    what it sends) and, for the shards of such kinds, the seconds the rebuild of the gradient
    takes after it is in (None where no shard has one)."""
    # Only the sparse shards and those kinds' are worked on (a round's proposals have millions of rows).
    var = b.var
    nbytes = ctx.var_bytes[var] * b.frac
    sparse = np.flatnonzero(ctx.var_sparse[var])
    nbytes[sparse] *= ctx.sparse_density[var[sparse]]
    rebuild = None
    for _code, kind, rows in _present(b, "message"):
        seconds = kind.message(b, ctx, rows, nbytes)
        if seconds is not None:
            rebuild = np.zeros(len(var)) if rebuild is None else rebuild
            rebuild[rows] = seconds
    return nbytes, rebuild


PRE_NAMES = ("ps_flow", "ps_nic", "ps_intra", "ps_phi", "ar_transfer", "ar_phi", "ag_transfer", "ag_phi", "delta")


def shard_features(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard predefined features in seconds/counts (S, 9), and per-shard wire bytes: each
    kind's columns (its ``predefined`` terms), and a kernel latency (``delta``) per shard."""
    m = ctx.var_bytes[b.var] * b.frac
    sparse = ctx.var_sparse[b.var]
    m_eff = np.where(sparse, m * ctx.sparse_density[b.var], m)
    wire = m_eff * b.ratio
    out = np.zeros((len(b.sid), len(PRE_NAMES)))
    terms = FeatureTerms(b=b, ctx=ctx, t=comm_terms(b, ctx), wire=wire, sent=m_eff, out=out, col=_PRE)
    for _code, kind, rows in _present(b, "predefined"):
        kind.predefined(terms, rows)
    out[:, _PRE["delta"]] = 1.0
    return out, wire


_PRE = {name: i for i, name in enumerate(PRE_NAMES)}
#: The families of AutoSync's predefined terms, each with its share of the model's bytes.
_FAMILIES = ("ps", "ar", "ag")
GLOBAL_NAMES = tuple(f"{agg}_{name}" for agg in ("max", "mean") for name in PRE_NAMES) + (
    "t_ps", "t_ar", "t_ag", "t_comp", "partitions_per_var", "ps_bytes", "ar_bytes", "ag_bytes", "max_server_share",
    "num_groups")


def _segment_sum(values: np.ndarray, seg: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(seg, weights=values, minlength=n)


def analytic_parts(b: StrategyColumns, ctx: DomainContext, *, split: bool = True) -> dict[str, np.ndarray]:
    """Per-strategy analytic terms in seconds (AutoSync Eq. 2 and the ring/gather analogues):
    ``per_server`` (n, nodes) PS load, ``t_ps`` the most loaded server, ``t_ar`` all-reduce,
    ``t_ag`` all-gather, ``t_comp`` compute, ``t_rebuild`` the rebuild of gradients sent as
    something else, and the parts kinds add of their own (``shard``'s). Computed with the fewest
    passes over the shards: proposals are scored with it tens of thousands at a time
    (``split=False`` saves the pass that tells all-gather from all-reduce: ``t_ar`` is then both
    collectives, ``t_ag`` zero)."""
    c = ctx.constants
    n = b.size
    kinds = priced(FEATURE_KINDS, b)
    m, rebuild = message_sizes(b, ctx)
    wire = m * b.ratio
    # Per-strategy tables only where a strategy replicates on a subset: the domain's constants
    # otherwise (measured: per-shard lookups for every strategy cut bert-large's analytic rate
    # from about 62,000 to 14,000 strategies/s, below the 50,000 goal).
    subset = b.replica_counts() is not None
    t = comm_terms(b, ctx) if subset else None
    collective = [(code, kind) for code, kind in kinds if kind.collective is not None]
    if subset:
        nn, ring = t["N"][b.sid], t["ring_bw"][b.sid]
        masks = [b.pattern_mask(code) for code, _kind in collective]
        seconds = [kind.collective(nn, ring, c) for _code, kind in collective]
        per_byte = np.select(masks, [s[0] for s in seconds], 0.0) if masks else np.zeros(len(b.sid))
        fixed = np.select(masks, [s[1] for s in seconds], 0.0) if masks else np.zeros(len(b.sid))
        ring_msgs = 2 * (t["N"] - 1)
    else:
        nn = ctx.N
        # Per-kind constants looked up by kind code: one gather, no masks.
        table = by_code(collective, lambda kind: kind.collective(nn, ctx.ring_bw, c), (0.0, 0.0)).astype(np.float64)
        per_byte, fixed = table[:, 0][b.pattern], table[:, 1][b.pattern]
        ring_msgs = 2 * (nn - 1)
    terms = AnalyticTerms(b=b, ctx=ctx, t=t, message=m, wire=wire, per_byte=per_byte,
                          per_server=np.zeros((n, ctx.W)), ring_msgs=ring_msgs,
                          parts={name: np.zeros(n) for _code, kind in kinds for name in kind.hidden + kind.exposed})
    for _code, kind, rows in _present(b, "adjust"):
        kind.adjust(terms, rows)
    per_shard = wire * terms.per_byte + fixed
    gathers = by_code(kinds, lambda kind: kind.family == "ag", False)
    terms.t_ag = np.bincount(b.sid, per_shard * gathers[b.pattern], n) if split else np.zeros(n)
    # A merge group pays the ring's 2(N-1) message overheads once.
    terms.t_ar = np.bincount(b.sid, per_shard, n) - terms.t_ag + c.phi * ring_msgs * b.ngroups
    for _code, kind, rows in _present(b, "totals"):
        kind.totals(terms, rows)
    # Stitching partitions costs kernels; the step waits for the slowest replica (its batch
    # share times its node's slowdown, :func:`batch_scale`), as the replay does.
    t_comp = (ctx.t_comp + c.delta * (np.diff(b.offsets) - ctx.num_vars)) * batch_scale(b, ctx)
    # Gradients sent as something else (SFB's factors) are rebuilt once every gather is in (the
    # step), after communication and compute.
    t_rebuild = np.bincount(b.sid, rebuild, n) if rebuild is not None else np.zeros(n)
    out = {"t_ps": terms.per_server.max(axis=1), "t_ar": terms.t_ar, "t_ag": terms.t_ag, "t_comp": t_comp,
           "per_server": terms.per_server, "t_rebuild": t_rebuild}
    out.update(terms.parts)
    return out


def analytic_time(b: StrategyColumns, ctx: DomainContext) -> np.ndarray:
    """The training-free estimate T = max(T_comp, T_sync) in seconds (AutoDist §2.4, AutoSync §3.1.1):
    T_sync the PS, all-reduce and all-gather seconds and the parts kinds add that overlap
    backward, then the rebuilds and the parts kinds add after it."""
    p = analytic_parts(b, ctx, split=False)
    kinds = [kind for _code, kind in priced(FEATURE_KINDS)]
    sync = p["t_ps"] + p["t_ar"] + p["t_ag"]
    for name in (name for kind in kinds for name in kind.hidden):
        sync = sync + p[name]
    total = np.maximum(p["t_comp"], sync) + p["t_rebuild"]
    for name in (name for kind in kinds for name in kind.exposed):
        total = total + p[name]
    return total


def global_features(b: StrategyColumns, ctx: DomainContext, pre: np.ndarray, wire: np.ndarray) -> np.ndarray:
    """(n, len(GLOBAL_NAMES)) domain-normalised global features."""
    n = b.size
    norm = pre.copy()
    norm[:, [0, 1, 2, 4, 6]] /= ctx.t_ref
    norm[:, [3, 5, 7]] /= max(1.0, ctx.N)
    counts = np.diff(b.offsets).astype(np.float64)
    # Shards of a strategy are contiguous: segment reductions are reduceat over the offsets.
    mx = np.maximum.reduceat(norm, b.offsets[:-1], axis=0)
    mean = np.add.reduceat(norm, b.offsets[:-1], axis=0) / counts[:, None]
    parts = analytic_parts(b, ctx)
    bytes_total = ctx.model_bytes
    # Each family's share of the model's bytes: its kinds' gradients, then the messages of its
    # kinds that send something else (SFB's factors count with the all-gathered bytes).
    kinds = priced(FEATURE_KINDS, b)
    kind_bytes = []
    for family in _FAMILIES:
        codes = [code for code, kind in kinds if kind.family == family and not kind.counts_message]
        mine = b.pattern_mask(codes[0]) if len(codes) == 1 else np.isin(b.pattern, codes)
        kind_bytes.append(_segment_sum(np.where(mine, ctx.var_bytes[b.var] * b.frac, 0.0), b.sid, n) / bytes_total)
    for code, kind in kinds:
        sent = b.pattern_mask(code)
        if kind.family is not None and kind.counts_message and sent.any():
            at = _FAMILIES.index(kind.family)
            kind_bytes[at] = kind_bytes[at] + _segment_sum(np.where(sent, message_sizes(b, ctx)[0], 0.0), b.sid,
                                                           n) / bytes_total
    server_share = parts["per_server"].max(axis=1) / np.maximum(parts["per_server"].sum(axis=1), 1e-30)
    groups = b.ngroups
    extra = np.stack([parts["t_ps"] / ctx.t_ref, parts["t_ar"] / ctx.t_ref, parts["t_ag"] / ctx.t_ref,
                      parts["t_comp"] / ctx.t_ref, counts / ctx.num_vars, *kind_bytes, server_share,
                      groups / ctx.num_vars], axis=1)
    return np.concatenate([mx, mean, extra], axis=1)


RAW_NAMES = ("is_ps", "is_ar", "is_ag", "is_sfb", *(f"comp_{name}" for name in COMPRESSORS), "wire_ratio", "local_agg",
             "server_nic", "server_devices", "server_flow", "group_members", "group_bytes", "group_order", "nshards",
             "shard_frac", "axis_gt0", "log_bytes", "bytes_share", "ndims", "sparse", "position", "nodes", "log_devices",
             "min_nic", "max_nic", "min_flow", "min_intra")
_RAW = {name: i for i, name in enumerate(RAW_NAMES)}


def raw_features(b: StrategyColumns, ctx: DomainContext, wire: np.ndarray) -> np.ndarray:
    """(S, len(RAW_NAMES)) per-shard raw features (AutoSync §3.1.2), scale-free."""
    s = len(b.sid)
    out = np.zeros((s, len(RAW_NAMES)))
    col = _RAW
    # A kind's one-hot (-1: its own features hold it, appended after everything a simulator
    # trained before the kind existed reads, so its inputs keep their positions and values).
    column = by_code(priced(FEATURE_KINDS, b), lambda kind: _RAW[kind.one_hot] if kind.one_hot else -1, -1)[b.pattern]
    known = column >= 0
    out[np.flatnonzero(known), column[known]] = 1.0
    out[np.arange(s), col["comp_" + COMPRESSORS.names()[0]] + b.comp.astype(np.int64)] = 1.0
    out[:, col["wire_ratio"]] = b.ratio
    out[:, col["local_agg"]] = b.local
    terms = FeatureTerms(b=b, ctx=ctx, t=None, wire=wire, sent=None, out=out, col=col)
    for _code, kind, rows in _present(b, "raw"):
        kind.raw(terms, rows)
    out[:, col["nshards"]] = b.nshards / 4.0
    out[:, col["shard_frac"]] = b.frac
    out[:, col["axis_gt0"]] = b.axis > 0
    nbytes = ctx.var_bytes[b.var] * b.frac
    out[:, col["log_bytes"]] = np.log10(np.maximum(nbytes, 1.0)) / 10.0
    out[:, col["bytes_share"]] = nbytes / ctx.model_bytes
    out[:, col["ndims"]] = ctx.var_ndims[b.var] / 4.0
    out[:, col["sparse"]] = ctx.var_sparse[b.var]
    out[:, col["position"]] = b.var / max(1, ctx.num_vars - 1)
    out[:, col["nodes"]] = ctx.W / 16.0
    out[:, col["log_devices"]] = math.log2(max(1.0, ctx.N)) / 5.0
    out[:, col["min_nic"]] = ctx.nic.min() / (10 * GBIT)
    out[:, col["max_nic"]] = ctx.nic.max() / (10 * GBIT)
    out[:, col["min_flow"]] = ctx.flow.min() / (10 * GBIT)
    out[:, col["min_intra"]] = ctx.intra.min() / (10 * GBIT)
    return out


def per_shard_inputs(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """(S, raw + predefined) inputs of the sequence models, and (n, global) features."""
    pre, wire = shard_features(b, ctx)
    glob = global_features(b, ctx, pre, wire)
    norm = pre.copy()
    norm[:, [0, 1, 2, 4, 6]] /= ctx.t_ref
    norm[:, [3, 5, 7]] /= max(1.0, ctx.N)
    return np.concatenate([raw_features(b, ctx, wire), norm], axis=1), glob


def kind_blocks(kinds: list[str] | None = None) -> list[tuple[str, object]]:
    """(kind name, :class:`~synctune.simulator.kinds.FeatureBlock`) of the kinds with features of
    their own, in registry order, among ``kinds`` (names; None: every registered kind)."""
    return [(name, FEATURE_KINDS.get(name).block) for name in FEATURE_KINDS
            if FEATURE_KINDS.get(name).block is not None and (kinds is None or name in kinds)]


def kind_inputs(b: StrategyColumns, ctx: DomainContext, kinds: list[str] | None = None
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The per-shard and per-strategy features of :func:`kind_blocks`' blocks, one array each, in
    its order: what the learned models append after their other inputs."""
    values = [block.inputs(b, ctx) for _name, block in kind_blocks(kinds)]
    return [x for x, _g in values], [g for _x, g in values]
