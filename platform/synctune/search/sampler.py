"""Samplers of composed strategies (AutoDist §2.4 "strategy sampler").

:class:`RandomSampler` draws from the whole representation with no knowledge constraints: per
variable a random partition (sometimes), per shard a synchronizer (PS on a node's server, or
all-reduce; all-gather too for sparse gradients), PS local aggregation at random, and merge
groups over adjacent variables. It is the "plain random" ablation of the papers and the source
of varied training data for the simulator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import (
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    PSSynchronizer,
    ShardPlan,
    Strategy,
    VariablePlan,
)

__all__ = ["RandomSampler"]


@dataclass
class RandomSampler:
    """Uniform-ish random strategies; ``seed`` makes the sequence reproducible."""

    model: ModelSpec
    cluster: ClusterSpec
    seed: int = 0
    partition_prob: float = 0.3
    max_shards: int = 4
    ps_prob: float = 0.5
    new_group_prob: float = 0.2

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.servers = [node.devices[0] for node in self.cluster.nodes]

    def sample(self) -> Strategy:
        """One random valid strategy."""
        rng = self.rng
        plans = []
        group = 0
        sparse_group_offset = 10_000  # sparse and dense gradients never share a merge group
        for var in self.model.variables:
            partition = [1] * len(var.shape)
            axes = [a for a, d in enumerate(var.shape) if d > 1 and (a == 0 or not var.sparse)]
            if axes and rng.random() < self.partition_prob:
                axis = rng.choice(axes)
                partition[axis] = rng.randint(2, min(self.max_shards, var.shape[axis]))
            shards = []
            for _ in range(math.prod(partition)):
                roll = rng.random()
                if var.sparse and roll < (1 - self.ps_prob) / 2:
                    sync = AllGatherSynchronizer()
                elif roll < self.ps_prob:
                    sync = PSSynchronizer(placement=rng.choice(self.servers), local_aggregation=rng.random() < 0.5)
                else:
                    if rng.random() < self.new_group_prob:
                        group += 1
                    sync = AllReduceSynchronizer(group=group + (sparse_group_offset if var.sparse else 0))
                shards.append(ShardPlan(synchronizer=sync))
            plans.append(VariablePlan(variable=var.name, partition=tuple(partition), shards=tuple(shards)))
        return Strategy(model={"name": self.model.name, "hash": self.model.hash},
                        cluster={"name": self.cluster.name, "hash": self.cluster.hash},
                        replicas=self.cluster.devices,
                        batch_split=tuple(self.model.batch_size for _ in self.cluster.devices),
                        plans=tuple(plans))

    def sample_many(self, n: int) -> list[Strategy]:
        return [self.sample() for _ in range(n)]
