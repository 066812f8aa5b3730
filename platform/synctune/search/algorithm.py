"""AutoDist Algorithm 1 as an ask/tell searcher (AutoDist §2.4, AutoSync §3.2).

Baselines (the hand-optimised builders) are trialled first. Then, round by round: sample N
proposals with the guided sampler, score them with the simulator, drop those below the
simulator's fidelity level, select K candidates trading score against diversity, trial them,
and update the simulator on everything measured so far. Variants (the papers' ablations):
``random-guided`` (guided sampler, no simulator), ``random`` (no constraints either),
``genetic`` (crossover and mutation of the best strategies, scored by the simulator), and
``coordinate-descent`` and ``mcts``, whose simulator-only search (``local_search``) picks the
round's trials itself; with ``generator:`` either one feeds ``autodist`` its proposals instead
of the sampler.

The searcher talks to its simulator through :class:`SimulatorProtocol` only (``score``,
``fit``) and never runs trials itself: callers ``ask()`` for the next strategy, run it however
they like, and ``tell()`` the runtime (None for a failed trial). A strategy already measured
or pending is never proposed again.

Every round draws from a random stream of its own, seeded by (seed, round), and the
simulator is updated at fixed points (after the baselines and after each round), so the
whole search is a function of the seed and the measured runtimes: :meth:`Algorithm1.from_state`
rebuilds an interrupted search from its finished trials (the dataset rows) and goes on
exactly as the uninterrupted search would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.builders import TUNED_BASELINES, baseline_strategy
from ..strategy.schema import StrategyError
from ..strategy.validate import validate
from ..strategy.outcomes import search_outcome
from ..strategy.schema import AllReduceSynchronizer, Strategy, VariablePlan
from .experiment import Experiment
from .sampler import GuidedSampler, RandomSampler

__all__ = ["SimulatorProtocol", "Proposal", "Algorithm1", "fidelity_level", "select_diverse"]


class SimulatorProtocol(Protocol):
    """What the search needs of a simulator bound to its domain.

    ``score(strategies)``: one number per strategy, higher is better. ``fit(strategies,
    runtimes)``: learn from what was measured (a training-free simulator ignores it). An
    optional ``score_columns(columns)`` scores :class:`~synctune.strategy.columns.StrategyColumns`
    (the round's proposals then stay columns until picked); an optional ``fine_tune(strategies,
    runtimes)`` is the caller's business, not the search's.
    """

    def score(self, strategies: list[Strategy]) -> np.ndarray: ...

    def fit(self, strategies: list[Strategy], runtimes: np.ndarray) -> Any: ...


@dataclass(frozen=True)
class Proposal:
    """A strategy to trial: its id, origin (builder name or the algorithm) and predicted iteration
    time in seconds (None for baselines, and where the simulator scoring it ranks rather than
    predicts times)."""

    trial_id: str
    strategy: Strategy
    origin: str
    predicted: float | None


def fidelity_level(scores: np.ndarray, runtimes: np.ndarray, target: float) -> float:
    """The highest score below which the simulator ranks measured trials with at least ``target``
    pairwise accuracy (AutoDist §2.4 "Filtering"); -inf when it cannot vouch for any.

    Trials sorted by score: for each prefix of three or more, the share of its pairs with
    different runtimes that the score orders right (higher score, lower runtime; tied scores
    count half)."""
    order = np.argsort(scores, kind="stable")
    s, r = np.asarray(scores, float)[order], np.asarray(runtimes, float)[order]
    level = -np.inf
    agree = total = 0.0
    for j in range(1, len(s)):
        d_r = np.sign(r[:j] - r[j])  # earlier (lower-scored) vs the new one
        d_s = np.sign(s[:j] - s[j])
        valid = d_r != 0
        total += valid.sum()
        agree += ((d_r == -d_s) & (d_s != 0) & valid).sum() + 0.5 * ((d_s == 0) & valid).sum()
        if j >= 2 and total and agree / total >= target:
            level = float(s[j])
    return level


class _Index:
    """Positions of variables and nodes of devices in one domain (for strategy signatures)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        self.var_index = {v.name: i for i, v in enumerate(model.variables)}
        self.num_vars = len(model.variables)
        self.node_of_device = {d: i for i, n in enumerate(cluster.nodes) for d in n.devices}


