"""The simulator's registries of synchronizer kinds, and what a kind's entries are handed.

One registry per concern, each keyed by a kind's name
(:data:`synctune.strategy.kinds.SYNCHRONIZERS`) and filled by the kind's own module of this
package:

- :data:`MEMORY_KINDS`: what the memory model books for the kind's units on each rank
  (:func:`synctune.simulator.memory.predict_memory`);
- :data:`FEATURE_KINDS`: how the analytic model and the learned models' features price the
  kind's rows (AutoSync §3.1; :mod:`synctune.simulator.features`);
- :data:`REPLAY_KINDS`: how the replay runs the kind's units (dPRO §4.3;
  :mod:`synctune.simulator.replay`).

The cost terms (features and replay) price a row by its
:attr:`~synctune.strategy.columns.StrategyColumns.pattern`: its own kind, or the kind it is
:attr:`~synctune.strategy.kinds.Synchronizer.priced_as`. A kind that prices itself brings an
entry to both registries; one priced as another brings none. Every term is a function over one
kind's rows of a whole batch of strategies (numpy over those rows, no Python per row), called once
per batch, with the kind's rows found once per batch
(:meth:`~synctune.strategy.columns.StrategyColumns.pattern_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ...spec.errors import SpecError
from ...spec.registry import Registry
from ...strategy.kinds import SYNCHRONIZER_KINDS, SYNCHRONIZERS, PlanUnit
from ...strategy.partition import shard_shapes

__all__ = ["Tally", "MemoryContext", "MemoryKind", "MEMORY_KINDS", "register_memory_kind",
           "AnalyticTerms", "FeatureTerms", "FeatureBlock", "FeatureKind", "FEATURE_KINDS", "register_feature_kind",
           "ReplayBatch", "ReplayKind", "REPLAY_KINDS", "register_replay_kind", "priced", "by_code", "index_bytes"]

T = TypeVar("T")


# ------------------------------------------------------------------------------ memory

@dataclass
class Tally:
    """Per-rank byte counts while the memory model walks a strategy; :meth:`own` books the
    optimizer state of ``elements`` updated elements (and the per-tensor scalars) on rank ``r``."""

    world: int
    multiplier: float
    step_bytes: int
    params: list[int] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    buffers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "state", "buffers"):
            setattr(self, name, [0] * self.world)

    def own(self, r: int, elements: int, item: int) -> None:
        """Book the optimizer state of ``elements`` updated elements of ``item`` bytes on rank ``r``."""
        self.state[r] += int(self.multiplier * elements) * item + self.step_bytes


@dataclass(frozen=True)
class MemoryContext:
    """What a kind's tally knows of the strategy: the model spec, each rank's batch, each
    replica device's rank, each rank's node, the looked-up rows per sample of a sparse gradient,
    and whether FSDP2 runs it (``fsdp``) rather than the engine."""

    model: Any
    split: Sequence[int]
    rank_of: dict[str, int]
    nodes: Sequence[str]
    sparse_rows_per_sample: float
    fsdp: bool

    @property
    def world(self) -> int:
        """The number of ranks."""
        return len(self.split)

    def shard_shape(self, member) -> tuple[int, ...]:
        """The shape of a unit member's shard."""
        var = self.model[member.variable]
        return shard_shapes(var.shape, member.plan.partition)[member.index]

    def item(self, member) -> int:
        """The bytes of one element of a unit member's variable."""
        var = self.model[member.variable]
        return var.num_bytes // var.num_elements

    def everyone_owns(self, tally: Tally, member) -> None:
        """Book a unit member's optimizer state on every rank (every replica updates the shard)."""
        numel = math.prod(self.shard_shape(member))
        for r in range(tally.world):
            tally.own(r, numel, self.item(member))

    def row_buffers(self, tally: Tally, member, receivers: Sequence[int]) -> None:
        """A sparse shard's row buffers: each rank's own rows (and the padded copy), the
        ``receivers`` every rank's."""
        shape = self.shard_shape(member)
        rows = [int(self.sparse_rows_per_sample * b) for b in self.split]
        row_bytes = shape[1] * self.item(member) + 8
        longest = max(rows)
        for r in range(tally.world):
            tally.buffers[r] += (rows[r] + longest) * row_bytes
        for r in receivers:
            tally.buffers[r] += tally.world * longest * row_bytes


