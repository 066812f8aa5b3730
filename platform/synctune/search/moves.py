"""Strategies made from measured ones: the incumbent's moves on all its merge groups at once
(AutoDDL §4.4's coordinate step, taken on every group) and the genetic algorithm's children
(AutoDist §3.3's ablation: crossover of the best strategies, mutation from a guided sample)."""

from __future__ import annotations

import dataclasses
import random

from ..strategy.kinds import renumber_units
from ..strategy.schema import AllReduceSynchronizer, Compressor, ShardSynchronizer, Strategy, VariablePlan
from .local_search import NO_COMPRESSION, SPARSE_GROUPS, ChoiceSpace, canonical_groups, compressor_choices
from .sampler import GuidedSampler, hsdp_size

__all__ = ["crossover", "global_moves", "renumber_groups", "shard_moves"]


def global_moves(strategy: Strategy, space: ChoiceSpace) -> list[Strategy]:
    """Moves of every dense all-reduce merge group of ``strategy`` at once: each compressor that
    takes no rank (of the registry's, those ``space`` allows) on the groups whose members all
    take it, hierarchical all-reduce (where every node holds as many replicas), and the groups
    re-cut into half or twice as many by bytes (when they share one compressor and algorithm).
    A strategy whose plans are all ``shard`` (FSDP2's whole-model sharding) moves every unit at
    once instead (:func:`shard_moves`)."""
    if strategy.plans and all(isinstance(sh.synchronizer, ShardSynchronizer) for p in strategy.plans
                              for sh in p.shards):
        return shard_moves(strategy, space)
    variables = {v.name: v for v in space.variables}
    dense = [(i, j, sh) for i, plan in enumerate(strategy.plans) for j, sh in enumerate(plan.shards)
             if isinstance(sh.synchronizer, AllReduceSynchronizer) and sh.synchronizer.group < SPARSE_GROUPS
             and not variables[plan.variable].sparse]
    if not dense:
        return []

    def rebuilt(change) -> Strategy:
        plans = [list(p.shards) for p in strategy.plans]
        for i, j, sh in dense:
            new = change(i, j, sh)
            if new is not None:
                plans[i][j] = new
        return canonical_groups(dataclasses.replace(strategy, plans=tuple(
            dataclasses.replace(p, shards=tuple(sh)) for p, sh in zip(strategy.plans, plans))))

    out = []
    groups: dict[int, list[str]] = {}
    for i, _j, sh in dense:
        groups.setdefault(sh.synchronizer.group, []).append(strategy.plans[i].variable)
    for kind in [c for c, rank in compressor_choices("allreduce", space.lossy) if c != NO_COMPRESSION and not rank]:
        fits = {g for g, names in groups.items() if all(space.fits(variables[n], kind, 0, "allreduce") for n in names)}
        if fits:
            out.append(rebuilt(lambda i, j, sh, kind=kind, fits=fits: dataclasses.replace(
                sh, compressor=Compressor(kind=kind),
                synchronizer=dataclasses.replace(sh.synchronizer, algorithm="flat")) if sh.synchronizer.group in fits
                else None))
    if "hierarchical" in space.algorithms:
        out.append(rebuilt(lambda i, j, sh: dataclasses.replace(
            sh, compressor=Compressor(), synchronizer=dataclasses.replace(sh.synchronizer, algorithm="hierarchical"))))
    if len({(sh.compressor, sh.synchronizer.algorithm) for _i, _j, sh in dense}) == 1:
        out += _recut(strategy, dense, [variables[strategy.plans[i].variable].num_bytes
                                        / max(1, len(strategy.plans[i].shards)) for i, _j, _sh in dense],
                      len(groups), rebuilt)
    return out


def shard_moves(strategy: Strategy, space: ChoiceSpace) -> list[Strategy]:
    """Moves of every ``shard`` unit of ``strategy`` at once (FSDP2's knobs, each set for the
    whole model as users set them): every unit resharded after forward (ZeRO-3, prefetch 1:
    FSDP2's default), every unit reducing in bf16 (when ``space`` is lossy), and the shard group
    toggled between every replica and HSDP over the nodes (where :func:`hsdp_size` finds it).
    A move that changes nothing is left out."""
    def every(change) -> Strategy:
        return canonical_groups(dataclasses.replace(strategy, plans=tuple(
            dataclasses.replace(p, shards=tuple(dataclasses.replace(sh, synchronizer=change(sh.synchronizer))
                                                for sh in p.shards)) for p in strategy.plans)))

    syncs = [sh.synchronizer for p in strategy.plans for sh in p.shards]
    out = []
    if not all(s.reshard for s in syncs):
        out.append(every(lambda s: dataclasses.replace(s, reshard=True, prefetch=1)))
    if space.lossy and not all(s.reduce_dtype == "bf16" for s in syncs):
        out.append(every(lambda s: dataclasses.replace(s, reduce_dtype="bf16")))
    hsdp = hsdp_size(strategy, space.cluster)
    if hsdp:
        target = hsdp if any(s.group == 0 for s in syncs) else 0
        out.append(every(lambda s: dataclasses.replace(s, group=target)))
    return out


def _recut(strategy: Strategy, dense: list, sizes: list[float], num_groups: int, rebuilt) -> list[Strategy]:
    """``strategy``'s dense shards cut into half and into twice ``num_groups`` merge groups of
    similar bytes, along backward order."""
    out = []
    total = float(sum(sizes)) or 1.0
    for count in {max(1, num_groups // 2), 2 * num_groups}:
        if count == num_groups:
            continue
        cut, filled = {}, 0.0
        for (i, j, _sh), size in zip(dense, sizes):
            cut[(i, j)] = min(count - 1, int(filled / total * count))
            filled += size
        out.append(rebuilt(lambda i, j, sh, cut=cut: dataclasses.replace(
            sh, synchronizer=dataclasses.replace(sh.synchronizer, group=cut[(i, j)]))))
    return out


def crossover(parents: list[Strategy], n: int, rng: random.Random, guided: GuidedSampler) -> list[Strategy]:
    """``n`` children of ``parents`` (two or more): per variable, one of two parents' plans; a
    tenth of the variables re-drawn from a fresh guided sample (mutation)."""
    children = []
    for _ in range(n):
        a, b = rng.sample(parents, 2)
        donor = guided.sample()
        sources = [{p.variable: p for p in s.plans} for s in (a, b, donor)]
        plans: list[tuple[int, VariablePlan]] = []
        for var in guided.model.variables:
            roll = rng.random()
            parent = 2 if roll < 0.1 else (0 if roll < 0.55 else 1)
            plans.append((parent, sources[parent][var.name]))
        children.append(renumber_groups(a, plans))
    return children


def renumber_groups(template: Strategy, plans: list[tuple[int, VariablePlan]]) -> Strategy:
    """A strategy from (parent index, plan) pairs: a parent's units (merge groups, ``shard``
    units) stay together, and units of different parents never share an id (they may differ in
    members and options); the ids then numbered as :func:`renumber_units` numbers them."""
    return renumber_units(dataclasses.replace(template, plans=tuple(plan for _parent, plan in plans)),
                          sources=[parent for parent, _plan in plans])
