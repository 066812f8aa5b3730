"""Strategies made from measured ones: the incumbent's moves on all its units at once (AutoDDL
§4.4's coordinate step, taken on every merge group or shard unit: each kind's own moves,
:attr:`synctune.search.kinds.SearchKind.global_moves`) and the genetic algorithm's children
(AutoDist §3.3's ablation: crossover of the best strategies, mutation from a guided sample)."""

from __future__ import annotations

import dataclasses
import random

from ..strategy.builders import without_tensor_parallel
from ..strategy.kinds import renumber_units
from ..strategy.errors import StrategyError
from ..strategy.schema import Strategy, VariablePlan
from ..strategy.tensor_parallel import check_tensor_parallel
from .kinds import SEARCH_KINDS, shard_moves
from .local_search import ChoiceSpace
from .sampler import GuidedSampler

__all__ = ["crossover", "global_moves", "renumber_groups", "shard_moves"]


def global_moves(strategy: Strategy, space: ChoiceSpace) -> list[Strategy]:
    """Moves of every unit of ``strategy`` at once, each registered kind's in the registry's
    order: the built-in all-reduce's (each compressor that takes no rank on the dense merge
    groups whose members all take it, hierarchical all-reduce where every node holds as many
    replicas, the groups re-cut into half or twice as many by bytes) and, for a strategy whose
    plans are all ``shard`` (FSDP2's whole-model sharding), the shard units' (:func:`shard_moves`);
    then, where the space offers it, the checkpointing coordinate's
    (:meth:`~synctune.search.local_search.ChoiceSpace.checkpointing`); of a split strategy, only
    the moves that keep its split valid; then, where the space offers it, the tensor-parallel
    coordinate's (:meth:`~synctune.search.local_search.ChoiceSpace.tensor_parallelism`)."""
    moves = [m for _name, kind in SEARCH_KINDS.items() for m in kind.global_moves(strategy, space)] + \
        space.checkpointing(strategy)
    return space.still_split(strategy, moves) + space.tensor_parallelism(strategy)


def crossover(parents: list[Strategy], n: int, rng: random.Random, guided: GuidedSampler) -> list[Strategy]:
    """``n`` children of ``parents`` (two or more): per variable, one of two parents' plans; a
    tenth of the variables re-drawn from a fresh guided sample (mutation). A child takes the
    first parent's tensor parallelism where its plans still run it
    (:func:`~synctune.strategy.tensor_parallel.check_tensor_parallel`), else none."""
    children = []
    for donor in guided.sample_many(n):
        a, b = rng.sample(parents, 2)
        sources = [{p.variable: p for p in s.plans} for s in (a, b, donor)]
        plans: list[tuple[int, VariablePlan]] = []
        for var in guided.model.variables:
            roll = rng.random()
            parent = 2 if roll < 0.1 else (0 if roll < 0.55 else 1)
            plans.append((parent, sources[parent][var.name]))
        child = renumber_groups(a, plans)
        if child.tensor_parallel is not None:
            try:
                check_tensor_parallel(child, guided.model, guided.cluster)
            except StrategyError:
                try:
                    child = without_tensor_parallel(child)
                except StrategyError:
                    continue  # its group batch cannot be spread over the replicas: no child
        children.append(child)
    return children


def renumber_groups(template: Strategy, plans: list[tuple[int, VariablePlan]]) -> Strategy:
    """A strategy from (parent index, plan) pairs: a parent's units (merge groups, ``shard``
    units) stay together, and units of different parents never share an id (they may differ in
    members and options); the ids then numbered as :func:`renumber_units` numbers them."""
    return renumber_units(dataclasses.replace(template, plans=tuple(plan for _parent, plan in plans)),
                          sources=[parent for parent, _plan in plans])
