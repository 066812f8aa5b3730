"""Simulator-only searches over per-variable choices: AutoDDL's coordinate descent (§4.4) and
TAG's Monte-Carlo tree search (§4.2.2).

Both work on a :class:`ChoiceSpace`: for a variable (or a group of adjacent variables, TAG's
"op group"), the synchronization choices a strategy may give it, each applied with every other
variable's plan fixed. They score strategies with a callable (higher is better: the search's
training-free simulator, negated time) and never run trials; Algorithm 1 trials what they find
(``algorithm: coordinate-descent`` or ``mcts``) or scores what they find with its own simulator
(``generator:``). Their effort is bounded by a number of scored strategies and, optionally, a
wall-clock deadline, so the search time they get is explicit (AutoDDL Fig. 7).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.compressors import COMPRESSORS
from ..strategy.partition import shard_shapes
from ..strategy.schema import (SPARSE_GROUP_BASE, AllGatherSynchronizer, AllReduceSynchronizer, Compressor,
                               PSSynchronizer, SFBSynchronizer, ShardPlan, ShardSynchronizer, Strategy, VariablePlan)
# canonical_groups lives with the sampler (which numbers its sharded draws with it); it is
# re-exported here, where the searches have always found it.
from .sampler import GuidedSampler, canonical_groups, hsdp_size, shardable

__all__ = ["ChoiceSpace", "Choice", "coordinate_descent", "mcts", "random_sampling", "LocalSearchResult",
           "canonical_groups", "compressor_choices"]

Score = Callable[[list[Strategy]], np.ndarray]

#: Sparse all-reduce shards live in groups of their own (ids from here on), as the sampler does.
SPARSE_GROUPS = SPARSE_GROUP_BASE
#: Batch splits tried on replicas of different measured speeds: the fraction of the way from an
#: even split to one proportional to speed (TAG §4.2: the batch share is part of the strategy).
SPLIT_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Ranks tried for a compressor that takes one (PowerSGD): a low and a higher one.
RANK_CHOICES = (1, 4)
#: Lossy compressors offered on a PS server, the first ones in registry order: each adds a
#: choice per server to every coordinate, and the training-free model scores casts of one wire
#: size alike, so a second one costs evaluations and finds nothing new (experiments/findings/
#: README.md, "The replay's versions", the last paragraph).
PS_LOSSY_CHOICES = 1
#: The identity compressor's name: gradients sent as they are.
NO_COMPRESSION = Compressor().kind
#: The reduce dtypes a ``shard`` choice offers: fp32, and bf16 (lossy) when the space is lossy.
SHARD_DTYPES = ("fp32", "bf16")
#: With a space that offers ``shard``: how often the restarts of coordinate descent and the
#: random-sampling reference draw a sharded strategy (:class:`GuidedSampler`'s ``shard_prob``).
SHARD_RESTART_PROB = 0.5


def compressor_choices(sync_kind: str, lossy: bool, max_lossy: int | None = None) -> list[tuple[str, int]]:
    """``(name, rank)`` of the compressors in the registry that wrap ``sync_kind``, in registry
    order: every lossless one, and where ``lossy`` the lossy ones (the first ``max_lossy`` of
    them; None: all); a compressor that takes a rank once per :data:`RANK_CHOICES` (rank 0: it
    takes none)."""
    out: list[tuple[str, int]] = []
    num_lossy = 0
    for name, info in COMPRESSORS.items():
        if sync_kind not in info.synchronizers or not (info.lossless or lossy):
            continue
        if not info.lossless:
            if max_lossy is not None and num_lossy >= max_lossy:
                continue
            num_lossy += 1
        out += [(name, r) for r in RANK_CHOICES] if "rank" in info.params else [(name, 0)]
    return out


@dataclass(frozen=True)
class Choice:
    """One synchronization choice for the variables of a coordinate.

    ``kind``: ``ar`` (dense all-reduce; ``group`` an existing merge group to join, or None for
    a new one), ``ps`` (whole variable on ``server``, ``local`` aggregation within nodes),
    ``pps`` (cut along axis 0 into one shard per server, AutoDist's partitioned PS), ``sfb``
    (sufficient-factor broadcasting of the coordinate's linear weights), ``shard`` (ZeRO-2: the
    coordinate's shardable variables sharded as one new unit, or joining the neighbours' unit
    ``unit``, over shard groups of ``group`` replicas, 0 every one, reducing in
    ``reduce_dtype``; its other variables keep their plans).
    ``algorithm``, ``compressor`` and ``rank`` as in the strategy language. Sparse variables
    given an ``ar`` choice are all-gathered (their rows, not a dense tensor)."""

    kind: str
    server: int = 0
    local: bool = False
    group: int | None = None
    algorithm: str = "flat"
    compressor: str = NO_COMPRESSION
    rank: int = 0
    reduce_dtype: str = "fp32"
    unit: int | None = None


class ChoiceSpace:
    """The choices of a (model, cluster) domain, and strategies with one coordinate changed.

    Coordinates are groups of adjacent variables in backward order (``coordinates(n)``: at
    most ``n`` of them, of similar bytes; one per variable for coordinate descent), plus, where
    nodes differ in measured speed, the replication: which nodes hold replicas and how the
    batch is split among them. Choices: all-reduce joining a merge group already used by the
    neighbouring variables or a new group (flat, or hierarchical where every node holds as many
    replicas; flat groups with every compressor of the registry that wraps all-reduce, the lossy
    ones only when ``lossy``), a PS on each node (uncompressed with and without local
    aggregation; without it, also with the lossless compressors that wrap a PS and, when
    ``lossy``, the first :data:`PS_LOSSY_CHOICES` lossy ones), a PS partitioned over every node
    for variables of at least ``small_bytes``, all-gather for sparse variables, sufficient-factor
    broadcasting for linear weights (TAG §4.2.3; the other variables of a coordinate keep their
    plans). With ``shard`` (issue 34 item 2), also ZeRO-2 sharding of a coordinate's shardable
    variables (DESIGN.md "shard"): a new unit, over every replica or, where the nodes allow it,
    HSDP over each node (:func:`~synctune.search.sampler.hsdp_size`), reducing in fp32 or, when
    ``lossy``, bf16; or joining a neighbouring variable's unit, so units can grow to modules."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, lossy: bool = True,
                 small_bytes: int = 256 * 1024, shard: bool = False) -> None:
        self.model, self.cluster, self.lossy, self.small_bytes = model, cluster, lossy, small_bytes
        self.shard = shard
        self.shard_dtypes = SHARD_DTYPES if lossy else SHARD_DTYPES[:1]
        self.shardable = {v.name for v in model.variables if shardable(v)}
        self.helper = GuidedSampler(model, cluster, seed=0, lossy=lossy)  # servers, speeds, compressor fitting
        self.servers = self.helper.servers
        self.variables = list(model.variables)
        self.index = {v.name: i for i, v in enumerate(self.variables)}
        self.linear = {v.name for v, r in zip(self.variables, model.factor_rows or ()) if r}
        #: All-reduce algorithms a new merge group may use.
        self.algorithms = ("flat",) + (("hierarchical",) if self.helper.even_nodes and len(cluster.nodes) > 1 else ())
        self._new_groups = [(a, c, r) for a in self.algorithms for c, r in compressor_choices("allreduce", lossy)
                            if a == "flat" or c == NO_COMPRESSION]
        self._ps = [(j, local, c, r) for j in range(len(self.servers)) for local in (False, True)
                    for c, r in compressor_choices("ps", lossy, PS_LOSSY_CHOICES)
                    if not (local and c != NO_COMPRESSION)]

    # ------------------------------------------------------------------------------- coordinates

    def coordinates(self, n: int | None = None) -> list[list[int]]:
        """Variable indices grouped into at most ``n`` runs of adjacent variables of similar
        bytes (None: one per variable)."""
        count = len(self.variables)
        if n is None or n >= count:
            return [[i] for i in range(count)]
        total = sum(v.num_bytes for v in self.variables) or 1
        runs, current, filled = [], [], 0.0
        for i, v in enumerate(self.variables):
            if current and filled + v.num_bytes > total / n * 1.0001 and len(runs) < n - 1:
                runs.append(current)
                current, filled = [], 0.0
            current.append(i)
            filled += v.num_bytes
        runs.append(current)
        return runs

    @property
    def has_split(self) -> bool:
        return self.helper.speeds is not None

    def splits(self, strategy: Strategy) -> list[Strategy]:
        """The replication coordinate (TAG §4.2; replicas of different speeds only): ``strategy``
        on every node or without one node, each under every batch split of :data:`SPLIT_STEPS`."""
        if not self.has_split:
            return []
        nodes = list(range(len(self.cluster.nodes)))
        bases = [strategy if list(strategy.replicas) == list(self.cluster.devices) else
                 self.helper.on_nodes(strategy, nodes)]
        if len(nodes) > 1:
            bases += [c for c in (self.helper.without_node(strategy, out) for out in nodes) if c is not None]
        return [self.helper.split_towards_speed(base, t) for base in bases for t in SPLIT_STEPS]

    # ----------------------------------------------------------------------------------- choices

    def choices(self, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
        """The choices for the variables of ``coordinate`` in ``strategy``: joining the dense
        groups its neighbours use (merging with them, AutoSync's c_am) or a new group, the PS
        placements, and the partitioned PS where a variable is large enough."""
        variables = [self.variables[i] for i in coordinate]
        dense = [v for v in variables if not v.sparse]
        out: list[Choice] = []
        for algorithm, comp, rank in self._new_groups:
            if comp == NO_COMPRESSION or all(self.fits(v, comp, rank, "allreduce") for v in dense) and dense:
                out.append(Choice("ar", algorithm=algorithm, compressor=comp, rank=rank))
        for gid, (algorithm, comp, rank) in self._neighbour_groups(strategy, coordinate).items():
            if dense and all(comp == NO_COMPRESSION or self.fits(v, comp, rank, "allreduce") for v in dense):
                out.append(Choice("ar", group=gid, algorithm=algorithm, compressor=comp, rank=rank))
        held = set(strategy.replicas)
        for j, local, comp, rank in self._ps:
            if comp != NO_COMPRESSION and not (dense and all(self.fits(v, comp, rank, "ps") for v in dense)):
                continue
            if self.servers[j] in held:  # a PS lives on a replica
                out.append(Choice("ps", server=j, local=local, compressor=comp, rank=rank))
        if len(self._servers_of(strategy)) > 1 and any(v.num_bytes >= self.small_bytes and v.shape and v.shape[0] >= 2
                                         for v in variables):
            out.append(Choice("pps"))
        if any(v.name in self.linear for v in variables):
            out.append(Choice("sfb"))
        if self.shard and len(strategy.replicas) > 1 and any(v.name in self.shardable for v in variables):
            hsdp = hsdp_size(strategy, self.cluster)
            for group in (0, hsdp) if hsdp else (0,):
                for dtype in self.shard_dtypes:
                    out.append(Choice("shard", group=group, reduce_dtype=dtype))
            for uid, sync in self._neighbour_units(strategy, coordinate).items():
                out.append(Choice("shard", group=sync.group, reduce_dtype=sync.reduce_dtype, unit=uid))
        return out

    def _neighbour_units(self, strategy: Strategy, coordinate: Sequence[int]) -> dict[int, ShardSynchronizer]:
        """The ``shard`` units of the variables just before and after ``coordinate`` (joining one
        grows a unit towards a module: one reduce-scatter for more variables)."""
        units: dict[int, ShardSynchronizer] = {}
        inside = set(coordinate)
        for i in (min(coordinate) - 1, max(coordinate) + 1):
            if 0 <= i < len(strategy.plans) and i not in inside:
                for shard in strategy.plans[i].shards:
                    if isinstance(shard.synchronizer, ShardSynchronizer):
                        units.setdefault(shard.synchronizer.unit, shard.synchronizer)
        return units

    def fits(self, var, comp: str, rank: int, sync_kind: str) -> bool:
        """Whether compressor ``comp`` (at ``rank``) encodes the whole of ``var`` under a
        ``sync_kind`` synchronizer (never a sparse variable)."""
        if var.sparse:
            return False
        return self.helper._compressor(comp, rank, var, tuple(var.shape), sync_kind).kind == comp

    def _neighbour_groups(self, strategy: Strategy, coordinate: Sequence[int]) -> dict[int, tuple[str, str, int]]:
        """The dense merge groups of the variables just before and after ``coordinate``."""
        groups: dict[int, tuple[str, str, int]] = {}
        for i in (min(coordinate) - 1, max(coordinate) + 1):
            if 0 <= i < len(strategy.plans):
                for shard in strategy.plans[i].shards:
                    sync = shard.synchronizer
                    if isinstance(sync, AllReduceSynchronizer) and sync.group < SPARSE_GROUPS:
                        groups[sync.group] = (sync.algorithm, shard.compressor.kind, shard.compressor.rank or 0)
        return groups

    def _servers_of(self, strategy: Strategy) -> list[str]:
        """The PS servers (each node's first device) that hold a replica of ``strategy``."""
        held = set(strategy.replicas)
        return [d for d in self.servers if d in held]

    def _plan(self, var, choice: Choice, group: int, servers: list[str]) -> VariablePlan:
        shape = tuple(var.shape)
        whole = tuple(1 for _ in shape)
        if (choice.kind == "pps" and len(servers) > 1 and var.shape and var.shape[0] >= 2
                and var.num_bytes >= self.small_bytes):
            pieces = min(len(servers), var.shape[0])
            partition = (pieces,) + tuple(1 for _ in shape[1:])
            shards = tuple(ShardPlan(synchronizer=PSSynchronizer(placement=servers[k]))
                           for k in range(len(shard_shapes(shape, partition))))
            return VariablePlan(variable=var.name, partition=partition, shards=shards)
        if choice.kind in ("ps", "pps"):
            server = self.servers[choice.server] if choice.kind == "ps" else servers[self.index[var.name] % len(servers)]
            sync = PSSynchronizer(placement=server, local_aggregation=choice.local and not var.sparse)
            return VariablePlan(variable=var.name, partition=whole, shards=(ShardPlan(
                synchronizer=sync, compressor=self._compressor(var, choice, "ps")),))
        if var.sparse:  # ``ar`` on a sparse variable: its rows, all-gathered
            return VariablePlan(variable=var.name, partition=whole,
                                shards=(ShardPlan(synchronizer=AllGatherSynchronizer()),))
        sync = AllReduceSynchronizer(group=group, algorithm=choice.algorithm)
        return VariablePlan(variable=var.name, partition=whole, shards=(ShardPlan(
            synchronizer=sync, compressor=self._compressor(var, choice, "allreduce")),))

    def _compressor(self, var, choice: Choice, sync_kind: str) -> Compressor:
        """``choice``'s compressor for ``var``: none on a sparse variable, a rank fitted to the
        variable's shape for a compressor that takes one."""
        if choice.compressor == NO_COMPRESSION or var.sparse:
            return Compressor()
        if "rank" in COMPRESSORS.get(choice.compressor).params:
            return self.helper._compressor(choice.compressor, choice.rank, var, tuple(var.shape), sync_kind)
        return Compressor(kind=choice.compressor)

    def apply(self, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
        """``strategy`` with the variables of ``coordinate`` synchronized by ``choice`` (its groups renumbered)."""
        if choice.kind == "ar" and choice.group is not None:
            group = choice.group
        else:
            group = 1 + max((s.synchronizer.group for p in strategy.plans for s in p.shards
                             if isinstance(s.synchronizer, AllReduceSynchronizer)
                             and s.synchronizer.group < SPARSE_GROUPS), default=-1)
        plans = list(strategy.plans)
        if choice.kind == "shard":
            return canonical_groups(dataclasses.replace(strategy, plans=tuple(self._sharded(strategy, coordinate,
                                                                                            choice))))
        servers = self._servers_of(strategy)
        for i in coordinate:
            if choice.kind == "sfb":
                var = self.variables[i]
                if var.name in self.linear:
                    plans[i] = VariablePlan(variable=var.name, partition=tuple(1 for _ in var.shape),
                                            shards=(ShardPlan(synchronizer=SFBSynchronizer()),))
                continue
            plans[i] = self._plan(self.variables[i], choice, group, servers)
        return canonical_groups(dataclasses.replace(strategy, plans=tuple(plans)))

    def _sharded(self, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> list[VariablePlan]:
        """The plans of ``strategy`` with the shardable variables of ``coordinate`` in ``choice``'s
        unit: the neighbour's (its synchronizer as it is) or a new one (ZeRO-2: no reshard)."""
        units = [s.synchronizer for p in strategy.plans for s in p.shards
                 if isinstance(s.synchronizer, ShardSynchronizer)]
        sync = next((u for u in units if u.unit == choice.unit), None) if choice.unit is not None else None
        if sync is None:
            sync = ShardSynchronizer(unit=1 + max((u.unit for u in units), default=-1), group=choice.group or 0,
                                     reduce_dtype=choice.reduce_dtype)
        plans = list(strategy.plans)
        for i in coordinate:
            var = self.variables[i]
            if var.name in self.shardable:
                plans[i] = VariablePlan(variable=var.name, partition=tuple(1 for _ in var.shape),
                                        shards=(ShardPlan(synchronizer=sync),))
        return plans

    def neighbours(self, strategy: Strategy, coordinate: Sequence[int]) -> list[Strategy]:
        """Every strategy one choice away along ``coordinate`` (distinct, ``strategy`` excluded)."""
        seen = {strategy.hash}
        out = []
        for choice in self.choices(strategy, coordinate):
            candidate = self.apply(strategy, coordinate, choice)
            h = candidate.hash
            if h not in seen:
                seen.add(h)
                out.append(candidate)
        return out

    def sampler(self, seed: int) -> GuidedSampler:
        """A guided sampler of this space's domain (restarts, the random reference): sharded
        draws at :data:`SHARD_RESTART_PROB` where the space offers ``shard``, none otherwise."""
        return GuidedSampler(self.model, self.cluster, seed=seed, lossy=self.lossy,
                             shard_prob=SHARD_RESTART_PROB if self.shard else 0.0)

    def data_parallel(self) -> Strategy:
        """TAG's baseline and the tree's root: every variable on one flat all-reduce group
        (sparse ones all-gathered), the batch split evenly."""
        plans = [self._plan(v, Choice("ar"), 0, self.servers) for v in self.variables]
        return canonical_groups(Strategy.over(self.model, self.cluster, plans))


@dataclass
class LocalSearchResult:
    """What a simulator-only search found: distinct strategies, best first, with their scores,
    and how much it scored (``evaluations``) in how long (``seconds``)."""

    strategies: list[Strategy]
    scores: list[float]
    evaluations: int
    seconds: float
    trace: list[tuple[int, float, float]]  # (evaluations, seconds, best score so far)

    def top(self, k: int, exclude: Iterable[str] = ()) -> list[tuple[Strategy, float]]:
        skip = set(exclude)
        return [(s, sc) for s, sc in zip(self.strategies, self.scores) if s.hash not in skip][:k]


class _Budget:
    """Counts scored strategies against ``evaluations`` and a wall-clock ``seconds`` limit, and
    keeps the best distinct strategies seen."""

    def __init__(self, score: Score, evaluations: int, seconds: float | None, keep: int = 64) -> None:
        self._score, self.limit, self.keep = score, evaluations, keep
        self.start = time.perf_counter()
        self.deadline = None if seconds is None else self.start + seconds
        self.used = 0
        self.best: dict[str, tuple[float, Strategy]] = {}
        self.trace: list[tuple[int, float, float]] = []
        self.best_score = -math.inf
        self._floor = -math.inf  # scores at or below it can no longer make the kept best

    @property
    def spent(self) -> bool:
        return self.used >= self.limit or (self.deadline is not None and time.perf_counter() >= self.deadline)

    def score(self, strategies: list[Strategy]) -> np.ndarray:
        if not strategies:
            return np.zeros(0)
        values = np.asarray(self._score(strategies), dtype=float)
        self.used += len(strategies)
        for s, v in zip(strategies, values):
            if np.isfinite(v) and v > self._floor:
                self.best[s.hash] = (float(v), s)
        if len(self.best) > 2 * self.keep:
            kept = sorted(self.best.items(), key=lambda item: -item[1][0])[: self.keep]
            self.best = dict(kept)
            self._floor = kept[-1][1][0]
        top = float(np.max(values))
        if top > self.best_score:
            self.best_score = top
        self.trace.append((self.used, time.perf_counter() - self.start, self.best_score))
        return values

    def result(self) -> LocalSearchResult:
        ranked = sorted(self.best.values(), key=lambda x: -x[0])[: self.keep]
        return LocalSearchResult([s for _, s in ranked], [v for v, _ in ranked], self.used,
                                 time.perf_counter() - self.start, self.trace)


def coordinate_descent(space: ChoiceSpace, score: Score, starts: Sequence[Strategy], *, rng: random.Random,
                       evaluations: int = 20_000, seconds: float | None = None, max_sweeps: int = 8,
                       keep: int = 64) -> LocalSearchResult:
    """AutoDDL §4.4: from each start, for each coordinate in turn (the batch split, then every
    variable in backward order), the choice the model scores best with every other coordinate
    fixed; sweeps until a fixed point (no coordinate improves), then restart from the next start,
    then from random guided samples, until ``evaluations`` strategies were scored or ``seconds``
    passed ("many restarts": a single descent converges fast, restarts escape local minima)."""
    budget = _Budget(score, evaluations, seconds, keep)
    coords = space.coordinates()
    sampler = space.sampler(rng.getrandbits(63))
    queue = list(starts)
    while not budget.spent:
        start = queue.pop(0) if queue else canonical_groups(sampler.sample())
        current = start
        current_score = float(budget.score([current])[0])
        for _sweep in range(max_sweeps):
            improved = False
            order = list(range(len(coords)))
            rng.shuffle(order)  # a fixed order favours the first variables' choices
            steps: list[Callable[[Strategy], list[Strategy]]] = []
            if space.has_split:
                steps.append(space.splits)
            steps += [lambda s, c=coords[i]: space.neighbours(s, c) for i in order]
            for step in steps:
                if budget.spent:
                    break
                candidates = [c for c in step(current) if c.hash != current.hash]
                values = budget.score(candidates)
                if len(values) and values.max() > current_score + 1e-12:
                    j = int(np.argmax(values))
                    current, current_score, improved = candidates[j], float(values[j]), True
            if not improved or budget.spent:
                break
    return budget.result()


def random_sampling(space: ChoiceSpace, score: Score, *, rng: random.Random, evaluations: int = 20_000,
                    seconds: float | None = None, batch: int = 100, keep: int = 64) -> LocalSearchResult:
    """The reference of AutoDDL Fig. 7: guided random strategies (AutoDist §2.4's sampler),
    scored in batches, the best kept, under the same budget as the other searches."""
    budget = _Budget(score, evaluations, seconds, keep)
    sampler = space.sampler(rng.getrandbits(63))
    while not budget.spent:
        budget.score([canonical_groups(sampler.sample()) for _ in range(batch)])
    return budget.result()


class _Node:
    __slots__ = ("strategy", "children", "prior", "visits", "value", "expanded")

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.children: list[_Node] = []
        self.prior = np.zeros(0)
        self.visits = 0
        self.value = 0.0  # running mean reward
        self.expanded = False


def mcts(space: ChoiceSpace, score: Score, *, rng: random.Random, levels: int = 16, evaluations: int = 20_000,
         seconds: float | None = None, c_puct: float = 1.5, temperature: float = 0.5,
         backup: str = "max", rollout: bool = True, keep: int = 64,
         root: Strategy | None = None) -> LocalSearchResult:
    """TAG §4.2.2: a tree whose root is data-parallel all-reduce (by default) and whose level ``i`` decides
    the ``i``-th coordinate (first the batch split on replicas of different speeds, then groups
    of adjacent variables, largest bytes first, at most ``levels`` of them); a vertex is the
    strategy so far, the variables not yet decided keeping the root's plan. Selection by PUCT
    (``Q + c·G·sqrt(ΣN)/(1+N)``); a vertex is expanded by scoring all its children at once
    with the model, whose softmax (``temperature`` relative to the root's score) is the prior
    G (where TAG uses its GNN) and whose best child's speed-up over the root is the value
    backed up (the reward: predicted speed-up over data parallelism). ``root``: another
    strategy to start from (a search's best measured one) in place of data parallelism."""
    budget = _Budget(score, evaluations, seconds, keep)
    root = _Node(canonical_groups(root) if root is not None else space.data_parallel())
    base = float(budget.score([root.strategy])[0])
    scale = abs(base) or 1.0
    runs = space.coordinates(levels)
    runs.sort(key=lambda run: -sum(space.variables[i].num_bytes for i in run))
    depth_steps: list[Callable[[Strategy], list[Strategy]]] = []
    if space.has_split:
        depth_steps.append(space.splits)
    depth_steps += [lambda s, c=run: [s] + space.neighbours(s, c) for run in runs]

    def reward(value: float) -> float:
        return (-base) / max(-value, 1e-12) if value < 0 else value / scale  # predicted speed-up over the root

    idle = 0  # selections in a row that reached only vertices already scored
    while not budget.spent and idle < 1000:
        node, path, depth = root, [root], 0
        while node.expanded and node.children:
            total = math.sqrt(max(1, node.visits))
            best, best_u = None, -math.inf
            for child, g in zip(node.children, node.prior):
                u = child.value + c_puct * g * total / (1 + child.visits)
                if u > best_u:
                    best, best_u = child, u
            node = best
            path.append(node)
            depth += 1
        value = node.value
        if not node.expanded:
            node.expanded = True
            if depth < len(depth_steps):
                children = list({s.hash: s for s in depth_steps[depth](node.strategy)}.values())
                rng.shuffle(children)  # ties (the model often scores choices alike) broken by the seed
                values = budget.score(children)
                node.children = [_Node(s) for s in children]
                if len(values):
                    logits = (values - values.max()) / (temperature * scale)
                    prior = np.exp(logits)
                    node.prior = prior / prior.sum()
                    for child, v in zip(node.children, values):
                        child.value, child.visits = reward(float(v)), 1
                    value = reward(float(values.max()))
                    if rollout:
                        # The rollout (TAG §4.2.2's evaluation of a vertex, with the model as
                        # the policy): from the best child, the best choice level by level down
                        # to a complete strategy. The best child is worth at least that.
                        best_child = node.children[int(np.argmax(values))]
                        final = _greedy_rollout(best_child.strategy, depth_steps[depth + 1:], budget)
                        if final is not None:
                            value = max(value, reward(final))
                            best_child.value = max(best_child.value, reward(final))
                    idle = 0
        else:
            idle += 1  # a complete strategy chosen again: its value is known
        for n in path:
            n.visits += 1
            # Max backup: a vertex is worth the best complete strategy found below it. TAG backs
            # up the running mean; with a deterministic model the mean punishes a vertex for
            # its bad siblings' subtrees, and the tree then rarely leaves the first good path.
            n.value = max(n.value, value) if backup == "max" else n.value + (value - n.value) / n.visits
    return budget.result()


def _greedy_rollout(strategy: Strategy, steps: Sequence[Callable[[Strategy], list[Strategy]]],
                    budget: _Budget) -> float | None:
    """The score of the strategy reached from ``strategy`` by taking, at each remaining level,
    the choice the model scores best (None when there is no level left or the budget ran out)."""
    value = None
    for step in steps:
        if budget.spent:
            break
        candidates = step(strategy)
        values = budget.score(candidates)
        if not len(values):
            break
        j = int(np.argmax(values))
        strategy, value = candidates[j], float(values[j])
    return value
