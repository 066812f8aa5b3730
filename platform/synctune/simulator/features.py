"""Features of (model, cluster, strategy) for the simulator (AutoSync §3.1).

A batch of strategies of one domain is encoded as flat arrays over their shards
(:class:`StrategyBatch`), so features and the analytic estimate are computed with numpy for
thousands of strategies at once.

Predefined per-shard features follow AutoSync Eq. 2 for PS (network transfer to and from the
server over per-flow bandwidth, coefficients of the network overhead phi and kernel latency
delta, plus the server NIC and intra-node terms) and the analogous ring all-reduce (per merge
group) and all-gather costs, honouring single-flow bandwidth, local aggregation, partitioning
and compression. Global features are elementwise max and mean per synchronizer kind. All
times are divided by the domain's reference time (model bytes over the slowest flow) and
counts by the device count, so features do not grow with model or cluster size and learned
models transfer between domains (§3.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import AllGatherSynchronizer, AllReduceSynchronizer, PSSynchronizer, SFBSynchronizer, Strategy
from ..strategy.compressors import COMPRESSORS
from ..strategy.partition import shard_shapes

__all__ = ["AnalyticConstants", "DomainContext", "StrategyBatch", "encode", "encode_columns", "shard_features", "global_features",
           "analytic_time", "RAW_NAMES", "PRE_NAMES", "GLOBAL_NAMES"]

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
#: Synchronizer kind codes. Sufficient-factor broadcasting (TAG §2.3) is an all-gather of the
#: factors, padded to the largest replica batch, then a rebuild of the gradient on every replica.
KIND_PS, KIND_AR, KIND_AG, KIND_SFB = 0, 1, 2, 3
#: Peak dense float32 throughput per device model (FLOP/s), for the compute term.
DEVICE_FLOPS = {"T4": 8.1e12, "M60": 4.8e12, "TITAN X": 11e12, "cpu": 5e10}


@dataclass(frozen=True)
class AnalyticConstants:
    """phi: per-message network overhead (s); delta: per-shard kernel latency (s);
    sparse_rows_per_sample: rows of an embedding one sample touches (sparse message size)."""

    phi: float = 5e-5
    delta: float = 2e-5
    sparse_rows_per_sample: float = 32.0
    compute_flops_per_param_sample: float = 6.0


@dataclass
class DomainContext:
    """Per-(model, cluster) arrays the encoders and features share."""

    model: ModelSpec
    cluster: ClusterSpec
    constants: AnalyticConstants = field(default_factory=AnalyticConstants)

    def __post_init__(self) -> None:
        m, c = self.model, self.cluster
        self.var_index = {v.name: i for i, v in enumerate(m.variables)}
        self.var_bytes = np.array([v.num_bytes for v in m.variables], dtype=np.float64)
        self.var_ndims = np.array([len(v.shape) for v in m.variables], dtype=np.float64)
        self.var_sparse = np.array([v.sparse for v in m.variables], dtype=bool)
        self.var_rows = np.array([v.shape[0] if v.shape else 1 for v in m.variables], dtype=np.float64)
        self.num_vars = len(m.variables)
        self.model_bytes = float(self.var_bytes.sum())
        self.node_names = [n.name for n in c.nodes]
        self.node_of_device = {d: i for i, n in enumerate(c.nodes) for d in n.devices}
        # Heterogeneous compute (TAG §2.1): how much longer a replica on each node computes the
        # same batch than one on the fastest node, from calibrated speeds (1 where unmeasured).
        speeds = [n.compute_gflops for n in c.nodes]
        known = [x for x in speeds if x]
        self.node_slowdown = np.array([max(known) / x if (x and known) else 1.0 for x in speeds], dtype=np.float64)
        self.device_slowdown = {d: float(self.node_slowdown[i]) for d, i in self.node_of_device.items()}
        self.r = np.array([n.num_devices for n in c.nodes], dtype=np.float64)
        self.nic = np.array([n.nic_gbps for n in c.nodes]) * GBIT
        self.flow = np.array([n.single_flow_gbps for n in c.nodes]) * GBIT
        self.intra = np.array([n.intra_node_gbps for n in c.nodes]) * GBIT
        self.W = len(c.nodes)
        self.N = float(self.r.sum())
        tables = self.comm_tables(self.r[None, :])
        self.ps_flow_coef, self.ps_phi_coef = tables["ps_flow"][0], tables["ps_phi"][0]
        self.ps_nic_coef, self.ps_intra_coef = tables["ps_nic"][0], tables["ps_intra"][0]
        self.ring_bw = float(tables["ring_bw"][0])
        self.hier_per_byte, self.hier_msgs = float(tables["hier_per_byte"][0]), float(tables["hier_msgs"][0])
        self.t_ref = self.model_bytes / float(self.flow.min())
        flops = DEVICE_FLOPS.get(c.nodes[0].device_model, DEVICE_FLOPS["cpu"])
        per_sample = m.flops_per_sample or self.constants.compute_flops_per_param_sample * m.num_parameters
        self.t_comp = per_sample * m.batch_size / flops
        # The rebuild of an SFB gradient runs at the nominal speed of the slowest replica.
        self.device_flops = flops / float(self.node_slowdown.max())
        # Sufficient factors: a linear weight's input and output widths in bytes per factor row,
        # and the factor rows one sample feeds it (0 where the variable is no linear weight).
        elem = self.var_bytes / np.maximum(1.0, np.array([v.num_elements for v in m.variables], dtype=np.float64))
        self.factor_rows = np.array([r or 0 for r in (m.factor_rows or [0] * self.num_vars)], dtype=np.float64)
        self.factor_width = np.array([(v.shape[0] + v.shape[1]) if len(v.shape) == 2 else 0 for v in m.variables],
                                     dtype=np.float64) * elem
        self.var_elems = np.array([v.num_elements for v in m.variables], dtype=np.float64)
        # Flat lookup tables: coefficient of server node j with hierarchical flag ip at j*2+ip.
        self.ps_flow_flat = self.ps_flow_coef.reshape(-1)
        self.ps_nic_flat = self.ps_nic_coef.reshape(-1)
        self.ps_phi_flat = self.ps_phi_coef.reshape(-1)
        self.ps_intra_flat = self.ps_intra_coef.reshape(-1)

        self.sparse_density = np.minimum(1.0, m.batch_size * self.constants.sparse_rows_per_sample
                                         / np.maximum(self.var_rows, 1.0))

    def comm_tables(self, r: np.ndarray) -> dict[str, np.ndarray]:
        """Communication coefficients for strategies whose replicas per node are the rows of
        ``r`` (n, nodes): every device (``self.r``), or a subset (TAG §4.2: idle devices take
        no part in synchronization). ``ps_flow``/``ps_phi``/``ps_nic``/``ps_intra`` are (n,
        nodes, 2) by server node and local-aggregation flag: per server node j, the sum over
        other nodes k of the messages they send (1 with local aggregation, r_k without) over the
        j-k per-flow bandwidth; ``ring_bw`` the ring's slowest flow among nodes holding replicas
        (the slowest intra-node link on one node), ``N`` replicas, ``W`` nodes holding them."""
        r = np.asarray(r, dtype=np.float64)
        w = self.W
        used = r > 0
        b = np.minimum(self.flow[:, None], self.flow[None, :])
        other = (1.0 - np.eye(w))[None, :, :] * used[:, None, :]  # [s, j, k]: k != j sends to j
        flow = np.stack([(other * r[:, None, :] / b[None]).sum(2), (other / b[None]).sum(2)], axis=2)
        phi = np.stack([(other * r[:, None, :]).sum(2), other.sum(2)], axis=2)
        nic = phi / self.nic[None, :, None]
        within = np.maximum(r - 1, 0) / self.intra[None, :]
        intra = np.stack([within, np.repeat(within.max(1, keepdims=True), w, axis=1)], axis=2)
        nodes = used.sum(1)
        flows = np.where(used, self.flow[None, :], np.inf).min(1)
        intras = np.where(used, self.intra[None, :], np.inf).min(1)
        ring = np.where(nodes > 1, flows, intras)
        # Hierarchical all-reduce as the engine runs it (Horovod's hierarchical mode): a
        # reduce-scatter inside each node, the node's r pieces all-reduced across the W nodes as r
        # rings in parallel (sharing the NIC), an all-gather inside each node. Seconds per byte
        # of the message, and messages per replica.
        per_node = r.max(1)
        w_used = nodes.astype(np.float64)
        cross = np.where(used, np.minimum(self.nic[None, :], per_node[:, None] * self.flow[None, :]), np.inf).min(1)
        hier_bytes = (2 * np.maximum(per_node - 1, 0) / np.maximum(per_node, 1) / intras
                      + np.where(w_used > 1, 2 * (w_used - 1) / np.maximum(w_used, 1) / cross, 0.0))
        hier_msgs = 2 * np.maximum(per_node - 1, 0) + 2 * np.maximum(w_used - 1, 0)
        return {"ps_flow": flow, "ps_phi": phi, "ps_nic": nic, "ps_intra": intra, "ring_bw": ring,
                "N": r.sum(1), "W": w_used, "r": r, "hier_per_byte": hier_bytes, "hier_msgs": hier_msgs}


def comm_terms(b: "StrategyBatch", ctx: DomainContext) -> dict[str, np.ndarray]:
    """Per-strategy communication coefficients of ``b`` (:meth:`DomainContext.comm_tables`),
    the PS ones flattened for a lookup at ``sid * 2 * nodes + node * 2 + local``: the domain's
    own where every strategy replicates on every device."""
    n, w = b.size, ctx.W
    if b.replica_counts is None:
        tabs = {"ps_flow": np.broadcast_to(ctx.ps_flow_coef, (n, w, 2)),
                "ps_phi": np.broadcast_to(ctx.ps_phi_coef, (n, w, 2)),
                "ps_nic": np.broadcast_to(ctx.ps_nic_coef, (n, w, 2)),
                "ps_intra": np.broadcast_to(ctx.ps_intra_coef, (n, w, 2)),
                "ring_bw": np.full(n, ctx.ring_bw), "N": np.full(n, ctx.N), "W": np.full(n, float(w)),
                "r": np.broadcast_to(ctx.r, (n, w)), "hier_per_byte": np.full(n, ctx.hier_per_byte),
                "hier_msgs": np.full(n, ctx.hier_msgs)}
    else:
        tabs = ctx.comm_tables(b.replica_counts)
    for key in ("ps_flow", "ps_phi", "ps_nic", "ps_intra"):
        tabs[key + "_flat"] = np.ascontiguousarray(tabs[key]).reshape(-1)
    return tabs


@dataclass
class StrategyBatch:
    """Shards of many strategies of one domain as flat arrays (shards in backward order)."""

    offsets: np.ndarray  # (n+1,) shard range of each strategy
    sid: np.ndarray  # (S,) strategy index of each shard
    var: np.ndarray  # (S,) variable index
    frac: np.ndarray  # (S,) share of the variable's elements
    nshards: np.ndarray  # (S,) shards of its variable
    axis: np.ndarray  # (S,) partition axis (0 when whole)
    kind: np.ndarray  # (S,) 0 ps, 1 allreduce, 2 allgather, 3 sfb
    node: np.ndarray  # (S,) PS placement node (-1 otherwise)
    local: np.ndarray  # (S,) local aggregation
    group: np.ndarray  # (S,) merge group renumbered 0.. per strategy (-1 otherwise)
    comp: np.ndarray  # (S,) compressor code
    ratio: np.ndarray  # (S,) wire bytes / shard bytes
    ngroups: np.ndarray  # (n,) merge groups per strategy
    nbytes: np.ndarray  # (S,) bytes a shard's gradient carries (sparse: rows touched)
    wire: np.ndarray  # (S,) the same after the compressor
    #: (n,) the largest replica batch over the model's batch (an uneven split's slowest replica)
    batch_scale: np.ndarray | None = None
    #: (n, nodes) replicas per node of each strategy; None when every strategy uses every device
    replica_counts: np.ndarray | None = None
    #: (S,) seconds every replica spends rebuilding an SFB gradient from the gathered factors
    rebuild: np.ndarray | None = None
    #: (S,) all-reduce shards run hierarchically (reduce-scatter in each node, all-reduce across
    #: nodes, all-gather in each node); None when no shard does
    hier: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.offsets) - 1


def _message_sizes(ctx: DomainContext, var, frac, kind, sid, longest, global_batch):
    """Per shard, the bytes its gradient carries (sparse: the rows touched; SFB: the factors,
    padded to the largest replica batch ``longest`` of its strategy) and, for SFB shards, the
    seconds the rebuild of the gradient from ``global_batch`` rows takes (None without SFB)."""
    # Only the sparse and SFB shards are worked on (a round's proposals have millions of rows).
    nbytes = ctx.var_bytes[var] * frac
    sparse = np.flatnonzero(ctx.var_sparse[var])
    nbytes[sparse] *= ctx.sparse_density[var[sparse]]
    sfb = np.flatnonzero(kind == KIND_SFB)
    if not len(sfb):
        return nbytes, None
    v, s = var[sfb], sid[sfb]
    rows = ctx.factor_rows[v]
    nbytes[sfb] = np.asarray(longest, np.float64)[s] * rows * ctx.factor_width[v]
    rebuild = np.zeros(len(var))
    rebuild[sfb] = 2.0 * np.asarray(global_batch, np.float64)[s] * rows * ctx.var_elems[v] / ctx.device_flops
    return nbytes, rebuild


def encode(strategies: list[Strategy], ctx: DomainContext) -> StrategyBatch:
    """Encode strategies of ``ctx``'s domain (they must validate against it)."""
    cols: dict[str, list] = {k: [] for k in ("sid", "var", "frac", "nshards", "axis", "kind", "node", "local",
                                              "group", "comp", "ratio")}
    offsets = [0]
    ngroups: list[int] = []
    scales: list[float] = []
    counts = np.zeros((len(strategies), ctx.W))
    longest: list[int] = []  # the largest replica batch (SFB pads every replica's factors to it)
    global_batch: list[int] = []  # the rows of a rebuilt SFB gradient
    model = ctx.model
    wire_of: dict[tuple, tuple[int, float]] = {}  # (compressor, rank, shape) -> (code, wire ratio)
    hier: list[int] = []  # shard indices on hierarchical all-reduce
    for si, s in enumerate(strategies):
        groups: dict[int, int] = {}
        plans = sorted(s.plans, key=lambda p: ctx.var_index[p.variable])
        for plan in plans:
            vi = ctx.var_index[plan.variable]
            var = model.variables[vi]
            k = plan.num_shards
            axis = next((a for a, p in enumerate(plan.partition) if p > 1), 0)
            shapes = shard_shapes(var.shape, plan.partition) if k > 1 else [var.shape]
            total = max(1, var.num_elements)
            for shard, shape in zip(plan.shards, shapes):
                sync = shard.synchronizer
                n_el = math.prod(shape) if shape else 1
                cols["sid"].append(si)
                cols["var"].append(vi)
                cols["frac"].append(n_el / total)
                cols["nshards"].append(k)
                cols["axis"].append(axis)
                comp = shard.compressor
                key = (comp.kind, comp.rank, shape)
                if key not in wire_of:
                    info = comp.info
                    wire_of[key] = (info.code, info.wire_ratio(tuple(shape), comp.rank))
                code, ratio = wire_of[key]
                cols["comp"].append(code)
                cols["ratio"].append(ratio)
                if isinstance(sync, PSSynchronizer):
                    cols["kind"].append(KIND_PS)
                    cols["node"].append(ctx.node_of_device[sync.placement])
                    cols["local"].append(sync.local_aggregation)
                    cols["group"].append(-1)
                elif isinstance(sync, AllReduceSynchronizer):
                    cols["kind"].append(KIND_AR)
                    cols["node"].append(-1)
                    cols["local"].append(False)
                    cols["group"].append(groups.setdefault(sync.group, len(groups)))
                    if sync.algorithm == "hierarchical":
                        hier.append(len(cols["sid"]) - 1)
                else:
                    assert isinstance(sync, (AllGatherSynchronizer, SFBSynchronizer))
                    cols["kind"].append(KIND_SFB if isinstance(sync, SFBSynchronizer) else KIND_AG)
                    cols["node"].append(-1)
                    cols["local"].append(False)
                    cols["group"].append(-1)
        offsets.append(len(cols["sid"]))
        longest.append(max(s.batch_split) if s.batch_split else model.batch_size)
        global_batch.append(sum(s.batch_split) if s.batch_split else model.batch_size)
        ngroups.append(len(groups))
        for d in s.replicas:
            counts[si, ctx.node_of_device[d]] += 1
        # Every replica's compute time relative to one nominal batch on the fastest node: its
        # batch share times its node's slowdown; the iteration waits for the slowest replica.
        scales.append(max(n * ctx.device_slowdown.get(d, 1.0) for n, d in zip(s.batch_split, s.replicas))
                      / model.batch_size if s.batch_split else 1.0)
    ints = {"sid", "var", "nshards", "axis", "kind", "node", "group", "comp"}
    arrays = {k: np.asarray(v, dtype=np.int64 if k in ints else (bool if k == "local" else np.float64))
              for k, v in cols.items()}
    var, frac = arrays["var"], arrays["frac"]
    nbytes, rebuild = _message_sizes(ctx, var, frac, arrays["kind"], arrays["sid"], longest, global_batch)
    return StrategyBatch(offsets=np.asarray(offsets, dtype=np.int64), ngroups=np.asarray(ngroups, np.float64),
                         nbytes=nbytes, wire=nbytes * arrays["ratio"], batch_scale=np.asarray(scales, np.float64),
                         replica_counts=None if (counts == ctx.r[None, :]).all() else counts, rebuild=rebuild,
                         hier=_flags(hier, len(arrays["sid"])), **arrays)


