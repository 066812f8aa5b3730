"""Search: samplers of strategies (and, with the search issue, Algorithm 1 and Tune glue)."""

from .sampler import RandomSampler

__all__ = ["RandomSampler"]