def _signature(strategy: Strategy, index: _Index) -> np.ndarray:
    """Per-variable decision codes used to compare strategies: the partition and, for every
    shard, its synchronizer kind, server node, local aggregation, all-reduce algorithm and
    compressor (two variables are alike only if all their shards are)."""
    codes = np.zeros(index.num_vars, dtype=np.int64)
    for plan in strategy.plans:
        parts: list[Any] = [tuple(plan.partition)]
        for shard in plan.shards:
            sync = shard.synchronizer
            parts.append((sync.kind, index.node_of_device.get(getattr(sync, "placement", None), -1),
                          bool(getattr(sync, "local_aggregation", False)), getattr(sync, "algorithm", ""),
                          shard.compressor.label))
        digest = hashlib.blake2b(repr(parts).encode(), digest_size=7).digest()
        codes[index.var_index[plan.variable]] = int.from_bytes(digest, "big")
    return codes


def select_diverse(strategies: list[Strategy] | None, scores: np.ndarray, k: int, index: _Index | None,
                   weight: float = 0.5, *, signatures: np.ndarray | None = None,
                   accept: Callable[[int], bool] | None = None) -> list[int]:
    """Greedy selection of ``k`` indices maximising normalised score minus ``weight`` times the
    largest similarity to those already chosen (AutoSync §3.2, after AutoTVM). Similarity is
    the share of variables decided alike, from ``strategies`` or from their ``signatures``
    (one code per variable, :meth:`~synctune.strategy.columns.StrategyColumns.signatures`).
    A candidate ``accept`` refuses (one already measured) is passed over as if never drawn:
    it takes no place and pushes no other candidate away."""
    if signatures is None and not strategies or signatures is not None and not len(signatures):
        return []
    sig = signatures if signatures is not None else np.stack([_signature(s, index) for s in strategies])
    span = scores.max() - scores.min()
    norm = (scores - scores.min()) / span if span > 0 else np.zeros_like(scores)
    chosen: list[int] = []
    out = np.zeros(len(sig), dtype=bool)  # chosen or refused
    best_sim = np.zeros(len(sig))
    while len(chosen) < k and not out.all():
        value = np.where(out, -np.inf, norm - weight * best_sim)
        nxt = int(np.argmax(value))
        out[nxt] = True
        if accept is not None and not accept(nxt):
            continue
        chosen.append(nxt)
        best_sim = np.maximum(best_sim, (sig == sig[nxt]).mean(axis=1))
    return chosen


def experiment_explicit(experiment: Experiment) -> tuple[str, ...]:
    """The baselines an experiment names itself (``tuned`` expands to entries that may not apply)."""
    return getattr(experiment, "explicit_baselines", ())


def _round_seed(seed: int, round_: int) -> int:
    return int.from_bytes(hashlib.sha256(f"synctune-round:{seed}:{round_}".encode()).digest()[:8], "big")


def _round_of(trial_id: str) -> int:
    """The round a trial id belongs to (``r3-1`` -> 3; baselines -> 0)."""
    head = trial_id.split("-", 1)[0]
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else 0