def _flags(indices: list[int], size: int) -> np.ndarray | None:
    if not indices:
        return None
    out = np.zeros(size, dtype=bool)
    out[indices] = True
    return out


def encode_columns(cols, ctx: DomainContext) -> StrategyBatch:
    """Encode :class:`~synctune.strategy.columns.StrategyColumns` of ``ctx``'s domain without
    making a strategy object: the same batch :func:`encode` makes of ``[cols.strategy(i) for i
    in range(cols.size)]``, at array speed (a search round's proposals)."""
    n = cols.size
    sid, var, kind = cols.sid, cols.var, cols.kind
    is_ar = kind == KIND_AR
    # Merge groups renumbered 0.. per strategy in the order they first appear (as encode does).
    group = np.full(len(sid), -1, np.int64)
    ngroups = np.zeros(n)
    if cols.group_order is not None and cols.ngroups is not None:  # the producer numbered them
        group, ngroups = cols.group_order, np.asarray(cols.ngroups, np.float64)
    elif is_ar.any():
        rows = np.flatnonzero(is_ar)
        key = sid[rows] * (int(cols.group.max()) + 2) + cols.group[rows]
        uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        owner = sid[rows][first]
        order = np.lexsort((first, owner))  # groups by strategy, then by first appearance
        rank = np.empty(len(uniq), np.int64)
        starts = np.r_[0, np.flatnonzero(np.diff(owner[order])) + 1]
        rank[order] = np.arange(len(uniq)) - np.repeat(starts, np.diff(np.r_[starts, len(uniq)]))
        group[rows] = rank[inverse]
        ngroups = np.bincount(owner, minlength=n).astype(np.float64)
    model = ctx.model
    if cols.batch_split is None:
        split = np.full((n, len(ctx.node_of_device)), model.batch_size, np.int64)
    else:
        split = np.asarray(cols.batch_split, np.int64)
    slowdown = np.array([ctx.device_slowdown.get(d, 1.0) for d in ctx.cluster.devices])
    scales = (split * slowdown[None, :]).max(1) / model.batch_size
    nbytes, rebuild = _message_sizes(ctx, var, cols.frac, kind, sid, split.max(1), split.sum(1))
    node = cols.node
    return StrategyBatch(offsets=np.asarray(cols.offsets, np.int64), sid=sid, var=var, frac=cols.frac,
                         nshards=cols.nshards, axis=cols.axis, kind=kind, node=node, local=cols.local, group=group,
                         comp=cols.comp_code, ratio=cols.ratio, ngroups=ngroups, nbytes=nbytes,
                         wire=nbytes * cols.ratio, batch_scale=scales, replica_counts=None, rebuild=rebuild,
                         hier=cols.hier if cols.hier.any() else None)


