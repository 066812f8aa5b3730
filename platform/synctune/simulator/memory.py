"""The memory model: each rank's peak bytes under a strategy, part by part, without running it
(DESIGN.md "memory budget"; ZeRO, Rajbhandari et al. SC'20 §5 for the replicated vs sharded
accounting).

It counts what the engine (:mod:`synctune.engine.units`) actually holds on a rank, in the parts
a trial measures (:mod:`synctune.engine.memory`):

- **params**: every variable whole on every rank (the engine's shard views alias the module's
  parameters), except ``shard`` variables with ``reshard`` (ZeRO-3 / FSDP2's
  ``reshard_after_forward``): the rank's rows only, plus the gathered units in flight
  (``prefetch + 1`` units, the largest ones, whole);
- **grads**: autograd's ``.grad`` of every dense variable, whole (the engine's hooks copy it into
  the units' buffers, and it lives until ``zero_grad``; a variable on all-reduce of at most
  :data:`~synctune.engine.kinds.GRAD_IN_BUCKET_MAX_ELEMENTS` elements has its ``.grad`` in its
  bucket slot, counted here too: an over-count of those small gradients, a few kB, as torch DDP
  holds them apart); a sparse variable's gradient is its
  looked-up rows (``sparse_rows_per_sample`` x the rank's batch, row values and an 8-byte index
  each); resharded ``shard`` variables: the rank's rows (FSDP2 frees the unsharded gradient after
  its reduce-scatter);
- **optimizer state**: ``optimizer_state_multiplier`` x the elements this rank updates (Adam 2,
  SGD with momentum 1, plain SGD 0) plus ``optimizer_step_bytes`` per updated tensor (Adam's
  ``step``): all-reduce, all-gather and sfb shards on every rank; a PS shard on its placement
  only; a ``shard`` variable's rows of this rank (:func:`~synctune.strategy.partition.shard_rows`);
- **comm buffers**, held between steps: an all-reduce merge group's bucket (the size of its
  members; hierarchical: padded to a multiple of the node's ranks, plus one piece), a dense PS
  shard's buffer (on every rank), a sparse shard's row buffers (this rank's rows, padded to the
  longest; the receivers hold every rank's), and a ``shard`` unit's bucket (``group`` x the sum
  of its members' padded slices) and its output segment, in float32, plus the same pair in
  bfloat16 when the unit reduces in bf16;
- **activations**: what the caller gives (``activation_bytes``: one figure for every rank, one per
  rank, or a function of the rank's batch size). It stands for everything that depends on the
  model and the batch but not on the strategy: saved activations, the batch itself, module
  buffers, the iteration's temporaries; measure it once per (model, batch) and reuse it.

A rank's ``peak_bytes`` is the sum: the peak of one iteration is at the end of backward, when
every gradient exists and the activations are not yet all freed; taking all of both is the
upper bound, and the measured activation figure is what absorbs the difference.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.kinds import units_of
from ..strategy.tensor_parallel import local_shape, tp_key
from ..strategy.schema import Strategy
from .kinds import MEMORY_KINDS, MemoryContext, Tally

__all__ = ["RankMemory", "OPTIMIZER_STATE", "optimizer_state", "predict_memory", "memory_errors",
           "activation_figures", "ActivationFigures", "MemoryBudget", "reference_activations", "over_limits", "GIB",
           "MIB"]

#: Optimizer name -> (state elements per parameter element, bytes of per-tensor scalars): Adam's
#: two moments and its ``step`` (a float32 scalar tensor per parameter, torch's default).
OPTIMIZER_STATE: dict[str, tuple[float, int]] = {
    "sgd": (0.0, 0), "sgd-momentum": (1.0, 0), "adam": (2.0, 4), "adamw": (2.0, 4), "adagrad": (1.0, 4),
    "rmsprop": (1.0, 4)}


def optimizer_state(name: str) -> tuple[float, int]:
    """``(state multiplier, per-tensor bytes)`` of the optimizer ``name`` (:data:`OPTIMIZER_STATE`)."""
    try:
        return OPTIMIZER_STATE[name]
    except KeyError:
        raise SpecError(f"optimizer {name!r}: the memory model knows {', '.join(OPTIMIZER_STATE)}; pass "
                        f"optimizer_state_multiplier as a number for another") from None


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's predicted memory at its peak, part by part (bytes)."""

    rank: int
    device: str
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    comm_buffers_bytes: int
    activations_bytes: int

    @property
    def peak_bytes(self) -> int:
        """The predicted peak: the sum of the parts."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_state_bytes + self.comm_buffers_bytes
                + self.activations_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The parts as plain data, with their sum as ``peak_bytes`` (what reports and rows hold)."""
        return {**asdict(self), "peak_bytes": self.peak_bytes}


