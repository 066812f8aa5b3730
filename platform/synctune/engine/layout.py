"""Where each shard of each variable lives: slices of the parameter tensor, ranks and nodes.

Rank ``r`` of a trial runs replica ``strategy.replicas[r]``; shard ``i`` of a variable is the
i-th cell, in row-major order, of the grid its partition cuts (AutoDist §2.3 "Partitioner"),
with uneven cuts as in ``torch.tensor_split``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.cluster import ClusterSpec
from ..strategy.schema import Strategy

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    """The ranks of a trial and the node each belongs to."""

    replicas: tuple[str, ...]
    node_of_rank: tuple[str, ...]

    @classmethod
    def of(cls, strategy: Strategy, cluster: ClusterSpec) -> "RankLayout":
        """The layout of ``strategy``'s replicas on ``cluster``: rank ``r`` runs ``strategy.replicas[r]``."""
        return cls(replicas=tuple(strategy.replicas),
                   node_of_rank=tuple(cluster.node_of(d).name for d in strategy.replicas))

    @property
    def world_size(self) -> int:
        """The number of ranks (one per replica)."""
        return len(self.replicas)

    def rank_of(self, device: str) -> int:
        """The rank that runs replica ``device`` (a ``ValueError`` when none does)."""
        return self.replicas.index(device)

    def ranks_on_node(self, node: str) -> list[int]:
        """The ranks on node ``node``, in rank order (empty when none runs there)."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    def nodes(self) -> list[str]:
        """Node names in order of their first rank."""
        return list(dict.fromkeys(self.node_of_rank))

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks of its node (selects the GPU on that node)."""
        return self.ranks_on_node(self.node_of_rank[rank]).index(rank)

    def local_root(self, node: str, placement_rank: int) -> int:
        """The rank that aggregates ``node`` for a server at ``placement_rank``: the server itself
        on its own node, else the node's first rank."""
        ranks = self.ranks_on_node(node)
        return placement_rank if placement_rank in ranks else ranks[0]
