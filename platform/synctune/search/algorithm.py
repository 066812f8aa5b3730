"""The search shell: AutoDist's Algorithm 1 as an ask/tell searcher (AutoDist §2.4, AutoSync
§3.2), one round policy per algorithm (:data:`~synctune.search.policies.ROUND_POLICIES`).

Baselines (the hand-optimised builders) are trialled first. Then, round by round, the
experiment's algorithm proposes up to K trials (``autodist``: sample N proposals with the guided
sampler, score them with the simulator, drop those below the simulator's fidelity level, select
K trading score against diversity; the other algorithms are its ablations and the
simulator-only searches, see :mod:`~synctune.search.policies`), the caller trials them, and the
simulator is updated on everything measured so far before the next round is drawn.

The search talks to its simulator through :class:`SimulatorProtocol` only (``score``, ``fit``)
and never runs trials itself: callers ``ask()`` for the next strategy, run it however they
like, and ``tell()`` its mean iteration time in seconds (None for a failed trial). A strategy
already measured or pending is never proposed again.

Every round draws from a random stream of its own, seeded by (seed, round), and the simulator
is updated at fixed points (after the baselines and after each round), so the whole search is a
function of the seed and the measured times: :meth:`StrategySearch.from_state` rebuilds an
interrupted search from its finished trials (the dataset rows) and goes on exactly as the
uninterrupted search would have.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.builders import TUNED_BASELINES, baseline_strategy
from ..strategy.schema import Strategy, StrategyError
from ..strategy.validate import validate
from .experiment import Experiment
from .interface import BUILDER_PREFIX, MemoryCheck, Proposal, RoundContext, SearchFigures, SearchTrial, \
    SimulatorProtocol, search_figures
from .policies import ROUND_POLICIES
from .selection import _Index, fidelity_level, select_diverse

__all__ = ["SimulatorProtocol", "Proposal", "StrategySearch", "SearchTrial", "SearchFigures", "fidelity_level",
           "select_diverse"]

#: Rounds drawn in a row whose every pick the memory budget dropped before the search gives up
#: (a budget that only a few strategies fit; a round that proposes nothing ends the search at once).
MAX_EMPTY_ROUNDS = 20
#: Version of :meth:`StrategySearch.state`. 3: a trial's time is ``mean_s``; states before held
#: it as ``runtime`` (still read).
STATE_VERSION = 3


def _round_of(trial_id: str) -> int:
    """The round a trial id belongs to (``r3-1`` -> 3; baselines -> 0)."""
    head = trial_id.split("-", 1)[0]
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else 0


def _baseline_proposals(model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                        project: Callable[[Strategy], Strategy] | None,
                        memory: MemoryCheck | None = None) -> tuple[list[Proposal], list[str]]:
    """The experiment's baselines (AutoDist §3.1's hand-optimised builders), each strategy once,
    under the first builder that gives it; tuned-set entries that do not apply to the domain and
    strategies the trials' runtime cannot execute are left out, and so are those the memory
    budget says do not fit (returned second, by builder entry: never trialled)."""
    queue: list[Proposal] = []
    over: list[str] = []
    explicit = experiment.baselines.explicit_builders  # entries the experiment names itself
    for b in experiment.baselines.expanded_builders:
        strategy = baseline_strategy(b, model, cluster)
        if b in TUNED_BASELINES and b not in explicit:
            try:
                validate(strategy, model, cluster)
            except StrategyError:  # e.g. hierarchical all-reduce on nodes of different sizes
                continue
        # Two builders can agree on a domain (Parallax is AllReduce without sparse variables):
        # the strategy is measured once, under the first builder's name.
        if project is not None and project(strategy).hash != strategy.hash:
            continue  # the trials' runtime cannot execute this builder's strategy
        if memory is not None and not memory.fits(strategy):
            over.append(b)
            continue
        if all(p.strategy.hash != strategy.hash for p in queue):
            queue.append(Proposal(trial_id=f"{BUILDER_PREFIX}{b}", strategy=strategy, origin=b, predicted=None))
    return queue, over


class StrategySearch:
    """The search: baselines, then rounds of the experiment's algorithm (``ROUND_POLICIES``),
    ask/tell by trial id. ``simulator`` (a :class:`SimulatorProtocol`) is needed by every
    algorithm but ``random`` and ``random-guided``. ``project`` maps every sampled strategy into
    the space the trials' runtime executes (e.g. TensorFlow's all-reduce packs, for a Keras
    model) before it is scored; baselines outside that space are left out.

    ``trials`` holds the finished trials (:class:`SearchTrial`) in the order they were told."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                 simulator: SimulatorProtocol | None = None,
                 project: Callable[[Strategy], Strategy] | None = None, *, memory: MemoryCheck | None = None,
                 shard_prob: float = 0.0, tp_prob: float = 0.0) -> None:
        self.policy = ROUND_POLICIES.get(experiment.search.algorithm)
        self.memory = memory
        self.shard_prob = float(shard_prob)
        self.tp_prob = float(tp_prob)
        self.project = project
        self.model = model
        self.cluster = cluster
        self.exp = experiment
        self.settings = experiment.search  # what the round policies read: algorithm, proposals, ...
        self.index = _Index(model, cluster)
        self.simulator = simulator
        self.trials: list[SearchTrial] = []
        self.queue, self.over_budget_baselines = _baseline_proposals(model, cluster, experiment, project, memory)
        self.pending: dict[str, Proposal] = {}
        self.rounds = 0
        self.fitted_on = 0  # trials the simulator last learned from
        self.exhausted = False  # a round found nothing that was not measured already
        #: Why the search stopped before its budget because nothing in its space fits the memory
        #: budget (what its trials measured says so: :meth:`MemoryCheck.nothing_fits`), or None.
        self.stopped: str | None = None
        self.over_budget = 0  # strategies :meth:`fits` refused: a round they emptied draws afresh

    # ------------------------------------------------------------------------------ ask / tell

    @property
    def asked(self) -> int:
        """Trials asked for so far: the finished ones and those still pending (what the budget counts)."""
        return len(self.trials) + len(self.pending)

    @property
    def finished(self) -> bool:
        """Whether the search is over: the budget is spent (every trial asked for), or a round
        found no strategy that was not measured already."""
        return self.asked >= self.settings.budget or self.exhausted

    @property
    def waiting(self) -> bool:
        """Whether the next proposal must wait for running trials: a new round is chosen only
        once the simulator has learned from every trial of the previous one (Algorithm 1)."""
        return not self.finished and not self.queue and bool(self.pending)

    def ask(self) -> Proposal | None:
        """The next strategy to trial, or None once the budget is spent (or while :attr:`waiting`)."""
        if self.finished or self.waiting:
            return None
        if self.memory is not None:
            self.stopped = self.memory.nothing_fits()
            if self.stopped is not None:
                self.exhausted = True
                return None
            # The memory model may have learned since the queue was drawn (an oom trial): what
            # it would refuse now is never trialled.
            self.queue = [p for p in self.queue if self.fits(p.strategy)]
        if not self.queue:
            for _ in range(MAX_EMPTY_ROUNDS):
                self.rounds += 1
                # The last guard of the budget: a policy's pick the memory model says does not
                # fit is dropped, never trialled (the policies filter before they pick).
                refused = self.over_budget
                raw = self._round(self.rounds)
                self.queue = [p for p in raw if self.fits(p.strategy)]
                # A round empty with nothing refused means nothing new is left; one the budget
                # emptied (here or in the policies' own filter) is followed by a fresh draw.
                if self.queue or self.over_budget == refused:
                    break
                # Every pick was over the budget: the next round draws afresh (its own stream).
            if not self.queue:  # every proposal was measured already: nothing new to try
                self.exhausted = True
                return None
        proposal = self.queue.pop(0)
        self.pending[proposal.trial_id] = proposal
        return proposal

    def builder_proposals(self) -> list[Proposal]:
        """Every builder baseline of the experiment in the search's space, each strategy once (the
        proposals :attr:`queue` starts from), those the memory budget refuses included: what a
        tool that chooses from a cost model alone chooses among, judging the budget itself."""
        return _baseline_proposals(self.model, self.cluster, self.exp, self.project)[0]

    def fits(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` fits the memory budget (always, without one); a refusal is counted
        (:attr:`over_budget`)."""
        if self.memory is None or self.memory.fits(strategy):
            return True
        self.over_budget += 1
        return False

    def tell(self, trial_id: str, mean_s: float | None, memory: list[dict] | None = None) -> None:
        """Report a trial's mean iteration time in seconds (None when it failed or broke the
        memory budget) and, where it measured one, its memory per rank part by part."""
        proposal = self.pending.pop(trial_id)
        self.trials.append(SearchTrial(trial_id=trial_id, strategy=proposal.strategy, origin=proposal.origin,
                                       predicted=proposal.predicted, mean_s=mean_s,
                                       memory=tuple(memory) if memory else None))
        if not self.pending and not self.queue:
            self._fit(len(self.trials))

    # ------------------------------------------------------------- what round policies read

    def seen(self) -> set[str]:
        """Hashes of the strategies measured, pending or queued (a new set on every call)."""
        return {t.strategy.hash for t in self.trials} | {p.strategy.hash for p in self.pending.values()} | {
            p.strategy.hash for p in self.queue}

    def measured(self, upto: int | None = None) -> tuple[list[Strategy], np.ndarray]:
        """The successful trials among the first ``upto`` told (all by default): their strategies
        and mean iteration times in seconds."""
        done = [t for t in self.trials[:upto] if t.ok]
        return [t.strategy for t in done], np.array([t.mean_s for t in done], float)

    def round_context(self) -> RoundContext:
        """What the round policy reads of the search now (:class:`RoundContext`)."""
        return RoundContext(model=self.model, cluster=self.cluster, settings=self.settings, seed=self.exp.seed,
                            simulator=self.simulator, project=self.project, shard_prob=self.shard_prob,
                            trials=tuple(self.trials), fitted_on=self.fitted_on, seen=frozenset(self.seen()),
                            index=self.index, fits=self.fits,
                            budget_fits=self.memory.fits if self.memory is not None else None, tp_prob=self.tp_prob)

    # ---------------------------------------------------------------------------- internals

    def _round(self, round_: int) -> list[Proposal]:
        return self.policy.propose(self.round_context(), round_,
                                   min(self.settings.candidates, self.settings.budget - self.asked))

    def _fit(self, upto: int) -> None:
        """Let the simulator learn from the first ``upto`` trials (at a batch boundary)."""
        self.fitted_on = upto
        if self.memory is not None:
            told = self.trials[:upto]
            self.memory.fit([t.strategy for t in told], [list(t.memory) if t.memory else None for t in told])
        if self.simulator is None:
            return
        strategies, times_s = self.measured(upto)
        if len(strategies) >= 4:
            self.simulator.fit(strategies, times_s)

    # ----------------------------------------------------------------------------------- results

    def summary(self, other_baselines: tuple[float, ...] = ()) -> SearchFigures:
        """Best strategy, speed-up over the best baseline, hit rate, trials to 1.1x and 1.2x
        (AutoDist §3.3). ``other_baselines``: baseline times in seconds measured outside the
        search (tuned torch DDP)."""
        return search_figures(self.trials, other_baselines)

    # ------------------------------------------------------------------------------- persistence

    def state(self) -> dict[str, Any]:
        """Plain-JSON state: the finished trials, in the order they were told, and the memory
        check's own state where it has one (the rest is re-derived on restore)."""
        state = {"version": STATE_VERSION, "trials": [t.to_dict() for t in self.trials]}
        if self.memory is not None:
            state["memory"] = self.memory.state()
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], model: ModelSpec, cluster: ClusterSpec, experiment: Experiment,
                   simulator: SimulatorProtocol | None = None,
                   project: Callable[[Strategy], Strategy] | None = None, *, memory: MemoryCheck | None = None,
                   shard_prob: float = 0.0, tp_prob: float = 0.0) -> "StrategySearch":
        """Rebuild a search from its finished trials (in the order they were told; a trial's
        time under ``mean_s``, or ``runtime`` as older versions wrote it): the simulator relearns
        at the same points as it did, the last round is drawn again and its unfinished trials
        are proposed again, so the search goes on as if never interrupted. A memory check with
        ``restore`` gets back what its ``state`` gave (the budget's probe figures) first."""
        if memory is not None and state.get("memory") is not None:
            memory.restore(state["memory"])
        search = cls(model, cluster, experiment, simulator, project, memory=memory, shard_prob=shard_prob,
                     tp_prob=tp_prob)
        trials = [SearchTrial.from_dict(t) for t in state.get("trials", [])]
        done = {t.trial_id for t in trials}
        last = max((_round_of(t.trial_id) for t in trials), default=0)
        # A round starts only once the previous batch is told: batches before the last one are
        # complete. Replay the simulator's updates at their ends.
        for r in range(last):
            search.trials.extend(t for t in trials if _round_of(t.trial_id) == r)
            search._fit(len(search.trials))
        if last == 0:
            search.trials = trials
            search.queue = [p for p in search.queue if p.trial_id not in done]
            if not search.queue and trials:
                search._fit(len(trials))
            return search
        # Draw the last round again, exactly as it was drawn from the trials before it.
        search.queue = []
        search.rounds = last
        regenerated = [p for p in search._round(last) if search.fits(p.strategy)]
        search.trials = trials
        search.queue = [p for p in regenerated if p.trial_id not in done]
        if not search.queue:
            search._fit(len(trials))
        return search