def _per_rank(value, batch_split: Sequence[int], what: str) -> list[int]:
    n = len(batch_split)
    if callable(value):
        out = [value(b) for b in batch_split]
    elif isinstance(value, (list, tuple)):
        if len(value) != n:
            raise SpecError(f"{what}: expected one figure per rank ({n}), got {len(value)}")
        out = list(value)
    else:
        out = [value] * n
    for v in out:
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)):
            raise SpecError(f"{what}: expected non-negative byte counts, got {v!r}")
    return [int(v) for v in out]


def _multiplier(optimizer_state_multiplier: float | str, optimizer_step_bytes: int | None) -> tuple[float, int]:
    """(state elements per updated element, bytes of per-tensor scalars) of the caller's figure
    or optimizer name."""
    if isinstance(optimizer_state_multiplier, str):
        multiplier, step_bytes = optimizer_state(optimizer_state_multiplier)
    else:
        multiplier, step_bytes = float(optimizer_state_multiplier), 0
        if not (math.isfinite(multiplier) and multiplier >= 0):
            raise SpecError(f"optimizer_state_multiplier: expected a non-negative number, got "
                            f"{optimizer_state_multiplier!r}")
    if optimizer_step_bytes is not None:
        step_bytes = int(optimizer_step_bytes)
    return multiplier, step_bytes


def predict_memory(strategy: Strategy, model_spec: ModelSpec, cluster_spec: ClusterSpec, *,
                   optimizer_state_multiplier: float | str = 0.0, optimizer_step_bytes: int | None = None,
                   activation_bytes: int | Sequence[int] | Callable[[int], int] = 0,
                   sparse_rows_per_sample: float = 1.0, fsdp: bool = False) -> list[RankMemory]:
    """Each rank's predicted peak memory under ``strategy`` (see the module docstring), in the
    order of ``strategy.replicas``. ``optimizer_state_multiplier``: state elements per updated
    element, or an optimizer's name (``adam``: 2 and a 4-byte ``step`` per tensor; ``sgd``: 0);
    ``optimizer_step_bytes`` overrides the per-tensor scalars. ``activation_bytes``: the
    strategy-independent memory of a rank (one figure, one per rank, or a function of the
    rank's batch size). ``fsdp``: the strategy runs as torch FSDP2 holds memory (every unit's
    gradients are its rows after the reduce-scatter, two units' whole gradients in flight: the
    one in backward and the reduce-scatter input of the one before; gather and reduce-scatter
    buffers live only inside the iteration; a unit kept after forward holds its whole
    parameters beside its rows), else as the engine does (its shard units' buckets persist, a
    ZeRO-2 unit keeps whole gradients)."""
    if strategy.tensor_parallel is not None:
        return _predict_split(strategy, model_spec, cluster_spec, optimizer_state_multiplier=optimizer_state_multiplier,
                              optimizer_step_bytes=optimizer_step_bytes, activation_bytes=activation_bytes,
                              sparse_rows_per_sample=sparse_rows_per_sample, fsdp=fsdp)
    multiplier, step_bytes = _multiplier(optimizer_state_multiplier, optimizer_step_bytes)
    world = len(strategy.replicas)
    activations = _per_rank(activation_bytes, list(strategy.batch_split), "activation_bytes")
    tally = Tally(world=world, multiplier=multiplier, step_bytes=step_bytes)
    ctx = MemoryContext(model=model_spec, split=list(strategy.batch_split),
                        rank_of={dev: r for r, dev in enumerate(strategy.replicas)},
                        nodes=[cluster_spec.node_of(d).name for d in strategy.replicas],
                        sparse_rows_per_sample=sparse_rows_per_sample, fsdp=bool(fsdp))
    _count_variables(tally, strategy, ctx)
    by_kind: dict[str, list] = {}
    for unit in units_of(strategy):
        by_kind.setdefault(unit.kind, []).append(unit)
    for kind, units in by_kind.items():
        MEMORY_KINDS.get(kind).count(tally, units, ctx)
    return [RankMemory(rank=r, device=strategy.replicas[r], params_bytes=tally.params[r], grads_bytes=tally.grads[r],
                       optimizer_state_bytes=tally.state[r], comm_buffers_bytes=tally.buffers[r],
                       activations_bytes=activations[r]) for r in range(world)]


