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
the worker's device, not the link's). Each kind's terms (how its rows form units, what its units
cost on the link and the CPU, how they delay compute and what they run after the step) are its
own, in :data:`synctune.simulator.kinds.REPLAY_KINDS`; a row is priced by its kind, or the kind it
is ``priced_as`` (:attr:`synctune.strategy.columns.StrategyColumns.pattern`).

A strategy that splits modules (``tensor_parallel``) is not priced as columns (their rows are its
data-parallel part alone; ``encode`` refuses it): it is replayed on its own as
one device of its TP groups sees it, its data-parallel strategy over the groups on the model's
local shapes with the split compute and the blocking TP collectives
(:mod:`synctune.simulator.kinds.tensor_parallel`, :meth:`ReplaySimulator.tp_timeline`); the
calibration fits on them too, and on them alone the cost of a TP collective (``tp_collective_s``).

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
from ..strategy.checkpoint import CHECKPOINT_MODES, block_of, checkpoint_blocks
from ..strategy.columns import StrategyColumns
from ..strategy.compressors import COMPRESSORS
from ..strategy.kinds import SYNCHRONIZER_KINDS, SYNCHRONIZERS
from .base import Simulator
from .domain import DomainContext, batch_scale, comm_terms
from .features import encode, message_rows, message_sizes
from .kinds import REPLAY_KINDS, ReplayBatch, ReplayKind, by_code, priced
from .kinds.tensor_parallel import split_domain, tp_split

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
    #: Per blocking collective of a tensor-parallel group, what it costs beyond an all-reduce
    #: unit's launch and CPU costs (DTensor's redistribution around it, the group's ranks meeting
    #: in it while their cores compute): only strategies with ``tensor_parallel`` move it, so
    #: :func:`calibrate_replay` fits it on those.
    tp_collective_s: float = 0.0


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
    #: per checkpointing mode, the seconds backward takes longer with every block checkpointed
    #: (the profile's ``recompute_s``; empty: not measured, nothing added)
    recompute: dict[str, float] = dataclasses.field(default_factory=dict)
    #: (blocks,) when backward reaches each block of the model (its first gradient's ready time)
    block_start: np.ndarray | None = None
    #: per module, elements per sample of its input and output (the profile's ``io_elements``;
    #: None: not measured): what a tensor-parallel split of it sends
    io_elements: dict | None = None