class Algorithm1:
    """The searcher. ``simulator`` (a :class:`SimulatorProtocol`) is needed by ``autodist`` and
    ``genetic``; the random variants run without one. ``project`` maps every sampled strategy
    into the space the trials' runtime executes (e.g. TensorFlow's all-reduce packs, for a Keras
    model) before it is scored; baselines outside that space are left out."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                 simulator: SimulatorProtocol | None = None,
                 project: Callable[[Strategy], Strategy] | None = None) -> None:
        self.project = project
        self.model = model
        self.cluster = cluster
        self.exp = experiment
        self.index = _Index(model, cluster)
        self.simulator = simulator
        self.trials: list[dict[str, Any]] = []  # {trial_id, strategy (dict), hash, origin, predicted, runtime}
        self.queue: list[Proposal] = []
        for b in experiment.baselines:
            strategy = baseline_strategy(b, model, cluster)
            if b in TUNED_BASELINES and b not in experiment_explicit(experiment):
                try:
                    validate(strategy, model, cluster)
                except StrategyError:  # e.g. hierarchical all-reduce on nodes of different sizes
                    continue
            # Two builders can agree on a domain (Parallax is AllReduce without sparse variables):
            # the strategy is measured once, under the first builder's name.
            if project is not None and project(strategy).hash != strategy.hash:
                continue  # the trials' runtime cannot execute this builder's strategy
            if all(p.strategy.hash != strategy.hash for p in self.queue):
                self.queue.append(Proposal(f"baseline-{b}", strategy, b, None))
        self.pending: dict[str, Proposal] = {}
        self.rounds = 0
        self.fitted_on = 0  # trials the simulator last learned from
        self.exhausted = False  # a round found nothing that was not measured already

    # ------------------------------------------------------------------------------ ask / tell

    @property
    def asked(self) -> int:
        return len(self.trials) + len(self.pending)

    @property
    def finished(self) -> bool:
        """Whether the search is over: the budget is spent (every trial asked for), or a round
        found no strategy that was not measured already."""
        return self.asked >= self.exp.budget or self.exhausted

    @property
    def waiting(self) -> bool:
        """Whether the next proposal must wait for running trials: a new round is chosen only
        once the simulator has learned from every trial of the previous one (Algorithm 1)."""
        return not self.finished and not self.queue and bool(self.pending)

    def ask(self) -> Proposal | None:
        """The next strategy to trial, or None once the budget is spent (or while :attr:`waiting`)."""
        if self.finished or self.waiting:
            return None
        if not self.queue:
            self.rounds += 1
            self.queue = self._round(self.rounds)
            if not self.queue:  # every proposal was measured already: nothing new to try
                self.exhausted = True
                return None
        proposal = self.queue.pop(0)
        self.pending[proposal.trial_id] = proposal
        return proposal

    def tell(self, trial_id: str, runtime: float | None) -> None:
        """Report a trial's mean iteration time (None when it failed)."""
        proposal = self.pending.pop(trial_id)
        self.trials.append({"trial_id": trial_id, "strategy": proposal.strategy.to_dict(),
                            "hash": proposal.strategy.hash, "origin": proposal.origin,
                            "predicted": proposal.predicted, "runtime": runtime})
        if not self.pending and not self.queue:
            self._fit(len(self.trials))

    # ------------------------------------------------------------------------------------ rounds

    def _measured(self, upto: int | None = None) -> tuple[list[Strategy], np.ndarray]:
        done = [t for t in self.trials[:upto] if t["runtime"] is not None]
        return [Strategy.from_dict(t["strategy"]) for t in done], np.array([t["runtime"] for t in done], float)

    def _fit(self, upto: int) -> None:
        """Let the simulator learn from the first ``upto`` trials (at a batch boundary)."""
        self.fitted_on = upto
        if self.simulator is None:
            return
        strategies, runtimes = self._measured(upto)
        if len(strategies) >= 4:
            self.simulator.fit(strategies, runtimes)

    def _seen(self) -> set[str]:
        return {t["hash"] for t in self.trials} | {p.strategy.hash for p in self.pending.values()} | {
            p.strategy.hash for p in self.queue}

    def _round(self, round_: int) -> list[Proposal]:
        k = min(self.exp.candidates, self.exp.budget - self.asked)
        algo = self.exp.algorithm
        seed = _round_seed(self.exp.seed, round_)
        tag = f"r{round_}"
        seen = self._seen()

        def fresh(strategies: list[Strategy]) -> list[Strategy]:
            out, hashes = [], set(seen)
            for s in strategies:
                s = self.project(s) if self.project is not None else s
                if s.hash not in hashes:
                    hashes.add(s.hash)
                    out.append(s)
            return out

        if algo in ("random", "random-guided"):
            sampler = (RandomSampler(self.model, self.cluster, seed=seed) if algo == "random" else
                       GuidedSampler(self.model, self.cluster, seed=seed, lossy=self.exp.lossy))
            # Oversample a little: a draw equal to a measured strategy is skipped, not re-measured.
            picked = fresh(sampler.sample_many(3 * k))[:k]
            return [Proposal(f"{tag}-{i}", s, algo, None) for i, s in enumerate(picked)]
        rng = random.Random(seed)
        guided = GuidedSampler(self.model, self.cluster, seed=seed, lossy=self.exp.lossy)
        if algo in ("coordinate-descent", "mcts"):
            # Alone: the simulator-only search's best strategies are the round's trials.
            picked, hashes = [], set(seen)
            for strategy, score in self._local_search(algo, rng, 4 * k):
                strategy = self.project(strategy) if self.project is not None else strategy
                if strategy.hash not in hashes and len(picked) < k:
                    hashes.add(strategy.hash)
                    picked.append(Proposal(f"{tag}-{len(picked)}", strategy, algo,
                                           self._seconds(score, getattr(self.simulator, "training_free", None))))
            return picked
        if (algo == "autodist" and self.exp.generator == "sampler" and self.project is None and guided.speeds is None
                and hasattr(self.simulator, "score_columns")):
            out = self._round_from_columns(guided, k, tag, seen)
        else:
            out = self._round_from_objects(guided, rng, k, tag, seen, fresh)
        if out is None:
            return []
        if algo == "autodist" and self.exp.incumbent_moves and len(out) >= 2:
            move = self._incumbent_step({p.strategy.hash for p in out} | seen)
            if move is not None:
                # Exploitation beside the sampler's exploration: the best measured strategy
                # (a tuned baseline, often) one move away, in place of the round's last pick.
                out[-1] = Proposal(f"{tag}-{len(out) - 1}", move[0], f"{algo}+incumbent", self._seconds(move[1]))
        step = self._split_step(guided, {p.strategy.hash for p in out} | seen)
        if step is not None and out:
            # One coordinate step per round (AutoDDL §4.4: one dimension, the others fixed): the
            # best measured strategy with the batch split the simulator prefers, in place of the
            # round's last pick. Sampled strategies change every dimension at once and rarely
            # keep a good one while moving the split.
            strategy, score = step
            out[-1] = Proposal(f"{tag}-{len(out) - 1}", strategy, f"{algo}+split", self._seconds(score))
        return out

    def _seconds(self, score: float, model: Any = None) -> float | None:
        """A proposal's predicted iteration time: the negated score where the model that scored
        it (``model``, else the simulator scoring now) predicts seconds (analytic, replay); None
        where it ranks (a learned ranker's scores are not times, and the dataset's
        ``predicted_time_s`` must not pretend they are)."""
        model = self.simulator if model is None else model
        return float(-score) if getattr(model, "predicts_seconds", False) else None

    def _elite(self, scores: np.ndarray) -> np.ndarray:
        """Proposals scored at or above the simulator's fidelity level on what was measured
        (every proposal while fewer than 4 trials were)."""
        strategies, runtimes = self._measured(self.fitted_on)
        level = -np.inf
        if len(strategies) >= 4:
            level = fidelity_level(np.asarray(self.simulator.score(strategies), dtype=float), runtimes,
                                   self.exp.fidelity_accuracy)
        elite = np.flatnonzero(scores >= level)
        return elite if len(elite) else np.arange(len(scores))

    def _round_from_columns(self, guided: GuidedSampler, k: int, tag: str, seen: set[str]) -> list[Proposal] | None:
        """The round's proposals drawn and scored as columns (:meth:`GuidedSampler.sample_columns`);
        only those picked become strategies. Equal draws count once; a pick equal to a measured
        strategy is passed over for the next most diverse. Picks come from the elite first; if it
        holds fewer than ``k`` strategies not measured yet (the elite is what scores at least as
        well as the measured strategies the simulator ranks right, so it can be the measured ones
        and little else), the rest of the round fills the places."""
        cols = guided.sample_columns(self.exp.proposals)
        _, first = np.unique(cols.digests(), return_index=True)
        distinct = np.sort(first)
        scores = np.asarray(self.simulator.score_columns(cols), dtype=float)[distinct]
        signatures = cols.signatures()[distinct]
        made: dict[int, Strategy] = {}
        picks: list[int] = []
        elite = self._elite(scores)
        rest = np.setdiff1d(np.arange(len(scores)), elite)
        for pool in (elite, rest):
            if len(picks) >= k or not len(pool):
                continue

            def fresh(c: int, pool=pool) -> bool:
                i = int(pool[c])
                made[i] = cols.strategy(int(distinct[i]))
                return made[i].hash not in seen and all(made[i].hash != made[j].hash for j in picks)

            chosen = select_diverse(None, scores[pool], k - len(picks), None, signatures=signatures[pool],
                                    accept=fresh)
            picks += [int(pool[c]) for c in chosen]
        return [Proposal(f"{tag}-{j}", made[i], self.exp.algorithm, self._seconds(scores[i])) for j, i in enumerate(picks)] \
            or None

    def _round_from_objects(self, guided: GuidedSampler, rng: random.Random, k: int, tag: str, seen: set[str],
                            fresh) -> list[Proposal] | None:
        algo = self.exp.algorithm
        if self.exp.generator != "sampler":
            raw = [s for s, _ in self._local_search(self.exp.generator, rng, self.exp.proposals)]
        elif algo == "genetic":
            raw = self._crossover(self.exp.proposals, rng, guided)
        else:
            raw = guided.sample_many(self.exp.proposals)
        proposals = fresh(raw)
        if not proposals:
            return None
        scores = np.asarray(self.simulator.score(proposals), dtype=float)
        elite = [int(i) for i in self._elite(scores)]
        chosen = select_diverse([proposals[i] for i in elite], scores[elite], k, self.index)
        return [Proposal(f"{tag}-{j}", proposals[elite[c]], algo, self._seconds(scores[elite[c]]))
                for j, c in enumerate(chosen)]

    def _local_search(self, kind: str, rng: random.Random, keep: int) -> list[tuple[Strategy, float]]:
        """The best distinct strategies (with scores) of a simulator-only search under the
        training-free model (AutoDDL §4.4: the analytic model; the learned one, where the search
        switched to it, only picks among them), not yet measured, at most ``keep``. Coordinate
        descent starts from the best measured strategies, then from guided samples; the tree
        search is rooted at the best measured strategy (data parallelism before any, TAG §4.2.2)."""
        from .local_search import ChoiceSpace, coordinate_descent, mcts

        model = getattr(self.simulator, "training_free", self.simulator)
        space = ChoiceSpace(self.model, self.cluster, lossy=self.exp.lossy)

        def score(strategies: list[Strategy]) -> np.ndarray:
            if self.project is not None:
                strategies = [self.project(s) for s in strategies]
            return np.asarray(model.score(strategies), dtype=float)

        seen = self._seen()
        strategies, runtimes = self._measured()
        starts = [strategies[i] for i in np.argsort(runtimes, kind="stable")[:2]] if strategies else []
        if kind == "coordinate-descent":
            result = coordinate_descent(space, score, starts + [space.data_parallel()], rng=rng,
                                        evaluations=self.exp.sim_evaluations, keep=keep + len(seen))
        else:
            result = mcts(space, score, rng=rng, evaluations=self.exp.sim_evaluations, keep=keep + len(seen),
                          root=starts[0] if starts else None)
        return result.top(keep, exclude=seen)

    def _incumbent_step(self, taken: set[str]) -> tuple[Strategy, float] | None:
        """The best measured strategy one move away, the move the simulator scores best among
        those not measured or proposed yet: a compressor on every all-reduce merge group that
        takes it, hierarchical all-reduce, its merge groups halved or doubled (re-cut by bytes
        along backward order), or one choice changed on one of 8 runs of adjacent variables
        (AutoDDL §4.4's coordinate step, on the incumbent). The sampler's draws change every
        variable at once and rarely keep what made a tuned baseline fast."""
        if self.simulator is None:
            return None
        strategies, runtimes = self._measured()
        if not strategies:
            return None
        from .local_search import ChoiceSpace

        best = strategies[int(np.argmin(runtimes))]
        space = ChoiceSpace(self.model, self.cluster, lossy=self.exp.lossy)
        moves = _global_moves(best, space)
        for coordinate in space.coordinates(8):
            moves += space.neighbours(best, coordinate)
        if self.project is not None:
            moves = [self.project(m) for m in moves]
        unique: dict[str, Strategy] = {}
        for m in moves:
            if m.hash not in taken and m.hash != best.hash and m.hash not in unique:
                try:
                    validate(m, self.model, self.cluster)
                except StrategyError:
                    continue
                unique[m.hash] = m
        if not unique:
            return None
        candidates = list(unique.values())
        scores = np.asarray(self.simulator.score(candidates), dtype=float)
        i = int(np.argmax(scores))
        return candidates[i], float(scores[i])

    def _split_step(self, guided: GuidedSampler, taken: set[str]) -> tuple[Strategy, float] | None:
        """On replicas of different measured speeds: the best measured strategy with its batch
        split moved towards speed-proportional (a quarter, half, three quarters, all the way),
        the variant the simulator scores best, unless every variant was tried already."""
        if guided.speeds is None or self.simulator is None:
            return None
        strategies, runtimes = self._measured()
        if not strategies:
            return None
        best = strategies[int(np.argmin(runtimes))]
        variants = [v for v in (guided.split_towards_speed(best, t) for t in (0.25, 0.5, 0.75, 1.0))
                    if v.hash not in taken]
        variants = list({v.hash: v for v in variants}.values())
        if not variants:
            return None
        scores = np.asarray(self.simulator.score(variants), dtype=float)
        i = int(np.argmax(scores))
        return variants[i], float(scores[i])

    def _crossover(self, n: int, rng: random.Random, guided: GuidedSampler) -> list[Strategy]:
        """Children of the best measured strategies: per variable, one parent's plan; a few
        variables re-drawn from a fresh guided sample (mutation)."""
        strategies, runtimes = self._measured(self.fitted_on)
        if len(strategies) < 2:
            return guided.sample_many(n)
        parents = [strategies[i] for i in np.argsort(runtimes, kind="stable")[: max(2, len(strategies) // 2)]]
        children = []
        for _ in range(n):
            a, b = rng.sample(parents, 2)
            donor = guided.sample()
            sources = [{p.variable: p for p in s.plans} for s in (a, b, donor)]
            plans: list[tuple[int, VariablePlan]] = []
            for var in self.model.variables:
                roll = rng.random()
                parent = 2 if roll < 0.1 else (0 if roll < 0.55 else 1)
                plans.append((parent, sources[parent][var.name]))
            children.append(_renumber_groups(a, plans))
        return children

    # ----------------------------------------------------------------------------------- results

    def summary(self, other_baselines: tuple[float, ...] = ()) -> dict[str, Any]:
        """Best strategy, speed-up over the best baseline, hit rate, trials to 1.1x and 1.2x.
        ``other_baselines``: baseline times measured outside the search (tuned torch DDP)."""
        out = search_outcome(((t["trial_id"].startswith("baseline-"), t["runtime"]) for t in self.trials),
                             other_baselines=other_baselines)
        best = self.trials[out.best_index] if out.best_index is not None else None
        return {
            "trials": out.num_trials, "failed": out.num_failed,
            "best_runtime_s": out.best_runtime_s, "best_origin": best["origin"] if best else None,
            "best_strategy": best["strategy"] if best else None, "best_baseline_s": out.best_baseline_s,
            "speedup_over_best_baseline": out.speedup, "hit_rate": out.hit_rate,
            "trials_to_1.1x": out.trials_to[1.1], "trials_to_1.2x": out.trials_to[1.2],
        }

    # ------------------------------------------------------------------------------- persistence

    def state(self) -> dict[str, Any]:
        """Plain-JSON state: the finished trials, in the order they were told (the rest is
        re-derived on restore)."""
        return {"version": 2, "trials": list(self.trials)}

    @classmethod
    def from_state(cls, state: dict[str, Any], model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                   simulator: SimulatorProtocol | None = None,
                   project: Callable[[Strategy], Strategy] | None = None) -> "Algorithm1":
        """Rebuild a searcher from its finished trials (in the order they were told): the
        simulator relearns at the same points as it did, the last round is drawn again and its
        unfinished trials are proposed again, so the search goes on as if never interrupted."""
        algo = cls(model, cluster, experiment, simulator, project)
        trials = []
        for t in state.get("trials", []):
            strategy = Strategy.from_dict(t["strategy"])  # migrates older schemas
            trials.append(dict(t, strategy=strategy.to_dict(), hash=strategy.hash))
        done = {t["trial_id"] for t in trials}
        last = max((_round_of(t["trial_id"]) for t in trials), default=0)
        # A round starts only once the previous batch is told: batches before the last one are
        # complete. Replay the simulator's updates at their ends.
        for r in range(last):
            algo.trials.extend(t for t in trials if _round_of(t["trial_id"]) == r)
            algo._fit(len(algo.trials))
        if last == 0:
            algo.trials = trials
            algo.queue = [p for p in algo.queue if p.trial_id not in done]
            if not algo.queue and trials:
                algo._fit(len(trials))
            return algo
        # Draw the last round again, exactly as it was drawn from the trials before it.
        algo.queue = []
        algo.rounds = last
        regenerated = algo._round(last)
        algo.trials = trials
        algo.queue = [p for p in regenerated if p.trial_id not in done]
        if not algo.queue:
            algo._fit(len(trials))
        return algo


def _global_moves(strategy: Strategy, space) -> list[Strategy]:
    """Moves of every dense all-reduce merge group of ``strategy`` at once (see
    :meth:`Algorithm1._incumbent_step`): each lossy compressor on the groups whose members all
    take it, hierarchical all-reduce (where every node holds as many replicas), and the groups
    re-cut into half or twice as many by bytes (when they share one compressor and algorithm)."""
    from ..strategy.schema import Compressor
    from .local_search import SPARSE_GROUPS, canonical_groups

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
    for kind in ("fp16", "bf16") if space.lossy else ():
        fits = {g for g, names in groups.items() if all(space._fits(variables[n], kind, 0, "allreduce") for n in names)}
        if fits:
            out.append(rebuilt(lambda i, j, sh, kind=kind, fits=fits: dataclasses.replace(
                sh, compressor=Compressor(kind=kind), synchronizer=dataclasses.replace(sh.synchronizer, algorithm="flat"))
                if sh.synchronizer.group in fits else None))
    if "hierarchical" in {a for a, _c, _r in space._new_groups}:
        out.append(rebuilt(lambda i, j, sh: dataclasses.replace(
            sh, compressor=Compressor(), synchronizer=dataclasses.replace(sh.synchronizer, algorithm="hierarchical"))))
    if len({(sh.compressor, sh.synchronizer.algorithm) for _i, _j, sh in dense}) == 1:
        sizes = [variables[strategy.plans[i].variable].num_bytes / max(1, len(strategy.plans[i].shards))
                 for i, _j, _sh in dense]
        total = float(sum(sizes)) or 1.0
        for count in {max(1, len(groups) // 2), 2 * len(groups)}:
            if count == len(groups):
                continue
            cut, filled = {}, 0.0
            for (i, j, _sh), size in zip(dense, sizes):
                cut[(i, j)] = min(count - 1, int(filled / total * count))
                filled += size
            out.append(rebuilt(lambda i, j, sh, cut=cut: dataclasses.replace(
                sh, synchronizer=dataclasses.replace(sh.synchronizer, group=cut[(i, j)]))))
    return out


def _renumber_groups(template: Strategy, plans: list[tuple[int, VariablePlan]]) -> Strategy:
    """A strategy from (parent index, plan) pairs: a parent's merge groups stay together, and
    groups of different parents never share an id (they may differ in members and kind)."""
    remap: dict[tuple[int, int], int] = {}
    out = []
    for parent, plan in plans:
        shards = []
        for shard in plan.shards:
            sync = shard.synchronizer
            if isinstance(sync, AllReduceSynchronizer):
                gid = remap.setdefault((parent, sync.group), len(remap))
                shard = dataclasses.replace(shard, synchronizer=dataclasses.replace(sync, group=gid))
            shards.append(shard)
        out.append(dataclasses.replace(plan, shards=tuple(shards)))
    return dataclasses.replace(template, plans=tuple(out))
