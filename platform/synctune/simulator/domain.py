"""One domain's tables: what every cost term of the simulators reads of a (model, cluster) pair.

A domain is one (model, cluster) pair (DESIGN.md "domain"). :class:`DomainContext` works out once
per domain the per-variable arrays (bytes, rows, sparsity, sufficient factors) and the cluster's
communication coefficients: AutoSync Eq. 2's per-server sums over the other nodes' flows for PS,
the ring's slowest flow, the hierarchical all-reduce's stages, and the process groups gloo runs a
dense PS shard's reduce and broadcast on; :func:`comm_terms` gives them per strategy where a
strategy replicates on a subset of the devices (TAG §4.2). The features
(:mod:`synctune.simulator.features`), the replay (:mod:`synctune.simulator.replay`) and each
kind's cost terms (:mod:`synctune.simulator.kinds`) read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.columns import StrategyColumns

__all__ = ["GBIT", "DEVICE_FLOPS", "GLOO_KEYS", "AnalyticConstants", "DomainContext", "comm_terms", "batch_scale"]

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
#: Peak dense float32 throughput per device model (FLOP/s), for the compute term.
DEVICE_FLOPS = {"T4": 8.1e12, "M60": 4.8e12, "TITAN X": 11e12, "cpu": 5e10}
#: The tables of :meth:`DomainContext._gloo_ps_tables` (the replay's dense PS shards).
GLOO_KEYS = ("gloo_ring_a", "gloo_n_a", "gloo_ring_b", "gloo_n_b", "gloo_gather", "gloo_bcast", "gloo_bcast_rounds")


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
        self.gloo = {k: tables[k][0] for k in GLOO_KEYS}
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
        out = {k: np.zeros((n, w, 2)) for k in GLOO_KEYS}
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
                for key, f, loc in zip(GLOO_KEYS, flat, local):
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
                **{k: np.broadcast_to(ctx.gloo[k], (n, w, 2)) for k in GLOO_KEYS}}
    else:
        tabs = ctx.comm_tables(counts)
    for key in ("ps_flow", "ps_phi", "ps_nic", "ps_intra"):
        tabs[key + "_flat"] = np.ascontiguousarray(tabs[key]).reshape(-1)
    return tabs


def batch_scale(b: StrategyColumns, ctx: DomainContext, slowdowns: np.ndarray | None = None) -> np.ndarray:
    """(n,) each strategy's compute time relative to one model batch on the fastest node: every
    replica's batch share times its node's slowdown (``slowdowns`` per device, default the
    cluster's calibrated speeds), the iteration waiting for the slowest replica (TAG §4.2's batch
    split on calibrated, heterogeneous nodes)."""
    slow = ctx.device_slowdowns if slowdowns is None else slowdowns
    return (b.splits() * slow[None, :]).max(1) / ctx.model.batch_size
