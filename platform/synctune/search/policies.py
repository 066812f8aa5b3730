"""One round policy per search algorithm, in a registry keyed by the name an experiment gives
(``algorithm:``), as Optuna's samplers beside its study: AutoDist §2.4's Algorithm 1
(``autodist``) and its ablations (§3.3: ``random-guided``, ``random``, ``genetic``), AutoDDL
§4.4's coordinate descent and TAG §4.2.2's Monte-Carlo tree search, whose simulator-only search
picks the round's trials itself (and, with ``generator:``, feeds ``autodist`` its proposals).

A policy proposes one round: ``propose(ctx, round_, k)`` returns at most ``k``
:class:`~synctune.search.interface.Proposal`\\ s with ids ``r{round_}-{i}``, none of them
measured, pending or queued already (``ctx.seen``). It reads only the
:class:`~synctune.search.interface.RoundContext` the search hands it (what the search measured
before the round, its simulator, its predicates) and draws from the round's own random stream
(:func:`round_seed`); it keeps nothing between rounds, so a resumed search draws its last round
again and gets the same proposals. Adding an algorithm is a class here and
its ``ROUND_POLICIES.register`` line (and its name in the experiment files' ``ALGORITHMS``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Protocol

import numpy as np

from ..spec.registry import Registry
from ..strategy.builders import build_strategy
from ..strategy.schema import Strategy, StrategyError
from ..strategy.validate import validate
from .interface import Proposal, RoundContext
from .local_search import ChoiceSpace, LocalSearchResult, coordinate_descent, mcts
from .moves import crossover, global_moves
from .sampler import GuidedSampler, RandomSampler
from .selection import select_diverse

__all__ = ["ROUND_POLICIES", "RoundPolicy", "AutoDistPolicy", "RandomPolicy", "RandomGuidedPolicy",
           "GeneticPolicy", "CoordinateDescentPolicy", "MCTSPolicy", "round_seed", "guided_sampler", "split_share",
           "SPLIT_LEAD"]


class RoundPolicy(Protocol):
    """What a search algorithm is to the search shell: the proposals of one round."""

    def propose(self, search: RoundContext, round_: int, k: int) -> list[Proposal]:
        """The ``k`` proposals of round ``round_`` (fewer where the space has no more)."""
        ...


def round_seed(seed: int, round_: int) -> int:
    """The seed of round ``round_``'s random stream in a search seeded ``seed`` (one stream per
    round, so a round drawn again draws the same)."""
    return int.from_bytes(hashlib.sha256(f"synctune-round:{seed}:{round_}".encode()).digest()[:8], "big")


def _fresh(search: RoundContext, strategies: list[Strategy], seen: set[str]) -> list[Strategy]:
    """``strategies`` projected into the trials' space, each once, none in ``seen``, none over
    the memory budget."""
    out, hashes = [], set(seen)
    for s in strategies:
        s = search.project(s) if search.project is not None else s
        if s.hash not in hashes:
            hashes.add(s.hash)
            if search.fits(s):
                out.append(s)
    return out


#: The share of a round's draws that checkpoint blocks where replicated training does not fit.
CHECKPOINT_PROB = 0.5


def guided_sampler(search: RoundContext, seed: int) -> GuidedSampler:
    """The guided sampler of a round (AutoDist §2.4), drawing ``shard`` units at the search's rate,
    each sharded draw grown until the search's memory budget holds it. Where the budget, as the
    memory model judges it now (after what the trials taught it), does not hold replicated
    training, half the draws also checkpoint blocks (:data:`CHECKPOINT_PROB`), so a budget that
    the first trials showed to be tighter than predicted is searched as one known tight; a grown
    draw splits its blocks before checkpointing them in the share the trials' measured costs set
    (:func:`split_share`)."""
    checkpoint_prob = CHECKPOINT_PROB if _tight(search) else 0.0
    return GuidedSampler(search.model, search.cluster, seed=seed, lossy=search.settings.lossy,
                         shard_prob=search.shard_prob, fits=search.budget_fits, checkpoint_prob=checkpoint_prob,
                         tp_prob=search.tp_prob, split_share=split_share(search))


#: Once a search has measured both, the share of grown draws that take the step measured faster
#: first (splitting the blocks, or checkpointing them); the rest keep trying the other.
SPLIT_LEAD = 0.75


def split_share(search: RoundContext) -> float:
    """The share of a round's grown sharded draws that split their blocks (tensor parallelism with
    sequence parallelism) before checkpointing them, where both would fit the budget: half until
    the search has measured a split strategy and a checkpointed unsplit one, then
    :data:`SPLIT_LEAD` towards whichever of the two kinds' fastest trials was faster, so the growth
    order follows the measured cost and keeps trying the other."""
    strategies, times = search.measured()
    split = [t for s, t in zip(strategies, times) if s.tensor_parallel is not None]
    checkpointed = [t for s, t in zip(strategies, times) if s.tensor_parallel is None and s.checkpoint]
    if not split or not checkpointed:
        return 0.5
    return SPLIT_LEAD if min(split) < min(checkpointed) else 1.0 - SPLIT_LEAD


def choice_space(search: RoundContext) -> ChoiceSpace:
    """The local searches' choices in the search's domain (``shard`` among them where the search
    shards, checkpointing where the memory model says replicated training does not fit)."""
    return ChoiceSpace(search.model, search.cluster, lossy=search.settings.lossy, shard=search.shard_prob > 0,
                       checkpoint=_tight(search), split=search.tp_prob > 0)


def _tight(search: RoundContext) -> bool:
    """Whether the search's memory budget, as the memory model judges it now, refuses replicated
    training (the all-reduce builder's strategy)."""
    return search.budget_fits is not None and not search.budget_fits(
        build_strategy("allreduce", search.model, search.cluster))


class RandomPolicy:
    """``random`` (AutoDist §3.3's ablation): strategies of the unconstrained random sampler,
    trialled as drawn, no simulator."""

    def sampler(self, search: RoundContext, seed: int) -> RandomSampler | GuidedSampler:
        """The sampler a round draws from, seeded ``seed``."""
        return RandomSampler(search.model, search.cluster, seed=seed)

    def propose(self, search: RoundContext, round_: int, k: int) -> list[Proposal]:
        """Round ``round_``'s ``k`` proposals: the first fresh draws of :meth:`sampler` (none
        measured or pending, each within the memory budget), unscored (``predicted`` None)."""
        sampler = self.sampler(search, round_seed(search.seed, round_))
        # Oversample a little: a draw equal to a measured strategy is skipped, not re-measured;
        # under a memory budget, more batches while too few draws fit.
        picked: list[Strategy] = []
        seen = set(search.seen)
        for _ in range(1 if search.budget_fits is None else 20):
            picked += _fresh(search, sampler.sample_many(3 * k), seen | {s.hash for s in picked})
            if len(picked) >= k:
                break
        picked = picked[:k]
        return [Proposal(trial_id=f"r{round_}-{i}", strategy=s, origin=search.settings.algorithm, predicted=None)
                for i, s in enumerate(picked)]


class RandomGuidedPolicy(RandomPolicy):
    """``random-guided`` (AutoDist §3.3's "Random+G"): strategies of the guided sampler (the
    knowledge constraints, AutoDist §2.4), trialled as drawn, no simulator."""

    def sampler(self, search: RoundContext, seed: int) -> RandomSampler | GuidedSampler:
        return guided_sampler(search, seed)


class _LocalSearchPolicy:
    """A simulator-only search whose best distinct strategies are the round's trials."""

    def run(self, space: ChoiceSpace, score, starts: list[Strategy], *, rng: random.Random, evaluations: int,
            keep: int) -> LocalSearchResult:
        """The local search from ``starts`` with ``evaluations`` scores, its ``keep`` best."""
        raise NotImplementedError

    def local_search(self, search: RoundContext, rng: random.Random, keep: int) -> list[tuple[Strategy, float]]:
        """The best distinct strategies (with scores) of the search under the training-free model
        (AutoDDL §4.4: the analytic model; the learned one, where the search switched to it, only
        picks among them), not measured yet, at most ``keep``; started from the two fastest
        measured strategies."""
        model = search.simulator.training_free
        space = choice_space(search)

        def score(strategies: list[Strategy]) -> np.ndarray:
            if search.project is not None:
                strategies = [search.project(s) for s in strategies]
            values = np.asarray(model.score(strategies), dtype=float)
            if search.budget_fits is not None:
                # Over the budget is never kept (the local searches keep finite scores only).
                values[[not search.fits(s) for s in strategies]] = -np.inf
            return values

        seen = set(search.seen)
        strategies, times_s = search.measured()
        starts = [strategies[i] for i in np.argsort(times_s, kind="stable")[:2]] if strategies else []
        result = self.run(space, score, starts, rng=rng, evaluations=search.settings.sim_evaluations,
                          keep=keep + len(seen))
        return result.top(keep, exclude=seen)

    def propose(self, search: RoundContext, round_: int, k: int) -> list[Proposal]:
        rng = random.Random(round_seed(search.seed, round_))
        free = search.simulator.training_free  # the model that scored them
        picked: list[Proposal] = []
        hashes = set(search.seen)
        for strategy, score in self.local_search(search, rng, 4 * k):
            strategy = search.project(strategy) if search.project is not None else strategy
            if strategy.hash not in hashes and len(picked) < k:
                hashes.add(strategy.hash)
                picked.append(Proposal(trial_id=f"r{round_}-{len(picked)}", strategy=strategy,
                                       origin=search.settings.algorithm, predicted=search.predicted_s(score, free)))
        return picked


class CoordinateDescentPolicy(_LocalSearchPolicy):
    """``coordinate-descent`` (AutoDDL §4.4): descent with restarts from the best measured
    strategies, then from data parallelism, then from guided samples."""

    def run(self, space: ChoiceSpace, score, starts: list[Strategy], *, rng: random.Random, evaluations: int,
            keep: int) -> LocalSearchResult:
        return coordinate_descent(space, score, starts + [space.data_parallel()], rng=rng, evaluations=evaluations,
                                  keep=keep)


class MCTSPolicy(_LocalSearchPolicy):
    """``mcts`` (TAG §4.2.2): the tree search rooted at the best measured strategy (data
    parallelism before any is measured)."""

    def run(self, space: ChoiceSpace, score, starts: list[Strategy], *, rng: random.Random, evaluations: int,
            keep: int) -> LocalSearchResult:
        return mcts(space, score, rng=rng, evaluations=evaluations, keep=keep, root=starts[0] if starts else None)


def _scored_columns(search: RoundContext, guided: GuidedSampler, k: int, tag: str,
                    seen: set[str]) -> list[Proposal]:
    """The round's proposals drawn as columns (:meth:`GuidedSampler.sample_columns`, the one
    sampler) and, where the simulator scores columns, scored as columns: only those picked
    become strategies. Equal draws count once; a pick equal to a measured strategy is passed
    over for the next most diverse. Picks come from the elite first; if it holds fewer than
    ``k`` strategies not measured yet (the elite is what scores at least as well as the
    measured strategies the simulator ranks right, so it can be the measured ones and little
    else), the rest of the round fills the places. Where the trials' space is a projection
    (``search.project``, which maps objects), the draws are made objects and scored as
    :func:`_scored_objects` scores them."""
    cols = guided.sample_columns(search.settings.proposals)
    if search.project is not None:
        return _scored_objects(search, [cols.strategy(i) for i in range(cols.size)], k, tag, seen)
    _, first = np.unique(cols.digests(), return_index=True)
    distinct = np.sort(first)
    scores = np.asarray(search.simulator.score_columns(cols), dtype=float)[distinct]
    signatures = cols.signatures()[distinct]
    made: dict[int, Strategy] = {}
    picks: list[int] = []
    elite = search.elite(scores)
    rest = np.setdiff1d(np.arange(len(scores)), elite)
    for pool in (elite, rest):
        if len(picks) >= k or not len(pool):
            continue

        def fresh(c: int, pool=pool) -> bool:
            i = int(pool[c])
            made[i] = cols.strategy(int(distinct[i]))
            return (made[i].hash not in seen and all(made[i].hash != made[j].hash for j in picks)
                    and search.fits(made[i]))

        chosen = select_diverse(None, scores[pool], k - len(picks), None, signatures=signatures[pool], accept=fresh)
        picks += [int(pool[c]) for c in chosen]
    return [Proposal(trial_id=f"{tag}-{j}", strategy=made[i], origin=search.settings.algorithm,
                     predicted=search.predicted_s(scores[i])) for j, i in enumerate(picks)]


def _scored_objects(search: RoundContext, raw: list[Strategy], k: int, tag: str, seen: set[str]) -> list[Proposal]:
    """``raw``'s fresh strategies scored by the simulator, filtered by its fidelity level, ``k``
    of them picked for score and diversity (AutoDist §2.4)."""
    proposals = _fresh(search, raw, seen)
    if not proposals:
        return []
    scores = np.asarray(search.simulator.score(proposals), dtype=float)
    elite = [int(i) for i in search.elite(scores)]
    chosen = select_diverse([proposals[i] for i in elite], scores[elite], k, search.index)
    return [Proposal(trial_id=f"{tag}-{j}", strategy=proposals[elite[c]], origin=search.settings.algorithm,
                     predicted=search.predicted_s(scores[elite[c]])) for j, c in enumerate(chosen)]


def _split_step(search: RoundContext, guided: GuidedSampler, out: list[Proposal], tag: str,
                seen: set[str]) -> list[Proposal]:
    """``out`` with its last pick replaced, on replicas of different measured speeds, by the best
    measured strategy with its batch split moved towards speed-proportional (a quarter, half,
    three quarters, all the way), the variant the simulator scores best, unless every variant was
    tried already: one coordinate step per round (AutoDDL §4.4: one dimension, the others fixed).
    Sampled strategies change every dimension at once and rarely keep a good one while moving
    the split."""
    if guided.speeds is None or search.simulator is None:
        return out
    strategies, times_s = search.measured()
    if not strategies:
        return out
    best = strategies[int(np.argmin(times_s))]
    taken = {p.strategy.hash for p in out} | seen
    variants = [v for v in (guided.split_towards_speed(best, t) for t in (0.25, 0.5, 0.75, 1.0))
                if v.hash not in taken and search.fits(v)]
    variants = list({v.hash: v for v in variants}.values())
    if not variants:
        return out
    scores = np.asarray(search.simulator.score(variants), dtype=float)
    i = int(np.argmax(scores))
    return out[:-1] + [Proposal(trial_id=f"{tag}-{len(out) - 1}", strategy=variants[i],
                                origin=f"{search.settings.algorithm}+split", predicted=search.predicted_s(scores[i]))]


class AutoDistPolicy:
    """``autodist`` (AutoDist §2.4, Algorithm 1): ``proposals`` strategies from the guided
    sampler (or, with ``generator:``, the best of a simulator-only search), scored by the
    simulator, those below its fidelity level dropped, ``k`` picked for score and diversity;
    with ``incumbent_moves``, the best measured strategy one move away in place of the last pick;
    on replicas of different speeds, a step on the batch split in place of the last pick."""

    def propose(self, search: RoundContext, round_: int, k: int) -> list[Proposal]:
        """Round ``round_``'s ``k`` proposals (Algorithm 1's loop body): the generator's draws,
        scored and picked for score and diversity, then the incumbent move and the split step
        in place of the last pick where they apply; none when every draw was measured already."""
        seed, settings = round_seed(search.seed, round_), search.settings
        rng = random.Random(seed)
        guided = guided_sampler(search, seed)
        tag, seen = f"r{round_}", set(search.seen)
        if settings.generator == "sampler":
            out = _scored_columns(search, guided, k, tag, seen)
        else:
            generator = ROUND_POLICIES.get(settings.generator)
            out = _scored_objects(search, [s for s, _ in generator.local_search(search, rng, settings.proposals)],
                                  k, tag, seen)
        if not out:
            return []
        if settings.incumbent_moves and len(out) >= 2:
            move = self.incumbent_step(search, {p.strategy.hash for p in out} | seen)
            if move is not None:
                # Exploitation beside the sampler's exploration: the best measured strategy
                # (a tuned baseline, often) one move away, in place of the round's last pick.
                out[-1] = Proposal(trial_id=f"{tag}-{len(out) - 1}", strategy=move[0],
                                   origin=f"{settings.algorithm}+incumbent", predicted=search.predicted_s(move[1]))
        return _split_step(search, guided, out, tag, seen)

    @staticmethod
    def incumbent_step(search: RoundContext, taken: set[str]) -> tuple[Strategy, float] | None:
        """The best measured strategy one move away, the move the simulator scores best among
        those not measured or proposed yet (``taken``): a compressor on every all-reduce merge
        group that takes it, hierarchical all-reduce, its merge groups halved or doubled (re-cut
        by bytes along backward order), or one choice changed on one of 8 runs of adjacent
        variables (AutoDDL §4.4's coordinate step, on the incumbent). The sampler's draws change
        every variable at once and rarely keep what made a tuned baseline fast."""
        if search.simulator is None:
            return None
        strategies, times_s = search.measured()
        if not strategies:
            return None
        best = strategies[int(np.argmin(times_s))]
        space = choice_space(search)
        moves = global_moves(best, space)
        for coordinate in space.coordinates(8):
            moves += space.neighbours(best, coordinate)
        if search.project is not None:
            moves = [search.project(m) for m in moves]
        unique: dict[str, Strategy] = {}
        for m in moves:
            if m.hash not in taken and m.hash != best.hash and m.hash not in unique and search.fits(m):
                try:
                    validate(m, search.model, search.cluster)
                except StrategyError:
                    continue
                unique[m.hash] = m
        if not unique:
            return None
        candidates = list(unique.values())
        scores = np.asarray(search.simulator.score(candidates), dtype=float)
        i = int(np.argmax(scores))
        return candidates[i], float(scores[i])


class GeneticPolicy:
    """``genetic`` (AutoDist §3.3's ablation): children of the best half of the measured
    strategies (crossover, mutation from a guided sample; guided samples while fewer than two
    were measured), scored, filtered and picked as ``autodist``'s proposals are."""

    def propose(self, search: RoundContext, round_: int, k: int) -> list[Proposal]:
        """Round ``round_``'s ``k`` proposals: ``proposals`` children of the measured strategies the
        simulator last learned from, scored and picked as ``autodist``'s, then the split step."""
        seed = round_seed(search.seed, round_)
        rng = random.Random(seed)
        guided = guided_sampler(search, seed)
        tag, seen = f"r{round_}", set(search.seen)
        strategies, times_s = search.measured(search.fitted_on)
        if len(strategies) < 2:
            children = guided.sample_many(search.settings.proposals)
        else:
            parents = [strategies[i] for i in np.argsort(times_s, kind="stable")[: max(2, len(strategies) // 2)]]
            children = crossover(parents, search.settings.proposals, rng, guided)
        out = _scored_objects(search, children, k, tag, seen)
        return _split_step(search, guided, out, tag, seen) if out else []


#: Search algorithm name (an experiment's ``algorithm:``) -> its round policy.
ROUND_POLICIES: Registry[RoundPolicy] = Registry("search algorithm")
ROUND_POLICIES.register("autodist", AutoDistPolicy())
ROUND_POLICIES.register("random-guided", RandomGuidedPolicy())
ROUND_POLICIES.register("random", RandomPolicy())
ROUND_POLICIES.register("genetic", GeneticPolicy())
ROUND_POLICIES.register("coordinate-descent", CoordinateDescentPolicy())
ROUND_POLICIES.register("mcts", MCTSPolicy())