@dataclass(frozen=True)
class MemoryKind:
    """How the memory model books one synchronizer kind.

    ``count(tally, units, ctx)``: book the kind's units of one strategy (all of them at once: a
    kind's in-flight buffers may depend on its largest units). ``holds_rows(sync, fsdp)``: the
    variable's parameters and gradients are this rank's rows, not whole (booked by ``count``).
    ``reference``: a strategy of only such kinds (and other reference kinds) adds no temporaries
    of its own, so its measured breakdown gives the strategy-independent bytes
    (:func:`~synctune.simulator.memory.reference_activations`)."""

    count: Callable[[Tally, list[PlanUnit], MemoryContext], None]
    holds_rows: Callable[[Any, bool], bool] = lambda sync, fsdp: False
    reference: bool = False


#: Synchronizer kind name -> what the memory model books for it.
MEMORY_KINDS: Registry[MemoryKind] = Registry("memory-model synchronizer kind")


def register_memory_kind(name: str, kind: MemoryKind) -> MemoryKind:
    """Let the memory model book synchronizer kind ``name`` (a second registration is an error)."""
    return MEMORY_KINDS.register(name, kind)


# ---------------------------------------------------------------------------- features

@dataclass
class AnalyticTerms:
    """One batch's analytic terms while :func:`~synctune.simulator.features.analytic_parts` adds
    them up (AutoSync Eq. 2 and the ring and gather analogues): the columns ``b`` of domain
    ``ctx``; the per-strategy tables ``t`` (:func:`~synctune.simulator.domain.comm_terms`; None
    where every strategy replicates on every device: the domain's own then); per row the bytes its
    gradient carries (``message``), those on the wire (``wire``) and its collective's seconds per
    byte (``per_byte``); per strategy each server node's PS load (``per_server``, (strategies,
    nodes)), the all-reduce and all-gather seconds (``t_ar``, ``t_ag``: set once the per-shard
    seconds are summed) and the ring's message count (``ring_msgs``); and the parts kinds add of
    their own (``parts``, name -> per-strategy seconds)."""

    b: Any
    ctx: Any
    t: dict | None
    message: np.ndarray
    wire: np.ndarray
    per_byte: np.ndarray
    per_server: np.ndarray
    ring_msgs: Any
    t_ar: np.ndarray | None = None
    t_ag: np.ndarray | None = None
    parts: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FeatureTerms:
    """What a kind's per-shard features read and write for one batch: the columns ``b`` of
    domain ``ctx``, the per-strategy tables ``t`` (:func:`~synctune.simulator.domain.comm_terms`),
    per row the bytes on the wire (``wire``) and those its gradient carries at the domain's
    density (``sent``, where the features read it), the output ``out`` (rows x features) and the
    position of each feature's column in it (``col``, name -> column)."""

    b: Any
    ctx: Any
    t: dict | None
    wire: np.ndarray
    sent: np.ndarray | None
    out: np.ndarray
    col: dict[str, int]