def _predict_split(strategy: Strategy, model_spec: ModelSpec, cluster_spec: ClusterSpec, *,
                   activation_bytes: int | Sequence[int] | Callable[[int], int], **args: Any) -> list[RankMemory]:
    """:func:`predict_memory` of a strategy with ``tensor_parallel``: each device of a TP group
    holds what a rank of the data-parallel strategy over the TP groups holds of the model as
    split (its variables at their local shapes,
    :func:`~synctune.strategy.tensor_parallel.local_shape`), without persistent communication
    buffers; ``activation_bytes`` are a device's, of the split model."""
    import dataclasses

    tp = strategy.tensor_parallel
    t = tp.degree
    local = dataclasses.replace(model_spec, variables=tuple(
        dataclasses.replace(v, shape=local_shape(tp, v.name, v.shape, model_spec)) for v in model_spec.variables))
    groups = dataclasses.replace(strategy, tensor_parallel=None, replicas=strategy.replicas[::t],
                                 batch_split=strategy.batch_split[::t])
    if not callable(activation_bytes) and not isinstance(activation_bytes, int):
        activation_bytes = list(activation_bytes)[::t]
    args["fsdp"] = split_layout(strategy)
    per_group = predict_memory(groups, local, cluster_spec, activation_bytes=activation_bytes, **args)
    # The tp runtime's all-reduce copies a merge group's gradients into one buffer in the step,
    # after backward's peak: no buffer is held through the iteration.
    return [dataclasses.replace(per_group[r // t], rank=r, device=strategy.replicas[r], comm_buffers_bytes=0)
            for r in range(len(strategy.replicas))]


def split_layout(strategy: Strategy) -> bool:
    """How the ``tp`` runtime holds a strategy with ``tensor_parallel``: as FSDP2 where its plans
    shard the data-parallel axis (their kind holds rows under FSDP2), else as replicas do."""
    return any(MEMORY_KINDS.get(s.synchronizer.kind).holds_rows(s.synchronizer, True)
               for _p, _i, s in strategy.iter_shards())


def _count_variables(tally: Tally, strategy: Strategy, ctx: MemoryContext) -> None:
    """Every variable's parameters and gradients where its kinds hold them whole (a sparse
    gradient: its looked-up rows); the kinds that hold them as rows book those themselves."""
    for plan in strategy.plans:
        var = ctx.model[plan.variable]
        item = var.num_bytes // var.num_elements
        sharded = any(MEMORY_KINDS.get(s.synchronizer.kind).holds_rows(s.synchronizer, ctx.fsdp) for s in plan.shards)
        for r in range(tally.world):
            if not sharded:
                tally.params[r] += var.num_bytes
            if var.sparse:
                tally.grads[r] += int(ctx.sparse_rows_per_sample * ctx.split[r]) * (var.shape[1] * item + 8)
            elif not sharded:
                tally.grads[r] += var.num_bytes


def _measured(record) -> list[dict[str, int | None]] | None:
    import json

    extra = json.loads(record.extra_json or "{}")
    memory = extra.get("memory")
    if not memory:
        return None
    ranks = max(len(v) for v in memory.values())
    return [{k: v[r] for k, v in memory.items()} for r in range(ranks)]


def _records_optimizer(record) -> str:
    """The optimizer a recorded trial ran (the trial config's, in its extra; default sgd)."""
    import json

    return json.loads(record.extra_json or "{}").get("optimizer", "sgd")


def activation_figures(records: Iterable[Any]) -> dict[tuple[str, int], int]:
    """Per (model hash, per-rank batch), the strategy-independent memory of a rank, measured on
    the recorded trials with a breakdown whose shards are all-reduced or all-gathered (the
    reference: the all-reduce builder's, which all-gathers sparse gradients): the median of ``peak_bytes`` minus params, optimizer state, comm
    buffers and gradients, i.e. activations, the batch, module buffers and the iteration's
    temporaries as the allocator saw them."""
    import statistics

    figures: dict[tuple[str, int], list[int]] = {}
    for rec in records:
        measured = _measured(rec)
        if measured is None or rec.status != "ok":
            continue
        for batch, rest in reference_activations(Strategy.from_json(rec.strategy_json), measured):
            figures.setdefault((rec.model_hash, batch), []).append(rest)
    return {k: int(statistics.median(v)) for k, v in figures.items()}


def memory_errors(records: Iterable[Any], *, activations: str = "reference") -> list[dict[str, Any]]:
    """Per rank of every recorded trial with a measured breakdown: the predicted and the measured
    peak and the relative error |predicted - measured| / measured. ``activations``: where the
    strategy-independent figure comes from: ``reference`` (:func:`activation_figures`, measured
    on the same model and batch under an all-reduce strategy; ranks without one are skipped) or
    ``measured`` (the row's own saved activations, inputs and module buffers: a test of every
    other part)."""
    import json

    records = [r for r in records if r.status == "ok" and _measured(r) is not None]
    reference = activation_figures(records) if activations == "reference" else {}
    out = []
    for rec in records:
        strategy = Strategy.from_json(rec.strategy_json)
        model = ModelSpec.from_dict(json.loads(rec.model_spec_json))
        cluster = ClusterSpec.from_dict(json.loads(rec.cluster_spec_json))
        measured = _measured(rec)
        if activations == "reference":
            figure = [reference.get((rec.model_hash, b)) for b in strategy.batch_split]
        else:
            figure = [(m["activations_bytes"] or 0) + (m["inputs_bytes"] or 0) + (m["buffers_bytes"] or 0)
                      for m in measured]
        try:
            predicted = predict_memory(strategy, model, cluster,
                                       optimizer_state_multiplier=_records_optimizer(rec),
                                       activation_bytes=[f or 0 for f in figure])
        except SpecError:
            continue
        for r, (p, m) in enumerate(zip(predicted, measured)):
            if m.get("peak_bytes") is None or figure[r] is None:
                continue
            out.append({"record_id": rec.record_id, "model": rec.model_name, "cluster": rec.cluster_name, "strategy": rec.strategy_summary,
                        "origin": rec.origin, "runtime": rec.runtime, "rank": r, "predicted_bytes": p.peak_bytes,
                        "measured_bytes": m["peak_bytes"],
                        "error": abs(p.peak_bytes - m["peak_bytes"]) / m["peak_bytes"] if m["peak_bytes"] else None,
                        "predicted": p.to_dict(), "measured": m})
    return out


#: Bytes in a GiB (budgets are written in GiB, as device memory is).
GIB = 1 << 30
#: Bytes in a MiB (what a refused budget's smallest peak is given in).
MIB = 1 << 20


class ActivationFigures:
    """The strategy-independent memory of a rank (activations, the batch, module buffers, the
    iteration's temporaries) as a function of its batch size, from what was measured: figures
    at the batch sizes seen (their median), a least-squares line through them elsewhere (one
    batch size seen: proportional to the batch). Measured trials add figures as a search runs,
    so the memory model learns the domain it judges."""

    def __init__(self, points: Mapping[int, Iterable[int]] | None = None) -> None:
        self.points: dict[int, list[int]] = {int(b): [int(v) for v in vs] for b, vs in (points or {}).items()}

    def add(self, batch: int, figure: int) -> None:
        """One measured figure of a rank with ``batch`` samples."""
        self.points.setdefault(int(batch), []).append(max(0, int(figure)))

    def __bool__(self) -> bool:
        return any(self.points.values())

    def __call__(self, batch: int) -> int:
        import statistics

        medians = {b: statistics.median(v) for b, v in self.points.items() if v}
        if not medians:
            return 0
        if batch in medians:
            return int(medians[batch])
        if len(medians) == 1:
            (b0, f0), = medians.items()
            return int(f0 * batch / b0) if b0 else int(f0)
        xs, ys = list(medians), list(medians.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sum((x - mx) ** 2 for x in xs) or 1.0)
        return max(0, int(my + slope * (batch - mx)))


def reference_activations(strategy: Strategy, measured: Sequence[Mapping[str, int | None]]) -> list[tuple[int, int]]:
    """(rank's batch, strategy-independent bytes) of each rank of a measured breakdown, where the
    strategy is a reference for it (every shard all-reduced or all-gathered: a PS server, SFB's
    factors or a shard unit's gathers would add temporaries of their own; no module split, whose
    ranks hold a slice of some activations, and none recomputed); [] otherwise."""
    if strategy.checkpoint or strategy.tensor_parallel is not None or not all(
            MEMORY_KINDS.get(s.synchronizer.kind).reference for _p, _i, s in strategy.iter_shards()):
        return []
    out = []
    for r, m in enumerate(measured):
        if r >= len(strategy.batch_split) or None in (m.get("peak_bytes"), m.get("params_bytes"), m.get("grads_bytes"),
                                                      m.get("optimizer_state_bytes"), m.get("comm_buffers_bytes")):
            continue
        out.append((strategy.batch_split[r], m["peak_bytes"] - m["params_bytes"] - m["optimizer_state_bytes"]
                    - m["comm_buffers_bytes"] - m["grads_bytes"]))
    return out


def over_limits(peaks: Sequence[int | None], limits: Sequence[int | None]) -> str | None:
    """Why measured ``peaks`` break per-rank ``limits`` (bytes; None: unknown), or None when every
    rank is within its own."""
    for r, (p, lim) in enumerate(zip(peaks, limits)):
        if p is not None and lim is not None and p > lim:
            return f"rank {r} peaked at {p / GIB:.3f} GiB of tensor memory, over its budget of {lim / GIB:.3f} GiB"
    return None


@dataclass
class MemoryBudget:
    """A search's memory budget (DESIGN.md "memory budget"): each device may use ``gib`` GiB at
    its peak (0: the cluster spec's device memory, see
    :meth:`~synctune.spec.cluster.ClusterSpec.device_memory_budget_bytes`), less ``headroom``
    of it; a strategy fits when every rank's predicted peak (:func:`predict_memory`, the
    trials' ``optimizer``, the ``activations``) is within its device's limit.

    ``optimizer``: an optimizer's name (:data:`OPTIMIZER_STATE`) or its measured shape
    ``(state elements per parameter element, per-tensor bytes)``. ``probe``: the activation
    figures measured before any trial (one process); :meth:`fit` replaces them with what the
    search's own trials measured once any did. ``checkpointed``: the probe's figures with every
    block checkpointed, per mode (``full``, ``selective``), and ``shares``: each block's part of
    what checkpointing them all saves; a strategy that checkpoints some blocks is predicted to
    save those blocks' parts. ``split``: per tensor-parallel plan
    (:func:`~synctune.strategy.tensor_parallel.tp_key`), a device's figures of the model as split
    (measured on one TP group running the plan:
    :func:`synctune.run.prepare.split_activations`); a plan without its own figures is predicted
    with the unsplit model's, which hold at least as much. ``tensor_parallel``: whether the
    search's space holds tensor parallelism (Megatron's plan, with sequence parallelism or
    without), so that :meth:`smallest` tries it among the most frugal strategies.

    **Every measured trial teaches it** (:meth:`observe`), an ``oom`` one first: per layout
    (the engine's, FSDP2's), the correction added to every prediction is the larger of the
    median under-prediction of the trials measured and the largest under-prediction of an
    ``oom`` trial (never below 0). A strategy that ran out of memory is therefore predicted, from
    then on, at least at the peak it measured: the search never trials it, or anything the
    corrected model says is as large, again."""

    model: ModelSpec
    cluster: ClusterSpec
    gib: float = 0.0
    headroom: float = 0.1
    optimizer: str | tuple[float, int] = "sgd"
    probe: ActivationFigures = field(default_factory=ActivationFigures)
    checkpointed: dict[str, ActivationFigures] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    split: dict[str, ActivationFigures] = field(default_factory=dict)
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        self.activations = self.probe
        #: Per layout (True: FSDP2's), the bytes added to every rank's prediction (:meth:`observe`).
        self.corrections: dict[bool, int] = {False: 0, True: 0}
        #: What :meth:`observe` was shown: (strategy, layout, per-rank breakdown, oom).
        self.observations: list[tuple[Strategy, bool, list[Mapping[str, int | None]], bool]] = []
        self._residuals: list[int | None] = []  # each observation's under-prediction, uncorrected

    def checkpoint_modes(self) -> tuple[str, ...]:
        """The checkpointing modes the probe measured (the ones a search may propose)."""
        return tuple(m for m, figures in self.checkpointed.items() if figures)

    def activation_bytes(self, batch: int, checkpoint: Sequence[tuple[str, str]] = (), tp: Any = None) -> int:
        """The strategy-independent memory of a rank with ``batch`` samples whose blocks are
        checkpointed as ``checkpoint`` says: the activation figures (a tensor-parallel plan
        ``tp``'s own where measured) less, per checkpointed block, its share of what the probe
        measured checkpointing every block saves in that mode; under a plan with its own figures,
        that saving scaled by the plan's share of the unsplit figures (a device of a TP group
        saves what it holds of each block, not what a whole replica does)."""
        figures = self.split.get(tp_key(tp)) if tp is not None else None
        base = figures(batch) if figures else self.activations(batch)
        whole = self.probe(batch)
        scale = min(1.0, base / whole) if figures and whole > 0 else 1.0
        saved = 0.0
        for block, mode in checkpoint:
            figures = self.checkpointed.get(mode)
            if figures:
                saved += max(0, whole - figures(batch)) * self.shares.get(block, 0.0) * scale
        return max(0, int(base - saved))

    def _raw_predict(self, strategy: Strategy, fsdp: bool) -> list[RankMemory]:
        return predict_memory(strategy, self.model, self.cluster, **self._optimizer_args(),
                              activation_bytes=lambda b: self.activation_bytes(b, strategy.checkpoint,
                                                                               strategy.tensor_parallel), fsdp=fsdp)

    def _optimizer_args(self) -> dict[str, Any]:
        if isinstance(self.optimizer, str):
            return {"optimizer_state_multiplier": self.optimizer}
        multiplier, step_bytes = self.optimizer
        return {"optimizer_state_multiplier": float(multiplier), "optimizer_step_bytes": int(step_bytes)}

    def observe(self, strategy: Strategy, fsdp: bool, breakdown: Sequence[Mapping[str, int | None]] | None,
                oom: bool) -> None:
        """Learn from one measured trial: ``strategy`` as its ranks held it (``fsdp``: FSDP2's
        layout; a strategy with ``tensor_parallel`` is held as the tp runtime holds it,
        :func:`split_layout`, the layout :meth:`predict` corrects it in), its per-rank
        ``breakdown`` (nothing to learn without one), and whether it broke the budget (``oom``);
        the corrections are recomputed (see the class docstring)."""
        if not breakdown or all(m.get("peak_bytes") is None for m in breakdown):
            return
        if strategy.tensor_parallel is not None:
            fsdp = split_layout(strategy)
        self.observations.append((strategy, bool(fsdp), [dict(m) for m in breakdown], bool(oom)))
        self._residuals.append(self._residual(*self.observations[-1][:3]))
        self._correct()

    def _residual(self, strategy: Strategy, fsdp: bool, breakdown: Sequence[Mapping[str, int | None]]) -> int | None:
        """How far the uncorrected model under-predicts a trial (its largest rank's), or None."""
        try:
            predicted = self._raw_predict(strategy, fsdp)
        except SpecError:
            return None
        under = [m["peak_bytes"] - p.peak_bytes for p, m in zip(predicted, breakdown) if m.get("peak_bytes") is not None]
        return max(under) if under else None

    def _correct(self, recompute: bool = False) -> None:
        import statistics

        if recompute or len(self._residuals) != len(self.observations):
            self._residuals = [self._residual(s, f, b) for s, f, b, _o in self.observations]
        residuals: dict[bool, list[int]] = {False: [], True: []}
        ooms: dict[bool, list[int]] = {False: [], True: []}
        for (_s, fsdp, _b, oom), under in zip(self.observations, self._residuals):
            if under is None:
                continue
            residuals[fsdp].append(under)
            if oom:
                ooms[fsdp].append(under)
        self.corrections = {layout: int(max(0, statistics.median(residuals[layout]) if residuals[layout] else 0,
                                            max(ooms[layout], default=0)))
                            for layout in (False, True)}

    def limit_bytes(self, device: str) -> int | None:
        """What a rank on ``device`` may hold at its peak (None: no limit is known)."""
        base = int(self.gib * GIB) if self.gib else self.cluster.device_memory_budget_bytes(device)
        return None if base is None else int(base * (1.0 - self.headroom))

    def limits(self, strategy: Strategy) -> list[int | None]:
        """Each rank's limit, in the order of ``strategy.replicas``."""
        return [self.limit_bytes(d) for d in strategy.replicas]

    def predict(self, strategy: Strategy, fsdp: bool | None = None) -> list[RankMemory]:
        """Each rank's predicted memory under ``strategy``, held as FSDP2 holds it (``fsdp``) or as
        the engine does; None: as where a search runs it, FSDP2 when a unit frees its parameters
        after forward (:attr:`~synctune.strategy.schema.Strategy.frees_parameters`, the rule of
        :func:`synctune.engine.runtimes.executor_for`), else the engine. The layout's correction
        (:meth:`observe`) is in the activations part."""
        layout = strategy.frees_parameters if fsdp is None else bool(fsdp)
        if strategy.tensor_parallel is not None:
            layout = split_layout(strategy)
        correction = self.corrections.get(layout, 0)
        return predict_memory(strategy, self.model, self.cluster, **self._optimizer_args(),
                              activation_bytes=lambda b: self.activation_bytes(b, strategy.checkpoint,
                                                                               strategy.tensor_parallel) + correction,
                              fsdp=layout)

    def peaks(self, strategy: Strategy, fsdp: bool | None = None) -> list[int]:
        """Each rank's predicted peak bytes (``fsdp`` as :meth:`predict`)."""
        return [r.peak_bytes for r in self.predict(strategy, fsdp)]

    def fits(self, strategy: Strategy, fsdp: bool | None = None) -> bool:
        """Whether every rank's predicted peak is within its limit (``fsdp`` as :meth:`predict`)."""
        return all(lim is None or p <= lim for p, lim in zip(self.peaks(strategy, fsdp), self.limits(strategy)))

    def fits_many(self, strategies: Sequence[Strategy]) -> list[bool]:
        """:meth:`fits` of each strategy."""
        return [self.fits(s) for s in strategies]

    def fit(self, strategies: Sequence[Strategy], measured: Sequence[Sequence[Mapping[str, int | None]] | None]) -> None:
        """Learn the activation figures from measured trials (each strategy's per-rank
        breakdown, None where it has none), the reference ones only
        (:func:`reference_activations`); without any, the probe's figures stay."""
        learned = ActivationFigures()
        for strategy, breakdown in zip(strategies, measured):
            for batch, figure in reference_activations(strategy, breakdown or []):
                learned.add(batch, figure)
        self.activations = learned if learned else self.probe
        if self.observations:
            self._correct(recompute=True)  # the activation figures moved: every residual with them

    def state(self) -> dict[str, Any]:
        """Plain JSON of what a resumed search must judge with as the uninterrupted one did: the
        probe's figures (measured once, before any trial; a second probe would differ a little),
        checkpointed ones included, and the blocks' shares (the trials' lessons come back from
        their rows)."""
        points = lambda figures: {str(b): list(v) for b, v in figures.points.items()}  # noqa: E731
        return {"probe": points(self.probe), "checkpointed": {m: points(f) for m, f in self.checkpointed.items()},
                "shares": dict(self.shares), **({"split": {k: points(f) for k, f in self.split.items()}}
                                                 if self.split else {})}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take the probe's figures from :meth:`state` (before the search learns any)."""
        figures = lambda points: ActivationFigures({int(b): v for b, v in (points or {}).items()})  # noqa: E731
        probe = figures(state.get("probe"))
        if probe:
            self.probe = self.activations = probe
        if state.get("checkpointed"):
            self.checkpointed = {m: figures(p) for m, p in state["checkpointed"].items()}
            self.shares = {str(k): float(v) for k, v in (state.get("shares") or {}).items()}
        if state.get("split"):
            self.split = {str(k): figures(p) for k, p in state["split"].items()}
        if self.observations:
            self._correct(recompute=True)

    def over(self, peaks: Sequence[int | None], strategy: Strategy) -> str | None:
        """Why measured ``peaks`` (per rank) break the budget, or None when within it."""
        return over_limits(peaks, self.limits(strategy))

    def describe(self) -> str:
        """The budget in words, e.g. ``0.25 GiB per device, less 10% headroom``."""
        base = f"{self.gib:g} GiB per device" if self.gib else "the cluster's device memory"
        return f"{base}, less {self.headroom:.0%} headroom" if self.headroom else base

    def smallest(self) -> tuple[int, str, bool]:
        """The smallest predicted peak (the largest rank's) of the most frugal strategies the
        builders make (:meth:`frugal`: every lever of the search's space), that strategy's name,
        and whether any of them fits rank by rank (devices of different memory): what a budget
        that nothing fits is refused with."""
        named = self.frugal()
        peak, name = min((max(self.peaks(s)), name) for name, s in named)
        return peak, name, any(self.fits(s) for _n, s in named)

    def frugal(self) -> list[tuple[str, Strategy]]:
        """The most frugal strategies of the search's space, named: the replicated all-reduce,
        FSDP2's way at every module depth resharded or not, and, where the space holds tensor
        parallelism (:attr:`tensor_parallel`), Megatron's plan at every degree a node's devices
        allow (:meth:`tp_degrees`), with sequence parallelism and without, over all-reduce or
        resharded FSDP2, its token embedding and output layer split where the model allows; each
        also with every block checkpointed in each mode the probe measured."""
        import dataclasses

        from ..strategy.builders import build_strategy
        from ..strategy.checkpoint import checkpoint_blocks

        depth = max((len(v.name.split(".")) - 1 for v in self.model.variables), default=1)
        named = [("allreduce", build_strategy("allreduce", self.model, self.cluster))]
        for d in range(1, max(1, depth) + 1):
            for reshard in (True, False):
                named.append((f"shard:depth={d},reshard={str(reshard).lower()}",
                              build_strategy("shard", self.model, self.cluster, depth=d, reshard=reshard)))
        if self.tensor_parallel:
            named += self._frugal_split()
        blocks = checkpoint_blocks(v.name for v in self.model.variables)
        for mode in self.checkpoint_modes():
            pairs = tuple((b, mode) for b in blocks)
            named += [(f"{name}+checkpoint={mode}", dataclasses.replace(s, checkpoint=pairs)) for name, s in named
                      if not s.checkpoint]
        return named

    def tp_degrees(self) -> tuple[list[int], str | None]:
        """The TP degrees the cluster allows (2 or more, dividing every node's devices: a TP
        group lies inside one node) at which the model has Megatron pairs, and, where there is
        none, why (one clause)."""
        from ..strategy.builders import megatron_styles

        counts = [node.num_devices for node in self.cluster.nodes]
        common = math.gcd(*counts)
        degrees = [d for d in range(2, common + 1) if common % d == 0]
        if not degrees:
            return [], f"cluster {self.cluster.name!r} has a node of {min(counts)} device(s), too few for a TP group"
        found = [d for d in degrees if megatron_styles(self.model, d)]
        if not found:
            return [], (f"model {self.model.name!r} has no attention or MLP pair of linear layers whose features "
                        f"a degree of {degrees[0]} divides")
        return found, None

    def _frugal_split(self) -> list[tuple[str, Strategy]]:
        """Megatron's most frugal strategies at each degree of :meth:`tp_degrees` (see :meth:`frugal`)."""
        from ..strategy.builders import build_strategy
        from ..strategy.errors import StrategyError

        out = []
        degrees, _why = self.tp_degrees()
        for degree in degrees:
            groups = self.cluster.num_devices // degree
            for sp in (False, True):
                for dp in (("allreduce", "shard") if groups > 1 else ("allreduce",)):
                    made = None
                    # The vocabulary's matrices split too where the model allows it, else whole.
                    for extra in ({"embedding": "rowwise", "loss_parallel": True}, {"loss_parallel": True},
                                  {"embedding": "rowwise"}, {}):
                        try:
                            made = build_strategy("megatron", self.model, self.cluster, degree=degree, dp=dp,
                                                  sequence_parallel=sp, **extra)
                            break
                        except StrategyError:
                            continue
                    if made is not None:
                        name = f"megatron:degree={degree},dp={dp}" + (",sp" if sp else "")
                        out.append((name, made))
        return out

    def levers_tried(self) -> str:
        """Which levers :meth:`smallest` tried, in words (what a budget nothing fits is refused
        with), and tensor parallelism's state where it was not tried."""
        depth = max((len(v.name.split(".")) - 1 for v in self.model.variables), default=1)
        parts = [f"sharding (FSDP2 at module depths 1-{max(1, depth)}, resharded or not)"]
        modes = self.checkpoint_modes()
        parts.append(f"checkpointing every block ({' or '.join(modes)})" if modes
                     else "checkpointing not tried (not measurable on this model)")
        degrees, why = self.tp_degrees()
        if self.tensor_parallel and degrees:
            parts.append(f"tensor parallelism (Megatron, degree {', '.join(map(str, degrees))}, with and without "
                         f"sequence parallelism)")
        elif self.tensor_parallel:
            parts.append(f"tensor parallelism not tried ({why})")
        elif degrees:
            parts.append("tensor parallelism not tried (not in the search's space; search.tensor_parallel: true puts "
                         "it there)")
        return ", ".join(parts)

    def nothing_fits(self) -> str | None:
        """Once a trial broke the budget: why nothing in a search's space fits, in one line (the
        smallest peak a trial measured, the budget, the corrected model's smallest prediction and
        the levers), when the corrected model says so (:meth:`smallest`); None otherwise, and
        before any ``oom`` trial (a budget nothing fits is refused before the first trial)."""
        ooms = [o for o in self.observations if o[3]]
        if not ooms:
            return None
        if any(not oom and self.over([m.get("peak_bytes") for m in breakdown], strategy) is None
               for strategy, _f, breakdown, oom in self.observations):
            return None  # a trial held within the budget: something fits
        key = len(self.observations)
        if getattr(self, "_nothing_fits_key", None) != key:
            self._nothing_fits_key = key
            peak, name, fits = self.smallest()
            if fits:
                self._nothing_fits = None
            else:
                measured = min(max(m.get("peak_bytes") or 0 for m in breakdown) for _s, _f, breakdown, _o in
                               self.observations)
                limits = [x for x in self.limits(ooms[0][0]) if x is not None]
                self._nothing_fits = (
                    f"search.memory_gib: nothing in the search's space fits {self.describe()} "
                    f"({min(limits) / GIB:.4f} GiB per rank): the smallest peak a trial measured was "
                    f"{measured / GIB:.4f} GiB, and after {len(ooms)} trial(s) over it the memory model's smallest "
                    f"prediction is {peak / GIB:.4f} GiB ({name}); levers: {self.levers()}")
        return self._nothing_fits

    def levers(self) -> str:
        """What may make a model fit, in words (the end of every "nothing fits" line)."""
        modes = self.checkpoint_modes()
        ckpt = (f"checkpointing ({' or '.join(modes)}, already in the space)" if modes
                else "activation checkpointing (not measurable on this model)")
        degrees, _why = self.tp_degrees()
        tp = ("tensor parallelism with sequence parallelism (already in the space), " if self.tensor_parallel and degrees
              else "tensor parallelism (search.tensor_parallel: true), " if degrees else "")
        return f"{ckpt}, sharding (search.shard: auto), {tp}a smaller batch, or a larger search.memory_gib"
