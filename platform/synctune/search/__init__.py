"""Search: samplers of strategies, experiment files, and AutoDist's Algorithm 1 (ask/tell)."""

from .algorithm import Algorithm1, Proposal, fidelity_level, select_diverse
from .experiment import ALGORITHMS, Experiment, load_experiment
from .sampler import GuidedSampler, RandomSampler

__all__ = [
    "ALGORITHMS",
    "Algorithm1",
    "Experiment",
    "GuidedSampler",
    "Proposal",
    "RandomSampler",
    "fidelity_level",
    "load_experiment",
    "select_diverse",
]
