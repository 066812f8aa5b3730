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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.columns import KIND_CODES, StrategyColumns
from ..strategy.compressors import COMPRESSORS
from ..strategy.schema import REDUCE_DTYPES, SYNCHRONIZER_KINDS, Strategy

__all__ = ["AnalyticConstants", "DomainContext", "encode", "message_sizes", "batch_scale", "shard_features",
           "shard_units", "shard_unit_seconds", "shard_inputs", "SHARD_RAW_NAMES", "SHARD_GLOBAL_NAMES",
           "global_features", "analytic_time", "RAW_NAMES", "PRE_NAMES", "GLOBAL_NAMES"]

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
#: Synchronizer kind codes (the synchronizer registry's, :data:`KIND_CODES`). Sufficient-factor
#: broadcasting (TAG §2.3) is an all-gather of the factors, padded to the largest replica batch,
#: then a rebuild of the gradient on every replica.
KIND_PS, KIND_AR, KIND_AG, KIND_SFB = (KIND_CODES[k] for k in ("ps", "allreduce", "allgather", "sfb"))
#: Sharded data parallelism (ZeRO / FSDP): one reduce-scatter and one all-gather per unit.
KIND_SHARD = KIND_CODES["shard"]
#: Peak dense float32 throughput per device model (FLOP/s), for the compute term.
DEVICE_FLOPS = {"T4": 8.1e12, "M60": 4.8e12, "TITAN X": 11e12, "cpu": 5e10}


