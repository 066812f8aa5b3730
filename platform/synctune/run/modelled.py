"""The modelled pick: the strategy a tool that chooses from a cost model alone would deploy for a
domain, untested (AutoDDL §4.4's search over its alpha-beta model; Galvatron's, Miao et al. 2022,
over its cost model), so that a search's evidence can report the confirmed ratio of its
measured recommendation to it.

The pick is made in the measured search's own space, with the search's own models, so that what
the comparison isolates is the trials. The candidates (:func:`candidate_pool`) are the builder
baselines the search trials first, Megatron's plan over the tuned Megatron baseline's settings
where the model has Megatron's pairs of linear layers, and draws of the search's own guided
sampler (sharding, tensor parallelism and checkpointing where the search's space holds them).
Each is judged by the memory model the search prepared, before any trial taught it, and ranked by
the training-free simulator (no learned weights; a calibrated replay before any calibration): the
fastest the simulator predicts among those the memory model says fit is the pick
(:func:`modelled_pick`). :func:`modelled_arm` makes it an arm of an interleaved confirmation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..search.algorithm import StrategySearch
from ..search.policies import guided_sampler
from ..simulator.bound import DomainScorer
from ..simulator.memory import MIB, MemoryBudget
from ..spec.checks import is_int
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from ..strategy.tensor_parallel import tp_key
from .confirm import Arm
from .prepare import SearchContext, SearchFilter, search_algorithm

__all__ = ["MODELLED_LABEL", "Candidate", "ModelledPick", "candidate_pool", "megatron_candidates", "modelled_pick",
           "context_pick", "modelled_arm", "untaught_memory"]

#: The label of the modelled pick's arm in a confirmation or a findings table.
MODELLED_LABEL = "modelled pick (training-free)"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A strategy a model-only tool may choose, and where it came from: ``builder <name>`` (a
    builder baseline of the experiment), ``megatron (<settings>)`` (Megatron's plan under the
    tuned Megatron baseline's settings) or ``sampler`` (a draw of the search's guided sampler)."""

    strategy: Strategy
    origin: str


@dataclass(frozen=True, kw_only=True)
class ModelledPick:
    """What a model-only tool deploys (:func:`modelled_pick`): the ``strategy`` and its ``origin``
    (as :class:`Candidate`), its iteration time as the training-free ``simulator`` (its kind)
    predicts it (``predicted_s``), each rank's predicted peak and limit in bytes, in replica
    order (``peak_bytes``, ``limit_bytes``; a limit of None: none known), the distinct candidates
    the pool held (``pool``), how many the simulator ranked faster that the budget refused
    (``passed_over``), and the candidates the simulator could not price, each as ``origin:
    reason`` (``unpriced``: a strategy that splits modules, under a simulator that does not
    price tensor parallelism)."""

    strategy: Strategy
    origin: str
    predicted_s: float
    peak_bytes: tuple[int, ...]
    limit_bytes: tuple[int | None, ...]
    simulator: str
    pool: int
    passed_over: int
    unpriced: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: origin, predicted time, largest rank's predicted peak, and the pool."""
        unpriced = f", {len(self.unpriced)} unpriced" if self.unpriced else ""
        return (f"{MODELLED_LABEL}: {self.origin}, predicted {self.predicted_s * 1e3:.2f} ms per iteration by the "
                f"{self.simulator} simulator, peak {max(self.peak_bytes) / MIB:.1f} MiB per rank; {self.pool} "
                f"candidates, {self.passed_over} predicted faster over the budget{unpriced}")


def megatron_candidates(model: ModelSpec, cluster: ClusterSpec) -> list[Candidate]:
    """Megatron's plan at every setting of the tuned Megatron baseline's grid (each TP degree the
    domain allows, sequence parallelism or not, resharded or not, every block checkpointed in
    each mode or none: :func:`~synctune.engine.megatron.megatron_plan` on the replicated
    all-reduce skeleton), each setting the builder writes; none where the domain has no
    Megatron-style run (:func:`~synctune.engine.megatron.megatron_refusal`: no pairs of linear
    layers, nodes too small for a TP group, a sparse gradient)."""
    from ..engine.megatron import megatron_plan, megatron_refusal, megatron_settings
    from ..strategy.builders import build_strategy

    if megatron_refusal(model, cluster) is not None:
        return []
    skeleton = build_strategy("allreduce", model, cluster)
    out = []
    for config in megatron_settings(model, cluster):
        try:
            strategy = megatron_plan(config, skeleton, model)
        except SpecError:
            continue  # a setting the builder cannot write for this model
        out.append(Candidate(strategy=strategy, origin=f"megatron ({config.summary()})"))
    return out


