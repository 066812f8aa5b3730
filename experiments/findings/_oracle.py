"""The oracle of the findings (the best strategy known for a domain), drawn by a procedure of its
own, not the searches' samplers: a sweep of the domain's coarse strategy space, every tuned
baseline, and the strategies the searches found; the fastest re-measured interleaved.

The coarse space is a grid over what decides synchronization cost in AutoDist's and TAG's
terms (AutoDist §2.2, TAG §4.2):

- the synchronizer of each *variable class*: sparse gradients (all-gather; PS on the first
  node; PS load-balanced over the nodes), the large dense variables (those holding 80% of the
  dense bytes: flat or hierarchical all-reduce; PS load-balanced, with or without local
  aggregation; PS on the first node; SFB where its factors are fewer bytes) and the small
  dense ones (all-reduce; PS load-balanced; PS on the first node);
- the merge chunk of the all-reduced variables (1, 2, 4, 8, 16, 32 adjacent variables, or one
  group);
- the compressor of the all-reduced dense messages (none, fp16);
- the batch split (even; proportional to the nodes' measured speeds, where they differ) and the
  replicas (every device; every node but the slowest, where speeds differ).

Grid points the engine refuses (e.g. hierarchical all-reduce on nodes of different sizes) are
dropped; a grid larger than the sweep is sampled uniformly without replacement (seeded), so every
coarse choice is equally represented; a smaller one is swept whole and topped up with strategies
whose every variable draws its own choice from its class's (uniformly, seeded): the small zoo
models' grids hold 50-160 distinct strategies.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

__all__ = ["coarse_grid", "coarse_sweep", "per_variable_draws", "variable_classes"]

CHUNKS = (1, 2, 4, 8, 16, 32, 0)  # 0: every all-reduced variable in one group
SPARSE = ("allgather", "ps-first", "ps-lb")
LARGE = ("allreduce", "allreduce-hier", "ps-lb", "ps-lb-agg", "ps-first", "sfb")
SMALL = ("allreduce", "ps-lb", "ps-first")
COMPRESSORS = ("none", "fp16")


def variable_classes(spec) -> dict[str, str]:
    """Each variable's class: ``sparse``, ``large`` (the dense variables, largest first, that
    hold 80% of the dense bytes) or ``small``."""
    dense = sorted((v for v in spec.variables if not v.sparse), key=lambda v: -v.num_bytes)
    total = sum(v.num_bytes for v in dense)
    out, held = {v.name: "sparse" for v in spec.variables if v.sparse}, 0
    for v in dense:
        out[v.name] = "large" if held < 0.8 * total else "small"
        held += v.num_bytes
    return out


def _point(spec, cluster, choice_of: dict[str, str], chunk: int, compressor: str):
    from synctune.strategy.builders import build_strategy
    from synctune.strategy.schema import (AllGatherSynchronizer, AllReduceSynchronizer, Compressor,
                                          PSSynchronizer, SFBSynchronizer, ShardPlan, VariablePlan)

    servers = [node.devices[0] for node in cluster.nodes]
    loads = {s: 0.0 for s in servers}
    base = build_strategy("allreduce", spec, cluster)
    sfb_rows = dict(zip((v.name for v in spec.variables), spec.factor_rows or (None,) * len(spec.variables)))
    plans, reduced = [], 0
    for var, plan in zip(spec.variables, base.plans):
        choice = choice_of[var.name]
        comp = Compressor()
        if choice == "sfb" and not sfb_rows.get(var.name):
            choice = "allreduce"
        if choice == "allgather":
            sync = AllGatherSynchronizer()
        elif choice == "sfb":
            sync = SFBSynchronizer()
        elif choice in ("allreduce", "allreduce-hier"):
            group = reduced // chunk if chunk else 0
            reduced += 1
            sync = AllReduceSynchronizer(group=group, algorithm="hierarchical" if choice == "allreduce-hier" else "flat")
            comp = Compressor(kind=compressor) if not var.sparse else comp
        else:
            if choice == "ps-first":
                server = servers[0]
            else:
                server = min(loads, key=loads.__getitem__)
                loads[server] += var.num_bytes
            sync = PSSynchronizer(placement=server, local_aggregation=choice == "ps-lb-agg" and not var.sparse)
        plans.append(VariablePlan(variable=var.name, partition=(1,) * len(plan.partition),
                                  shards=(ShardPlan(synchronizer=sync, compressor=comp),)))
    return dataclasses.replace(base, plans=tuple(plans))


def _finish(strategy, helper, nodes, split, spec, cluster):
    from synctune.strategy import validate

    if nodes is not None:
        strategy = helper.on_nodes(strategy, nodes)
    elif split:
        strategy = helper.split_towards_speed(strategy, split)
    validate(strategy, spec, cluster)
    return strategy


def _placements(cluster, helper) -> list[tuple[str, list[int] | None]]:
    placements = [("all", None)]
    if helper.speeds is not None and len(cluster.nodes) > 1:
        slowest = min(range(len(cluster.nodes)), key=lambda j: cluster.nodes[j].compute_gflops or 0.0)
        placements.append(("no-slowest", [j for j in range(len(cluster.nodes)) if j != slowest]))
    return placements


def coarse_grid(spec, cluster, lossy: bool = True):
    """Every valid point of the coarse grid (module docstring), as (strategy, label), distinct."""
    from synctune.search.sampler import GuidedSampler
    from synctune.strategy import StrategyError

    classes = variable_classes(spec)
    present = set(classes.values())
    helper = GuidedSampler(spec, cluster)
    splits = (0.0, 1.0) if helper.speeds is not None else (0.0,)
    out, seen = [], set()
    axes = itertools.product(SPARSE if "sparse" in present else ("-",), LARGE if "large" in present else ("-",),
                             SMALL if "small" in present else ("-",), CHUNKS, COMPRESSORS if lossy else ("none",),
                             _placements(cluster, helper), splits)
    for sparse, large, small, chunk, compressor, (where, nodes), split in axes:
        by_class = {"sparse": sparse, "large": large, "small": small}
        try:
            strategy = _finish(_point(spec, cluster, {v: by_class[c] for v, c in classes.items()}, chunk, compressor),
                               helper, nodes, split, spec, cluster)
        except StrategyError:
            continue
        if strategy.hash in seen:
            continue
        seen.add(strategy.hash)
        label = (f"grid sparse={sparse} large={large} small={small} chunk={chunk or 'all'} comp={compressor} "
                 f"replicas={where}" + (f" split={split:g}" if split else ""))
        out.append((strategy, label))
    return out


def per_variable_draws(spec, cluster, count: int, seed: int, exclude: set[str], lossy: bool = True):
    """``count`` distinct strategies whose every variable draws its synchronizer uniformly from
    its class's choices (and chunk, compressor, replicas and split uniformly from theirs): the
    coarse space beyond one choice per class, for domains whose grid is smaller than the sweep."""
    from synctune.search.sampler import GuidedSampler
    from synctune.strategy import StrategyError

    classes = variable_classes(spec)
    choices = {"sparse": SPARSE, "large": LARGE, "small": SMALL}
    helper = GuidedSampler(spec, cluster)
    splits = (0.0, 0.5, 1.0) if helper.speeds is not None else (0.0,)
    placements = _placements(cluster, helper)
    rng = random.Random(seed)
    out, seen, tries = [], set(exclude), 0
    while len(out) < count and tries < 50 * count:
        tries += 1
        choice_of = {v: rng.choice(choices[c]) for v, c in classes.items()}
        chunk, compressor = rng.choice(CHUNKS), rng.choice(COMPRESSORS if lossy else ("none",))
        (_where, nodes), split = rng.choice(placements), rng.choice(splits)
        try:
            strategy = _finish(_point(spec, cluster, choice_of, chunk, compressor), helper, nodes, split, spec, cluster)
        except StrategyError:
            continue
        if strategy.hash in seen:
            continue
        seen.add(strategy.hash)
        out.append((strategy, f"per-variable draw {len(out)}"))
    return out


def coarse_sweep(spec, cluster, count: int, seed: int = 0, lossy: bool = True):
    """``count`` strategies of the coarse space: the whole grid when it is smaller (topped up
    with :func:`per_variable_draws`), else ``count`` grid points sampled uniformly without
    replacement with ``seed``."""
    grid = coarse_grid(spec, cluster, lossy)
    if len(grid) >= count:
        return random.Random(seed).sample(grid, count)
    return grid + per_variable_draws(spec, cluster, count - len(grid), seed, {s.hash for s, _l in grid}, lossy)
