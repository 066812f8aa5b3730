"""Search: samplers of strategies, experiment files, AutoDist's Algorithm 1 (ask/tell), and the
simulator-only searches (coordinate descent, Monte-Carlo tree search) it can trial or draw from."""

from .algorithm import Algorithm1, Proposal, fidelity_level, select_diverse
from .experiment import ALGORITHMS, GENERATORS, Experiment, load_experiment
from .local_search import ChoiceSpace, LocalSearchResult, coordinate_descent, mcts
from .sampler import GuidedSampler, RandomSampler

__all__ = [
    "ALGORITHMS",
    "Algorithm1",
    "ChoiceSpace",
    "Experiment",
    "GENERATORS",
    "GuidedSampler",
    "LocalSearchResult",
    "Proposal",
    "RandomSampler",
    "coordinate_descent",
    "fidelity_level",
    "load_experiment",
    "mcts",
    "select_diverse",
]