class ReplaySimulator(Simulator):
    """Training-free: predicts iteration times in seconds by replaying one iteration.

    ``profiles`` maps :func:`profile_key` to measured profiles; a domain whose model has no
    measured profile falls back on the analytic compute estimate (counted FLOPs), spread over
    backward in proportion to the variables' bytes, and says so in :attr:`fallbacks`."""

    kind = "replay"
    predicts_seconds = True
    #: It predicts strategies with ``tensor_parallel`` (:meth:`tp_timeline`); no other simulator does.
    replays_tensor_parallel = True

    def __init__(self, profiles: dict[str, ComputeProfile] | None = None,
                 constants: ReplayConstants = ReplayConstants()) -> None:
        self.profiles = dict(profiles or {})
        self.constants = constants
        self.fallbacks: set[str] = set()
        #: ``model@cluster`` of domains whose strategies split modules the profile has no
        #: activation sizes for (their TP collectives priced at one position per sample)
        self.unmeasured_activations: set[str] = set()
        # Each tensor-parallel plan's model at its local shapes as a domain, by plan, with the
        # domain it was made for.
        self._split_ctx: dict[str, tuple[DomainContext, DomainContext]] = {}
        # The last domain replayed and its inputs; the context itself is held, so its identity
        # cannot pass to another context after it is freed.
        self._cache: tuple[DomainContext, _ReplayDomain] | None = None

    # ------------------------------------------------------------------ profiles
    def set_constants(self, constants: ReplayConstants) -> None:
        """Replay with ``constants`` from now on."""
        self.constants = constants
        self._cache = None

    def add_profile(self, profile: ComputeProfile) -> None:
        """Use ``profile`` for its (model, device, worker count), replacing one filed before
        (dPRO §4.1: the replay's compute input)."""
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
        recompute = {m: float(v) * c for m, v in ((profile.recompute_s or {}) if measured else {}).items()}
        dom = _ReplayDomain(ready, float(backward_end), float(step_s), int(batch), density, measured, alpha,
                            rebuild_scale, float(forward_s),
                            ctx.device_slowdowns if slowdowns is None else slowdowns,
                            float((profile.host_s() if measured else None) or 0.0), recompute,
                            _block_starts(model, ready), dict(profile.io_elements) if measured and
                            profile.io_elements is not None else None)
        self._cache = (ctx, dom)  # one domain at a time: a search scores one domain
        return dom

    # ------------------------------------------------------------------ replay
    def _predict_batch(self, batch: StrategyColumns, ctx: DomainContext) -> np.ndarray:
        return replay_units(batch, ctx, self._domain(ctx), self.constants)["iteration_s"]

    def predict(self, strategies: list, model, cluster) -> np.ndarray:
        """Predicted seconds of ``strategies``; those that split modules (``tensor_parallel``)
        replayed one by one (:meth:`tp_timeline`), the others as columns."""
        ctx = DomainContext(model, cluster)
        mask = np.array([s.tensor_parallel is not None for s in strategies], dtype=bool)
        if not mask.any():
            return self._predict_batch(encode(strategies, ctx), ctx)
        out = np.empty(len(strategies))
        plain = np.flatnonzero(~mask)
        if len(plain):
            out[plain] = self._predict_batch(encode([strategies[i] for i in plain], ctx), ctx)
        out[mask] = [self.tp_timeline(strategies[i], ctx)["iteration_s"][0] for i in np.flatnonzero(mask)]
        return out

    def predict_domain(self, domain) -> np.ndarray:
        """:meth:`predict` of a domain's strategies (those that are columns encoded once)."""
        mask = domain.split_mask()
        if not mask.any():
            return super().predict_domain(domain)
        out = np.empty(len(domain.strategies))
        plain = np.flatnonzero(~mask)
        if len(plain):
            out[plain] = super().predict_domain(domain.without_tensor_parallel())
        out[mask] = [self.tp_timeline(domain.strategies[i], domain.ctx)["iteration_s"][0]
                     for i in np.flatnonzero(mask)]
        return out

    def tp_timeline(self, strategy, ctx: DomainContext) -> dict[str, Any]:
        """:meth:`timeline` of one strategy with ``tensor_parallel`` as a device of its TP groups
        replays it (:mod:`synctune.simulator.kinds.tensor_parallel`): the data-parallel
        strategy over the groups on the model at its local shapes, on the compute the split
        leaves a device, with the TP collectives on the critical path; also ``tp_forward_s`` and
        ``tp_backward_s``, those collectives' seconds in each phase."""
        dom = self._domain(ctx)  # first: a calibrated replay switches to the domain's constants here
        split = tp_split(strategy, ctx.model)
        found = self._split_ctx.get(split.key)
        if found is None or found[0] is not ctx:  # the context itself is held, as the domain cache does
            found = self._split_ctx[split.key] = (ctx, DomainContext(split.local, ctx.cluster))
        local = found[1]
        b = encode([split.groups], local)
        scale = float(batch_scale(b, local, dom.device_slowdowns)[0] * (ctx.model.batch_size / dom.profile_batch))
        tdom, fwd, bwd, unmeasured = split_domain(dom, split, ctx.model, ctx.cluster, self.constants, scale,
                                                  dom.io_elements)
        if unmeasured:
            self.unmeasured_activations.add(f"{ctx.model.name}@{ctx.cluster.name}")
        tdom = dataclasses.replace(tdom, block_start=_block_starts(split.local, tdom.ready))
        events = replay_units(b, local, tdom, self.constants)
        return {**events, "tp_forward_s": np.array([fwd]), "tp_backward_s": np.array([bwd])}

    def timeline(self, batch: StrategyColumns, ctx: DomainContext) -> dict[str, np.ndarray]:
        """Per-unit events of every strategy (``unit_sid``, ``unit_kind``, ``unit_first`` the first
        member's variable, ``unit_launch``, ``unit_start``, ``unit_finish``, ``unit_s``, of which
        ``unit_in_node_s`` inside the nodes first; a shard's unit is ``shard_unit``), and per
        strategy ``iteration_s``, ``comm_end`` and ``backward_end``: the critical path is the
        chain of units whose start equals the previous unit's finish (waiting on the link)."""
        return replay_units(batch, ctx, self._domain(ctx), self.constants)

    def lower_bound(self, strategy, model, cluster) -> dict[str, float]:
        """The least an iteration of ``strategy`` can take as this replay prices it, with perfect
        overlap: the larger of its compute and its communication. ``compute_s``: forward and
        backward at its ranks' batches on their nodes (recomputation included, the slowest rank;
        the optimizer step left out); ``comm_s``: its units' seconds on the links (alpha-beta at
        the calibrated bandwidths, with their launch costs), those of each link added, the busier
        link (a strategy's tensor-parallel collectives on its node's link). Returns ``compute_s``,
        ``comm_s`` and ``bound_s``; a measured time over ``bound_s`` says how much room is left."""
        ctx = DomainContext(model, cluster)
        if strategy.tensor_parallel is not None:
            events = self.tp_timeline(strategy, ctx)
            split = float(events["tp_forward_s"][0] + events["tp_backward_s"][0])
        else:
            events = self.timeline(encode([strategy], ctx), ctx)
            split = 0.0
        mine = events["unit_sid"] == 0
        queue, inside = events["unit_s"][mine], events["unit_in_node_s"][mine]
        # In the TP timeline backward ends after the TP collectives: they are communication.
        compute = float(events["backward_end"][0]) - split
        comm = max(float(inside.sum()) + split, float((queue - inside).sum()))
        return {"compute_s": compute, "comm_s": comm, "bound_s": max(compute, comm)}

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


