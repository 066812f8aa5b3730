"""The guided sampler's draw of activation checkpointing (:mod:`synctune.strategy.checkpoint`),
on strategy columns, and the growth step that adds it to a draw the memory budget refuses.

At the sampler's ``checkpoint_prob``, a drawn strategy checkpoints some of the model's blocks:
a mode (``full`` or ``selective``, even odds) and a number of blocks (uniform from one to all),
the blocks taken in forward order (the first blocks' activations live longest). With a memory
budget's predicate, a draw it refuses is grown: its blocks checkpoint ``full`` one more at a
time, the largest saver first, until it fits, and where checkpointing every block is not enough
and the search proposes tensor parallelism, it is split (Megatron's plan with sequence
parallelism, :func:`~synctune.search.tp_draw.grow_split`); the sharded draw's growth ends with
the same steps (:func:`grow_checkpointing`), after sharding, as a user reaches for
checkpointing once sharding is not enough.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..strategy.checkpoint import CHECKPOINT_MODES, checkpoint_blocks
from ..strategy.columns import StrategyColumns
from ..strategy.schema import Strategy
from .draw import DrawContext, splice

__all__ = ["draw_checkpointing", "grow_checkpointing"]


def grow_checkpointing(strategy: Strategy, fits: Callable[[Strategy], bool], blocks: list[str],
                       order: list[str] | None = None) -> Strategy:
    """``strategy`` with its blocks checkpointed ``full``, one more at a time (``order``, default
    ``blocks`` in forward order; blocks it checkpoints already keep their mode), until ``fits``
    holds it; the last step (every block) where nothing fits."""
    out = strategy
    have = dict(strategy.checkpoint)
    for block in order or blocks:
        if have.get(block) == "full":
            continue
        have[block] = "full"
        out = dataclasses.replace(strategy, checkpoint=tuple(sorted(have.items())))
        if fits(out):
            return out
    return out


def draw_checkpointing(ctx: DrawContext, cols: StrategyColumns, order: list[str] | None = None) -> StrategyColumns:
    """``cols`` with each strategy, at ``ctx.rate``, checkpointing a drawn mode on a drawn number
    of its first blocks (the module docstring); with ``ctx.fits``, a picked strategy it refuses
    is grown (:func:`grow_checkpointing`, blocks in ``order``), and where checkpointing every
    block is not enough, split (``ctx.split``: tensor parallelism with sequence parallelism,
    :func:`~synctune.search.tp_draw.grow_split`, where the search proposes it; what it returns
    fits)."""
    blocks = checkpoint_blocks(v.name for v in ctx.model.variables)
    n = cols.size
    if not blocks or not n or ctx.rate <= 0:
        return cols
    picked = np.flatnonzero(ctx.rng.random(n) < ctx.rate)
    if not len(picked):
        return cols
    mode = ctx.rng.integers(1, len(CHECKPOINT_MODES) + 1, len(picked))
    count = ctx.rng.integers(1, len(blocks) + 1, len(picked))
    table = np.zeros((n, len(blocks)), np.int8) if cols.checkpoint is None else cols.checkpoint.copy()
    for k, i in enumerate(picked.tolist()):
        table[i, :count[k]] = mode[k]
    out = dataclasses.replace(cols, checkpoint=table)
    if ctx.fits is None:
        return out
    grown = {}
    for i in picked.tolist():
        made = out.strategy(i)
        if not ctx.fits(made):
            fitted = grow_checkpointing(made, ctx.fits, blocks, order)
            if ctx.split is not None and not ctx.fits(fitted):
                fitted = ctx.split(made) or fitted
            grown[i] = StrategyColumns.from_strategies(ctx.model, ctx.cluster, [fitted])
    return splice(out, grown)