#: The tables of :meth:`DomainContext._gloo_ps_tables` (the replay's dense PS shards).
_GLOO_KEYS = ("gloo_ring_a", "gloo_n_a", "gloo_ring_b", "gloo_n_b", "gloo_gather", "gloo_bcast", "gloo_bcast_rounds")


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
        self.device_slowdowns = np.array([self.device_slowdown[d] for d in c.devices], dtype=np.float64)
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
        self.gloo = {k: tables[k][0] for k in _GLOO_KEYS}
        self.hier_per_byte, self.hier_msgs = float(tables["hier_per_byte"][0]), float(tables["hier_msgs"][0])
        self.flow_min, self.intra_min, self.nic_min = (float(tables[k][0]) for k in ("flow_min", "intra_min", "nic_min"))
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
        nics = np.where(used, self.nic[None, :], np.inf).min(1)
        out = {"ps_flow": flow, "ps_phi": phi, "ps_nic": nic, "ps_intra": intra, "ring_bw": ring,
               "N": r.sum(1), "W": w_used, "r": r, "hier_per_byte": hier_bytes, "hier_msgs": hier_msgs,
               "flow_min": flows, "intra_min": intras, "nic_min": nics}
        out.update(self._gloo_ps_tables(r))
        return out

    def _concurrent_per_byte(self, transfers: list[tuple[int, int]]) -> float:
        """Seconds per byte of transfers (from node, to node) running at once, each of one byte:
        the slowest one's link (a node's own: intra-node), a cross-node one on the slower flow of
        its ends, and every NIC's share (its cross-node transfers out, or in, one after the other)."""
        worst = 0.0
        out_count: dict[int, int] = {}
        in_count: dict[int, int] = {}
        for a, b in transfers:
            if a == b:
                worst = max(worst, 1.0 / self.intra[a])
                continue
            worst = max(worst, 1.0 / min(self.flow[a], self.flow[b]))
            out_count[a] = out_count.get(a, 0) + 1
            in_count[b] = in_count.get(b, 0) + 1
        for counts in (out_count, in_count):
            for node, c in counts.items():
                worst = max(worst, c / self.nic[node])
        return worst

    def _gloo_layout(self, ranks: list[int], root: int) -> tuple[float, float, float, float]:
        """(ring, gather, broadcast seconds per byte, broadcast rounds) of a group whose ranks sit
        on the nodes ``ranks`` (in rank order) with its root at position ``root``, as gloo runs
        them (gloo/reduce.cc: a ring reduce-scatter, each rank sending to rank - 1, then every
        rank's chunk of 1/N sent to the root at once; gloo/broadcast.cc: a binomial tree, round i
        sending from virtual ranks below 2^i to those 2^i above)."""
        n = len(ranks)
        if n < 2:
            return 0.0, 0.0, 0.0, 0.0
        ring = self._concurrent_per_byte([(ranks[i], ranks[i - 1]) for i in range(n)])
        gather = self._concurrent_per_byte([(ranks[i], ranks[root]) for i in range(n) if i != root]) / n
        rounds = math.ceil(math.log2(n))
        bcast = 0.0
        for i in range(rounds):
            sends = [(ranks[(v + root) % n], ranks[(v + (1 << i) + root) % n])
                     for v in range(1 << i) if v + (1 << i) < n]
            bcast += self._concurrent_per_byte(sends)
        return ring, gather, bcast, float(rounds)

    def _gloo_ps_tables(self, r: np.ndarray) -> dict[str, np.ndarray]:
        """A dense PS shard as the engine runs it on gloo: ``dist.reduce`` to its server, then after
        the step ``dist.broadcast`` from it (:class:`~synctune.engine.units.PSUnit`). Per strategy
        (replicas per node ``r``), server node j and local-aggregation flag (n, nodes, 2): the two
        reduce phases (flat: the world's ring then nothing; with local aggregation: a ring inside
        every node at once, then one across the node roots), each as seconds per byte of its ring
        (``gloo_ring_a``/``_b``) with its group size (``gloo_n_a``/``_b``: gloo cuts a message into
        segments by it), gather per byte of the message (``gloo_gather``, both phases), and the
        broadcast back per byte and its rounds (``gloo_bcast``, ``gloo_bcast_rounds``). The group's
        ranks are its replicas node by node, as the engine orders devices; the root is the
        server node's first replica."""
        n, w = r.shape
        out = {k: np.zeros((n, w, 2)) for k in _GLOO_KEYS}
        rows, inverse = np.unique(r, axis=0, return_inverse=True)
        for u, counts in enumerate(rows):
            counts = counts.astype(int)
            ranks = [k for k in range(w) for _ in range(counts[k])]
            roots = [k for k in range(w) if counts[k] > 0]
            widest = int(counts.max()) if len(counts) else 0
            # Every node's own ring at once: the slowest node's, first replica its root.
            intra = [self._gloo_layout([k] * counts[k], 0) for k in roots]
            i_ring = max((x[0] for x in intra), default=0.0)
            i_gather = max((x[1] for x in intra), default=0.0)
            i_bcast = max((x[2] for x in intra), default=0.0)
            i_rounds = max((x[3] for x in intra), default=0.0)
            sel = inverse.reshape(-1) == u
            for j in roots:
                ring, gather, bcast, rounds = self._gloo_layout(ranks, ranks.index(j))
                c_ring, c_gather, c_bcast, c_rounds = self._gloo_layout(roots, roots.index(j))
                flat = (ring, len(ranks), 0.0, 0, gather, bcast, rounds)
                local = (i_ring, widest, c_ring, len(roots), i_gather + c_gather, i_bcast + c_bcast,
                         i_rounds + c_rounds)
                for key, f, loc in zip(_GLOO_KEYS, flat, local):
                    out[key][sel, j, 0] = f
                    out[key][sel, j, 1] = loc
        return out