def candidate_pool(search: StrategySearch, *, draws: int, seed: int, megatron: bool = True) -> list[Candidate]:
    """What a model-only tool chooses from in ``search``'s space, each strategy once (its first
    origin kept), in this order: every builder baseline of the experiment
    (:meth:`~synctune.search.algorithm.StrategySearch.builder_proposals`, those over the budget
    included: the choice judges the budget), Megatron's plans (:func:`megatron_candidates`, with
    ``megatron`` and where the search's proposals are not projected into another framework's
    space), then ``draws`` draws of the guided sampler the search's rounds draw from
    (:func:`~synctune.search.policies.guided_sampler` on the search as it stands, seeded
    ``seed``: shard units, tensor parallelism and checkpointing at the search's own rates),
    projected as the search projects its proposals. The same proposer as the search's, so that a
    comparison of the two differs by the trials alone."""
    if not (is_int(draws) and draws >= 0):
        raise ValueError(f"candidate_pool: draws: expected a count of 0 or more, got {draws!r}")
    if not is_int(seed):
        raise ValueError(f"candidate_pool: seed: expected an integer, got {seed!r}")
    found = [Candidate(strategy=p.strategy, origin=f"builder {p.origin}") for p in search.builder_proposals()]
    if megatron and search.project is None:
        found += megatron_candidates(search.model, search.cluster)
    if draws:
        cols = guided_sampler(search.round_context(), int(seed)).sample_columns(int(draws))
        _, first = np.unique(cols.digests(), return_index=True)  # equal draws made into objects once
        for i in np.sort(first):
            strategy = cols.strategy(int(i))
            found.append(Candidate(strategy=search.project(strategy) if search.project is not None else strategy,
                                   origin="sampler"))
    pool, seen = [], set()
    for candidate in found:
        if candidate.strategy.hash not in seen:
            seen.add(candidate.strategy.hash)
            pool.append(candidate)
    return pool


def modelled_pick(pool: Sequence[Candidate], *, model: ModelSpec, cluster: ClusterSpec, memory: MemoryBudget,
                  simulator: DomainScorer, fits: Callable[[Strategy], bool] | None = None) -> ModelledPick:
    """The candidate of ``pool`` the training-free simulator predicts fastest among those the
    memory model says fit the budget: what a tool that chooses from a cost model alone deploys,
    untested.

    ``simulator``: the search's simulator bound to (``model``, ``cluster``); its
    ``training_free`` model ranks (a learned one is not a cost model a model-only tool has), and
    must predict seconds. ``memory``: the memory budget of the same domain; ``fits``: the
    search's judgement of a strategy (default ``memory.fits``; a search's proposal filter also
    refuses what no runtime runs). Equal strategies count once; equal predicted times go to the
    earlier candidate (the builders come first in :func:`candidate_pool`). A strategy that splits
    modules under a simulator that does not price tensor parallelism is left out and named in
    :attr:`ModelledPick.unpriced`.

    Refuses, naming the setting and the fix, an empty pool and a budget of another domain
    (:class:`ValueError`), and (:class:`~synctune.spec.errors.SpecError`, a ValueError the
    command line prints in one line) a simulator that ranks rather than predicts, a pool the
    simulator prices none of, and a pool nothing of which fits the budget."""
    if memory.model.hash != model.hash or memory.cluster.hash != cluster.hash:
        raise ValueError(f"modelled_pick: memory: a budget of {memory.model.name} on {memory.cluster.name}, expected "
                         f"one of {model.name} on {cluster.name}; pass the search's own memory budget")
    free = simulator.training_free
    if not free.predicts_seconds:
        raise SpecError(f"search.simulator: the training-free {free.kind} model ranks strategies without predicting "
                        f"seconds, which the modelled pick reports; use simulator: analytic or replay")
    distinct: list[Candidate] = []
    seen: set[str] = set()
    for candidate in pool:
        if candidate.strategy.hash not in seen:
            seen.add(candidate.strategy.hash)
            distinct.append(candidate)
    if not distinct:
        raise ValueError("modelled_pick: pool: expected at least one candidate strategy, got none; build it with "
                         "candidate_pool (builders, Megatron's plans, the search's sampler)")
    predicted = np.full(len(distinct), np.nan)
    plain = [i for i, c in enumerate(distinct) if c.strategy.tensor_parallel is None]
    if plain:
        predicted[plain] = -np.asarray(free.score([distinct[i].strategy for i in plain]), dtype=np.float64)
    unpriced = []
    for i, candidate in enumerate(distinct):
        if candidate.strategy.tensor_parallel is None:
            continue
        try:  # one at a time: a refusal names the one strategy it refuses
            predicted[i] = -float(np.asarray(free.score([candidate.strategy]), dtype=np.float64)[0])
        except SpecError as exc:
            unpriced.append(f"{candidate.origin}: {exc}")
    priced = [i for i in range(len(distinct)) if math.isfinite(predicted[i])]
    if not priced:
        raise SpecError(f"search.simulator: the training-free {free.kind} model prices none of the modelled pick's "
                        f"{len(distinct)} candidates ({unpriced[0] if unpriced else 'no finite prediction'}); use "
                        f"simulator: replay")
    judge = fits if fits is not None else memory.fits
    order = sorted(priced, key=lambda i: (predicted[i], i))
    for rank, i in enumerate(order):
        strategy = distinct[i].strategy
        if judge(strategy):
            return ModelledPick(strategy=strategy, origin=distinct[i].origin, predicted_s=float(predicted[i]),
                                peak_bytes=tuple(memory.peaks(strategy)), limit_bytes=tuple(memory.limits(strategy)),
                                simulator=free.kind, pool=len(distinct), passed_over=rank,
                                unpriced=tuple(unpriced))
    peak, name = min((max(memory.peaks(distinct[i].strategy)), distinct[i].origin) for i in priced)
    limits = [x for x in memory.limits(distinct[priced[0]].strategy) if x is not None]
    limit = f" ({min(limits) / MIB:.1f} MiB per rank)" if limits else ""
    judged = "" if fits is None else " (or the search's filter refuses what would fit: no runtime runs it)"
    raise SpecError(f"search.memory_gib: nothing in the modelled pick's pool of {len(priced)} priced candidates "
                     f"fits {memory.describe()}{limit}: the smallest predicted peak is {peak / MIB:.1f} MiB per rank "
                     f"({name}){judged}; raise search.memory_gib, lower search.memory_headroom, or widen the pool "
                     f"(more draws; search.shard and search.tensor_parallel put sharding and tensor parallelism in "
                     f"it)")


