"""The guided sampler's draw of tensor parallelism (Megatron-LM, Shoeybi et al. 2019; sequence
parallelism, Korthikanti et al. 2022) on strategy columns, and the growth step that splits a draw
the memory budget refuses.

At the sampler's ``tp_prob``, a drawn strategy that holds a replica on every device with one
batch size (a TP group trains one batch) is turned into Megatron's plan per block
(:func:`~synctune.strategy.builders.megatron_block_styles`, the columns' ``tp_*``): a degree drawn from
those a node's devices allow (:func:`split_layout`), then, with even odds where the model allows
it at that degree, sequence parallelism on every block, else Megatron's pairs on each block at a
rate drawn per strategy (one block at least); the row-wise token embedding and the loss-parallel
head each with even odds where the model allows them. Its data-parallel plans become the ones
the ``tp`` runtime runs over the TP groups (the ``megatron`` builder's: one all-reduce group, or,
with even odds where there is more than one group and every variable is shardable, FSDP2 with one
unit per block, resharded at even odds).

With a memory budget's predicate (``fits``), a split draw it refuses grows, with no further draw
from the stream: every block split, then sequence parallelism on every block, then the next
degree, then the units resharded, then the blocks checkpointed
(:func:`~synctune.search.checkpoint_draw.grow_checkpointing`); the first that fits is kept. The
sharded and checkpointed draws' growth takes tensor parallelism with sequence parallelism as a
step of its own (:func:`grow_split`) where the search proposes it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..strategy.builders import TP_BLOCK_PLANS, build_strategy, megatron_block_styles, megatron_styles
from ..strategy.checkpoint import block_of, checkpoint_blocks
from ..strategy.columns import StrategyColumns
from ..strategy.errors import StrategyError
from ..strategy.schema import Strategy
from .checkpoint_draw import grow_checkpointing
from .draw import DrawContext, splice

__all__ = ["SplitLayout", "split_layout", "draw_tensor_parallel", "grow_split", "split_strategy"]

_MEMO_KEY = "split-layout"
_PAIRS, _SEQUENCE = TP_BLOCK_PLANS.index("pairs"), TP_BLOCK_PLANS.index("sequence")


@dataclass(frozen=True)
class SplitLayout:
    """What Megatron's plan allows on a domain, per TP degree (``degrees``: 2 or more, dividing
    every node's devices): the blocks with pairs (``pairs[d]``, indices into the model's blocks),
    whether sequence parallelism runs with every such block split (``sequence[d]``), and whether
    the row-wise token embedding (``embedding[d]``: without and with sequence parallelism) and the
    loss-parallel head (``logits[d]``) are allowed; whether FSDP2 may shard the data-parallel
    axis (``shardable``: every variable dense float32, more than one TP group)."""

    degrees: tuple[int, ...]
    blocks: tuple[str, ...]
    pairs: dict[int, tuple[int, ...]]
    sequence: dict[int, bool]
    embedding: dict[int, tuple[bool, bool]]
    logits: dict[int, bool]
    shardable: dict[int, bool]

    @classmethod
    def of(cls, model: Any, cluster: Any) -> "SplitLayout":
        """The layout of (``model``, ``cluster``)."""
        counts = [node.num_devices for node in cluster.nodes]
        common = math.gcd(*counts) if counts else 1
        blocks = tuple(checkpoint_blocks(v.name for v in model.variables))
        at = {b: j for j, b in enumerate(blocks)}
        degrees, pairs, sequence, embedding, logits, shardable = [], {}, {}, {}, {}, {}
        dense = all(not v.sparse and v.shape and v.dtype == "float32" for v in model.variables)
        for d in range(2, common + 1):
            if common % d:
                continue
            split = sorted({at[block_of(m + ".weight")] for m in megatron_styles(model, d)
                            if block_of(m + ".weight") in at})
            if not split:
                continue
            degrees.append(d)
            pairs[d] = tuple(split)
            every = {blocks[j]: "pairs" for j in split}
            sequence[d] = _allowed(model, d, {b: "sequence" for b in every})
            embedding[d] = (_allowed(model, d, every, embedding="rowwise"),
                            sequence[d] and _allowed(model, d, {b: "sequence" for b in every}, embedding="rowwise"))
            logits[d] = _allowed(model, d, every, loss_parallel=True)
            shardable[d] = dense and cluster.num_devices > d
        return cls(degrees=tuple(degrees), blocks=blocks, pairs=pairs, sequence=sequence, embedding=embedding,
                   logits=logits, shardable=shardable)


def _allowed(model: Any, degree: int, blocks: dict[str, str], **options: Any) -> bool:
    try:
        megatron_block_styles(model, degree, blocks, **options)
    except StrategyError:
        return False
    return True


def split_layout(model: Any, cluster: Any, memo: dict) -> SplitLayout:
    """``model``'s :class:`SplitLayout` on ``cluster``, cached in ``memo`` (a sampler's, one domain)."""
    layout = memo.get(_MEMO_KEY)
    if layout is None:
        layout = memo[_MEMO_KEY] = SplitLayout.of(model, cluster)
    return layout


def _base(model: Any, cluster: Any, memo: dict, degree: int, dp: str, reshard: bool) -> StrategyColumns:
    """The ``megatron`` builder's strategy at ``degree`` over ``dp`` as columns (its data-parallel
    rows: what a split draw's rows become), built once per domain."""
    key = ("split-base", degree, dp, reshard)
    found = memo.get(key)
    if found is None:
        made = build_strategy("megatron", model, cluster, degree=degree, dp=dp, reshard=reshard)
        found = memo[key] = StrategyColumns.from_strategies(model, cluster, [made])
    return found