@dataclass(frozen=True)
class FeatureBlock:
    """Features a kind adds of its own, appended after every other input of the learned models
    (so a model trained without them reads the inputs it was trained on): ``raw_names`` per shard,
    ``global_names`` per strategy, and ``inputs(b, ctx)`` -> their (rows, len(raw_names)) and
    (strategies, len(global_names)) values (zero off the kind's rows)."""

    raw_names: tuple[str, ...]
    global_names: tuple[str, ...]
    inputs: Callable[[Any, Any], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class FeatureKind:
    """How the analytic model and the features price one kind's rows (AutoSync §3.1).

    The features speak AutoSync's vocabulary: three families of predefined terms, ``ps`` (Eq. 2's
    load of each server), ``ar`` (a ring all-reduce per merge group) and ``ag`` (an all-gather),
    summed per strategy into ``t_ps``, ``t_ar`` and ``t_ag``, and a one-hot per kind. An entry
    says where its kind's rows go in it:

    - ``one_hot``: its one-hot's column of :data:`~synctune.simulator.features.RAW_NAMES` (None:
      its :attr:`block` holds one);
    - ``family``: the family whose bytes share (``ps_bytes``, ``ar_bytes``, ``ag_bytes``) counts
      its rows (their gradients' bytes, or with ``counts_message`` the messages they send), and,
      for ``ag``, whose total ``t_ag`` counts its collective's seconds (else ``t_ar`` does);
    - ``collective(nn, replicas' ring, constants)``: (seconds per byte, fixed seconds) of one
      shard's collective over ``nn`` replicas on a ring whose slowest flow is ``ring``, scalars
      for the domain or one per row (None: no collective of that shape, 0);
    - ``message(b, ctx, rows, nbytes)``: for a kind whose rows send something else than their
      gradient, writes those bytes into ``nbytes[rows]`` and returns the seconds each row's
      gradient then takes to rebuild (or None);
    - ``adjust(terms, rows)``: changes its rows' ``per_byte`` before the per-shard seconds are
      summed; ``totals(terms, rows)``: adds what it costs beyond them (its servers' loads, its
      parts, a change to ``t_ar``), with ``hidden`` (parts overlapping backward, as
      communication does) and ``exposed`` (parts after it) naming the parts it adds (zero for
      strategies without its rows);
    - ``predefined(terms, rows)`` and ``raw(terms, rows)``: write its rows' columns of
      :data:`~synctune.simulator.features.PRE_NAMES` and
      :data:`~synctune.simulator.features.RAW_NAMES` (beyond the one-hot);
    - ``block``: features of its own (:class:`FeatureBlock`).
    """

    one_hot: str | None = None
    family: str | None = None
    counts_message: bool = False
    collective: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None
    message: Callable[[Any, Any, np.ndarray, np.ndarray], np.ndarray | None] | None = None
    adjust: Callable[[AnalyticTerms, np.ndarray], None] | None = None
    totals: Callable[[AnalyticTerms, np.ndarray], None] | None = None
    hidden: tuple[str, ...] = ()
    exposed: tuple[str, ...] = ()
    predefined: Callable[[FeatureTerms, np.ndarray], None] | None = None
    raw: Callable[[FeatureTerms, np.ndarray], None] | None = None
    block: FeatureBlock | None = None

    def __post_init__(self) -> None:
        if self.family not in (None, "ps", "ar", "ag"):
            raise ValueError(f"FeatureKind: family: expected None, 'ps', 'ar' or 'ag', got {self.family!r}")


#: Synchronizer kind name -> how the features price its rows.
FEATURE_KINDS: Registry[FeatureKind] = Registry("feature-term synchronizer kind")


def register_feature_kind(name: str, kind: FeatureKind) -> FeatureKind:
    """Let the analytic model and the features price synchronizer kind ``name`` itself (a second
    registration is an error)."""
    return FEATURE_KINDS.register(name, kind)


# ------------------------------------------------------------------------------ replay

@dataclass
class ReplayBatch:
    """One batch while the replay runs it (:func:`~synctune.simulator.replay.replay_units`): what
    its kinds' terms read and write.

    Per batch: the columns ``b`` of domain ``ctx``, the replayed domain ``dom`` (compute, link
    latency ``alpha``) and constants ``k``, the per-strategy tables ``t``. Per row: the bytes of its
    shard (``plain``), the share of them a replica sends (``sparse_part``: the rows it touched),
    the bytes on the wire (``wire``), the seconds its gradient takes to rebuild (``rebuild``, or
    None), when its gradient is ready (``ready``) and the row that keys its unit (``own``: itself,
    unless its kind joins rows into units of its own). Per strategy: its compute scale
    (``scale``), the end of backward (``backward_end``), and what each kind runs after the step
    (``after_step``: kind name -> seconds, added in registry order). Once units are formed: per
    row its unit (``unit_of``); per unit its strategy, kind and bytes (``usid``, ``ukind``, ``ubytes``), its replicas and ring
    (``unn``, ``ring``), its compressor's chained collectives (``stages``), the collectives it
    launches and the steps with another replica each takes (``launches``, ``steps``), its
    seconds on the link (``dur``), the part of them inside the nodes first (``in_node``), and
    whether it runs on process groups of its own (``roots``)."""

    b: Any
    ctx: Any
    dom: Any
    k: Any
    t: dict
    alpha: float
    plain: np.ndarray
    sparse_part: np.ndarray
    wire: np.ndarray
    rebuild: np.ndarray | None
    ready: np.ndarray
    own: np.ndarray
    scale: np.ndarray
    backward_end: np.ndarray
    after_step: dict[str, np.ndarray] = field(default_factory=dict)
    unit_of: np.ndarray | None = None
    usid: np.ndarray | None = None
    ukind: np.ndarray | None = None
    ubytes: np.ndarray | None = None
    unn: np.ndarray | None = None
    ring: np.ndarray | None = None
    stages: np.ndarray | None = None
    launches: np.ndarray | None = None
    steps: np.ndarray | None = None
    dur: np.ndarray | None = None
    in_node: np.ndarray | None = None
    roots: np.ndarray | None = None


@dataclass(frozen=True)
class ReplayKind:
    """How the replay runs one kind's units (dPRO §4.3, AutoDDL's alpha-beta costs).

    - ``densifies``: a sparse gradient travels dense (the engine densifies it for an all-reduce);
      otherwise a replica sends the rows it touched;
    - ``step_cost``: the :class:`~synctune.simulator.replay.ReplayConstants` field its units pay
      per step with another replica (the calibrated CPU cost), ``unit_cost`` the one they pay once;
    - ``counted_as``: the family its units count in among the residual correction's features
      (``ps``, ``ar``, ``ag``, ``shard``; None: in none);
    - ``prepare(batch, rows)``: what its other terms share for one batch (e.g. its units);
    - ``form_units(batch, rows, state)``: before units are formed: the row keying each row's unit
      (``own``) and the bytes on the wire;
    - ``compute(batch, rows, state)``: how its units delay compute (``ready``, ``backward_end``)
      and what they run after the step (``after_step[name]``);
    - ``durations(batch, rows, units, state)``: its units' seconds on the link (``dur``), and
      where they differ, their launches and steps, their stage inside the nodes (``in_node``,
      ``roots``) and what they run after the step;
    - ``step_saved(batch, rows, state)``: per strategy, the bytes of optimizer step a rank does
      not run (it updates a slice).

    Units are formed for every kind alike: one per all-reduce merge group where the kind's units
    are merge groups (:attr:`~synctune.strategy.kinds.Synchronizer.merge_groups`), else one per
    row, or per the row ``form_units`` names."""

    densifies: bool = False
    step_cost: str | None = None
    unit_cost: str | None = None
    counted_as: str | None = None
    prepare: Callable[[ReplayBatch, np.ndarray], Any] | None = None
    form_units: Callable[[ReplayBatch, np.ndarray, Any], None] | None = None
    compute: Callable[[ReplayBatch, np.ndarray, Any], None] | None = None
    durations: Callable[[ReplayBatch, np.ndarray, np.ndarray, Any], None] | None = None
    step_saved: Callable[[ReplayBatch, np.ndarray, Any], np.ndarray] | None = None


#: Synchronizer kind name -> how the replay runs its units.
REPLAY_KINDS: Registry[ReplayKind] = Registry("replay synchronizer kind")


def register_replay_kind(name: str, kind: ReplayKind) -> ReplayKind:
    """Let the replay run synchronizer kind ``name`` itself (a second registration is an error)."""
    return REPLAY_KINDS.register(name, kind)


# ------------------------------------------------------------------------------ lookups

_PRICED: dict[int, tuple[tuple, list]] = {}


def priced(registry: Registry[T], b: Any = None) -> list[tuple[int, T]]:
    """(kind code, entry) of every kind that prices itself (``priced_as`` None), in registry
    order, from ``registry`` (:data:`FEATURE_KINDS` or :data:`REPLAY_KINDS`). A kind without an
    entry is left out while ``b`` (strategy columns) holds none of its rows, and an error naming
    the registry's kinds once it does."""
    version = (len(SYNCHRONIZERS), len(registry))
    cached = _PRICED.get(id(registry))
    if cached is None or cached[0] != version:
        entries, missing = [], []
        for code, name in enumerate(SYNCHRONIZER_KINDS):
            if SYNCHRONIZERS.get(name).priced_as is not None:
                continue
            if name in registry:
                entries.append((code, registry.get(name)))
            else:
                missing.append((code, name))
        cached = _PRICED[id(registry)] = (version, (entries, missing))
    entries, missing = cached[1]
    for code, name in missing:
        if b is not None and b.pattern_mask(code).any():
            raise SpecError(f"synchronizer kind {name!r} is not in the {registry.kind} registry "
                            f"({', '.join(registry)}), and these strategies have shards of it: register its terms "
                            f"there, or name the kind it communicates as in its priced_as")
    return entries


def by_code(entries: list[tuple[int, T]], value: Callable[[T], Any], default: Any) -> np.ndarray:
    """Per kind code (every registered kind), ``value(entry)`` for the ``entries`` of
    :func:`priced`, ``default`` for the others: a table one gather reads per row."""
    table = [default] * len(SYNCHRONIZER_KINDS)
    for code, entry in entries:
        table[code] = value(entry)
    return np.array(table)


def index_bytes(ctx: Any, var: np.ndarray, rows_bytes: np.ndarray) -> np.ndarray:
    """The int64 indices of ``rows_bytes`` of rows of variables ``var`` (a sparse unit sends them
    beside its rows)."""
    row_bytes = ctx.var_bytes[var] / np.maximum(ctx.var_rows[var], 1.0)
    return rows_bytes / np.maximum(row_bytes, 1.0) * 8.0