def untaught_memory(memory: MemoryBudget) -> MemoryBudget:
    """``memory`` as the search prepared it, before any trial taught it: the same budget and
    the figures measured before the first trial (the probe's, checkpointed and split ones), none
    of the trials' activation figures or corrections. What a model-only tool, which runs no
    trial, judges the budget with."""
    return dataclasses.replace(memory, checkpointed=dict(memory.checkpointed), shares=dict(memory.shares),
                               split=dict(memory.split))


def context_pick(context: SearchContext, *, draws: int | None = None, seed: int | None = None) -> ModelledPick:
    """The modelled pick of a prepared search (:func:`~synctune.run.prepare.prepare_search`),
    without a trial: the pool of :func:`candidate_pool` (``draws``: the experiment's
    ``search.proposals`` by default, a round's worth; ``seed``: the experiment's), judged by the
    search's proposal filter (:class:`~synctune.run.prepare.SearchFilter`: the memory budget in
    the layout of the runtime that would run it, and what that runtime runs; never a
    tensor-parallel plan the preparation saw the runtime refuse) on the memory model before any
    trial taught it (:func:`untaught_memory`), ranked by the search's training-free simulator
    (:func:`modelled_pick`). Refuses a search whose algorithm scores nothing (``random``,
    ``random-guided``): it has no simulator to choose with."""
    exp = context.exp
    if not exp.search.uses_simulator:
        raise SpecError(f"{exp.source or exp.name}: search.algorithm: {exp.search.algorithm} scores no proposal, so "
                        f"the search has no training-free simulator to make the modelled pick with; use an algorithm "
                        f"that scores (autodist, genetic, coordinate-descent, mcts)")
    ctx = dataclasses.replace(context, memory=untaught_memory(context.memory))
    algorithm = search_algorithm(ctx, {"trials": []})
    check = SearchFilter(ctx)

    def fits(strategy: Strategy) -> bool:
        if strategy.tensor_parallel is not None and tp_key(strategy.tensor_parallel) in ctx.refused_plans:
            return False
        return check.fits(strategy)

    pool = candidate_pool(algorithm, draws=exp.search.proposals if draws is None else draws,
                          seed=exp.seed if seed is None else seed)
    return modelled_pick(pool, model=ctx.model, cluster=ctx.cluster, memory=ctx.memory, simulator=algorithm.simulator,
                         fits=fits)


def modelled_arm(context: SearchContext, pick: ModelledPick | None = None, *, draws: int | None = None,
                 seed: int | None = None) -> Arm:
    """The modelled pick of a prepared search as an arm of an interleaved confirmation (labelled
    :data:`MODELLED_LABEL`, run by the runtime that runs the search's strategies:
    :meth:`~synctune.run.prepare.SearchContext.executor`); ``pick``: one :func:`context_pick`
    made already, else it is made here (``draws``, ``seed`` as there)."""
    pick = pick if pick is not None else context_pick(context, draws=draws, seed=seed)
    return Arm(strategy=pick.strategy, runtime=context.executor(pick.strategy), label=MODELLED_LABEL)