def split_strategy(model: Any, cluster: Any, memo: dict, strategy: Strategy, degree: int,
                   blocks: dict[str, str], *, dp: str = "allreduce", reshard: bool = True, logits: bool = False,
                   embedding: bool = False) -> Strategy:
    """``strategy`` (its replicas and checkpointing) split: Megatron's plan on ``blocks`` at
    ``degree`` (:func:`~synctune.strategy.builders.megatron_block_styles`), its data-parallel plans the
    ``megatron`` builder's over ``dp``."""
    base = _base(model, cluster, memo, degree, dp, reshard)
    styles = megatron_block_styles(model, degree, blocks, loss_parallel=logits, embedding="rowwise" if embedding else "whole")
    return dataclasses.replace(base.strategy(0), checkpoint=strategy.checkpoint,
                               tensor_parallel={"degree": degree, "modules": styles})


def draw_tensor_parallel(ctx: DrawContext, cols: StrategyColumns) -> StrategyColumns:
    """``cols`` with each strategy that holds a replica of one batch size on every device, at
    ``ctx.rate``, split as the module docstring draws it; with ``ctx.fits``, a split draw it
    refuses is grown (:func:`_grow_draw`)."""
    layout = split_layout(ctx.model, ctx.cluster, ctx.memo)
    n = cols.size
    if not layout.degrees or not n or ctx.rate <= 0:
        return cols
    splits = cols.splits()
    even = (splits == splits[:, :1]).all(1) & (splits[:, 0] > 0)
    picked = np.flatnonzero((ctx.rng.random(n) < ctx.rate) & even)
    if not len(picked):
        return cols
    m, nb = len(picked), len(layout.blocks)
    rng = ctx.rng
    degree = np.asarray(layout.degrees)[rng.integers(0, len(layout.degrees), m)]
    coin = rng.random((5, m))  # sequence, embedding, logits, sharded data parallelism, reshard
    rate, one = rng.random(m), rng.random(m)
    u = rng.random((m, nb))
    codes = np.zeros((m, nb), np.int8)
    sequence = np.zeros(m, bool)
    embedding, logits = np.zeros(m, bool), np.zeros(m, bool)
    dp, reshard = [], []
    for k in range(m):
        d = int(degree[k])
        pairs = np.asarray(layout.pairs[d])
        sequence[k] = layout.sequence[d] and coin[0, k] < 0.5
        if sequence[k]:
            codes[k, pairs] = _SEQUENCE
        else:
            on = pairs[u[k, pairs] < rate[k]]
            if not len(on):
                on = pairs[min(int(one[k] * len(pairs)), len(pairs) - 1):][:1]
            codes[k, on] = _PAIRS
        embedding[k] = layout.embedding[d][int(sequence[k])] and coin[1, k] < 0.5
        logits[k] = layout.logits[d] and coin[2, k] < 0.5
        sharded = layout.shardable[d] and coin[3, k] < 0.5
        dp.append("shard" if sharded else "allreduce")
        reshard.append(bool(sharded and coin[4, k] < 0.5))
    replaced = {int(i): _base(ctx.model, ctx.cluster, ctx.memo, int(degree[k]), dp[k], reshard[k])
                for k, i in enumerate(picked)}
    out = splice(cols, replaced)
    # A TP group trains the samples its replicas would: each rank holds its group's batch (the
    # rows picked are even), so the split draw keeps the global batch it was drawn at.
    split = out.splits().copy()
    split[picked] = splits[picked] * degree[:, None]
    out = dataclasses.replace(out, batch_split=split)
    out.tp_degree[picked] = degree
    out.tp_blocks[picked] = codes
    out.tp_logits[picked] = logits
    out.tp_embedding[picked] = embedding
    if ctx.fits is None:
        return out
    grown = {}
    for k, i in enumerate(picked.tolist()):  # fits takes objects: the draws it refuses grow as objects
        made = out.strategy(i)
        if not ctx.fits(made):
            fitted = _grow_draw(ctx, layout, made, int(degree[k]), dp[k], bool(embedding[k]), bool(logits[k]))
            grown[i] = StrategyColumns.from_strategies(ctx.model, ctx.cluster, [fitted])
    return splice(out, grown)