def comm_terms(b: StrategyColumns, ctx: DomainContext) -> dict[str, np.ndarray]:
    """Per-strategy communication coefficients of ``b`` (:meth:`DomainContext.comm_tables`),
    the PS ones flattened for a lookup at ``sid * 2 * nodes + node * 2 + local``: the domain's
    own where every strategy replicates on every device."""
    n, w = b.size, ctx.W
    counts = b.replica_counts()
    if counts is None:
        tabs = {"ps_flow": np.broadcast_to(ctx.ps_flow_coef, (n, w, 2)),
                "ps_phi": np.broadcast_to(ctx.ps_phi_coef, (n, w, 2)),
                "ps_nic": np.broadcast_to(ctx.ps_nic_coef, (n, w, 2)),
                "ps_intra": np.broadcast_to(ctx.ps_intra_coef, (n, w, 2)),
                "ring_bw": np.full(n, ctx.ring_bw), "N": np.full(n, ctx.N), "W": np.full(n, float(w)),
                "r": np.broadcast_to(ctx.r, (n, w)), "hier_per_byte": np.full(n, ctx.hier_per_byte),
                "hier_msgs": np.full(n, ctx.hier_msgs), "flow_min": np.full(n, ctx.flow_min),
                "intra_min": np.full(n, ctx.intra_min), "nic_min": np.full(n, ctx.nic_min),
                **{k: np.broadcast_to(ctx.gloo[k], (n, w, 2)) for k in _GLOO_KEYS}}
    else:
        tabs = ctx.comm_tables(counts)
    for key in ("ps_flow", "ps_phi", "ps_nic", "ps_intra"):
        tabs[key + "_flat"] = np.ascontiguousarray(tabs[key]).reshape(-1)
    return tabs


def encode(strategies: list[Strategy], ctx: DomainContext) -> StrategyColumns:
    """Strategies of ``ctx``'s domain (they must validate against it) as the columns every
    function here reads (:meth:`StrategyColumns.from_strategies`)."""
    return StrategyColumns.from_strategies(ctx.model, ctx.cluster, strategies)


def batch_scale(b: StrategyColumns, ctx: DomainContext, slowdowns: np.ndarray | None = None) -> np.ndarray:
    """(n,) each strategy's compute time relative to one model batch on the fastest node: every
    replica's batch share times its node's slowdown (``slowdowns`` per device, default the
    cluster's calibrated speeds), the iteration waiting for the slowest replica (TAG §4.2's batch
    split on calibrated, heterogeneous nodes)."""
    slow = ctx.device_slowdowns if slowdowns is None else slowdowns
    return (b.splits() * slow[None, :]).max(1) / ctx.model.batch_size


def message_sizes(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray | None]:
    """Per shard, the bytes its gradient carries (sparse: the rows touched; SFB: the factors,
    padded to the largest replica batch of its strategy) and, for SFB shards, the seconds the
    rebuild of the gradient from the strategy's global batch takes (None without SFB)."""
    # Only the sparse and SFB shards are worked on (a round's proposals have millions of rows).
    var = b.var
    nbytes = ctx.var_bytes[var] * b.frac
    sparse = np.flatnonzero(ctx.var_sparse[var])
    nbytes[sparse] *= ctx.sparse_density[var[sparse]]
    sfb = np.flatnonzero(b.pattern == KIND_SFB)
    if not len(sfb):
        return nbytes, None
    split = b.splits()
    v, s = var[sfb], b.sid[sfb]
    rows = ctx.factor_rows[v]
    nbytes[sfb] = split.max(1).astype(np.float64)[s] * rows * ctx.factor_width[v]
    rebuild = np.zeros(len(var))
    rebuild[sfb] = 2.0 * split.sum(1).astype(np.float64)[s] * rows * ctx.var_elems[v] / ctx.device_flops
    return nbytes, rebuild


def hier_rows(b: StrategyColumns) -> np.ndarray | None:
    """The shards on hierarchical all-reduce, or None when no shard is (the cheaper path)."""
    return b.hier if b.hier.any() else None


def per_kind(values: dict[str, object]) -> np.ndarray:
    """``values`` by synchronizer kind name as an array indexed by kind code (0 where absent)."""
    return np.array([values.get(kind, 0.0) for kind in SYNCHRONIZER_KINDS], dtype=np.float64)


#: By kind code: whether the kind gathers (rows, or sufficient factors) rather than reduces.
_GATHERS = per_kind({"allgather": 1, "sfb": 1}).astype(bool)


