"""AutoDist Algorithm 1 as an ask/tell searcher (AutoDist §2.4, AutoSync §3.2).

Baselines (the hand-optimised builders) are trialled first. Then, round by round: sample N
proposals with the guided sampler, score them with the simulator, drop those below the
simulator's fidelity level, select K candidates trading score against diversity, trial them,
and refit the learned simulator on everything measured so far. Variants (the papers'
ablations): ``random-guided`` (guided sampler, no simulator), ``random`` (no constraints
either) and ``genetic`` (crossover and mutation of the best strategies, scored by the
simulator).

The searcher talks to the simulator through a small protocol (``fit(domains)``,
``predict_domain(domain)``) and never runs trials itself: callers ``ask()`` for the next
strategy, run it however they like, and ``tell()`` the runtime (None for a failed trial).
Its whole state is plain JSON (:meth:`state` / :meth:`from_state`), so a search survives a
driver restart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy
from ..strategy.schema import Strategy, VariablePlan
from .experiment import Experiment
from .sampler import GuidedSampler, RandomSampler

__all__ = ["SimulatorProtocol", "Proposal", "Algorithm1", "fidelity_level", "select_diverse"]


class SimulatorProtocol(Protocol):
    def fit(self, domains: list, **kwargs: Any) -> Any: ...

    def predict_domain(self, domain: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class Proposal:
    """A strategy to trial: its id, origin (builder name or the algorithm) and predicted score."""

    trial_id: str
    strategy: Strategy
    origin: str
    predicted: float | None


def fidelity_level(scores: np.ndarray, runtimes: np.ndarray, target: float) -> float:
    """The highest score below which the simulator ranks recent trials with at least ``target``
    pairwise accuracy (AutoDist §2.4 "Filtering"); -inf when it cannot vouch for any."""
    from ..simulator.evaluate import pairwise_accuracy

    order = np.argsort(scores)
    level = -np.inf
    for cut in range(3, len(order) + 1):
        idx = order[:cut]
        acc = pairwise_accuracy(-scores[idx], runtimes[idx])  # higher score should mean lower runtime
        if acc == acc and acc >= target:
            level = float(scores[order[cut - 1]])
    return level


def _signature(strategy: Strategy, ctx) -> np.ndarray:
    """Per-variable decision codes used to compare strategies (kind, placement, partitioning)."""
    codes = np.zeros(ctx.num_vars, dtype=np.int64)
    for plan in strategy.plans:
        sync = plan.shards[0].synchronizer
        code = {"ps": 1, "allreduce": 2, "allgather": 3}[sync.kind]
        if sync.kind == "ps":
            code += 10 * (1 + ctx.node_of_device[sync.placement])
        codes[ctx.var_index[plan.variable]] = code + 1000 * plan.num_shards
    return codes


def select_diverse(strategies: list[Strategy], scores: np.ndarray, k: int, ctx, weight: float = 0.5) -> list[int]:
    """Greedy selection of ``k`` indices maximising normalised score minus ``weight`` times the
    largest similarity to those already chosen (AutoSync §3.2, after AutoTVM)."""
    if not strategies:
        return []
    sig = np.stack([_signature(s, ctx) for s in strategies])
    span = scores.max() - scores.min()
    norm = (scores - scores.min()) / span if span > 0 else np.zeros_like(scores)
    chosen = [int(np.argmax(norm))]
    best_sim = (sig == sig[chosen[0]]).mean(axis=1)
    while len(chosen) < min(k, len(strategies)):
        value = norm - weight * best_sim
        value[chosen] = -np.inf
        nxt = int(np.argmax(value))
        chosen.append(nxt)
        best_sim = np.maximum(best_sim, (sig == sig[nxt]).mean(axis=1))
    return chosen


class Algorithm1:
    """The searcher. ``make_simulator()`` returns a fresh simulator to (re)fit, or an analytic one."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                 make_simulator: Callable[[], SimulatorProtocol] | None = None) -> None:
        from ..simulator.features import DomainContext

        self.model = model
        self.cluster = cluster
        self.exp = experiment
        self.ctx = DomainContext(model, cluster)
        self.make_simulator = make_simulator
        self.simulator = make_simulator() if make_simulator else None
        self.rng = random.Random(experiment.seed)
        self.guided = GuidedSampler(model, cluster, seed=experiment.seed)
        self.random = RandomSampler(model, cluster, seed=experiment.seed)
        self.trials: list[dict[str, Any]] = []  # {trial_id, strategy (dict), origin, predicted, runtime}
        self.queue: list[Proposal] = [Proposal(f"baseline-{b}", build_strategy(b, model, cluster), b, None)
                                      for b in experiment.baselines]
        self.pending: dict[str, Proposal] = {}
        self.rounds = 0

    # ------------------------------------------------------------------------------ ask / tell

    @property
    def asked(self) -> int:
        return len(self.trials) + len(self.pending)

    @property
    def finished(self) -> bool:
        """Whether the budget is spent (every trial asked for)."""
        return self.asked >= self.exp.budget

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
            self.queue = self._round()
        proposal = self.queue.pop(0)
        self.pending[proposal.trial_id] = proposal
        return proposal

    def tell(self, trial_id: str, runtime: float | None) -> None:
        """Report a trial's mean iteration time (None when it failed)."""
        proposal = self.pending.pop(trial_id)
        self.trials.append({"trial_id": trial_id, "strategy": proposal.strategy.to_dict(), "origin": proposal.origin,
                            "predicted": proposal.predicted, "runtime": runtime})
        if not self.pending and not self.queue:
            self._refit()

    # ------------------------------------------------------------------------------------ rounds

    def _measured(self):
        done = [t for t in self.trials if t["runtime"] is not None]
        return [Strategy.from_dict(t["strategy"]) for t in done], np.array([t["runtime"] for t in done])

    def _domain(self, strategies, runtimes):
        from ..simulator.models import Domain

        return Domain(self.ctx, strategies, np.asarray(runtimes, dtype=np.float64))

    def _scores(self, strategies: list[Strategy]) -> np.ndarray:
        return -self.simulator.predict_domain(self._domain(strategies, np.zeros(len(strategies))))

    def _refit(self) -> None:
        if self.simulator is None or self.make_simulator is None or not getattr(self.simulator, "learned", False):
            return
        strategies, runtimes = self._measured()
        if len(strategies) >= 4:
            self.simulator = self.make_simulator()
            self.simulator.fit([self._domain(strategies, runtimes)])

    def _round(self) -> list[Proposal]:
        self.rounds += 1
        k = min(self.exp.candidates, self.exp.budget - self.asked)
        algo = self.exp.algorithm
        tag = f"r{self.rounds}"
        if algo == "random":
            return [Proposal(f"{tag}-{i}", s, algo, None) for i, s in enumerate(self.random.sample_many(k))]
        if algo == "random-guided":
            return [Proposal(f"{tag}-{i}", s, algo, None) for i, s in enumerate(self.guided.sample_many(k))]
        proposals = self._crossover(self.exp.proposals) if algo == "genetic" else self.guided.sample_many(
            self.exp.proposals)
        scores = self._scores(proposals)
        strategies, runtimes = self._measured()
        level = -np.inf
        if len(strategies) >= 4 and getattr(self.simulator, "learned", False):
            level = fidelity_level(self._scores(strategies), runtimes, self.exp.fidelity_accuracy)
        elite = [i for i in range(len(proposals)) if scores[i] >= level] or list(range(len(proposals)))
        chosen = select_diverse([proposals[i] for i in elite], scores[elite], k, self.ctx)
        return [Proposal(f"{tag}-{j}", proposals[elite[c]], algo, float(-scores[elite[c]]))
                for j, c in enumerate(chosen)]

    def _crossover(self, n: int) -> list[Strategy]:
        """Children of the best measured strategies: per variable, one parent's plan; a few
        variables re-drawn from a fresh guided sample (mutation)."""
        strategies, runtimes = self._measured()
        if len(strategies) < 2:
            return self.guided.sample_many(n)
        parents = [strategies[i] for i in np.argsort(runtimes)[: max(2, len(strategies) // 2)]]
        children = []
        for _ in range(n):
            a, b = self.rng.sample(parents, 2)
            donor = self.guided.sample()
            sources = [{p.variable: p for p in s.plans} for s in (a, b, donor)]
            plans: list[tuple[int, VariablePlan]] = []
            for var in self.model.variables:
                roll = self.rng.random()
                parent = 2 if roll < 0.1 else (0 if roll < 0.55 else 1)
                plans.append((parent, sources[parent][var.name]))
            children.append(_renumber_groups(a, plans))
        return children

    # ----------------------------------------------------------------------------------- results

    def summary(self) -> dict[str, Any]:
        """Best strategy, speed-up over the best baseline, hit rate, trials to 1.1x and 1.2x."""
        ok = [t for t in self.trials if t["runtime"] is not None]
        base = [t["runtime"] for t in ok if t["trial_id"].startswith("baseline-")]
        best_base = min(base) if base else None
        best = min(ok, key=lambda t: t["runtime"]) if ok else None
        searched = [t for t in self.trials if not t["trial_id"].startswith("baseline-")]
        hits = [t for t in searched if t["runtime"] is not None and best_base and t["runtime"] < best_base]

        def first_reaching(factor: float) -> int | None:
            if not best_base:
                return None
            for i, t in enumerate(self.trials, 1):
                if t["runtime"] is not None and best_base / t["runtime"] >= factor:
                    return i
            return None

        return {
            "trials": len(self.trials), "failed": sum(t["runtime"] is None for t in self.trials),
            "best_runtime_s": best["runtime"] if best else None, "best_origin": best["origin"] if best else None,
            "best_strategy": best["strategy"] if best else None, "best_baseline_s": best_base,
            "speedup_over_best_baseline": (best_base / best["runtime"]) if best and best_base else None,
            "hit_rate": (len(hits) / len(searched)) if searched else None,
            "trials_to_1.1x": first_reaching(1.1), "trials_to_1.2x": first_reaching(1.2),
        }

    # ------------------------------------------------------------------------------- persistence

    def state(self) -> dict[str, Any]:
        """Plain-JSON state: finished trials (the rest is re-derived on restore)."""
        return {"version": 1, "trials": list(self.trials), "rounds": self.rounds}

    @classmethod
    def from_state(cls, state: dict[str, Any], model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                   make_simulator: Callable[[], SimulatorProtocol] | None = None) -> "Algorithm1":
        """Rebuild a searcher; finished trials are kept, unfinished ones are proposed again."""
        algo = cls(model, cluster, experiment, make_simulator)
        algo.trials = list(state.get("trials", []))
        done = {t["trial_id"] for t in algo.trials}
        algo.queue = [p for p in algo.queue if p.trial_id not in done]
        # Advance the samplers past what the finished rounds consumed, so new ids never collide.
        algo.rounds = int(state.get("rounds", 0))
        for _ in range(algo.rounds):
            algo.guided.sample()
        algo._refit()
        return algo


def _renumber_groups(template: Strategy, plans: list[tuple[int, VariablePlan]]) -> Strategy:
    """A strategy from (parent index, plan) pairs: a parent's merge groups stay together, and
    groups of different parents never share an id (they may differ in members and kind)."""
    import dataclasses

    from ..strategy.schema import AllReduceSynchronizer

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
