"""The simulators' part of the ``shard`` kind: sharded data parallelism (ZeRO, Rajbhandari et al.
SC'20; FSDP2 ``fully_shard``).

The variables of a ``shard`` unit are one reduce-scatter over the shard group (then, with HSDP,
an all-reduce of each slice across the groups) and one all-gather of the updated slices: after the
step as the engine runs it (ZeRO-2), or with reshard before each use in forward and again in
backward (ZeRO-3), where prefetching hides them behind the compute of the unit before. Each of
its collectives is half a ring all-reduce in AutoDDL's alpha-beta model (:func:`shard_unit_seconds`).
What the memory model books for a unit, how the analytic model and the features price it (its own
features, :data:`SHARD_RAW_NAMES` and :data:`SHARD_GLOBAL_NAMES`, appended after the others so a
model trained before the kind existed reads the inputs it was trained on) and how the replay runs
it (:class:`~synctune.engine.units.ShardUnit`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...strategy.kinds import KIND_CODES, REDUCE_DTYPES
from ...strategy.partition import shard_rows
from ..domain import comm_terms
from .registry import (AnalyticTerms, FeatureBlock, FeatureKind, MemoryContext, MemoryKind, ReplayBatch, ReplayKind,
                       Tally, register_feature_kind, register_memory_kind, register_replay_kind)

__all__ = ["SHARD_RAW_NAMES", "SHARD_GLOBAL_NAMES", "shard_units", "shard_unit_seconds", "shard_inputs"]

NAME = "shard"
#: The parts of the analytic estimate a strategy's shard units add (:func:`_parts`).
_PARTS = ("t_shard", "t_gather_hidden", "t_gather_exposed")


# ------------------------------------------------------------------------------ memory

def _count(tally: Tally, units: list, ctx: MemoryContext) -> None:
    """Each ``shard`` unit: this rank's rows' optimizer state, the unit's buffers, and with
    reshard this rank's rows of parameters and gradients plus the largest ``prefetch + 1``
    units gathered whole (in flight). Under FSDP2 (``fsdp``): no persistent buffers; every
    unit's rows of parameters and gradients, a kept unit's whole parameters beside them, and the
    two largest units' whole gradients: the unit in backward before its reduce-scatter, and the
    reduce-scatter input of the unit before it, which FSDP2 keeps referenced until the next
    unit's reduce-scatter is issued (one input: torch 2.11's ``reduce_scatter_state``, torch
    2.13's ``reduce_scatter_max_input_buffers`` at its default of 1)."""
    fsdp = ctx.fsdp
    largest_gathered = []
    wholes = []
    for unit in units:
        sync = unit.synchronizer
        variables = [ctx.model[m.variable] for m in unit.members]
        whole = sum(v.num_bytes for v in variables)
        for r in range(tally.world):
            size = sync.group or tally.world
            index = r % size
            mine = 0
            padded_slice = 0
            for var in variables:
                row = var.num_bytes // var.shape[0]
                cut = shard_rows(var.shape[0], size)
                mine += (cut[index].stop - cut[index].start) * row
                padded_slice += (cut[0].stop - cut[0].start) * row
                if cut[index].stop > cut[index].start:  # an empty slice is no optimizer parameter
                    tally.own(r, (cut[index].stop - cut[index].start) * (var.num_elements // var.shape[0]),
                              var.num_bytes // var.num_elements)
            # The unit's bucket (every member's padded rows) and this rank's output segment, in the
            # variables' float32; a bf16 reduce adds the same two in bfloat16 (what travels), so
            # 1.5 times the float32 pair.
            pair = padded_slice * size + padded_slice
            if not fsdp:
                tally.buffers[r] += pair + (pair // 2 if sync.reduce_dtype == "bf16" else 0)
            if sync.reshard or fsdp:
                tally.params[r] += mine
                tally.grads[r] += mine
            if fsdp and not sync.reshard:
                tally.params[r] += whole
        if sync.reshard:
            largest_gathered.append((whole, sync.prefetch))
        wholes.append(whole)
    if largest_gathered:
        depth = max(p for _, p in largest_gathered) + 1
        in_flight = sum(sorted((w for w, _ in largest_gathered), reverse=True)[:depth])
        for r in range(tally.world):
            tally.params[r] += in_flight
    if fsdp and units:
        pending = sum(sorted(wholes, reverse=True)[:2])
        for r in range(tally.world):
            tally.grads[r] += pending


# ------------------------------------------------------------------------------- units

def shard_units(b: Any, ctx: Any, t: dict | None = None) -> dict[str, np.ndarray] | None:
    """The ``shard`` units of every strategy of ``b`` (None when no row is a shard row): per unit
    (``usid`` its strategy, ``unit_of`` per shard row), its members' bytes (``bytes``, float32
    parameters) and the bytes its gradient is reduced in (``reduce_bytes``: halved in bf16), the
    shard-group size ``k`` (every replica for group 0) and the number of groups ``G`` (HSDP when
    above 1), the first and last member in backward order, ``reshard``, ``prefetch``, and the
    bandwidths its collectives run at: ``bw_group`` the ring of one shard group (inside a node: its
    intra-node link; across nodes: the slowest flow), ``bw_cross`` the ring of the G members at one
    position of every group (HSDP's all-reduce of the slices: across nodes the slowest flow, the
    node's NIC shared by the min(k, r) rings leaving it; on one node the intra-node link)."""
    rows = b.pattern_rows(KIND_CODES[NAME])
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



def _parts(b: Any, ctx: Any, t: dict | None) -> dict[str, np.ndarray]:
    """Per strategy, the seconds its ``shard`` units cost (:func:`shard_unit_seconds`, ``phi`` per
    message): ``t_shard`` the reduce-scatters and HSDP all-reduces, issued in backward and hidden
    behind compute as all-reduces are; ``t_gather_hidden`` the all-gathers of resharded units with
    prefetch, in forward and again in backward, overlapping the compute of the unit before;
    ``t_gather_exposed`` the all-gathers nothing hides: after the step without reshard (ZeRO-2, as
    the engine runs it), in forward and in backward, serialized with compute, with reshard and
    prefetch 0. Zero for strategies without shard plans."""
    n = b.size
    out = {key: np.zeros(n) for key in _PARTS}
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


# ---------------------------------------------------------------------------- features

def _totals(a: AnalyticTerms, rows: np.ndarray) -> None:
    """The seconds the strategy's shard units cost (:func:`_parts`)."""
    a.parts.update(_parts(a.b, a.ctx, a.t))


#: Per-shard features of the ``shard`` kind (zero on every other row): the one-hot, the shard
#: group over the replicas, HSDP's groups over the replicas, reshard, prefetch over its maximum,
#: the bf16 reduce, the unit's members over the variables and its bytes over the model's, and the
#: unit's reduce-scatter, HSDP all-reduce and all-gather seconds over the domain's reference time.
SHARD_RAW_NAMES = ("is_shard", "shard_group_share", "hsdp_groups_share", "reshard", "prefetch", "reduce_bf16",
                   "unit_members", "unit_bytes", "unit_reduce_scatter", "unit_cross", "unit_gather")
#: Per-strategy features of its shard units (the terms :func:`_parts` adds to
#: :func:`~synctune.simulator.features.analytic_parts`, over the reference time), the share of the
#: model's bytes sharded and the units over the variables.
SHARD_GLOBAL_NAMES = ("t_shard", "t_gather_hidden", "t_gather_exposed", "shard_bytes", "num_units")


def shard_inputs(b: Any, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
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
    parts = _parts(b, ctx, t)
    g[:, 0] = parts["t_shard"] / ctx.t_ref
    g[:, 1] = parts["t_gather_hidden"] / ctx.t_ref
    g[:, 2] = parts["t_gather_exposed"] / ctx.t_ref
    g[:, 3] = np.bincount(u["usid"], u["bytes"], b.size) / ctx.model_bytes
    g[:, 4] = np.bincount(u["usid"], minlength=b.size) / ctx.num_vars
    return x, g

# ------------------------------------------------------------------------------ replay

def _prepare(rb: ReplayBatch, rows: np.ndarray) -> tuple[dict, dict]:
    """The batch's shard units (:func:`shard_units`) and their seconds at the replay's alpha."""
    su = shard_units(rb.b, rb.ctx, rb.t)
    return su, shard_unit_seconds(su, rb.alpha)


def _unit_rows(rb: ReplayBatch, rows: np.ndarray, state: tuple[dict, dict]) -> None:
    """A unit's members are one reduce-scatter, keyed by its first row; it reduces its gradients
    in its reduce dtype (bf16: half the bytes)."""
    su = state[0]
    first_row = np.full(len(su["usid"]), len(rb.b.sid), np.int64)
    np.minimum.at(first_row, su["unit_of"], su["rows"])
    rb.own[su["rows"]] = first_row[su["unit_of"]]
    rb.wire[su["rows"]] = (su["reduce_bytes"] / su["bytes"])[su["unit_of"]] * rb.wire[su["rows"]]


def _compute(rb: ReplayBatch, rows: np.ndarray, state: tuple[dict, dict]) -> None:
    """ZeRO-2 (the engine's shard): the updated slices are all-gathered after the step, one unit
    after the other on the queue. ZeRO-3: gathers in forward and in backward delay the compute
    (:func:`_resharded_compute`)."""
    su, sec = state
    k = rb.k
    rb.after_step[NAME] = np.bincount(su["usid"], np.where(su["reshard"], 0.0, sec["gather"] + k.unit_s), rb.b.size)
    if su["reshard"].any():
        rb.ready, rb.backward_end = _resharded_compute(rb.b, rb.ctx, rb.dom, rb.scale, su, sec["gather"] + k.unit_s,
                                                       rb.ready, rb.backward_end)


def _durations(rb: ReplayBatch, rows: np.ndarray, units: np.ndarray, state: tuple[dict, dict]) -> None:
    """A shard unit: the reduce-scatter over its shard group, then (HSDP) the all-reduce of its
    slice across the groups, chained on the queue."""
    su, sec = state
    which = np.empty(len(rb.usid), np.int64)
    which[rb.unit_of[su["rows"]]] = su["unit_of"]
    rb.dur[units] = (sec["reduce_scatter"] + sec["cross"])[which[units]]


def _step_saved(rb: ReplayBatch, rows: np.ndarray, state: tuple[dict, dict]) -> np.ndarray:
    """The optimizer step a rank does not run: a member of a shard group of k updates 1/k of a
    sharded variable's rows (its optimizer state is that slice)."""
    su = state[0]
    return np.bincount(su["usid"], su["bytes"] * (1 - 1 / su["k"]), rb.b.size)


def _pass(comp: np.ndarray, gather: np.ndarray, prefetch: np.ndarray) -> np.ndarray:
    """End of each step's compute, (n, steps), in a pass (forward or backward) whose step j first
    waits for an all-gather of ``gather[:, j]`` seconds (0: none): gathers run one at a time on
    their queue; with ``prefetch`` p >= 1 the gather of a unit is issued when the compute of the
    unit p gathers earlier starts (at the start of the pass for the first p), so it overlaps that
    compute (FSDP2's explicit prefetch); with p = 0 it is issued when the previous step's compute
    ends, serialized with compute."""
    n, steps = comp.shape
    end = np.zeros((n, steps))
    t_comp, t_queue = np.zeros(n), np.zeros(n)
    starts = np.zeros((n, steps + 1))  # compute start of each gather point, by gather count
    count = np.zeros(n, np.int64)
    rows = np.arange(n)
    for j in range(steps):
        g = gather[:, j]
        has = g > 0
        if has.any():
            p = prefetch[:, j].astype(np.int64)
            back = count - p
            issue = np.where(p == 0, t_comp, np.where(back >= 0, starts[rows, np.maximum(back, 0)], 0.0))
            done = np.maximum(issue, t_queue) + g
            t_queue = np.where(has, done, t_queue)
            start = np.where(has, np.maximum(t_comp, done), t_comp)
            starts[rows, count] = np.where(has, start, starts[rows, count])
            count = count + has
        else:
            start = t_comp
        t_comp = start + comp[:, j]
        end[:, j] = t_comp
    return end



def _resharded_compute(b: Any, ctx: Any, dom: Any, scale: np.ndarray, su: dict,
                       gather: np.ndarray, ready: np.ndarray, backward_end: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Gradient-ready times and backward end of strategies with resharded units (ZeRO-3, FSDP2's
    ``reshard_after_forward``): a resharded unit's parameters are all-gathered before its first
    member's forward compute and again before its first member's backward compute (:func:`_pass`),
    so compute waits for what the gathers do not hide. Per-variable backward compute comes from the
    profile's ready times; forward compute is spread over the variables in the same proportion.
    The gathers have their own queue (FSDP2 runs all-gathers and reduce-scatters on separate
    streams): their contention with the reduce-scatters for the link is not modelled."""
    v = ctx.num_vars
    sids = np.unique(su["usid"][su["reshard"]])
    local = np.full(b.size, -1, np.int64)
    local[sids] = np.arange(len(sids))
    per_var = np.diff(np.r_[dom.forward_s, dom.ready])  # backward compute, variables in backward order
    total = per_var.sum()
    fwd = dom.forward_s * (per_var / total if total > 0 else np.full(v, 1.0 / max(v, 1)))
    sc = scale[sids][:, None]
    m = len(sids)
    g_fwd, g_bwd, pre = np.zeros((m, v)), np.zeros((m, v)), np.zeros((m, v))
    res = np.flatnonzero(su["reshard"])
    at = local[su["usid"][res]]
    # Forward runs variables in reverse backward order: a unit is first used at its last member.
    g_fwd[at, v - 1 - su["last_var"][res]] = gather[res]
    g_bwd[at, su["first_var"][res]] = gather[res]
    pre[at, v - 1 - su["last_var"][res]] = su["prefetch"][res]
    pre_b = np.zeros((m, v))
    pre_b[at, su["first_var"][res]] = su["prefetch"][res]
    forward_end = _pass(fwd[::-1][None, :] * sc, g_fwd, pre)[:, -1]
    bwd_end = _pass(per_var[None, :] * sc, g_bwd, pre_b)
    ready = ready.copy()
    mine = np.flatnonzero(local[b.sid] >= 0)
    ready[mine] = forward_end[local[b.sid[mine]]] + bwd_end[local[b.sid[mine]], b.var[mine]]
    backward_end = backward_end.copy()
    # What backward computes after the last gradient is ready (the profile's tail) still follows.
    tail = (dom.backward_end - dom.ready[-1]) if v else dom.backward_end - dom.forward_s
    backward_end[sids] = forward_end + bwd_end[:, -1] + max(0.0, tail) * scale[sids]
    return ready, backward_end


register_memory_kind(NAME, MemoryKind(count=_count, holds_rows=lambda sync, fsdp: sync.reshard or fsdp))
register_feature_kind(NAME, FeatureKind(totals=_totals, hidden=("t_shard", "t_gather_hidden"),
                                        exposed=("t_gather_exposed",),
                                        block=FeatureBlock(SHARD_RAW_NAMES, SHARD_GLOBAL_NAMES, shard_inputs)))
register_replay_kind(NAME, ReplayKind(unit_cost="shard_unit_s", counted_as="shard", prepare=_prepare, form_units=_unit_rows,
                                      compute=_compute, durations=_durations, step_saved=_step_saved))