def shard_units(b: StrategyColumns, ctx: DomainContext, t: dict | None = None) -> dict[str, np.ndarray] | None:
    """The ``shard`` units of every strategy of ``b`` (None when no row is a shard row): per unit
    (``usid`` its strategy, ``unit_of`` per shard row), its members' bytes (``bytes``, float32
    parameters) and the bytes its gradient is reduced in (``reduce_bytes``: halved in bf16), the
    shard-group size ``k`` (every replica for group 0) and the number of groups ``G`` (HSDP when
    above 1), the first and last member in backward order, ``reshard``, ``prefetch``, and the
    bandwidths its collectives run at: ``bw_group`` the ring of one shard group (inside a node: its
    intra-node link; across nodes: the slowest flow), ``bw_cross`` the ring of the G members at one
    position of every group (HSDP's all-reduce of the slices: across nodes the slowest flow, the
    node's NIC shared by the min(k, r) rings leaving it; on one node the intra-node link)."""
    rows = np.flatnonzero(b.pattern == KIND_SHARD)
    if not len(rows):
        return None
    t = comm_terms(b, ctx) if t is None else t
    width = int(b.group[rows].max()) + 1
    keys, unit_of = np.unique(b.sid[rows] * width + b.group[rows], return_inverse=True)
    u = len(keys)
    usid = (keys // width).astype(np.int64)
    first = np.full(u, len(b.sid), np.int64)
    np.minimum.at(first, unit_of, rows)  # the unit's first row carries its options (members agree)
    first_var = np.full(u, np.iinfo(np.int64).max)
    np.minimum.at(first_var, unit_of, b.var[rows])
    last_var = np.full(u, -1, np.int64)
    np.maximum.at(last_var, unit_of, b.var[rows])
    nbytes = np.bincount(unit_of, weights=ctx.var_bytes[b.var[rows]] * b.frac[rows], minlength=u)
    n = t["N"][usid]
    k = np.where(b.shard_group[first] > 0, b.shard_group[first], n).astype(np.float64)
    r_max = np.asarray(t["r"])[usid].max(1)
    bw_group = np.where(k > r_max, t["flow_min"][usid], t["intra_min"][usid])
    leaving = np.maximum(1.0, np.minimum(k, r_max))
    bw_cross = np.where(t["W"][usid] > 1, np.minimum(t["flow_min"][usid], t["nic_min"][usid] / leaving),
                        t["intra_min"][usid])
    reduce_scale = np.where(b.reduce_dtype[first] == REDUCE_DTYPES.index("bf16"), 0.5, 1.0)
    return {"rows": rows, "unit_of": unit_of, "usid": usid, "bytes": nbytes, "reduce_bytes": nbytes * reduce_scale,
            "k": k, "G": n / k, "first_var": first_var, "last_var": last_var, "reshard": b.reshard[first],
            "prefetch": b.prefetch[first].astype(np.float64), "bw_group": bw_group, "bw_cross": bw_cross}


def shard_unit_seconds(u: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """Alpha-beta seconds of each unit of :func:`shard_units`, ``alpha`` per message (AutoDDL's
    model, as the ring all-reduce is priced here: 2(N-1)(alpha + bytes/(N bw)), at least the
    bound of DESIGN.md "Measurement conventions", 2(N-1)/N * bytes / bw). A reduce-scatter and an
    all-gather are each half a ring all-reduce: ``reduce_scatter`` (k-1)(alpha + reduce_bytes/(k bw))
    over the shard group; ``cross`` HSDP's ring all-reduce of the slice (reduce_bytes / k) over the
    G groups, 2(G-1)(alpha + slice/(G bw)), 0 without HSDP; ``gather`` one all-gather of the
    updated float32 slices, (k-1)(alpha + bytes/(k bw))."""
    k, g = u["k"], u["G"]
    rs = (k - 1) * (alpha + u["reduce_bytes"] / (k * u["bw_group"]))
    cross = np.where(g > 1, 2 * (g - 1) * (alpha + u["reduce_bytes"] / k / (g * u["bw_cross"])), 0.0)
    gather = (k - 1) * (alpha + u["bytes"] / (k * u["bw_group"]))
    return {"reduce_scatter": rs, "cross": cross, "gather": gather}


PRE_NAMES = ("ps_flow", "ps_nic", "ps_intra", "ps_phi", "ar_transfer", "ar_phi", "ag_transfer", "ag_phi", "delta")


def shard_features(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard predefined features in seconds/counts (S, 9), and per-shard wire bytes."""
    m = ctx.var_bytes[b.var] * b.frac
    sparse = ctx.var_sparse[b.var]
    m_eff = np.where(sparse, m * ctx.sparse_density[b.var], m)
    wire = m_eff * b.ratio
    ps = b.pattern == KIND_PS
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
    ar = b.pattern == KIND_AR
    out[:, 4] = np.where(ar, 2 * (n - 1) / n * wire / ring, 0.0)
    hier = hier_rows(b)
    if hier is not None:
        out[:, 4] = np.where(hier, wire * t["hier_per_byte"][b.sid], out[:, 4])
    ag = _GATHERS[b.pattern]  # all-gather of rows or of sufficient factors
    rebuild = message_sizes(b, ctx)[1] if (b.pattern == KIND_SFB).any() else None
    out[:, 6] = np.where(ag, (n - 1) * wire / ring, 0.0) + (rebuild if rebuild is not None else 0.0)
    out[:, 7] = np.where(ag, np.where(b.pattern == KIND_SFB, 2.0, 1.0) * (n - 1), 0.0)  # SFB: counts, then factors
    out[:, 8] = 1.0
    # A merge group pays the ring's 2(N-1) message overheads once: share it among members.
    if ar.any():
        group = b.group_order
        key = b.sid[ar] * (group.max() + 1) + group[ar]
        _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
        msgs = 2 * (n[ar] - 1) if hier is None else np.where(hier[ar], t["hier_msgs"][b.sid[ar]], 2 * (n[ar] - 1))
        out[ar, 5] = msgs / counts[inv]
    return out, wire


GLOBAL_NAMES = tuple(f"{agg}_{name}" for agg in ("max", "mean") for name in PRE_NAMES) + (
    "t_ps", "t_ar", "t_ag", "t_comp", "partitions_per_var", "ps_bytes", "ar_bytes", "ag_bytes", "max_server_share",
    "num_groups")


def _segment_sum(values: np.ndarray, seg: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(seg, weights=values, minlength=n)


def _per_server(b: StrategyColumns, ctx: DomainContext, t: dict | None, m: np.ndarray,
                wire: np.ndarray) -> np.ndarray:
    """(n, nodes) seconds of each PS server's load (AutoSync Eq. 2): the slower of its NIC and
    its per-flow transfers, plus intra-node copies and overheads; ``t`` are the per-strategy
    tables of :func:`comm_terms` where strategies replicate on subsets, else None."""
    c = ctx.constants
    n, w = b.size, ctx.W
    ps = np.flatnonzero(b.pattern == KIND_PS)
    if not len(ps):
        return np.zeros((n, w))
    look = b.node[ps].astype(np.int64) * 2 + b.local[ps]
    both = wire[ps] + m[ps]  # gradient up (encoded), parameters down (plain)
    key = b.sid[ps] * w + b.node[ps]
    if t is not None:
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
    return (np.maximum(flows, nic) + rest).reshape(n, w)


def analytic_parts(b: StrategyColumns, ctx: DomainContext, *, split: bool = True) -> dict[str, np.ndarray]:
    """Per-strategy analytic terms in seconds (AutoSync Eq. 2 and the ring/gather analogues):
    ``per_server`` (n, nodes) PS load, ``t_ps`` the most loaded server, ``t_ar`` all-reduce,
    ``t_ag`` all-gather, ``t_comp`` compute. Computed with the fewest passes over the shards:
    proposals are scored with it tens of thousands at a time (``split=False`` saves the pass
    that tells all-gather from all-reduce: ``t_ar`` is then both collectives, ``t_ag`` zero)."""
    c = ctx.constants
    n = b.size
    m, rebuild = message_sizes(b, ctx)
    wire = m * b.ratio
    # Per-strategy tables only where a strategy replicates on a subset: the domain's constants
    # otherwise (measured: per-shard lookups for every strategy cut bert-large's analytic rate
    # from about 62,000 to 14,000 strategies/s, below the 50,000 goal).
    subset = b.replica_counts() is not None
    t = comm_terms(b, ctx) if subset else None
    per_server = _per_server(b, ctx, t, m, wire)
    if subset:
        nn, ring = t["N"][b.sid], t["ring_bw"][b.sid]
        scale = np.select([b.pattern == KIND_AR, _GATHERS[b.pattern]], [2 * (nn - 1) / nn / ring, (nn - 1) / ring], 0.0)
        # SFB's two gathers (row counts, then factors) pay the per-message overhead twice.
        fixed = np.select([b.pattern == KIND_AR, b.pattern == KIND_AG, b.pattern == KIND_SFB],
                          [np.full_like(nn, c.delta), c.phi * (nn - 1), 2 * c.phi * (nn - 1)], 0.0)
        ring_msgs = 2 * (t["N"] - 1)
    else:
        nn = ctx.N
        # Per-kind constants looked up by kind code: one gather, no masks.
        scale = per_kind({"allreduce": 2 * (nn - 1) / nn / ctx.ring_bw, "allgather": (nn - 1) / ctx.ring_bw,
                           "sfb": (nn - 1) / ctx.ring_bw})[b.pattern]
        fixed = per_kind({"allreduce": c.delta, "allgather": c.phi * (nn - 1), "sfb": 2 * c.phi * (nn - 1)})[b.pattern]
        ring_msgs = 2 * (nn - 1)
    hier = hier_rows(b)
    if hier is not None:
        scale = np.where(hier, t["hier_per_byte"][b.sid] if subset else ctx.hier_per_byte, scale)
    per_shard = wire * scale + fixed
    t_ag = np.bincount(b.sid, per_shard * _GATHERS[b.pattern], n) if split else np.zeros(n)
    # A merge group pays the ring's 2(N-1) message overheads once.
    t_ar = np.bincount(b.sid, per_shard, n) - t_ag + c.phi * ring_msgs * b.ngroups
    if hier is not None:
        # A hierarchical group pays its stages' messages, 2(r-1) + 2(W-1), not the flat ring's.
        rows = np.flatnonzero(hier & (b.pattern == KIND_AR))
        width = int(b.group_order.max()) + 1
        owner = np.unique(b.sid[rows] * width + b.group_order[rows]) // width
        hier_groups = np.bincount(owner, minlength=n)
        t_ar = t_ar + c.phi * hier_groups * ((t["hier_msgs"] if subset else ctx.hier_msgs) - ring_msgs)
    # Stitching partitions costs kernels; the step waits for the slowest replica (its batch
    # share times its node's slowdown, :func:`batch_scale`), as the replay does.
    t_comp = (ctx.t_comp + c.delta * (np.diff(b.offsets) - ctx.num_vars)) * batch_scale(b, ctx)
    # SFB gradients are rebuilt once every gather is in (the step), after communication and compute.
    t_rebuild = np.bincount(b.sid, rebuild, n) if rebuild is not None else np.zeros(n)
    out = {"t_ps": per_server.max(axis=1), "t_ar": t_ar, "t_ag": t_ag, "t_comp": t_comp, "per_server": per_server,
           "t_rebuild": t_rebuild}
    out.update(_shard_parts(b, ctx, t))
    return out


def _shard_parts(b: StrategyColumns, ctx: DomainContext, t: dict | None) -> dict[str, np.ndarray]:
    """Per strategy, the seconds its ``shard`` units cost (:func:`shard_unit_seconds`, ``phi`` per
    message): ``t_shard`` the reduce-scatters and HSDP all-reduces, issued in backward and hidden
    behind compute as all-reduces are; ``t_gather_hidden`` the all-gathers of resharded units with
    prefetch, in forward and again in backward, overlapping the compute of the unit before;
    ``t_gather_exposed`` the all-gathers nothing hides: after the step without reshard (ZeRO-2, as
    the engine runs it), in forward and in backward, serialized with compute, with reshard and
    prefetch 0. Zero for strategies without shard plans."""
    n = b.size
    out = {key: np.zeros(n) for key in ("t_shard", "t_gather_hidden", "t_gather_exposed")}
    u = shard_units(b, ctx, t)
    if u is None:
        return out
    sec = shard_unit_seconds(u, ctx.constants.phi)
    usid, gather = u["usid"], sec["gather"]
    out["t_shard"] = np.bincount(usid, sec["reduce_scatter"] + sec["cross"] + ctx.constants.delta, n)
    hidden = u["reshard"] & (u["prefetch"] > 0)
    out["t_gather_hidden"] = np.bincount(usid, np.where(hidden, 2 * gather, 0.0), n)
    out["t_gather_exposed"] = np.bincount(usid, np.where(hidden, 0.0, np.where(u["reshard"], 2 * gather, gather)), n)
    return out


def analytic_time(b: StrategyColumns, ctx: DomainContext) -> np.ndarray:
    """The training-free estimate T = max(T_comp, T_sync) in seconds (AutoDist §2.4, AutoSync §3.1.1)."""
    p = analytic_parts(b, ctx, split=False)
    return (np.maximum(p["t_comp"], p["t_ps"] + p["t_ar"] + p["t_ag"] + p["t_shard"] + p["t_gather_hidden"])
            + p["t_rebuild"] + p["t_gather_exposed"])


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
    kind_bytes = [_segment_sum(np.where(b.pattern == k, ctx.var_bytes[b.var] * b.frac, 0.0), b.sid, n) / bytes_total
                  for k in (KIND_PS, KIND_AR, KIND_AG)]
    sfb = b.pattern == KIND_SFB
    if sfb.any():  # the factors an SFB shard gathers count with the all-gathered bytes
        kind_bytes[2] = kind_bytes[2] + _segment_sum(np.where(sfb, message_sizes(b, ctx)[0], 0.0), b.sid, n) / bytes_total
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
#: By kind code: the column of its one-hot raw feature.
#: By kind code: the column of its one-hot raw feature; -1 for ``shard``, whose one-hot is
#: ``is_shard`` of :data:`SHARD_RAW_NAMES` (appended after everything a simulator trained before the
#: kind existed reads, so its inputs keep their positions and values).
_KIND_COLUMN = np.array([_RAW[name] if name else -1 for name in (
    {"ps": "is_ps", "allreduce": "is_ar", "allgather": "is_ag", "sfb": "is_sfb", "shard": ""}[kind]
    for kind in SYNCHRONIZER_KINDS)])


def raw_features(b: StrategyColumns, ctx: DomainContext, wire: np.ndarray) -> np.ndarray:
    """(S, len(RAW_NAMES)) per-shard raw features (AutoSync §3.1.2), scale-free."""
    s = len(b.sid)
    out = np.zeros((s, len(RAW_NAMES)))
    col = _RAW
    column = _KIND_COLUMN[b.pattern]
    known = column >= 0
    out[np.flatnonzero(known), column[known]] = 1.0
    out[np.arange(s), col["comp_" + COMPRESSORS.names()[0]] + b.comp.astype(np.int64)] = 1.0
    out[:, col["wire_ratio"]] = b.ratio
    out[:, col["local_agg"]] = b.local
    ps = b.pattern == KIND_PS
    node = np.where(ps, b.node, 0)
    out[:, col["server_nic"]] = np.where(ps, ctx.nic[node] / (10 * GBIT), 0.0)
    out[:, col["server_devices"]] = np.where(ps, ctx.r[node] / max(1.0, ctx.N), 0.0)
    out[:, col["server_flow"]] = np.where(ps, ctx.flow[node] / (10 * GBIT), 0.0)
    ar = b.pattern == KIND_AR
    if ar.any():
        group = b.group_order
        width = group.max() + 1
        key = b.sid[ar] * width + group[ar]
        _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
        gbytes = np.bincount(inv, weights=wire[ar])
        out[ar, col["group_members"]] = counts[inv] / ctx.num_vars
        out[ar, col["group_bytes"]] = gbytes[inv] / ctx.model_bytes
        # Position of the shard's merge group among the strategy's groups (numbered 0.. in
        # backward order, ``group_order``), in [0, 1).
        out[ar, col["group_order"]] = group[ar] / np.maximum(1.0, b.ngroups[b.sid[ar]])
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


#: Per-shard features of the ``shard`` kind (zero on every other row): the one-hot, the shard
#: group over the replicas, HSDP's groups over the replicas, reshard, prefetch over its maximum,
#: the bf16 reduce, the unit's members over the variables and its bytes over the model's, and the
#: unit's reduce-scatter, HSDP all-reduce and all-gather seconds over the domain's reference time.
SHARD_RAW_NAMES = ("is_shard", "shard_group_share", "hsdp_groups_share", "reshard", "prefetch", "reduce_bf16",
                   "unit_members", "unit_bytes", "unit_reduce_scatter", "unit_cross", "unit_gather")
#: Per-strategy features of its shard units (:func:`analytic_parts`' terms over the reference time),
#: the share of the model's bytes sharded and the units over the variables.
SHARD_GLOBAL_NAMES = ("t_shard", "t_gather_hidden", "t_gather_exposed", "shard_bytes", "num_units")


def shard_inputs(b: StrategyColumns, ctx: DomainContext) -> tuple[np.ndarray, np.ndarray]:
    """(S, len(SHARD_RAW_NAMES)) and (n, len(SHARD_GLOBAL_NAMES)) features of the ``shard`` kind;
    zeros for strategies without shard plans. The learned models append them after their other
    inputs, so a simulator trained before ``shard`` existed reads the same inputs it was trained on."""
    x = np.zeros((len(b.sid), len(SHARD_RAW_NAMES)))
    g = np.zeros((b.size, len(SHARD_GLOBAL_NAMES)))
    t = comm_terms(b, ctx)
    u = shard_units(b, ctx, t)
    if u is None:
        return x, g
    rows, of = u["rows"], u["unit_of"]
    sec = shard_unit_seconds(u, ctx.constants.phi)
    n = t["N"][u["usid"]]
    members = np.bincount(of, minlength=len(u["usid"]))
    per_unit = np.stack([np.ones(len(n)), u["k"] / n, np.where(u["G"] > 1, u["G"] / n, 0.0), u["reshard"],
                         u["prefetch"] / 8.0, u["reduce_bytes"] < u["bytes"], members / ctx.num_vars,
                         u["bytes"] / ctx.model_bytes, sec["reduce_scatter"] / ctx.t_ref, sec["cross"] / ctx.t_ref,
                         sec["gather"] / ctx.t_ref], axis=1)
    x[rows] = per_unit[of]
    parts = _shard_parts(b, ctx, t)
    g[:, 0] = parts["t_shard"] / ctx.t_ref
    g[:, 1] = parts["t_gather_hidden"] / ctx.t_ref
    g[:, 2] = parts["t_gather_exposed"] / ctx.t_ref
    g[:, 3] = np.bincount(u["usid"], u["bytes"], b.size) / ctx.model_bytes
    g[:, 4] = np.bincount(u["usid"], minlength=b.size) / ctx.num_vars
    return x, g
