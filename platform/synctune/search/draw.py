"""What a plan kind's column draw works with: its :class:`DrawContext`, and the edits it makes to
drawn strategy columns (rows rewritten or dropped, unit ids renumbered, strategies spliced in).

The guided sampler draws a round's proposals as columns (AutoDist §2.4's sampler, written into
:class:`~synctune.strategy.columns.StrategyColumns`); a registered kind may then turn some drawn
rows or strategies into its own (:attr:`synctune.search.kinds.SearchKind.draw`). These edits
keep columns what :meth:`~synctune.strategy.columns.StrategyColumns.from_strategies` would make
of the same strategies: rows grouped by strategy and variable in the model's order, merge ids
numbered by first appearance, ``group_order`` and ``ngroups`` rebuilt.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..strategy.columns import COLUMN_DTYPES, StrategyColumns
from ..strategy.kinds import SPARSE_GROUP_BASE

__all__ = ["DrawContext", "edited", "first_rows", "splice", "takes_turn"]


@dataclass(frozen=True, kw_only=True)
class DrawContext:
    """What a kind's column draw gets from the sampler: the domain (``model``, ``cluster``), the
    sampler's numpy stream (``rng``, shared: a draw takes what it needs from it in a fixed
    order), whether lossy encodings may be drawn (``lossy``), the kind's draw ``rate`` (a
    probability per strategy), the memory budget's predicate (``fits``: a strategy object ->
    whether it fits; None without a budget) and ``memo``, the sampler's cache of what depends
    on the domain only (a draw keys it by its own name); ``split``, where the search proposes
    tensor parallelism, the growth step that splits a strategy's blocks until ``fits`` holds it
    (:func:`~synctune.search.tp_draw.grow_split`: a strategy object -> the split one that fits, or
    None), which the sharded and checkpointed draws' growth takes (None: no split step), and
    ``split_share``, the share of grown sharded draws that split before checkpointing where both
    would fit (:func:`~synctune.search.shard_draw.grow`)."""

    model: Any
    cluster: Any
    rng: np.random.Generator
    lossy: bool
    rate: float
    fits: Callable[[Any], bool] | None = None
    memo: dict = field(default_factory=dict, compare=False)
    split: Callable[[Any], Any] | None = field(default=None, compare=False)
    split_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("rate", "split_share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ValueError(f"DrawContext: {name}: expected a probability in [0, 1], got {value!r}")


def takes_turn(k: int, share: float) -> bool:
    """Whether the ``k``-th of a run of draws (from 0) is one of the ``share`` of them, spread
    evenly and without a random draw (so the sampler's stream is the same whatever the share):
    at 0.5 the even ones, at 1 all, at 0 none."""
    return math.floor((k + 1) * share + 0.5) > math.floor(k * share + 0.5)


def first_rows(cols: StrategyColumns) -> np.ndarray:
    """Per row, whether it is its variable's first shard in its strategy."""
    first = np.ones(len(cols.sid), bool)
    if len(first) > 1:
        first[1:] = (np.diff(cols.sid) != 0) | (np.diff(cols.var) != 0)
    return first


def edited(cols: StrategyColumns, *, at: np.ndarray | None = None, values: Mapping[str, Any] | None = None,
           keep: np.ndarray | None = None, renumber: np.ndarray | None = None) -> StrategyColumns:
    """``cols`` with rows ``at`` (indices) given ``values`` (column name -> a value or one per
    row of ``at``), then only the rows where ``keep`` holds (None: every row; the rows ``at``
    must be kept), and the merge ids of the strategies ``renumber`` (a mask per strategy)
    numbered by first appearance per strategy, kind and space (ids from
    :data:`~synctune.strategy.kinds.SPARSE_GROUP_BASE` on, the sparse merge groups, in a space of
    their own: the columns' twin of :func:`~synctune.strategy.kinds.renumber_units`, so equal
    groupings hash equal once made objects); offsets recounted, merge-group numbering rebuilt.
    ``cols`` is left as it is."""
    if values and at is None:
        raise ValueError("edited: at: expected the indices of the rows values are written to, got None")
    rows = {name: getattr(cols, name) for name in COLUMN_DTYPES if name != "group_order"}
    fresh: set[str] = set()
    if keep is not None and not keep.all():
        if at is not None:
            at = (np.cumsum(keep) - 1)[at]
        index = np.flatnonzero(keep)
        rows = {name: column.take(index) for name, column in rows.items()}
        fresh = set(rows)
    for name, value in (values or {}).items():
        if name not in fresh:  # a column of ``cols``: copied before it is written
            rows[name] = rows[name].copy()
        rows[name][at] = value
    if renumber is not None:
        group = _renumbered(rows["sid"], rows["kind"], rows["group"], renumber)
        if group is not None:
            rows["group"] = group
    counts = np.bincount(rows["sid"], minlength=cols.size)
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return StrategyColumns(model=cols.model, cluster=cols.cluster, offsets=offsets, batch_split=cols.batch_split,
                           checkpoint=cols.checkpoint, **cols.tp_fields(0, cols.size), **rows)


def _renumbered(sid: np.ndarray, kind: np.ndarray, group: np.ndarray, strategies: np.ndarray) -> np.ndarray | None:
    """``group`` with the merge ids of the ``strategies`` (a mask) renumbered (:func:`edited`);
    None where they are numbered so already."""
    rows = np.flatnonzero((group >= 0) & strategies[sid])
    if not len(rows):
        return None
    ids = group[rows]
    space = np.where(ids >= SPARSE_GROUP_BASE, SPARSE_GROUP_BASE, 0)
    owner = (sid[rows] * 256 + kind[rows].astype(np.int64)) * 2 + (space > 0)
    _, first, inverse = np.unique(owner * (int(ids.max()) + 1) + ids, return_index=True, return_inverse=True)
    # Ids of one (strategy, kind, space) ranked by the row where each first appears.
    by_owner = np.lexsort((first, owner[first]))
    starts = np.r_[0, np.flatnonzero(np.diff(owner[first][by_owner])) + 1]
    rank = np.empty(len(first), np.int64)
    rank[by_owner] = np.arange(len(first)) - np.repeat(starts, np.diff(np.r_[starts, len(first)]))
    new = space + rank[inverse.ravel()]
    if np.array_equal(new, ids):
        return None
    out = group.copy()
    out[rows] = new
    return out


def splice(cols: StrategyColumns, replaced: Mapping[int, StrategyColumns]) -> StrategyColumns:
    """``cols`` with strategy ``i`` replaced by the single strategy of ``replaced[i]`` (columns
    of the same domain), its batch split included."""
    if not replaced:
        return cols
    names = [name for name in COLUMN_DTYPES if name != "group_order"]
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in names}
    at = 0
    for i in sorted(replaced):
        lo, hi = int(cols.offsets[i]), int(cols.offsets[i + 1])
        new = replaced[i]
        for name in names:
            pieces[name].append(getattr(cols, name)[at:lo])
            pieces[name].append(np.full(len(new.sid), i, np.int64) if name == "sid" else getattr(new, name))
        at = hi
    rows = {name: np.concatenate(pieces[name] + [getattr(cols, name)[at:]]).astype(COLUMN_DTYPES[name])
            for name in names}
    counts = np.bincount(rows["sid"], minlength=cols.size)
    checkpoint = cols.checkpoint
    if any(new.checkpoint is not None for new in replaced.values()):
        blocks = len(cols.blocks())
        checkpoint = np.zeros((cols.size, blocks), np.int8) if checkpoint is None else checkpoint.copy()
        for i, new in replaced.items():
            checkpoint[i] = new.checkpoint[0] if new.checkpoint is not None else 0
    elif checkpoint is not None:
        checkpoint = checkpoint.copy()
        for i in replaced:
            checkpoint[i] = 0
    batch_split = cols.batch_split
    if batch_split is not None or any(new.batch_split is not None for new in replaced.values()):
        batch_split = cols.splits().copy()
        for i, new in replaced.items():
            batch_split[i] = new.splits()[0]
        if (batch_split == cols.model.batch_size).all():
            batch_split = None
    return dataclasses.replace(cols, offsets=np.r_[0, np.cumsum(counts)].astype(np.int64), group_order=None,
                               ngroups=None, checkpoint=checkpoint, batch_split=batch_split,
                               **_spliced_tp(cols, replaced), **rows)


def _spliced_tp(cols: StrategyColumns, replaced: Mapping[int, StrategyColumns]) -> dict[str, np.ndarray | None]:
    """The tensor-parallel columns of ``cols`` with strategy ``i``'s taken from ``replaced[i]``
    (none where it splits no module)."""
    if cols.tp_degree is None and all(new.tp_degree is None for new in replaced.values()):
        return cols.tp_fields(0, cols.size)
    n, blocks = cols.size, len(cols.blocks())
    out = {"tp_degree": np.zeros(n, np.int16), "tp_blocks": np.zeros((n, blocks), np.int8),
           "tp_logits": np.zeros(n, bool), "tp_embedding": np.zeros(n, bool)}
    if cols.tp_degree is not None:
        for name in out:
            out[name][:] = getattr(cols, name)
    for i, new in replaced.items():
        for name in out:
            out[name][i] = 0 if new.tp_degree is None else getattr(new, name)[0]
    return out