PRE_NAMES = ("ps_flow", "ps_nic", "ps_intra", "ps_phi", "ar_transfer", "ar_phi", "ag_transfer", "ag_phi", "delta")


def shard_features(b: StrategyBatch, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard predefined features in seconds/counts (S, 9), and per-shard wire bytes."""
    m = ctx.var_bytes[b.var] * b.frac
    sparse = ctx.var_sparse[b.var]
    m_eff = np.where(sparse, m * ctx.sparse_density[b.var], m)
    wire = m_eff * b.ratio
    ps = b.kind == KIND_PS
    node = np.where(ps, b.node, 0)
    ip = b.local.astype(np.int64)
    both = wire + m_eff  # gradient up (encoded), parameters down (plain)
    out = np.zeros((len(b.sid), len(PRE_NAMES)))
    t = comm_terms(b, ctx)
    look = b.sid * (2 * ctx.W) + node * 2 + ip
    out[:, 0] = np.where(ps, both * t["ps_flow_flat"][look], 0.0)
    out[:, 1] = np.where(ps, both * t["ps_nic_flat"][look], 0.0)
    out[:, 2] = np.where(ps, both * t["ps_intra_flat"][look], 0.0)
    out[:, 3] = np.where(ps, t["ps_phi_flat"][look], 0.0)
    n, ring = t["N"][b.sid], t["ring_bw"][b.sid]
    ar = b.kind == KIND_AR
    out[:, 4] = np.where(ar, 2 * (n - 1) / n * wire / ring, 0.0)
    if b.hier is not None:
        out[:, 4] = np.where(b.hier, wire * t["hier_per_byte"][b.sid], out[:, 4])
    ag = b.kind >= KIND_AG  # all-gather of rows or of sufficient factors
    out[:, 6] = np.where(ag, (n - 1) * wire / ring, 0.0) + (b.rebuild if b.rebuild is not None else 0.0)
    out[:, 7] = np.where(ag, np.where(b.kind == KIND_SFB, 2.0, 1.0) * (n - 1), 0.0)  # SFB: counts, then factors
    out[:, 8] = 1.0
    # A merge group pays the ring's 2(N-1) message overheads once: share it among members.
    if ar.any():
        key = b.sid[ar] * (b.group.max() + 1) + b.group[ar]
        _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
        msgs = 2 * (n[ar] - 1) if b.hier is None else np.where(b.hier[ar], t["hier_msgs"][b.sid[ar]], 2 * (n[ar] - 1))
        out[ar, 5] = msgs / counts[inv]
    return out, wire


GLOBAL_NAMES = tuple(f"{agg}_{name}" for agg in ("max", "mean") for name in PRE_NAMES) + (
    "t_ps", "t_ar", "t_ag", "t_comp", "partitions_per_var", "ps_bytes", "ar_bytes", "ag_bytes", "max_server_share",
    "num_groups")


def _segment_sum(values: np.ndarray, seg: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(seg, weights=values, minlength=n)


def analytic_parts(b: StrategyBatch, ctx: DomainContext, *, split: bool = True) -> dict[str, np.ndarray]:
    """Per-strategy analytic terms in seconds (AutoSync Eq. 2 and the ring/gather analogues):
    ``per_server`` (n, nodes) PS load, ``t_ps`` the most loaded server, ``t_ar`` all-reduce,
    ``t_ag`` all-gather, ``t_comp`` compute. Computed with the fewest passes over the shards:
    proposals are scored with it tens of thousands at a time (``split=False`` saves the pass
    that tells all-gather from all-reduce: ``t_ar`` is then both collectives, ``t_ag`` zero)."""
    c = ctx.constants
    n, w = b.size, ctx.W
    m, wire = b.nbytes, b.wire
    per_server = np.zeros((n, w))
    ps = np.flatnonzero(b.kind == KIND_PS)
    # Per-strategy tables only where a strategy replicates on a subset: the domain's constants
    # otherwise (measured: per-shard lookups for every strategy cut bert-large's analytic rate
    # from about 62,000 to 14,000 strategies/s, below the 50,000 goal).
    subset = b.replica_counts is not None
    t = comm_terms(b, ctx) if subset else None
    if len(ps):
        # Each PS server: the slower of its NIC and its per-flow transfers, plus intra-node copies
        # and overheads; the strategy waits for the most loaded server.
        look = b.node[ps] * 2 + b.local[ps]
        both = wire[ps] + m[ps]  # gradient up (encoded), parameters down (plain)
        key = b.sid[ps] * w + b.node[ps]
        if subset:
            at = b.sid[ps] * (2 * w) + look
            flow_c, nic_c, intra_c, phi_c = (t[k + "_flat"][at] for k in ("ps_flow", "ps_nic", "ps_intra", "ps_phi"))
            spread = np.maximum(1.0, t["W"] - 1)
        else:
            flow_c, nic_c, intra_c, phi_c = (ctx.ps_flow_flat[look], ctx.ps_nic_flat[look], ctx.ps_intra_flat[look],
                                             ctx.ps_phi_flat[look])
            spread = np.full(n, float(max(1, w - 1)))
        flows = (np.bincount(key, both * flow_c, n * w).reshape(n, w) / spread[:, None]).reshape(-1)
        nic = np.bincount(key, both * nic_c, n * w)
        rest = np.bincount(key, both * intra_c + c.phi * phi_c + c.delta, n * w)
        per_server = (np.maximum(flows, nic) + rest).reshape(n, w)
    if subset:
        nn, ring = t["N"][b.sid], t["ring_bw"][b.sid]
        gather = b.kind >= KIND_AG
        scale = np.select([b.kind == KIND_AR, gather], [2 * (nn - 1) / nn / ring, (nn - 1) / ring], 0.0)
        # SFB's two gathers (row counts, then factors) pay the per-message overhead twice.
        fixed = np.select([b.kind == KIND_AR, b.kind == KIND_AG, b.kind == KIND_SFB],
                          [np.full_like(nn, c.delta), c.phi * (nn - 1), 2 * c.phi * (nn - 1)], 0.0)
        ring_msgs = 2 * (t["N"] - 1)
    else:
        nn = ctx.N
        # Per-kind constants looked up by kind code (ps, allreduce, allgather, sfb): one gather, no masks.
        scale = np.array([0.0, 2 * (nn - 1) / nn / ctx.ring_bw, (nn - 1) / ctx.ring_bw, (nn - 1) / ctx.ring_bw])[b.kind]
        fixed = np.array([0.0, c.delta, c.phi * (nn - 1), 2 * c.phi * (nn - 1)])[b.kind]
        ring_msgs = 2 * (nn - 1)
    if b.hier is not None:
        hier_scale = t["hier_per_byte"][b.sid] if subset else ctx.hier_per_byte
        scale = np.where(b.hier, hier_scale, scale)
    per_shard = wire * scale + fixed
    t_ag = np.bincount(b.sid, per_shard * (b.kind >= KIND_AG), n) if split else np.zeros(n)
    # A merge group pays the ring's 2(N-1) message overheads once.
    t_ar = np.bincount(b.sid, per_shard, n) - t_ag + c.phi * ring_msgs * b.ngroups
    if b.hier is not None:
        # A hierarchical group pays its stages' messages, 2(r-1) + 2(W-1), not the flat ring's.
        rows = np.flatnonzero(b.hier & (b.kind == KIND_AR))
        owner = np.unique(b.sid[rows] * (int(b.group.max()) + 1) + b.group[rows]) // (int(b.group.max()) + 1)
        hier_groups = np.bincount(owner, minlength=n)
        hier_msgs = t["hier_msgs"] if subset else ctx.hier_msgs
        t_ar = t_ar + c.phi * hier_groups * (hier_msgs - ring_msgs)
    t_comp = ctx.t_comp + c.delta * (np.diff(b.offsets) - ctx.num_vars)  # stitching partitions costs kernels
    if b.batch_scale is not None:
        # The step waits for the slowest replica: its batch share times its node's slowdown
        # (TAG §4.2's batch split on calibrated, heterogeneous nodes), as the replay does.
        t_comp = t_comp * b.batch_scale
    # SFB gradients are rebuilt once every gather is in (the step), after communication and compute.
    t_rebuild = np.bincount(b.sid, b.rebuild, n) if b.rebuild is not None else np.zeros(n)
    return {"t_ps": per_server.max(axis=1), "t_ar": t_ar, "t_ag": t_ag, "t_comp": t_comp, "per_server": per_server,
            "t_rebuild": t_rebuild}


def analytic_time(b: StrategyBatch, ctx: DomainContext) -> np.ndarray:
    """The training-free estimate T = max(T_comp, T_sync) in seconds (AutoDist §2.4, AutoSync §3.1.1)."""
    p = analytic_parts(b, ctx, split=False)
    return np.maximum(p["t_comp"], p["t_ps"] + p["t_ar"] + p["t_ag"]) + p["t_rebuild"]


def global_features(b: StrategyBatch, ctx: DomainContext, pre: np.ndarray, wire: np.ndarray) -> np.ndarray:
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
    kind_bytes = [_segment_sum(np.where(b.kind == k, ctx.var_bytes[b.var] * b.frac, 0.0), b.sid, n) / bytes_total
                  for k in (KIND_PS, KIND_AR, KIND_AG)]
    kind_bytes[2] = kind_bytes[2] + _segment_sum(np.where(b.kind == KIND_SFB, b.nbytes, 0.0), b.sid, n) / bytes_total
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


def raw_features(b: StrategyBatch, ctx: DomainContext, wire: np.ndarray) -> np.ndarray:
    """(S, len(RAW_NAMES)) per-shard raw features (AutoSync §3.1.2), scale-free."""
    s = len(b.sid)
    out = np.zeros((s, len(RAW_NAMES)))
    col = _RAW
    out[np.arange(s), b.kind] = 1.0
    out[np.arange(s), col["comp_" + COMPRESSORS.names()[0]] + b.comp] = 1.0
    out[:, col["wire_ratio"]] = b.ratio
    out[:, col["local_agg"]] = b.local
    ps = b.kind == KIND_PS
    node = np.where(ps, b.node, 0)
    out[:, col["server_nic"]] = np.where(ps, ctx.nic[node] / (10 * GBIT), 0.0)
    out[:, col["server_devices"]] = np.where(ps, ctx.r[node] / max(1.0, ctx.N), 0.0)
    out[:, col["server_flow"]] = np.where(ps, ctx.flow[node] / (10 * GBIT), 0.0)
    ar = b.kind == KIND_AR
    if ar.any():
        width = b.group.max() + 1
        key = b.sid[ar] * width + b.group[ar]
        _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
        gbytes = np.bincount(inv, weights=wire[ar])
        out[ar, col["group_members"]] = counts[inv] / ctx.num_vars
        out[ar, col["group_bytes"]] = gbytes[inv] / ctx.model_bytes
        # Position of the shard's merge group among the strategy's groups (groups are renumbered
        # 0.. in backward order by encode), in [0, 1).
        out[ar, col["group_order"]] = b.group[ar] / np.maximum(1.0, b.ngroups[b.sid[ar]])
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


def per_shard_inputs(b: StrategyBatch, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """(S, raw + predefined) inputs of the sequence models, and (n, global) features."""
    pre, wire = shard_features(b, ctx)
    glob = global_features(b, ctx, pre, wire)
    norm = pre.copy()
    norm[:, [0, 1, 2, 4, 6]] /= ctx.t_ref
    norm[:, [3, 5, 7]] /= max(1.0, ctx.N)
    return np.concatenate([raw_features(b, ctx, wire), norm], axis=1), glob