def _schedule(rb: ReplayBatch, order: np.ndarray, usid: np.ndarray, first: np.ndarray, launch: np.ndarray,
              dur: np.ndarray, in_node: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, finish) of every unit in launch order (``order``: from unit index to it), and each
    strategy's end of communication: one queue per strategy, or with units on process groups of
    their own (a dense PS shard's local aggregation, version 3) the queues of :func:`_two_queues`."""
    roots = rb.roots[order]
    if roots.any():
        start, finish = _two_queues(usid, first, launch, dur, in_node, roots)
    else:
        finish = _serial(launch, dur, usid)
        start = finish - dur
    comm_end = np.zeros(rb.b.size)
    if len(usid):
        np.maximum.at(comm_end, usid, finish)
    return start, finish, comm_end


def _present(b: StrategyColumns) -> list[tuple[int, ReplayKind, np.ndarray]]:
    """(code, entry, rows) of each kind with rows in ``b``, in registry order."""
    return [(code, kind, b.pattern_rows(code)) for code, kind in priced(REPLAY_KINDS, b) if b.pattern_mask(code).any()]


def _added(total: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    """``total`` plus each of ``parts``, one after the other."""
    for part in parts:
        total = total + part
    return total


def _block_starts(model, ready: np.ndarray) -> np.ndarray:
    """When backward reaches each block of ``model`` (:func:`~synctune.strategy.checkpoint.checkpoint_blocks`):
    the earliest ready time of its variables."""
    blocks = checkpoint_blocks(v.name for v in model.variables)
    index = {name: j for j, name in enumerate(blocks)}
    out = np.full(len(blocks), np.inf)
    for i, v in enumerate(model.variables):
        j = index.get(block_of(v.name))
        if j is not None:
            out[j] = min(out[j], ready[i])
    return out


def recompute_delays(b: StrategyColumns, dom: _ReplayDomain) -> tuple[np.ndarray | None, np.ndarray | None]:
    """What checkpointed blocks add to each strategy's backward: per shard row, how much later its
    variable's gradient is ready (every block whose recompute runs before it: backward reaches
    the block at its first gradient's ready time, recomputes its forward, then goes on), and per
    strategy, how much later backward ends. A mode's measured cost (every block checkpointed) is
    shared evenly among the blocks. (None, None) where nothing is checkpointed or nothing measured."""
    if b.checkpoint is None or not dom.recompute or dom.block_start is None or not b.checkpoint.any():
        return None, None
    per_block = np.zeros(b.checkpoint.shape, np.float64)
    nblocks = max(1, b.checkpoint.shape[1])
    for code, mode in enumerate(CHECKPOINT_MODES, start=1):
        per_block += (b.checkpoint == code) * (dom.recompute.get(mode, 0.0) / nblocks)
    after = (dom.ready[None, :] >= dom.block_start[:, None]).astype(np.float64)  # (blocks, variables)
    delay = per_block @ after
    return delay[b.sid, b.var], per_block.sum(1)


def replay_units(b: StrategyColumns, ctx: DomainContext, dom: _ReplayDomain, k: ReplayConstants) -> dict[str, Any]:
    """Replay every strategy of ``b`` (see the module docstring); per strategy and per unit. The
    kinds' terms are theirs (:data:`~synctune.simulator.kinds.REPLAY_KINDS`): each is handed its
    rows and units, here in one :class:`~synctune.simulator.kinds.ReplayBatch`."""
    n = b.size
    # A replica's compute scales with its batch and its node's slowdown (calibrated speeds);
    # the iteration waits for the slowest replica (TAG §2.1).
    scale = batch_scale(b, ctx, dom.device_slowdowns) * (ctx.model.batch_size / dom.profile_batch)
    entries = priced(REPLAY_KINDS, b)
    present = _present(b)
    plain = ctx.var_bytes[b.var] * b.frac
    densifies = by_code(entries, lambda kind: kind.densifies, False)
    sparse_part = np.where(densifies[b.pattern], 1.0, dom.density[b.var])  # e.g. all-reduce sends sparse dense
    wire = plain * sparse_part * b.ratio
    rebuild = None
    sends = message_rows(b)
    if sends:
        nbytes, rebuild = message_sizes(b, ctx)
        for rows in sends:  # what such a kind sends (SFB: the factors, padded to the largest replica batch)
            wire[rows] = nbytes[rows] * b.ratio[rows]
    num_shards = len(b.sid)
    ready, backward_end = dom.ready[b.var], np.full(n, dom.backward_end)
    delay, longer = recompute_delays(b, dom)
    if delay is not None:  # checkpointed blocks recompute their forward inside backward
        ready, backward_end = ready + delay, backward_end + longer
    rb = ReplayBatch(b=b, ctx=ctx, dom=dom, k=k, t=comm_terms(b, ctx), alpha=dom.alpha, plain=plain,
                     sparse_part=sparse_part, wire=wire, rebuild=rebuild, ready=ready * scale[b.sid],
                     own=np.arange(num_shards), scale=scale, backward_end=backward_end * scale)
    state = {code: kind.prepare(rb, rows) if kind.prepare else None for code, kind, rows in present}
    for code, kind, rows in present:
        if kind.form_units:
            kind.form_units(rb, rows, state[code])
    unit_of, usid = _units(b, entries, rb.own)
    u = len(usid)
    for code, kind, rows in present:
        if kind.compute:
            kind.compute(rb, rows, state[code])
    launch = np.full(u, -np.inf)
    np.maximum.at(launch, unit_of, rb.ready)
    first = np.full(u, np.iinfo(np.int64).max)
    np.minimum.at(first, unit_of, b.var)
    ukind = np.zeros(u, dtype=np.int64)
    ukind[unit_of] = b.pattern
    rb.unit_of, rb.usid, rb.ukind = unit_of, usid, ukind
    rb.ubytes = np.bincount(unit_of, weights=rb.wire, minlength=u)
    dur, in_node, cpu = _unit_durations(rb, entries, present, state)
    # Each strategy's communication CPU work, for the bound below (units still in their first order).
    cpu_s = np.bincount(usid, weights=cpu, minlength=n) if _host_bound(ctx, k) and u else None
    # The fixed launch order: by strategy, then by the first member's position in backward.
    order = np.lexsort((first, usid))
    position = np.empty(u, dtype=np.int64)
    position[order] = np.arange(u)
    usid, launch, dur, ukind, first = usid[order], launch[order], dur[order], ukind[order], first[order]
    start, finish, comm_end = _schedule(rb, order, usid, first, launch, dur, in_node[order])
    saved = [kind.step_saved(rb, rows, state[code]) for code, kind, rows in present if kind.step_saved]
    step = dom.step_s * (1.0 - _added(saved[0], saved[1:]) / max(ctx.model_bytes, 1.0) if saved else 1.0)
    # What runs after the step (PS broadcasts, ZeRO-2's gathers), kind after kind.
    after = [rb.after_step[name] for name in SYNCHRONIZER_KINDS if name in rb.after_step]
    backward_end = rb.backward_end
    iteration = _added(np.maximum(backward_end, comm_end) + step, after) + k.iteration_s
    if cpu_s is not None:
        # On CPU workers the communication's CPU work cannot hide behind backward: the cores compute.
        iteration = np.maximum(iteration, _added(backward_end + cpu_s + step, after) + k.iteration_s)
    if k.serial_share and u:
        hidden = np.clip(np.minimum(finish, backward_end[usid]) - start, 0.0, None)
        iteration = iteration + k.serial_share * np.bincount(usid, weights=hidden, minlength=n)
    if dom.host_s:
        # A GPU waits for a host that launches many small kernels (and runs the engine's hooks
        # between them): the iteration ends no sooner than the host's own path (dPRO §4: the
        # framework's CPU work is a node of the replayed graph, here a lower bound).
        iteration = np.maximum(iteration, dom.host_s + k.iteration_s)
    return {"iteration_s": iteration, "comm_end": comm_end, "backward_end": backward_end,
            "broadcast_s": _added(np.zeros(n), after),
            "unit_sid": usid, "unit_kind": ukind, "unit_first": first, "unit_launch": launch, "unit_start": start,
            "unit_finish": finish, "unit_s": dur, "unit_in_node_s": in_node[order], "shard_unit": position[unit_of],
            "unit_bytes": rb.ubytes[order]}


def _units(b: StrategyColumns, entries: list, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's unit and each unit's strategy: one unit per merge group where a kind's units
    are merge groups (all-reduce), else one per row or per the row a kind keys its units by
    (``own``: a shard unit's first row)."""
    num_shards = len(b.sid)
    group = b.group_order
    width = int(group.max()) + 1 if num_shards else 1
    merged = np.zeros(len(SYNCHRONIZER_KINDS), dtype=bool)
    for code, _kind in entries:
        merged[code] = SYNCHRONIZERS.get(SYNCHRONIZER_KINDS[code]).merge_groups
    unit_key = np.where(merged[b.pattern], b.sid * (width + num_shards) + group,
                        b.sid * (width + num_shards) + width + own)
    keys, unit_of = np.unique(unit_key, return_inverse=True)
    return unit_of, (keys // (width + num_shards)).astype(np.int64)


def _unit_durations(rb: ReplayBatch, entries: list, present: list, state: dict
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each unit's time on the link queue (its kind's alpha-beta terms, the fixed per-unit and CPU
    costs, compression), the part of it spent inside the nodes first (local aggregation; else 0),
    and the part of it that is CPU work (its calibrated costs and launches: version 6's bound).
    Per-unit transfer times are over the strategy's replicas (all devices, or the subset it
    replicates on: TAG §4.2)."""
    b, k, t, usid = rb.b, rb.k, rb.t, rb.usid
    u = len(usid)
    rb.unn, rb.ring = t["N"][usid], t["ring_bw"][usid]
    rb.stages, rb.launches, rb.steps = _collectives(b, k, t, rb.unit_of, usid)
    rb.dur, rb.in_node, rb.roots = np.zeros(u), np.zeros(u), np.zeros(u, dtype=bool)
    for code, kind, rows in present:
        if kind.durations:
            kind.durations(rb, rows, np.flatnonzero(rb.ukind == code), state[code])
    # The calibrated CPU costs: per step with another replica, and once, of each kind's units.
    per_step = by_code(entries, lambda kind: getattr(k, kind.step_cost) if kind.step_cost else 0.0, 0.0)
    per_unit = by_code(entries, lambda kind: getattr(k, kind.unit_cost) if kind.unit_cost else 0.0, 0.0)
    steps_cost = per_step[rb.ukind] if per_step.any() else np.zeros(u)
    cpu = k.unit_s * rb.launches + steps_cost * rb.steps + per_unit[rb.ukind]
    if b.comp.any():
        # Per MB encoded: a low-rank compressor at its own price (version 5), a cast at the other.
        lowrank = _per_compressor("low_rank")[b.comp] if k.replay_version >= 5 else np.zeros(len(b.comp), bool)
        price = np.where(lowrank, k.lowrank_s_per_mb, k.compress_s_per_mb)
        cpu += np.bincount(rb.unit_of, weights=np.where(b.comp > 0, rb.plain * price, 0.0), minlength=u) / 1e6
    return rb.dur + cpu, rb.in_node, cpu


def _host_bound(ctx: DomainContext, k: ReplayConstants) -> bool:
    """Whether the iteration is bounded below by the compute plus the communication's CPU work
    (version 6; CPU clusters, whose workers compute on the cores gloo's collectives run on)."""
    return k.replay_version >= 6 and ctx.cluster.device_kind == "cpu"


def _collectives(b: StrategyColumns, k: ReplayConstants, t: dict, unit_of: np.ndarray, usid: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per unit: the chained collectives its compressor runs (``stages``), the collectives it
    launches (each pays ``unit_s``) and the steps a rank takes in them with another replica (each
    pays the unit kind's CPU cost); a kind whose units run otherwise changes the last two
    (a hierarchical all-reduce)."""
    u = len(usid)
    stages = np.ones(u)
    if k.replay_version >= 5 and b.comp.any():  # PowerSGD: the P factors, then the Q factors
        np.maximum.at(stages, unit_of, _per_compressor("stages")[b.comp])
    # From version 4 a unit's CPU cost is per other replica of its collective (none alone).
    peers = np.maximum(t["N"][usid] - 1, 0) if k.replay_version >= 4 else np.ones(u)
    return stages, stages.copy(), peers * stages


_CPU_FIELDS = ("ps_unit_s", "ar_unit_s", "ag_unit_s", "compress_s_per_mb", "iteration_s", "serial_share",
               "latency_share", "shard_unit_s", "lowrank_s_per_mb", "tp_collective_s")
#: The latency share's field, and how hard its fit is pulled to 0: a relative error of this much
#: per trial for a share of 1.
_LATENCY, _LATENCY_PRIOR = _CPU_FIELDS.index("latency_share"), 0.035
#: Every field :func:`calibrate_replay` can fit: the CPU terms, then the compute scale.
ALL_FIELDS = (*_CPU_FIELDS, "compute_scale")
#: The fields other domains' trials say of a domain never measured (:func:`calibrate_replay`
#: says why the others are not): the CPU cost of each kind of unit and of compression.
UNIT_COSTS = ("ps_unit_s", "ar_unit_s", "ag_unit_s", "compress_s_per_mb", "shard_unit_s", "lowrank_s_per_mb",
              "tp_collective_s")
#: Upper bounds of the fields: a share is at most 1; a CPU cost of 50 ms per unit, 1 s per MB
#: compressed or 1 s per iteration is no CPU cost of these units (the fits found at most 13 ms,
#: 0.3 s and 0.35 s), and without a bound two nearly collinear columns can cancel at absurd sizes
#: (cnn-small@lab-4x1's fit once put 5e9 s on a PS unit against a compute scale of 6,000).
_CPU_UPPER = np.array([0.05, 0.05, 0.05, 1.0, 1.0, 1.0, 1.0, 0.05, 1.0, 0.05])


#: Steps of :func:`_cpu_features`' finite differences: seconds per unit, seconds per MB compressed,
#: seconds per iteration, the two shares, seconds per shard unit, seconds per MB low-rank encoded,
#: seconds per TP collective, then (``_SCALE_STEP``) a relative change of the compute.
_CPU_STEPS = (1e-4, 1e-4, 1e-4, 1e-3, 1e-4, 0.05, 0.05, 1e-4, 1e-3, 1e-4)
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
    k = sim.constants
    if base is None:
        base = sim.predict_domain(d)
    cols = []
    for field, h in zip(_CPU_FIELDS, _CPU_STEPS):
        sim.set_constants(dataclasses.replace(k, **{field: getattr(k, field) + h}))
        cols.append((sim.predict_domain(d) - base) / h)
    sim.set_constants(dataclasses.replace(k, compute_scale=k.compute_scale * (1 + _SCALE_STEP)))
    cols.append((sim.predict_domain(d) - base) / _SCALE_STEP)
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
    and the measured compute profiles are kept. Strategies with ``tensor_parallel`` take part
    (replayed one by one, :meth:`ReplaySimulator.tp_timeline`): they alone move
    ``tp_collective_s``, and their collectives pay the all-reduce unit's costs the others fit too.

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
