"""The simulator a search scores proposals with (AutoDist §2.4: start from a training-free
model, switch to the learned one once it ranks better on trials it had not seen)."""

from __future__ import annotations

import numpy as np

from ..search.experiment import Experiment
from ..simulator.bound import DomainScorer
from ..simulator.evaluate import pairwise_counts
from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec

__all__ = ["make_search_simulator", "SelectedSimulator", "CALIBRATE_AFTER"]


#: Trials of its own a search measures before its replay is calibrated on them (5 constants fitted).
CALIBRATE_AFTER = 8


def make_search_simulator(exp: Experiment, model: ModelSpec, cluster: ClusterSpec):
    """The simulator an experiment asks for, bound to its domain (None for the random variants)."""
    from ..data.paths import profiles_dir
    from ..simulator import AnalyticSimulator, BoundSimulator, CalibratedReplay, ReplaySimulator, load_simulator, \
        make_simulator, profile_key

    kind = exp.search.simulator
    if not exp.search.uses_simulator:
        return None
    if kind == "analytic":
        return BoundSimulator(AnalyticSimulator(), model, cluster)
    replay = ReplaySimulator.from_folder(profiles_dir())
    if kind == "replay":
        return BoundSimulator(replay, model, cluster)
    # The physical model learned models must beat: the replay where this domain's compute profile
    # was measured (`synctune sim profile`), calibrated on the search's own trials as they come
    # (its communication's CPU costs and compute scale; dPRO §4.3), else the analytic model.
    measured = profile_key(model.name, cluster.device_kind, cluster.num_devices) in replay.profiles
    physical = CalibratedReplay(min_trials=CALIBRATE_AFTER) if measured else AnalyticSimulator()
    if measured:
        physical.use_profiles(replay)
    training_free = BoundSimulator(physical, model, cluster)
    if kind in ("rnn", "linear", "gat"):
        def make():
            sim = make_simulator(kind, epochs=60, seed=exp.seed)
            sim.use_profiles(replay)  # its replay features use this domain's measured profile
            return sim

        return SelectedSimulator(training_free, BoundSimulator(make(), model, cluster, make=make), learned_ready=False)
    transferred = load_simulator(kind)
    transferred.use_profiles(replay)
    return SelectedSimulator(training_free, BoundSimulator(transferred, model, cluster, transfer=True), learned_ready=True)


class SelectedSimulator(DomainScorer):
    """The physical model (analytic, or the replay calibrated as the search goes: called
    training-free here, it has no learned weights) until the learned one beats it on trials it
    had not seen (AutoDist §2.4: start analytic, switch once the learned model is better).

    At every update (a batch boundary of the search), the trials measured since the previous
    update are held out: both models score them before either learns from them (the learned
    model trains; a calibrated replay refits its constants,
    :class:`~synctune.simulator.CalibratedReplay`),
    and each model's pairwise ranking accuracy on those pairs accumulates. The learned model
    scores proposals only while its accumulated held-out accuracy is above the training-free
    model's on the same pairs (and at least :attr:`MIN_PAIRS` pairs were judged). A transferred
    model (``learned_ready``) is judged from the first batch; one learned from scratch from the
    batch after its first fit. :attr:`history` keeps each judgement."""

    MIN_PAIRS = 6

    def __init__(self, training_free: DomainScorer, learned: DomainScorer, *, learned_ready: bool) -> None:
        self._training_free, self.learned = training_free, learned
        self.ready = learned_ready
        self.seen = 0
        self.right = {"learned": 0.0, "training_free": 0.0}
        self.pairs = 0
        self.use_learned = False
        self._history: list[dict] = []

    @property
    def kind(self) -> str:
        """The kind of the model scoring now."""
        return (self.learned if self.use_learned else self._training_free).kind

    @property
    def training_free(self) -> DomainScorer:
        """The physical model it scores with until the learned one ranks better."""
        return self._training_free

    @property
    def history(self) -> tuple[dict, ...]:
        """Each judgement of the learned model against the training-free one, in order."""
        return tuple(self._history)

    @property
    def predicts_seconds(self) -> bool:
        """Whether the model scoring now predicts seconds (the training-free ones do; a learned
        ranker does not)."""
        return (self.learned if self.use_learned else self._training_free).predicts_seconds

    def score(self, strategies):
        return (self.learned if self.use_learned else self._training_free).score(strategies)

    def score_columns(self, columns):
        return (self.learned if self.use_learned else self._training_free).score_columns(columns)

    def fit(self, strategies, times_s) -> None:
        times_s = np.asarray(times_s, dtype=float)
        new = slice(self.seen, len(strategies))
        if self.ready and len(strategies) > self.seen:
            held = strategies[new]
            # Scores are higher-is-faster: negated, they order as times do.
            learned_right, pairs = pairwise_counts(-np.asarray(self.learned.score(held), float), times_s[new])
            free_right, _ = pairwise_counts(-np.asarray(self.training_free.score(held), float), times_s[new])
            self.right["learned"] += learned_right
            self.right["training_free"] += free_right
            self.pairs += pairs
        self.learned.fit(strategies, times_s)
        # A calibrated replay refits its constants too, after it was judged on these trials.
        self.training_free.fit(strategies, times_s)
        self.ready = True
        self.seen = len(strategies)
        acc = {k: (v / self.pairs if self.pairs else None) for k, v in self.right.items()}
        self.use_learned = self.pairs >= self.MIN_PAIRS and acc["learned"] > acc["training_free"]
        self._history.append({"trials": self.seen, "held_out_pairs": self.pairs, "learned_accuracy": acc["learned"],
                             "training_free_accuracy": acc["training_free"],
                             "scoring": "learned" if self.use_learned else "training-free"})
