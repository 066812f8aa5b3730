"""The guided sampler's per-shard decisions for many strategies, compiled (numba).

:meth:`synctune.search.GuidedSampler.sample_columns` draws what is independent across a
strategy's variables with numpy (partitions, SFB, one compressor or hierarchical all-reduce
per strategy) and the uniforms every shard needs; what is sequential inside a strategy runs
here, one strategy after another, shard by shard in backward order:

- PS placement balanced by load (AutoDist §3.1's load-balanced placement: a node is drawn with
  probability proportional to its NIC bandwidth over ``1 + load / shard bytes``, so a loaded
  server is drawn less);
- adjacent merging of dense all-reduce shards into groups (c_am), a group closing once it holds
  its share of the strategy's all-reduce bytes or the compressor changes.

In numpy these loops would take an operation per shard (a few thousand per chunk on
BERT-large), most of a round's time; compiled, a strategy costs a pass over its rows. Importing
this module imports numba (seconds), so the sampler imports it lazily.
"""

from __future__ import annotations

import numba
import numpy as np

from ..strategy.schema import SPARSE_GROUP_BASE

_SPARSE_GROUP = SPARSE_GROUP_BASE


@numba.njit(cache=True, nogil=True, error_model="numpy")
def draw_partitions(draw, cuttable, always, naxes, upper, axes_of, combo, partition_prob, sfb, pieces, axes, base):
    """Each strategy's partition of each variable that may be cut (AutoDist §3.1's thresholds:
    ``always`` for the largest, else with ``partition_prob``; never one that goes by SFB): an
    axis drawn among ``naxes``, 2..``upper`` pieces, and where its table entries start.
    ``draw[:, i, c]`` are strategy i's three uniforms for ``cuttable[c]``."""
    n = pieces.shape[0]
    for i in range(n):
        for c in range(cuttable.shape[0]):
            vi = cuttable[c]
            if not (always[vi] or draw[0, i, c] < partition_prob) or sfb[i, vi]:
                continue
            ai = min(int(draw[1, i, c] * naxes[vi]), naxes[vi] - 1)
            k = min(2 + int(draw[2, i, c] * (upper[vi, ai] - 1)), upper[vi, ai])
            pieces[i, vi] = k
            axes[i, vi] = axes_of[vi, ai]
            base[i, vi] = combo[vi, ai, k]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def fill_rows(lo, hi, u, u_groups, offsets, pieces, axes, base, sfb,
              var_bytes, var_sparse, nic, ps_share, local_rate, compress, comp_kind, rank_idx, hier, codes,
              kind_axis, t_frac, t_ok, t_rank, t_ratio,
              sid, var, axis, nshards, kind, node, local, group, hier_row, comp, rank, frac, ratio,
              group_order, ngroups):
    """Fill rows ``offsets[lo]:offsets[hi]`` of the output columns (strategies ``lo..hi-1``).

    The uniforms come from the sampler's numpy stream: ``u[r - offsets[lo]]`` holds row r's
    two (PS or not; which node), ``u_groups[i - lo]`` the one that draws strategy i's number of
    merge groups.
    (numba's own generator would cost more than the rest of the loop.) The first uniform, rescaled
    within the side of the PS threshold it fell on, is again uniform and independent of that
    decision: it draws sparse all-gather for a non-PS sparse shard or local aggregation for a
    dense PS one. ``codes`` are the kind codes of ps, allreduce, allgather and sfb
    (:func:`synctune.search.kinds.kernel_codes`: arguments, not globals, so a cached
    compilation never keeps stale ones). ``t_*`` are the sampler's tables, indexed by (variable, axis, pieces,
    shard) entry, compressor code, ``kind_axis[kind code]`` (-1: no compressor wraps that kind)
    and rank choice: whether the strategy's compressor applies to the shard, the rank it takes
    there and its wire ratio (kept small: a search round reads them from cache). Besides the strategy's
    own group numbers (``group``: dense groups 0.., sparse all-reduce shards 10,000) it writes
    what the simulator reads: groups numbered 0.. in the order they first appear
    (``group_order``) and how many there are (``ngroups``)."""
    ps_kind, ar_kind, ag_kind, sfb_kind = codes[0], codes[1], codes[2], codes[3]
    n_comp, n_kind, n_rank = t_ok.shape[1], t_ok.shape[2], t_ok.shape[3]
    ok_flat, rank_flat, ratio_flat = t_ok.ravel(), t_rank.ravel(), t_ratio.ravel()  # one index, one bound
    w = nic.shape[0]
    nv = pieces.shape[1]
    loads = np.zeros(w)
    cum = np.zeros(w)
    most = 0
    for i in range(lo, hi):
        most = max(most, offsets[i + 1] - offsets[i])
    size = np.zeros(most)  # the strategy's rows, kept for its merging pass (in cache)
    label = np.zeros(most, np.int64)
    state = np.zeros(most, np.int8)  # 0: not all-reduce, 1: sparse all-reduce, 2: dense all-reduce
    for i in range(lo, hi):
        loads[:] = 0.0
        r = offsets[i]
        ar_count = 0
        ar_bytes = 0.0
        for vi in range(nv):
            k = pieces[i, vi]
            sparse = var_sparse[vi]
            sb = var_bytes[vi] / k
            for j in range(k):
                sid[r] = i
                var[r] = vi
                axis[r] = axes[i, vi]
                nshards[r] = k
                cb = base[i, vi] + (j if k > 1 else 0)
                frac[r] = t_frac[cb]
                ur = r - offsets[lo]
                p = ps_share[i]
                u0 = u[ur, 0]
                ps = u0 < p and not sfb[i, vi]
                u2 = u0 / p if u0 < p else (u0 - p) / (1.0 - p)
                if ps:
                    total = 0.0
                    inv = 1.0 / max(1.0, sb)
                    for q in range(w):
                        total += nic[q] / (1.0 + loads[q] * inv)
                        cum[q] = total
                    x = u[ur, 1] * total
                    chosen = 0
                    for q in range(w):
                        if cum[q] < x:
                            chosen += 1
                    chosen = min(chosen, w - 1)
                    loads[chosen] += sb
                    node[r] = chosen
                    kd = ps_kind
                else:
                    node[r] = -1
                    kd = ag_kind if sparse and u2 < 0.5 else ar_kind
                if sfb[i, vi]:
                    kd = sfb_kind
                kind[r] = kd
                local[r] = kd == ps_kind and not sparse and u2 < local_rate[i]
                hier_row[r] = hier[i] and kd == ar_kind
                c, rk, rt = 0, 0, 1.0
                if compress[i] and kind_axis[kd] >= 0:
                    want = comp_kind[i]
                    cell = ((cb * n_comp + want) * n_kind + kind_axis[kd]) * n_rank + rank_idx[i]
                    if ok_flat[cell]:
                        c = want
                        rk = rank_flat[cell]
                        rt = ratio_flat[cell]
                comp[r], rank[r], ratio[r] = c, rk, rt
                q = r - offsets[i]
                if kd == ar_kind:
                    ar_count += 1
                    ar_bytes += sb
                    state[q] = 1 if sparse else 2
                    size[q] = sb
                    label[q] = c * 64 + rk
                else:
                    state[q] = 0
                r += 1
        # Adjacent merging over the strategy's dense all-reduce shards, in backward order.
        num_groups = 1 + int(u_groups[i - lo] * max(1, min(16, ar_count)))
        target = (ar_bytes / num_groups if ar_bytes > 0 else 1.0) * 1.0001
        g, filled, open_label = 0, 0.0, -1
        seen, sparse_order, dense_order, dense_group = 0, -1, -1, -1
        for q in range(offsets[i + 1] - offsets[i]):
            r = offsets[i] + q
            if state[q] == 0:
                group[r] = -1
                group_order[r] = -1
            elif state[q] == 1:
                group[r] = _SPARSE_GROUP
                if sparse_order < 0:
                    sparse_order = seen
                    seen += 1
                group_order[r] = sparse_order
            else:
                x = size[q]
                if filled > 0 and (filled + x > target or label[q] != open_label):
                    g += 1
                    filled = 0.0
                filled += x
                open_label = label[q]
                group[r] = g
                if dense_order < 0 or g != dense_group:
                    dense_order = seen
                    dense_group = g
                    seen += 1
                group_order[r] = dense_order
        ngroups[i] = seen
