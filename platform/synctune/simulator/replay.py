"""The replay simulator: one iteration replayed as events, from measured inputs (dPRO §4.3).

dPRO predicts an iteration by replaying the trace of one run on per-device queues. synctune's
replay does the same for a strategy it has never run, from three measured inputs:

- the **compute profile** (:class:`~synctune.spec.profile.ComputeProfile`): forward time, when
  each variable's gradient is ready in backward, the optimizer's step, measured with the
  trial's contention (``synctune sim profile``);
- the **links** of the cluster spec (calibrated on the lab: per-flow and NIC bandwidth, beta,
  and per-node message latency ``latency_ms``, alpha; AutoDDL's alpha-beta model);
- what the engine executes (:mod:`synctune.engine`): a unit per all-reduce merge group, per PS
  shard, per all-gather shard and per ``shard`` unit; a unit launches when its last member's
  gradient is ready and every earlier unit launched (the engine's scheduler issues units in one
  fixed order, as torch DDP its buckets); units share one communication queue (the world process
  group, whose collectives gloo runs one at a time), so a unit starts when it launched and the
  previous one finished; a dense PS shard with local aggregation reduces inside the nodes on their
  own groups, then among the node roots on theirs, two more queues that gloo serves beside the
  world's; ``step`` waits for the queues and the end of backward, runs the optimizer, then each PS
  placement broadcasts its new values, one after the other.

Event times follow AutoDDL's alpha-beta costs: ring all-reduce ``2(N-1)(alpha + bytes/(N beta))``,
all-gather ``(N-1)(alpha + bytes/beta)``; a dense PS shard as gloo runs the engine's
``dist.reduce`` (a ring reduce-scatter in segments, then every rank's chunk to the server) and,
after the step, ``dist.broadcast`` (a binomial tree), each link and NIC shared by the transfers
running at once; a sparse one's rows gathered straight to the server (the busier of its NIC and
its flows, AutoSync Eq. 2), alpha per message, after an all-gather of the row counts, with the
rows' indices. alpha lies between the smallest and the largest calibrated node latency
(``latency_share``, fitted by :func:`calibrate_replay`). A sparse variable on all-reduce is dense
on the wire (the engine densifies it); on PS or all-gather it carries the rows a replica's batch
touches (measured, ``touched_rows``). Compressors shrink what they encode (their registry's wire
ratio); a compressor of several stages (PowerSGD: the P factors, then the Q factors) runs that
many chained collectives per unit. Units of several collectives pay the launch and CPU costs of
each: a compressor's stages, a hierarchical all-reduce's reduces, all-reduce and all-gather (each
with its own peers), and a PS shard's broadcast rounds after the step. The other units of several
collectives (a sparse all-gather or PS push, SFB, a locally aggregated PS push, an HSDP shard
unit) pay one launch; their CPU costs are fitted per unit of their kind. On CPU workers an
iteration ends no sooner than backward, then every unit's CPU work (its launches, its steps with
other replicas, its encoding), then the step: gloo's collectives run on the cores that compute,
so what they cost the CPU does not hide behind backward as their links' time does (dPRO §4.3's
replayer keeps a queue per device, a worker's and each link's: on CPU workers gloo's work is on
the worker's device, not the link's). A row is priced by its kind's ``priced_as``
(:attr:`synctune.strategy.columns.StrategyColumns.pattern`).

Replaying the fixed unit order is a max-plus recurrence (``finish_i = max(launch_i, finish_{i-1})
+ d_i``), which closes into cumulative maxima, so thousands of strategies replay at once in numpy.
Calibrated, not modelled from first principles: the communication's own CPU cost (per unit and
per other replica of its collective), a fixed cost per iteration, and how much of the
communication hidden behind backward still delays it on a shared CPU (:func:`calibrate_replay`).
Not modelled: the bytes of process groups running at once sharing their links (their messages'
latencies overlap). A simulator saved with an earlier replay replays as that version
(:attr:`ReplayConstants.replay_version` says what each one leaves out; the measurements behind
each are in experiments/findings/README.md, "The replay's versions").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..spec.errors import SpecError
from ..spec.files import read_json
from ..spec.profile import ComputeProfile
from ..strategy.columns import StrategyColumns
from ..strategy.compressors import COMPRESSORS
from ..strategy.schema import SYNCHRONIZER_KINDS
from .features import (_GLOO_KEYS, KIND_AG, KIND_AR, KIND_PS, KIND_SFB, KIND_SHARD, DomainContext, batch_scale,
                       comm_terms, encode, hier_rows, message_sizes, per_kind, shard_unit_seconds, shard_units)
from .base import Simulator

__all__ = ["ReplayConstants", "constants_from_file", "ReplaySimulator", "CalibratedReplay", "calibrate_replay",
           "calibrate_per_cluster", "ALL_FIELDS", "UNIT_COSTS", "replay_units",
           "replay_features", "profile_key", "critical_path",
           "REPLAY_SHARD_NAMES", "REPLAY_GLOBAL_NAMES"]

#: Per-shard features from the replay (AutoSync's learned models on top of dPRO's replay): how
#: long the shard's unit waited for the link, how long it took, when it finished; all over the
#: replayed iteration time.
REPLAY_SHARD_NAMES = ("replay_wait", "replay_unit", "replay_finish")
#: Per-strategy features from the replay: the log of the replayed iteration time, and the end of
#: communication, the end of backward, the PS broadcasts and the exposed communication (after
#: backward) over it.
REPLAY_GLOBAL_NAMES = ("replay_log_iteration", "replay_comm_end", "replay_backward_end", "replay_broadcast",
                       "replay_exposed")


@dataclass(frozen=True, kw_only=True)
class ReplayConstants:
    """alpha_s: latency of one message on a link where the cluster spec has no calibrated
    ``latency_ms`` (a calibrated spec's slowest node latency is used instead); unit_s: fixed cost of launching one unit
    (kernel and bookkeeping, dPRO's "overhead" op); iteration_s: per-iteration fixed cost
    (the trial's barrier and timing)."""

    alpha_s: float = 1e-4
    unit_s: float = 5e-5
    iteration_s: float = 5e-4
    #: The communication's own CPU time, which the links do not show (zero: training-free;
    #: :func:`calibrate_replay` fits them on measured trials): per unit of each kind and per other
    #: replica of its collective, beyond ``unit_s`` (a ring takes one step per peer, and gloo's CPU
    #: work is per step; per step of each stage of a compressor and of each collective of a
    #: hierarchical all-reduce, and a PS shard's per broadcast round too), and per MB compressed
    #: (encode and decode). Not per MB sent: every strategy of a domain sends about the model's
    #: bytes, so such a cost could not be told apart from the compute scale below.
    ps_unit_s: float = 0.0
    ar_unit_s: float = 0.0
    ag_unit_s: float = 0.0
    compress_s_per_mb: float = 0.0
    #: Per MB a low-rank compressor encodes (PowerSGD's products and QR): its work is matrix
    #: products where a cast's is one pass over the bytes.
    lowrank_s_per_mb: float = 0.0
    #: Per shard unit, the CPU time gloo's reduce-scatter takes beyond the links (more than the
    #: ring model says on the lab's CPUs).
    shard_unit_s: float = 0.0
    #: Measured compute over the profile's (1: the profile as measured). A profile is keyed by
    #: model, device kind and worker count, so a cluster whose CPUs run at other quotas replays
    #: another cluster's compute; :func:`calibrate_replay` fits this factor too.
    compute_scale: float = 1.0
    #: The share of the communication hidden behind backward that still delays the iteration (0:
    #: the links run beside the compute; 1: not at all): gloo's work runs on the CPU that computes,
    #: and on a host with more workers than cores the two take turns. :func:`calibrate_replay` fits it.
    serial_share: float = 0.0
    #: Which replay, each version adding to the one before: 1 runs every PS shard as AutoSync's
    #: star through the server (Eq. 2) with the largest node latency; 2 a dense PS shard as gloo's
    #: ring reduce and binomial broadcast, with alpha at ``latency_share``, and a sparse one as one
    #: gather and one broadcast; 3 a sparse PS shard as the engine's SparsePSUnit (an all-gather of
    #: the row counts, the indices and the rows gathered, then a blocking broadcast of the count,
    #: the indices and the rows), and local aggregation on queues of its own; 4 the CPU costs per
    #: unit per other replica; 5 each collective of a compressor's stages, of a hierarchical
    #: all-reduce and of a PS shard's broadcasts priced on its own, and low-rank encoding at its
    #: own price; 6 the CPU bound on CPU workers (the module docstring). A learned simulator
    #: replays with the version it was saved with, so its replay features are those it was
    #: trained on (:func:`constants_from_file`: a file from before the field existed is version 1).
    replay_version: int = 6
    #: Where between the smallest and the largest calibrated node latency alpha lies (version 2;
    #: version 1 takes the largest): a probe's round trip is lengthened by what else its host runs,
    #: and by a CPU quota. :func:`calibrate_replay` fits it.
    latency_share: float = 0.0


def constants_from_file(values: dict) -> ReplayConstants:
    """:class:`ReplayConstants` as a simulator file saved them; a file saved before
    ``replay_version`` existed replays as version 1."""
    values = {"replay_version": 1, **values}
    return ReplayConstants(**{k: (int(v) if k == "replay_version" else float(v)) for k, v in values.items()})


def profile_key(model: str, device: str, workers: int) -> str:
    """How profiles are filed: a model on a device kind with so many workers computing at once."""
    return f"{model}@{device}-w{workers}"


@dataclass
class _ReplayDomain:
    ready: np.ndarray  # (vars,) gradient ready time from iteration start, seconds
    backward_end: float
    step_s: float
    profile_batch: int
    density: np.ndarray  # (vars,) share of rows a replica's batch touches (1 for dense)
    measured: bool  # whether a measured profile was found
    alpha: float  # seconds per message: the slowest calibrated link, else the constant
    #: measured compute speed over the nominal one the encoder prices SFB rebuilds at (1 unmeasured)
    rebuild_scale: float = 1.0
    #: forward time before backward starts, seconds (where resharded units gather their parameters)
    forward_s: float = 0.0
    #: (devices,) each device's compute time over the fastest one's (per-node profiles, else the
    #: cluster's calibrated speeds)
    device_slowdowns: np.ndarray | None = None
    #: the host's own time per iteration where the profile measured it (a GPU's launches and the
    #: engine's hooks, :meth:`ComputeProfile.host_s`), else 0: the iteration ends no sooner
    host_s: float = 0.0


class ReplaySimulator(Simulator):
    """Training-free: predicts iteration times in seconds by replaying one iteration.

    ``profiles`` maps :func:`profile_key` to measured profiles; a domain whose model has no
    measured profile falls back on the analytic compute estimate (counted FLOPs), spread over
    backward in proportion to the variables' bytes, and says so in :attr:`fallbacks`."""

    kind = "replay"
    predicts_seconds = True

    def __init__(self, profiles: dict[str, ComputeProfile] | None = None,
                 constants: ReplayConstants = ReplayConstants()) -> None:
        self.profiles = dict(profiles or {})
        self.constants = constants
        self.fallbacks: set[str] = set()
        # The last domain replayed and its inputs; the context itself is held, so its identity
        # cannot pass to another context after it is freed.
        self._cache: tuple[DomainContext, _ReplayDomain] | None = None

    # ------------------------------------------------------------------ profiles
    def set_constants(self, constants: ReplayConstants) -> None:
        """Replay with ``constants`` from now on."""
        self.constants = constants
        self._cache = None

    def add_profile(self, profile: ComputeProfile) -> None:
        self.profiles[profile_key(profile.model, profile.device, profile.workers)] = profile
        self._cache = None

    @classmethod
    def from_folder(cls, folder: str | Path, constants: ReplayConstants = ReplayConstants()) -> "ReplaySimulator":
        """Every ``*.json`` profile in ``folder`` (``synctune sim profile`` writes them there)."""
        sim = cls(constants=constants)
        folder = Path(folder)
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            data = read_json(path, "compute profile")
            try:
                sim.add_profile(ComputeProfile.from_dict(data, where=str(path)))
            except (ValueError, UnicodeDecodeError) as exc:
                raise SpecError(f"{path}: not a compute profile ({type(exc).__name__})") from None
        return sim

    def _node_profiles(self, model, cluster) -> tuple[ComputeProfile | None, np.ndarray | None]:
        """The profile the replay's compute follows and, where the cluster's nodes are of several
        device types each with its own profile (``device_model``: a lab node's CPU quota, a GPU
        type), each device's compute time over the fastest type's, measured on this workload
        (None: the calibrated speeds of the cluster spec say it). With typed profiles the fastest
        type's shape is replayed and the slowest replica sets the pace (TAG §2.1); otherwise one
        profile per device kind (every node alike)."""
        fits = lambda p: p is not None and len(p.ready_s) == len(model.variables)  # noqa: E731
        # A GPU computes alone whatever the cluster's size: its one-worker profile stands for it.
        typed = {n.device_model: self.profiles.get(profile_key(model.name, n.device_model, cluster.num_devices))
                 or (self.profiles.get(profile_key(model.name, n.device_model, 1)) if n.device_kind == "gpu" else None)
                 for n in cluster.nodes}
        if all(fits(p) for p in typed.values()):
            if len(typed) == 1:
                return next(iter(typed.values())), None
            total = {t: p.forward_s + p.backward_s for t, p in typed.items()}
            fastest = min(total, key=total.get)
            slowdowns = np.array([max(total[cluster.node_of(d).device_model], 1e-12) / max(total[fastest], 1e-12)
                                  for d in cluster.devices], dtype=np.float64)
            ref = typed[fastest]
            step = max(p.step_s for p in typed.values())
            # The slowest host among the types (each replica's host launches its own kernels).
            host = max(typed.values(), key=lambda p: p.host_s() or 0.0)
            return dataclasses.replace(ref, step_s=step, launch_s=host.launch_s, hook_s=host.hook_s), slowdowns
        generic = self.profiles.get(profile_key(model.name, cluster.device_kind, cluster.num_devices))
        return (generic if fits(generic) else None), None

    def _domain(self, ctx: DomainContext) -> _ReplayDomain:
        if self._cache is not None and self._cache[0] is ctx:
            return self._cache[1]
        model, cluster = ctx.model, ctx.cluster
        profile, slowdowns = self._node_profiles(model, cluster)
        if profile is not None:
            ready = profile.forward_s + np.asarray(profile.ready_s, dtype=np.float64)
            backward_end, step_s, batch, measured = profile.forward_s + profile.backward_s, profile.step_s, \
                profile.batch_size, True
        else:
            self.fallbacks.add(f"{model.name}@{cluster.name}")
            forward = ctx.t_comp / 3
            share = np.cumsum(ctx.var_bytes) / max(ctx.model_bytes, 1.0)
            ready = forward + 2 * forward * share
            backward_end, step_s, batch, measured = 3 * forward, 0.0, model.batch_size, False
        c = self.constants.compute_scale
        ready, backward_end, step_s = ready * c, backward_end * c, step_s * c
        rows = ctx.var_rows
        if model.touched_rows is not None:
            touched = np.array([r if r is not None else rows[i] for i, r in enumerate(model.touched_rows)], float)
            density = np.where(ctx.var_sparse, np.minimum(1.0, touched / np.maximum(rows, 1.0)), 1.0)
        else:
            density = np.where(ctx.var_sparse, ctx.sparse_density, 1.0)
        latencies = [n.latency_ms for n in cluster.nodes]
        if all(x is not None for x in latencies):
            share = 1.0 if self.constants.replay_version < 2 else self.constants.latency_share
            alpha = (min(latencies) + share * (max(latencies) - min(latencies))) / 1e3
        else:
            alpha = self.constants.alpha_s
        rebuild_scale = 1.0
        if measured and model.flops_per_sample and backward_end > 0:
            # The rebuild of an SFB gradient is a matmul: price it at the speed the profile measured.
            # The encoder priced it at the slowest node's nominal speed: keep that node's slowdown.
            rebuild_scale = ctx.device_flops * float(ctx.node_slowdown.max()) / (
                model.flops_per_sample * batch / float(backward_end))
        forward_s = (profile.forward_s if measured else forward) * c
        dom = _ReplayDomain(ready, float(backward_end), float(step_s), int(batch), density, measured, alpha,
                            rebuild_scale, float(forward_s),
                            ctx.device_slowdowns if slowdowns is None else slowdowns,
                            float((profile.host_s() if measured else None) or 0.0))
        self._cache = (ctx, dom)  # one domain at a time: a search scores one domain
        return dom

    # ------------------------------------------------------------------ replay
    def _predict_batch(self, batch: StrategyColumns, ctx: DomainContext) -> np.ndarray:
        return replay_units(batch, ctx, self._domain(ctx), self.constants)["iteration_s"]

    def timeline(self, batch: StrategyColumns, ctx: DomainContext) -> dict[str, np.ndarray]:
        """Per-unit events of every strategy (``unit_sid``, ``unit_kind``, ``unit_first`` the first
        member's variable, ``unit_launch``, ``unit_start``, ``unit_finish``, ``unit_s``; a shard's
        unit is ``shard_unit``), and per
        strategy ``iteration_s``, ``comm_end`` and ``backward_end``: the critical path is the
        chain of units whose start equals the previous unit's finish (waiting on the link)."""
        return replay_units(batch, ctx, self._domain(ctx), self.constants)

    def critical_path(self, strategy, model, cluster) -> dict[str, Any]:
        """:func:`critical_path` of ``strategy`` under this replay."""
        ctx = DomainContext(model, cluster)
        batch = encode([strategy], ctx)
        return critical_path(self.timeline(batch, ctx), batch, model, measured=f"{model.name}@{cluster.name}"
                             not in self.fallbacks)

    def save(self, path: str | Path) -> None:
        from ..spec.files import write_text_atomic

        write_text_atomic(Path(path), json.dumps({"format": "synctune-replay", "profiles": [
            p.to_dict() for p in self.profiles.values()], "constants": self.constants.__dict__}, indent=1) + "\n")


def _per_compressor(field: str) -> np.ndarray:
    """Per compressor code (the registry's order), its :class:`~synctune.strategy.compressors.CompressorInfo`
    ``field`` (``stages``: chained collectives per unit; ``low_rank``: priced ``lowrank_s_per_mb``)."""
    return np.array([getattr(COMPRESSORS.get(name), field) for name in COMPRESSORS.names()])


def _segmented_cummax(values: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Running maximum of ``values`` restarting at every segment (segments contiguous, sorted)."""
    if not len(values):
        return values
    span = float(values.max() - values.min()) + 1.0
    shifted = values + seg * span
    return np.maximum.accumulate(shifted) - seg * span


def _index_bytes(b: StrategyColumns, ctx: DomainContext, rows_bytes: np.ndarray) -> np.ndarray:
    """The int64 indices of ``rows_bytes`` of each shard's rows (a sparse unit sends them beside
    the rows)."""
    row_bytes = ctx.var_bytes[b.var] / np.maximum(ctx.var_rows[b.var], 1.0)
    return rows_bytes / np.maximum(row_bytes, 1.0) * 8.0


def _serial(launch: np.ndarray, dur: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Finish times of units run one after the other on their queue (``seg``: contiguous, sorted
    segments, one queue each), each launched in order and no earlier than ``launch``."""
    launch = _segmented_cummax(launch, seg)
    csum = np.cumsum(dur)
    return csum + _segmented_cummax(launch - (csum - dur), seg)


def _two_queues(usid: np.ndarray, first: np.ndarray, launch: np.ndarray, dur: np.ndarray, in_node: np.ndarray,
                roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) of every unit (sorted by strategy, then launch order) where dense PS
    shards with local aggregation run on process groups of their own: gloo runs each group's
    collectives on its own threads, in the group's order, beside the other groups'
    (:class:`~synctune.engine.units.Scheduler`). Such a unit reduces inside the nodes first (every
    node at once, one queue: ``in_node`` seconds), then among the node roots (a second queue);
    every other unit keeps the world's queue. The queues share no latency (the messages of
    small units overlap); their bytes are not shared out between them."""
    u = len(usid)
    stage1 = np.flatnonzero(roots)
    done1 = launch.copy()
    if len(stage1):
        done1[stage1] = _serial(launch[stage1], in_node[stage1], usid[stage1])
    rest = np.where(roots, dur - in_node, dur)
    queue = usid * 2 + roots
    order = np.lexsort((first, queue))
    finish = np.empty(u)
    finish[order] = _serial(done1[order], rest[order], queue[order])
    start = np.where(roots, done1 - in_node, finish - rest)
    return start, finish


def _schedule(b: StrategyColumns, ctx: DomainContext, k: ReplayConstants, unit_of: np.ndarray, order: np.ndarray,
              usid: np.ndarray, first: np.ndarray, launch: np.ndarray, dur: np.ndarray, in_node: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, finish) of every unit in launch order (``order``: from unit index to it), and each
    strategy's end of communication: one queue per strategy, or with dense PS shards on local
    aggregation (version 3) the queues of :func:`_two_queues`."""
    roots = np.zeros(len(usid), dtype=bool)
    if k.replay_version >= 3:
        roots[unit_of] = (b.pattern == KIND_PS) & b.local.astype(bool) & ~ctx.var_sparse[b.var]
        roots = roots[order]
    if roots.any():
        start, finish = _two_queues(usid, first, launch, dur, in_node, roots)
    else:
        finish = _serial(launch, dur, usid)
        start = finish - dur
    comm_end = np.zeros(b.size)
    if len(usid):
        np.maximum.at(comm_end, usid, finish)
    return start, finish, comm_end


def replay_units(b: StrategyColumns, ctx: DomainContext, dom: _ReplayDomain, k: ReplayConstants) -> dict[str, Any]:
    """Replay every strategy of ``b`` (see the module docstring); per strategy and per unit."""
    n = b.size
    alpha = dom.alpha
    # A replica's compute scales with its batch and its node's slowdown (calibrated speeds);
    # the iteration waits for the slowest replica (TAG §2.1).
    scale = batch_scale(b, ctx, dom.device_slowdowns) * (ctx.model.batch_size / dom.profile_batch)
    plain = ctx.var_bytes[b.var] * b.frac
    sparse_part = np.where(b.pattern == KIND_AR, 1.0, dom.density[b.var])  # all-reduce sends sparse dense
    wire = plain * sparse_part * b.ratio
    sfb = b.pattern == KIND_SFB
    rebuild = None
    if sfb.any():
        nbytes, rebuild = message_sizes(b, ctx)
        wire = np.where(sfb, nbytes * b.ratio, wire)  # the factors, padded to the largest replica batch
    # Units: one per merge group (all-reduce), one per shard unit (a shard unit's members are one
    # reduce-scatter, keyed by its first row), one per shard otherwise.
    num_shards, group = len(b.sid), b.group_order
    width = int(group.max()) + 1 if num_shards else 1
    own = np.arange(num_shards)
    t = comm_terms(b, ctx)
    su = shard_units(b, ctx, t)
    if su is not None:
        first_row = np.full(len(su["usid"]), num_shards, np.int64)
        np.minimum.at(first_row, su["unit_of"], su["rows"])
        own[su["rows"]] = first_row[su["unit_of"]]
        # A unit reduces its gradients in its reduce dtype (bf16: half the bytes).
        wire[su["rows"]] = (su["reduce_bytes"] / su["bytes"])[su["unit_of"]] * wire[su["rows"]]
    unit_key = np.where(b.pattern == KIND_AR, b.sid * (width + num_shards) + group,
                        b.sid * (width + num_shards) + width + own)
    keys, unit_of = np.unique(unit_key, return_inverse=True)
    u = len(keys)
    usid = (keys // (width + num_shards)).astype(np.int64)
    ready_shard = dom.ready[b.var] * scale[b.sid]
    backward_end = dom.backward_end * scale
    gathers_after_step = np.zeros(n)
    if su is not None:
        sec = shard_unit_seconds(su, alpha)
        # ZeRO-2 (the engine's shard): the updated slices are all-gathered after the step, one unit
        # after the other on the queue.
        gathers_after_step = np.bincount(su["usid"], np.where(su["reshard"], 0.0, sec["gather"] + k.unit_s), n)
        if su["reshard"].any():  # ZeRO-3: gathers in forward and in backward delay the compute
            ready_shard, backward_end = _resharded_compute(b, ctx, dom, scale, su, sec["gather"] + k.unit_s,
                                                           ready_shard, backward_end)
    launch = np.full(u, -np.inf)
    np.maximum.at(launch, unit_of, ready_shard)
    first = np.full(u, np.iinfo(np.int64).max)
    np.minimum.at(first, unit_of, b.var)
    ukind = np.zeros(u, dtype=np.int64)
    ukind[unit_of] = b.pattern
    ubytes = np.bincount(unit_of, weights=wire, minlength=u)
    dur, bcast, in_node, cpu = _unit_durations(b, ctx, dom, k, t, unit_of, usid, ukind, ubytes, wire, plain,
                                               sparse_part, alpha, su=su, sec=sec if su is not None else None,
                                               rebuild=rebuild)
    # Each strategy's communication CPU work, for the bound below (units still in their first order).
    cpu_s = np.bincount(usid, weights=cpu, minlength=n) if _host_bound(ctx, k) and u else None
    # The fixed launch order: by strategy, then by the first member's position in backward.
    order = np.lexsort((first, usid))
    position = np.empty(u, dtype=np.int64)
    position[order] = np.arange(u)
    usid, launch, dur, ukind, first = usid[order], launch[order], dur[order], ukind[order], first[order]
    start, finish, comm_end = _schedule(b, ctx, k, unit_of, order, usid, first, launch, dur, in_node[order])
    step = dom.step_s * _step_share(b, ctx, su)
    iteration = np.maximum(backward_end, comm_end) + step + bcast + gathers_after_step + k.iteration_s
    if cpu_s is not None:
        # On CPU workers the communication's CPU work cannot hide behind backward: the cores compute.
        iteration = np.maximum(iteration, backward_end + cpu_s + step + bcast + gathers_after_step + k.iteration_s)
    if k.serial_share and u:
        hidden = np.clip(np.minimum(finish, backward_end[usid]) - start, 0.0, None)
        iteration = iteration + k.serial_share * np.bincount(usid, weights=hidden, minlength=n)
    if dom.host_s:
        # A GPU waits for a host that launches many small kernels (and runs the engine's hooks
        # between them): the iteration ends no sooner than the host's own path (dPRO §4: the
        # framework's CPU work is a node of the replayed graph, here a lower bound).
        iteration = np.maximum(iteration, dom.host_s + k.iteration_s)
    return {"iteration_s": iteration, "comm_end": comm_end, "backward_end": backward_end,
            "broadcast_s": bcast + gathers_after_step,
            "unit_sid": usid, "unit_kind": ukind, "unit_first": first, "unit_launch": launch, "unit_start": start,
            "unit_finish": finish, "unit_s": dur, "shard_unit": position[unit_of], "unit_bytes": ubytes[order]}


def _unit_durations(b: StrategyColumns, ctx: DomainContext, dom: _ReplayDomain, k: ReplayConstants, t: dict,
                    unit_of: np.ndarray, usid: np.ndarray, ukind: np.ndarray, ubytes: np.ndarray, wire: np.ndarray,
                    plain: np.ndarray, sparse_part: np.ndarray, alpha: float, *, su: dict | None, sec: dict | None,
                    rebuild: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each unit's time on the link queue (alpha-beta per kind, PS pushes, the fixed per-unit
    and CPU costs, compression), each strategy's PS broadcast after the step, the part of
    each unit's time spent inside the nodes first (local aggregation; else 0), and the part of
    each unit's time that is CPU work (its calibrated costs and launches: version 6's bound)."""
    u, n = len(usid), b.size
    sfb = b.pattern == KIND_SFB
    # Per-unit transfer time (alpha-beta), over the strategy's replicas (all devices, or the
    # subset it replicates on: TAG §4.2).
    unn, ring = t["N"][usid], t["ring_bw"][usid]
    dur = np.zeros(u)
    ar, ag, ps = (ukind == KIND_AR) & (unn > 1), (ukind == KIND_AG) & (unn > 1), ukind == KIND_PS
    hier = hier_rows(b)
    hr = None
    if hier is not None:  # the hierarchical all-reduce units
        hr = np.zeros(u, dtype=bool)
        hr[unit_of] = hier
        hr &= ukind == KIND_AR
    stages, launches, steps = _collectives(b, k, t, unit_of, usid, hr)
    dur[ar] = 2 * (unn[ar] - 1) * (alpha * stages[ar] + ubytes[ar] / (unn[ar] * ring[ar]))
    if hr is not None:
        dur[hr] = t["hier_msgs"][usid[hr]] * alpha + ubytes[hr] * t["hier_per_byte"][usid[hr]]
    if k.replay_version >= 3:
        # The engine's sparse all-gather (SparseAllGatherUnit): the row counts all-gathered first,
        # then the rows' int64 indices and the rows, each a ring all-gather of N - 1 messages.
        index_bytes = np.bincount(unit_of, weights=np.where(b.pattern == KIND_AG, _index_bytes(
            b, ctx, plain * sparse_part), 0.0), minlength=u)
        dur[ag] = (unn[ag] - 1) * (3 * alpha + (ubytes[ag] + index_bytes[ag]) / ring[ag])
    else:
        dur[ag] = (unn[ag] - 1) * (alpha + ubytes[ag] / ring[ag])
    if su is not None:
        # A shard unit: the reduce-scatter over its shard group, then (HSDP) the all-reduce of its
        # slice across the groups, chained on the queue.
        ushard = np.flatnonzero(ukind == KIND_SHARD)
        which = np.empty(u, np.int64)
        which[unit_of[su["rows"]]] = su["unit_of"]
        dur[ushard] = (sec["reduce_scatter"] + sec["cross"])[which[ushard]]
    if sfb.any():
        # Two chained gathers (row counts, then factors), then every replica rebuilds the gradient.
        fb = (ukind == KIND_SFB) & (unn > 1)
        dur[fb] = (unn[fb] - 1) * (2 * alpha + ubytes[fb] / ring[fb])
        dur += np.bincount(unit_of, weights=np.where(sfb, rebuild * dom.rebuild_scale, 0.0), minlength=u)
    bcast = np.zeros(n)
    in_node = np.zeros(u)
    if ps.any():
        push, pull, stage = _ps_shards(b, ctx, t, wire, plain * sparse_part, alpha, k)
        dur += np.bincount(unit_of, weights=push, minlength=u)
        bcast = np.bincount(b.sid, weights=pull, minlength=n)
        in_node = np.bincount(unit_of, weights=stage, minlength=u)
    cpu = k.unit_s * launches + _cpu_terms(k, ukind) * steps + np.where(ukind == KIND_SHARD, k.shard_unit_s, 0.0)
    if b.comp.any():
        # Per MB encoded: a low-rank compressor at its own price (version 5), a cast at the other.
        lowrank = _per_compressor("low_rank")[b.comp] if k.replay_version >= 5 else np.zeros(len(b.comp), bool)
        price = np.where(lowrank, k.lowrank_s_per_mb, k.compress_s_per_mb)
        cpu += np.bincount(unit_of, weights=np.where(b.comp > 0, plain * price, 0.0), minlength=u) / 1e6
    return dur + cpu, bcast, in_node, cpu


def _host_bound(ctx: DomainContext, k: ReplayConstants) -> bool:
    """Whether the iteration is bounded below by the compute plus the communication's CPU work
    (version 6; CPU clusters, whose workers compute on the cores gloo's collectives run on)."""
    return k.replay_version >= 6 and ctx.cluster.device_kind == "cpu"


def _collectives(b: StrategyColumns, k: ReplayConstants, t: dict, unit_of: np.ndarray, usid: np.ndarray,
                 hier: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit: the chained collectives its compressor runs (``stages``), the collectives it
    launches (each pays ``unit_s``) and the steps a rank takes in them with another replica (each
    pays the unit kind's CPU cost, :func:`_cpu_terms`); ``hier``: which units are hierarchical
    all-reduces (None: none is)."""
    u = len(usid)
    stages = np.ones(u)
    if k.replay_version >= 5 and b.comp.any():  # PowerSGD: the P factors, then the Q factors
        np.maximum.at(stages, unit_of, _per_compressor("stages")[b.comp])
    # From version 4 a unit's CPU cost is per other replica of its collective (none alone).
    peers = np.maximum(t["N"][usid] - 1, 0) if k.replay_version >= 4 else np.ones(u)
    launches, steps = stages.copy(), peers * stages
    if k.replay_version >= 5 and hier is not None:
        # The engine's HierarchicalAllReduceUnit, r replicas on each of W nodes: a reduce per piece
        # inside the node (r reduces, r - 1 peers each), the rank's piece all-reduced across the
        # nodes (W - 1), then an all-gather inside the node (r - 1); not one ring over N - 1 peers.
        r, w = t["r"][usid].max(1), t["W"][usid]
        inside = np.maximum(r - 1, 0)
        launches[hier] = (np.where(r > 1, r + 1, 0) + (w > 1))[hier]
        steps[hier] = (r * inside + np.maximum(w - 1, 0) + inside)[hier]
    return stages, launches, steps


def _step_share(b: StrategyColumns, ctx: DomainContext, su: dict | None) -> np.ndarray | float:
    """The optimizer step's share each strategy runs: a member of a shard group of k updates 1/k
    of a sharded variable's rows (its optimizer state is that slice); 1 without shard plans."""
    if su is None:
        return 1.0
    saved = np.bincount(su["usid"], su["bytes"] * (1 - 1 / su["k"]), b.size)
    return 1.0 - saved / max(ctx.model_bytes, 1.0)


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


def _resharded_compute(b: StrategyColumns, ctx: DomainContext, dom: _ReplayDomain, scale: np.ndarray, su: dict,
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


def _gloo_segments(nbytes: np.ndarray, group: np.ndarray) -> np.ndarray:
    """How many segments gloo's ring reduce cuts ``nbytes`` into over ``group`` ranks
    (gloo/reduce.cc: at least two per rank, at most 1 MiB each, a multiple of the ranks)."""
    group = np.maximum(group, 1.0)
    return np.maximum(2 * group, group * np.ceil(np.ceil(nbytes / _GLOO_SEGMENT) / group))


#: gloo's largest segment of a ring reduce (ReduceOptions::kMaxSegmentSize).
_GLOO_SEGMENT = float(1 << 20)


def _ps_shards(b: StrategyColumns, ctx: DomainContext, t: dict, wire: np.ndarray, sent: np.ndarray, alpha: float,
               k: ReplayConstants) -> tuple[np.ndarray, np.ndarray]:
    """Per shard, the seconds a PS shard's push and its pull (the ``sent`` parameter bytes back to
    every replica) take (0 off PS), and the part of the push inside the nodes (a dense shard with
    local aggregation, version 3; else 0), as the engine runs them on gloo
    (:meth:`~synctune.simulator.features.DomainContext._gloo_ps_tables`): a dense shard's push is
    ``dist.reduce`` (a ring reduce-scatter in segments, one message each, then every rank's chunk
    to the server), a sparse one's ``dist.gather`` of its rows straight to the server (its
    server's NIC and flows, AutoSync Eq. 2, one message per sender); the pull is a binomial-tree
    ``dist.broadcast`` (one message a round)."""
    shard_ps = b.pattern == KIND_PS
    look = b.node * 2 + b.local.astype(np.int64)
    look = np.where(shard_ps, look, 0) + b.sid * (2 * ctx.W)
    # A sparse shard (rows touched, density < 1) is gathered, not reduced.
    w = np.maximum(1.0, t["W"] - 1)[b.sid]
    per_byte = np.maximum(t["ps_flow_flat"][look] / w, t["ps_nic_flat"][look]) + t["ps_intra_flat"][look]
    r_server = np.asarray(t["r"])[b.sid, np.maximum(b.node, 0)]
    msgs = t["ps_phi_flat"][look] + np.where(b.local, r_server - 1, 0)
    gathered = wire * per_byte + msgs * alpha
    if k.replay_version < 2:  # every shard through the server's NIC and flows, both ways
        return (np.where(shard_ps, gathered, 0.0),
                np.where(shard_ps, sent * per_byte + (t["N"][b.sid] - 1) * alpha + k.unit_s, 0.0),
                np.zeros(len(wire)))
    # The (strategies, nodes, 2) tables read in place: a round's domain tables are broadcast views.
    server, local = np.where(shard_ps, b.node, 0), b.local.astype(np.int64)
    g = {key: t[key][b.sid, server, local] for key in _GLOO_KEYS}
    dense = np.zeros(len(wire))
    phases = []
    for ring, group in ((g["gloo_ring_a"], g["gloo_n_a"]), (g["gloo_ring_b"], g["gloo_n_b"])):
        segments = _gloo_segments(wire, group)
        steps = np.where(group > 1, segments - 2, 0.0)
        phases.append(wire * steps / segments * ring + steps * alpha)
        dense += phases[-1]
    dense += wire * g["gloo_gather"] + np.where(g["gloo_gather"] > 0, alpha, 0.0)
    sparse = ctx.var_sparse[b.var] & shard_ps
    pull_bytes, pull_msgs, in_node = sent, 1.0, np.zeros(len(wire))
    if k.replay_version >= 3:
        # SparsePSUnit: the row counts all-gathered first (gloo's ring: N - 1 messages, a few
        # bytes), then the rows' int64 indices gathered beside the rows, and after the step the
        # count broadcast (blocking), then the indices and the rows.
        index_bytes = np.where(sparse, _index_bytes(b, ctx, sent), 0.0)
        gathered = gathered + index_bytes * per_byte + msgs * alpha + (t["N"][b.sid] - 1) * alpha
        pull_bytes = np.where(sparse, sent + index_bytes, sent)
        pull_msgs = np.where(sparse, 3.0, 1.0)
        # With local aggregation the reduce inside the nodes is a stage of its own, on the nodes'
        # process groups (the rest, on the node roots' group, follows it).
        in_node = np.where(shard_ps & ~sparse & b.local.astype(bool), phases[0], 0.0)
    push = np.where(shard_ps, np.where(sparse, gathered, dense), 0.0)
    pull = np.where(shard_ps, pull_bytes * g["gloo_bcast"] + pull_msgs * g["gloo_bcast_rounds"] * alpha + k.unit_s,
                    0.0)
    if k.replay_version >= 5:
        # Each broadcast's rounds cost a rank the PS CPU cost, as the push's steps do (before version
        # 5 they were free: the fit charged them to the all-reduce units of the mixed strategies,
        # which put all-reduce-only strategies 6.7% too slow on release v0.3, median).
        pull = pull + np.where(shard_ps, k.ps_unit_s * pull_msgs * g["gloo_bcast_rounds"], 0.0)
    return push, pull, in_node


_CPU_FIELDS = ("ps_unit_s", "ar_unit_s", "ag_unit_s", "compress_s_per_mb", "iteration_s", "serial_share",
               "latency_share", "shard_unit_s", "lowrank_s_per_mb")
#: The latency share's field, and how hard its fit is pulled to 0: a relative error of this much
#: per trial for a share of 1.
_LATENCY, _LATENCY_PRIOR = _CPU_FIELDS.index("latency_share"), 0.035
#: Every field :func:`calibrate_replay` can fit: the CPU terms, then the compute scale.
ALL_FIELDS = (*_CPU_FIELDS, "compute_scale")
#: The fields other domains' trials say of a domain never measured (:func:`calibrate_replay`
#: says why the others are not): the CPU cost of each kind of unit and of compression.
UNIT_COSTS = ("ps_unit_s", "ar_unit_s", "ag_unit_s", "compress_s_per_mb", "shard_unit_s", "lowrank_s_per_mb")
#: Upper bounds of the fields: a share is at most 1; a CPU cost of 50 ms per unit, 1 s per MB
#: compressed or 1 s per iteration is no CPU cost of these units (the fits found at most 13 ms,
#: 0.3 s and 0.35 s), and without a bound two nearly collinear columns can cancel at absurd sizes
#: (cnn-small@lab-4x1's fit once put 5e9 s on a PS unit against a compute scale of 6,000).
_CPU_UPPER = np.array([0.05, 0.05, 0.05, 1.0, 1.0, 1.0, 1.0, 0.05, 1.0])


def _cpu_terms(k: ReplayConstants, ukind: np.ndarray) -> np.ndarray:
    """Per unit, the CPU seconds of :class:`ReplayConstants`' calibrated per-unit costs."""
    per_unit = per_kind({"ps": k.ps_unit_s, "allreduce": k.ar_unit_s, "allgather": k.ag_unit_s})
    return per_unit[ukind] if per_unit.any() else np.zeros(len(ukind))


#: Steps of :func:`_cpu_features`' finite differences: seconds per unit, seconds per MB compressed,
#: seconds per iteration, the two shares, seconds per shard unit, seconds per MB low-rank encoded,
#: then (``_SCALE_STEP``) a relative change of the compute.
_CPU_STEPS = (1e-4, 1e-4, 1e-4, 1e-3, 1e-4, 0.05, 0.05, 1e-4, 1e-3)
_SCALE_STEP = 1e-2


def _cpu_features(sim: "ReplaySimulator", d, base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(replayed seconds, how they move with the calibrated terms) of domain ``d`` under ``sim``'s
    current constants: per strategy, one column per field of :data:`_CPU_FIELDS` (seconds of
    iteration per second of the term, or per s/MB), then per relative change of the compute scale.
    Finite differences of the replay itself (a Gauss-Newton step), not counts of units: a cost
    added to a unit that hides behind backward adds nothing, and more compute delays a
    strategy bound on its links only by the compute before its critical chain starts; so a fixed
    cost per iteration and the compute scale are told apart by the strategies whose
    communication is exposed. ``base``: the replayed seconds under the current constants where
    the caller has them already."""
    b, ctx = d.encoded(), d.ctx
    k = sim.constants
    if base is None:
        base = sim.timeline(b, ctx)["iteration_s"]
    cols = []
    for field, h in zip(_CPU_FIELDS, _CPU_STEPS):
        sim.set_constants(dataclasses.replace(k, **{field: getattr(k, field) + h}))
        cols.append((sim.timeline(b, ctx)["iteration_s"] - base) / h)
    sim.set_constants(dataclasses.replace(k, compute_scale=k.compute_scale * (1 + _SCALE_STEP)))
    cols.append((sim.timeline(b, ctx)["iteration_s"] - base) / _SCALE_STEP)
    sim.set_constants(k)
    return base, np.stack(cols, axis=1)


def _step_bounds(current: np.ndarray, a: np.ndarray, fields: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of one round's step in :func:`calibrate_replay` (the CPU terms, then the relative
    change of the compute scale), given the constants so far and the round's sensitivities ``a``."""
    # A round may take back what an earlier one overshot, never below zero; the compute may
    # be scaled down as well as up (by half at most, or doubled, per round).
    lower, upper = np.r_[-current, -0.5], np.r_[_CPU_UPPER - current, 1.0]
    held = np.array([f not in fields for f in ALL_FIELDS])
    # A term no training trial moves (no all-gather unit among them, nothing compressed) is
    # not fitted: least squares would give it any value, and domains with such units would pay it.
    idle = ~(np.abs(a) > 1e-12).any(axis=0)
    lower[held | idle], upper[held | idle] = 0.0, 0.0
    return lower, upper


def calibrate_replay(sim: "ReplaySimulator", domains: list, *, rounds: int = 10,
                     fields: tuple[str, ...] = ALL_FIELDS) -> ReplayConstants:
    """The communication's CPU terms, a fixed cost per iteration, the serial and latency shares
    and the compute scale of :class:`ReplayConstants` fitted on measured trials (dPRO §4.3
    calibrates its replay's overhead ops from a trace in the same spirit): what the replay leaves
    unexplained, ``measured - replayed``, in proportion to each trial's time (so every trial weighs
    alike), as non-negative costs per unit of each kind, per MB compressed and per iteration, two
    shares in [0, 1] (the latency one pulled to 0 unless the trials move it), and a factor on the
    compute (bounded least squares, :func:`scipy.optimize.lsq_linear`, on the replay's own sensitivities,
    :func:`_cpu_features`), repeated from the constants so far (``rounds`` times: the replay is
    piecewise linear in them). Only ``fields`` (of :data:`ALL_FIELDS`) move; the other constants
    and the measured compute profiles are kept.

    For domains not among ``domains`` (an unseen model or cluster) fit :data:`UNIT_COSTS` only.
    The fixed cost per iteration and the serial share are a workload's own on its host: the
    fixed cost is seconds of one model's engine work (5 to 350 ms across the lab's models), and
    carried to an unseen model and cluster of release v0.2 the two took the replay's median
    error from 20% to 47%. The latency share says how far a cluster's own probe readings are to
    be believed: fitted on other clusters and applied to lab-4x1's spurious 1.8 ms probe, it put
    transformer-small@lab-4x1 (unseen model and cluster, v0.3) at +146%. The compute scale is
    the workload's too (its profile was measured on that device type with that many workers):
    on lab-b11c four small models, whose few milliseconds of compute hide fixed costs, fitted
    3.4, and bert-tiny's 300 ms of compute replayed with it came out 2.2 times too slow."""
    from scipy.optimize import lsq_linear

    base = sim.constants
    current = np.array([getattr(base, f) for f in _CPU_FIELDS], dtype=float)
    scale = base.compute_scale
    trial = ReplaySimulator(sim.profiles, base)
    replays = [None] * len(domains)  # each domain's replayed seconds under the accepted constants
    for _ in range(rounds):
        rows, target = [], []
        for d, known in zip(domains, replays):
            replayed, feats = _cpu_features(trial, d, known)
            truth = np.asarray(d.times_s, dtype=float)
            rows.append(feats / truth[:, None])
            target.append((truth - replayed) / truth)
        if not rows:
            break
        a, b = np.vstack(rows), np.concatenate(target)
        lower, upper = _step_bounds(current, a, fields)
        # The latency share is pulled to the smallest latency unless the trials say otherwise: on
        # nodes of near-equal latencies it barely moves them, and a share fitted there would price
        # another cluster's far slower node (lab-4x1's 1.8 ms probe) into every message.
        prior = np.zeros((1, a.shape[1]))
        prior[0, _LATENCY] = _LATENCY_PRIOR * np.sqrt(len(b))
        a, b = np.vstack([a, prior]), np.r_[b, -prior[0, _LATENCY] * current[_LATENCY]]
        step = lsq_linear(a, b, bounds=(lower, np.maximum(upper, lower + 1e-15))).x
        step[lower == upper] = 0.0  # the fields held (lsq_linear needs an open interval)
        if np.abs(step).max() < 1e-9:
            break
        # The replay is only piecewise linear in its constants: a full Gauss-Newton step can land
        # far worse (cnn-small@lab-4x1 once went to a compute scale of 6,000). Halve it until the
        # trials' squared relative residual falls; none that does ends the fit where it is.
        before = float(np.sum(b[:-1] ** 2) + (prior[0, _LATENCY] * current[_LATENCY]) ** 2)
        kept = trial.constants
        for _half in range(6):
            moved = np.clip(current + step[:-1], 0.0, _CPU_UPPER)
            candidate = dataclasses.replace(base, compute_scale=float(scale * (1.0 + step[-1])),
                                            **dict(zip(_CPU_FIELDS, moved.tolist())))
            trial.set_constants(candidate)
            predicted = [trial.predict_domain(d) for d in domains]
            after = sum(float(np.sum(((np.asarray(d.times_s, float) - p) / np.asarray(d.times_s, float)) ** 2))
                        for d, p in zip(domains, predicted))
            after += float((prior[0, _LATENCY] * moved[_LATENCY]) ** 2)
            if after < before:
                break
            step = step / 2
        else:
            trial.set_constants(kept)
            break
        current, scale, replays = moved, candidate.compute_scale, predicted
    return trial.constants


def calibrate_per_cluster(sim: "ReplaySimulator", domains: list, min_trials: int = 10) -> dict[str, ReplayConstants]:
    """Per cluster, what an unseen model on that cluster replays with, fitted on that cluster's
    domains with at least ``min_trials`` trials from ``sim``'s constants: :data:`UNIT_COSTS`,
    then with those set a fixed cost per iteration, the one the cluster adds to every model (its
    barrier on throttled CPUs; a separate fit, so the costs per unit are not traded against it,
    which would change the ranking). On release v0.3 the second fit took the unseen-model error
    from 15.4% to 14.7%. The shares and the compute scale stay as they were (see
    :func:`calibrate_replay`)."""
    by_cluster: dict[str, list] = {}
    for d in domains:
        if len(d.times_s) >= min_trials:
            by_cluster.setdefault(d.ctx.cluster.name, []).append(d)
    start, out = sim.constants, {}
    for name, ds in sorted(by_cluster.items()):
        sim.set_constants(calibrate_replay(sim, ds, fields=UNIT_COSTS))
        out[name] = calibrate_replay(sim, ds, fields=("iteration_s",))
        sim.set_constants(start)
    return out


class CalibratedReplay(ReplaySimulator):
    """The replay with the communication's CPU costs and the compute scale fitted on measured
    trials (:func:`calibrate_replay`): one set of constants per training domain with at least
    ``min_trials`` trials; for a domain never measured, one per cluster over that cluster's
    training domains (an unseen model on a known cluster), else one over all of them (an unseen
    cluster). Still the replay: seconds, a timeline, a critical path.

    Why a cluster's own: the CPU a collective costs and the compute scale are the cluster's
    (a CPU quota slows gloo's reductions and the model's kernels alike): on release v0.3 the
    quota presets run 3-6 times slower than the uncalibrated replay, the others 1.1-2.5 times;
    constants pooled over both put an unseen model 38% off (median), its cluster's 20%."""

    kind = "replay-calibrated"

    def __init__(self, profiles: dict[str, ComputeProfile] | None = None,
                 constants: ReplayConstants = ReplayConstants(), *, min_trials: int = 10) -> None:
        super().__init__(profiles, constants)
        self.general = constants
        self.per_domain: dict[str, ReplayConstants] = {}
        self.per_cluster: dict[str, ReplayConstants] = {}
        self.min_trials = min_trials

    def use_profiles(self, replay: ReplaySimulator) -> None:
        """Replay with the profiles and the base constants of ``replay``."""
        for profile in replay.profiles.values():
            self.add_profile(profile)
        self.general = replay.constants
        self.set_constants(replay.constants)

    def fit(self, domains: list) -> "CalibratedReplay":
        base = self.general
        self.fit_unseen(domains, base)
        self.set_constants(base)
        self.per_domain = {d.key: calibrate_replay(self, [d]) for d in domains if len(d.times_s) >= self.min_trials}
        return self

    def fit_unseen(self, domains: list, base: ReplayConstants) -> None:
        """The constants of domains not among ``domains``, both fitted from ``base``: the general
        ones, and each cluster's (:func:`calibrate_per_cluster`, starting from the general ones).
        Leaves the general constants set."""
        self.set_constants(base)
        self.general = calibrate_replay(self, domains, fields=UNIT_COSTS)
        self.set_constants(self.general)
        self.per_cluster = calibrate_per_cluster(self, domains, self.min_trials)

    #: :class:`~synctune.simulator.BoundSimulator` calls :meth:`calibrate` with a search's trials.
    calibrates = True

    def calibrate(self, domain) -> None:
        """Fit ``domain``'s constants on its measured trials, from the general ones (a search
        recalibrates after every batch of trials, dPRO §4.3's calibration from the job's own
        measurements); with fewer than ``min_trials`` trials the domain keeps the constants it
        had (the general ones, unless :meth:`fit` calibrated it)."""
        if len(domain.times_s) < self.min_trials:
            return
        self.set_constants(self.general)  # the fit starts from the constants it replays with
        self.per_domain[domain.key] = calibrate_replay(self, [domain])

    def _domain(self, ctx: DomainContext) -> _ReplayDomain:
        # Every replay of a domain comes through here: switch to that domain's constants first.
        wanted = self.per_domain.get(f"{ctx.model.name}@{ctx.cluster.name}") or self.per_cluster.get(
            ctx.cluster.name, self.general)
        if wanted is not self.constants:
            self.set_constants(wanted)
        return super()._domain(ctx)


def replay_features(events: dict[str, Any], b: StrategyColumns) -> tuple[np.ndarray, np.ndarray]:
    """(S, len(REPLAY_SHARD_NAMES)) and (n, len(REPLAY_GLOBAL_NAMES)) features of a replay."""
    it = events["iteration_s"]
    per = it[b.sid]
    unit = events["shard_unit"]
    shard = np.stack([(events["unit_start"] - events["unit_launch"])[unit] / per, events["unit_s"][unit] / per,
                      events["unit_finish"][unit] / per], axis=1)
    exposed = np.maximum(events["comm_end"] - events["backward_end"], 0.0)
    glob = np.stack([np.log(np.maximum(it, 1e-9)), events["comm_end"] / it, events["backward_end"] / it,
                     events["broadcast_s"] / it, exposed / it], axis=1)
    return shard, glob


_KIND_NAMES = dict(enumerate(SYNCHRONIZER_KINDS))


def critical_path(events: dict[str, Any], b: StrategyColumns, model, *, measured: bool = True) -> dict[str, Any]:
    """What one replayed iteration (the first strategy of ``b``) waits on, dPRO §4.3's critical
    path in our terms. Walking back from the last unit to finish: a unit that started after its
    gradients were ready waited for the unit before it on the communication queue (the link);
    one that started as soon as they were ready waited for backward compute, and the path ends
    there. Returns the predicted ``iteration_s``, ``backward_end_s``, ``comm_end_s`` (what is not
    hidden behind backward: ``exposed_s``), ``step_s`` (update and PS broadcast), ``measured``
    (whether compute came from a measured profile) and ``units``: the path in time order, each
    with ``kind``, ``variables`` (its members, backward order), ``wire_bytes``, ``ready_s``,
    ``start_s``, ``finish_s`` and ``waited_for`` (``gradients`` or ``link``)."""
    sid = events["unit_sid"]
    mine = np.flatnonzero(sid == 0)
    names = [v.name for v in model.variables]
    shard_unit = events["shard_unit"]
    members: dict[int, list[str]] = {}
    for shard in np.flatnonzero(b.sid == 0):
        members.setdefault(int(shard_unit[shard]), []).append(names[int(b.var[shard])])
    path = []
    i = int(mine[-1]) if len(mine) else -1
    eps = 1e-12
    while i >= 0 and sid[i] == 0:
        waited = "link" if events["unit_start"][i] > events["unit_launch"][i] + eps else "gradients"
        path.append({"kind": _KIND_NAMES.get(int(events["unit_kind"][i]), str(events["unit_kind"][i])),
                     "variables": list(dict.fromkeys(members.get(i, []))),
                     "wire_bytes": float(events["unit_bytes"][i]), "ready_s": float(events["unit_launch"][i]),
                     "start_s": float(events["unit_start"][i]), "finish_s": float(events["unit_finish"][i]),
                     "waited_for": waited})
        if waited == "gradients":
            break
        i -= 1
    backward, comm = float(events["backward_end"][0]), float(events["comm_end"][0])
    iteration = float(events["iteration_s"][0])
    return {"iteration_s": iteration, "backward_end_s": backward, "comm_end_s": comm,
            "exposed_s": max(0.0, comm - backward), "step_s": iteration - max(backward, comm),
            "measured": measured, "units": path[::-1]}