def _grow_draw(ctx: DrawContext, layout: SplitLayout, drawn: Strategy, degree: int, dp: str, embedding: bool,
               logits: bool) -> Strategy:
    """The split draw ``drawn`` grown until ``ctx.fits`` holds it (the module docstring); the last
    growth where nothing fits."""
    fits = ctx.fits
    out = drawn
    for step in _steps(layout, degree, dp, embedding, logits):
        out = split_strategy(ctx.model, ctx.cluster, ctx.memo, drawn, **step)
        if fits(out):
            return out
    return grow_checkpointing(out, fits, list(layout.blocks))


def _steps(layout: SplitLayout, degree: int, dp: str, embedding: bool, logits: bool) -> list[dict[str, Any]]:
    """The growth of a split draw at ``degree`` (then the larger degrees): every block's pairs,
    then sequence parallelism, the vocabulary's matrices split where the model allows it; then the
    data-parallel axis sharded and resharded where it may be."""
    steps = []
    for d in [x for x in layout.degrees if x >= degree]:
        every = {layout.blocks[j]: "pairs" for j in layout.pairs[d]}
        options = {"logits": logits or layout.logits[d], "embedding": embedding or layout.embedding[d][0]}
        steps.append({"degree": d, "blocks": every, "dp": dp, **options})
        if layout.sequence[d]:
            steps.append({"degree": d, "blocks": {b: "sequence" for b in every}, "dp": dp, "logits": options["logits"],
                          "embedding": layout.embedding[d][1]})
    last = dict(steps[-1])
    if layout.shardable[last["degree"]]:
        steps.append({**last, "dp": "shard", "reshard": True})
    return steps


def grow_split(ctx: DrawContext, strategy: Strategy) -> Strategy | None:
    """``strategy`` with tensor parallelism as one growth step: Megatron's plan on every block with
    pairs, with sequence parallelism where the model allows it and then without (where sequence
    parallelism keeps the token embedding whole, the plan without it may split it and fit), the
    vocabulary's matrices split where the model allows them, at the smallest degree where
    ``ctx.fits`` holds it, over its replicas and checkpointing; over all-reduce first (the
    data-parallel axis as it is whole), then FSDP2 resharded. None where nothing of that fits,
    the strategy's replicas are not every device with one batch size, or the domain allows no
    split."""
    layout = split_layout(ctx.model, ctx.cluster, ctx.memo)
    if not layout.degrees or ctx.fits is None:
        return None
    split = strategy.batch_split
    if len(strategy.replicas) != ctx.cluster.num_devices or len(set(split)) != 1:
        return None
    for d in layout.degrees:
        every = {layout.blocks[j]: "pairs" for j in layout.pairs[d]}
        plans = ([({b: "sequence" for b in every}, layout.embedding[d][1])] if layout.sequence[d] else []) + [
            (every, layout.embedding[d][0])]
        for blocks, embedding in plans:
            for dp in (("allreduce", "shard") if layout.shardable[d] else ("allreduce",)):
                made = split_strategy(ctx.model, ctx.cluster, ctx.memo, strategy, d, blocks, dp=dp,
                                      logits=layout.logits[d], embedding=embedding)
                if ctx.fits(made):
                    return made
    return None
