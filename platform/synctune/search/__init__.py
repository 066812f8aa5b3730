"""Search: samplers of strategies, experiment files, the ask/tell search shell
(:class:`StrategySearch`, AutoDist's Algorithm 1) with one round policy per algorithm
(:data:`ROUND_POLICIES`), and the simulator-only searches (coordinate descent, Monte-Carlo tree
search) it can trial or draw from."""

from .algorithm import StrategySearch
from .experiment import (ALGORITHMS, GENERATORS, BaselinesSection, ConfirmSection, DomainSection, Experiment, RunSection,
                         SearchSection, TrialSection, load_experiment)
from .interface import Proposal, SimulatorProtocol
from .local_search import ChoiceSpace, LocalSearchResult, coordinate_descent, mcts
from .policies import ROUND_POLICIES, RoundPolicy
from .sampler import GuidedSampler, RandomSampler
from .selection import fidelity_level, select_diverse

__all__ = [
    "ALGORITHMS",
    "BaselinesSection",
    "ChoiceSpace",
    "ConfirmSection",
    "DomainSection",
    "Experiment",
    "GENERATORS",
    "GuidedSampler",
    "LocalSearchResult",
    "Proposal",
    "ROUND_POLICIES",
    "RandomSampler",
    "RoundPolicy",
    "RunSection",
    "SearchSection",
    "SimulatorProtocol",
    "StrategySearch",
    "TrialSection",
    "coordinate_descent",
    "fidelity_level",
    "load_experiment",
    "mcts",
    "select_diverse",
]
