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
from ..strategy.checkpoint import checkpoint_blocks
from ..strategy.compressors import COMPRESSORS
from ..strategy.builders import megatron_choices, without_tensor_parallel
from ..strategy.errors import StrategyError
from ..strategy.schema import Compressor, Strategy
from ..strategy.tensor_parallel import check_tensor_parallel
from .kinds import NO_COMPRESSION, SEARCH_KINDS, Choice, choice_owner, compressor_choices, data_parallel_plans
# canonical_groups lives with the sampler (which numbers its draws with it); it is re-exported
# here, where the searches have always found it.
from .sampler import GuidedSampler, canonical_groups, shardable
from .tp_draw import split_layout, split_strategy

__all__ = ["ChoiceSpace", "Choice", "coordinate_descent", "mcts", "random_sampling", "LocalSearchResult",
           "canonical_groups", "compressor_choices"]

Score = Callable[[list[Strategy]], np.ndarray]

#: Batch splits tried on replicas of different measured speeds: the fraction of the way from an
#: even split to one proportional to speed (TAG §4.2: the batch share is part of the strategy).
SPLIT_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: With a space that offers ``shard``: how often the restarts of coordinate descent and the
#: random-sampling reference draw a sharded strategy (:class:`GuidedSampler`'s ``shard_prob``).
SHARD_RESTART_PROB = 0.5
#: With a space that offers tensor parallelism: how often those restarts draw a split strategy.
SPLIT_RESTART_PROB = 0.5


class ChoiceSpace:
    """The choices of a (model, cluster) domain, and strategies with one coordinate changed.

    Coordinates are groups of adjacent variables in backward order (``coordinates(n)``: at
    most ``n`` of them, of similar bytes; one per variable for coordinate descent), plus, where
    nodes differ in measured speed, the replication: which nodes hold replicas and how the
    batch is split among them. The choices on a coordinate are every registered kind's
    (:data:`~synctune.search.kinds.SEARCH_KINDS`, in its order), each applied by the kind that
    offers it. The built-in kinds offer: all-reduce joining a merge group already used by the
    neighbouring variables or a new group (flat, or hierarchical where every node holds as many
    replicas; flat groups with every compressor of the registry that wraps all-reduce, the lossy
    ones only when ``lossy``), a PS on each node (uncompressed with and without local
    aggregation; without it, also with the lossless compressors that wrap a PS and, when
    ``lossy``, the first :data:`~synctune.search.kinds.PS_LOSSY_CHOICES` lossy ones), a PS
    partitioned over every node for variables of at least ``small_bytes``, all-gather for sparse variables, sufficient-factor
    broadcasting for linear weights (TAG §4.2.3; the other variables of a coordinate keep their
    plans). With ``shard``, also ZeRO-2 sharding of a coordinate's shardable variables
    (DESIGN.md "shard"): a new unit, over every replica or, where the nodes allow it,
    HSDP over each node (:func:`~synctune.search.shard_draw.hsdp_size`), reducing in fp32 or, when
    ``lossy``, bf16; or joining a neighbouring variable's unit, so units can grow to modules.
    With ``checkpoint``, activation checkpointing is a coordinate too (:meth:`checkpointing`);
    with ``split``, tensor parallelism (:meth:`tensor_parallelism`). A neighbour of a strategy that
    splits modules is kept only where its split still holds
    (:func:`~synctune.strategy.tensor_parallel.check_tensor_parallel`: one data-parallel kind,
    whole variables, TP groups inside nodes)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, *, lossy: bool = True,
                 small_bytes: int = 256 * 1024, shard: bool = False, checkpoint: bool = False,
                 split: bool = False) -> None:
        self.model, self.cluster, self.lossy, self.small_bytes = model, cluster, lossy, small_bytes
        self.shard = shard
        #: What Megatron's plan allows on the domain (None without ``split``).
        self.split_layout = split_layout(model, cluster, {}) if split else None
        self._split_memo: dict = {}
        #: The model's blocks a strategy may checkpoint, in forward order (none without ``checkpoint``).
        self.blocks = checkpoint_blocks(v.name for v in model.variables) if checkpoint else []
        self.shardable = {v.name for v in model.variables if shardable(v)}
        self.helper = GuidedSampler(model, cluster, seed=0, lossy=lossy)  # servers, speeds, compressor fitting
        self.servers = self.helper.servers
        self.variables = list(model.variables)
        self.index = {v.name: i for i, v in enumerate(self.variables)}
        self.linear = {v.name for v, r in zip(self.variables, model.factor_rows or ()) if r}
        #: All-reduce algorithms a new merge group may use.
        self.algorithms = ("flat",) + (("hierarchical",) if self.helper.even_nodes and len(cluster.nodes) > 1 else ())

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
        """Whether the replication is a coordinate (replicas of different measured speeds)."""
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
        return self.still_split(strategy, [self.helper.split_towards_speed(base, t) for base in bases
                                            for t in SPLIT_STEPS])

    def still_split(self, strategy: Strategy, candidates: list[Strategy]) -> list[Strategy]:
        """``candidates`` (moves of ``strategy``), those whose tensor parallelism no longer holds
        left out (all of them kept where ``strategy`` splits no module)."""
        if strategy.tensor_parallel is None:
            return candidates
        out = []
        for c in candidates:
            try:
                check_tensor_parallel(c, self.model, self.cluster)
            except StrategyError:
                continue
            out.append(c)
        return out

    def tensor_parallelism(self, strategy: Strategy) -> list[Strategy]:
        """The tensor-parallel coordinate (where the space offers it,
        :mod:`~synctune.search.tp_draw`): a split ``strategy`` without its split, with one block's
        pairs added or removed, with sequence parallelism on every block or off, with the
        token embedding and the loss-parallel head toggled, and at each other degree; an unsplit
        one with Megatron's pairs on every block, and with sequence parallelism, at each degree
        (each also with the token embedding and the loss-parallel head split where allowed)
        (its data-parallel plans the ``megatron`` builder's, its checkpointing
        kept), each over all-reduce and, where there is more than one TP group and every variable
        is shardable, FSDP2 resharded. Only what the model allows."""
        layout = self.split_layout
        if layout is None or not layout.degrees:
            return []
        if len(strategy.replicas) != self.cluster.num_devices or len(set(strategy.batch_split)) != 1:
            return []
        options: list[tuple[int, dict[str, str], bool, bool]] = []
        tp = strategy.tensor_parallel
        if tp is None:
            for d in layout.degrees:
                every = {layout.blocks[j]: "pairs" for j in layout.pairs[d]}
                options.append((d, every, False, False))
                if layout.logits[d] or layout.embedding[d][0]:  # the vocabulary's matrices split too
                    options.append((d, every, layout.logits[d], layout.embedding[d][0]))
                if layout.sequence[d]:
                    sequence = {b: "sequence" for b in every}
                    options.append((d, sequence, False, False))
                    if layout.logits[d] or layout.embedding[d][1]:
                        options.append((d, sequence, layout.logits[d], layout.embedding[d][1]))
        else:
            blocks, logits, embedding = megatron_choices(self.model, tp)
            rowwise = embedding == "rowwise"
            sequence = tp.sequence_parallel
            d = tp.degree
            every = [layout.blocks[j] for j in layout.pairs.get(d, ())]
            if not sequence:
                for b in every:  # one block's pairs added or removed
                    toggled = {k: v for k, v in blocks.items() if k != b} if b in blocks else {**blocks, b: "pairs"}
                    if toggled:
                        options.append((d, toggled, logits, rowwise))
                if layout.sequence.get(d):
                    options.append((d, {b: "sequence" for b in every}, logits, rowwise and layout.embedding[d][1]))
            else:
                options.append((d, {b: "pairs" for b in every}, logits, rowwise))
            if layout.embedding.get(d, (False, False))[int(sequence)]:
                options.append((d, blocks, logits, not rowwise))
            if layout.logits.get(d):
                options.append((d, blocks, not logits, rowwise))
            for other in layout.degrees:
                if other != d:
                    same = {layout.blocks[j]: ("sequence" if sequence and layout.sequence[other] else "pairs")
                            for j in layout.pairs[other]}
                    options.append((other, same, False, False))
        out = []
        if tp is not None:
            try:
                out.append(without_tensor_parallel(strategy))
            except StrategyError:
                pass  # a group batch too small to give each replica a sample: no unsplit move
        for d, blocks, logits, rowwise in options:
            for dp in ("allreduce", "shard") if layout.shardable[d] else ("allreduce",):
                try:
                    out.append(split_strategy(self.model, self.cluster, self._split_memo, strategy, d, blocks, dp=dp,
                                              logits=logits, embedding=rowwise))
                except StrategyError:
                    continue
        return out

    # ----------------------------------------------------------------------------------- choices

    def choices(self, strategy: Strategy, coordinate: Sequence[int]) -> list[Choice]:
        """The choices for the variables of ``coordinate`` in ``strategy``: every registered
        kind's, in the registry's order (the built-in kinds': joining the dense groups the
        neighbours use, AutoSync's c_am, or a new group; the PS placements and the partitioned
        PS where a variable is large enough; SFB; shard units)."""
        return [c for _name, kind in SEARCH_KINDS.items() for c in kind.choices(self, strategy, coordinate)]

    def fits(self, var, comp: str, rank: int, sync_kind: str) -> bool:
        """Whether compressor ``comp`` (at ``rank``) encodes the whole of ``var`` under a
        ``sync_kind`` synchronizer (never a sparse variable)."""
        if var.sparse:
            return False
        return self.helper.compressor_for(comp, rank, var, tuple(var.shape), sync_kind).kind == comp

    def servers_of(self, strategy: Strategy) -> list[str]:
        """The PS servers (each node's first device) that hold a replica of ``strategy``."""
        held = set(strategy.replicas)
        return [d for d in self.servers if d in held]

    def compressor(self, var, choice: Choice, sync_kind: str) -> Compressor:
        """``choice``'s compressor for ``var`` under a ``sync_kind`` synchronizer: none on a
        sparse variable, a rank fitted to the variable's shape for a compressor that takes one."""
        if choice.compressor == NO_COMPRESSION or var.sparse:
            return Compressor()
        if "rank" in COMPRESSORS.get(choice.compressor).params:
            return self.helper.compressor_for(choice.compressor, choice.rank, var, tuple(var.shape), sync_kind)
        return Compressor(kind=choice.compressor)

    def apply(self, strategy: Strategy, coordinate: Sequence[int], choice: Choice) -> Strategy:
        """``strategy`` with the variables of ``coordinate`` synchronized by ``choice`` (by the
        kind that offers it; its groups renumbered)."""
        return choice_owner(choice.kind).apply(self, strategy, coordinate, choice)

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
        return self.still_split(strategy, out)

    def checkpointing(self, strategy: Strategy) -> list[Strategy]:
        """The checkpointing coordinate (where the space offers it): ``strategy`` with no block
        checkpointed, every block ``full``, every block ``selective``, and its first k blocks
        ``full`` (k from 1 to all but one, forward order: the first blocks' activations live
        longest); its other coordinates kept."""
        if not self.blocks:
            return []
        options: list[tuple[tuple[str, str], ...]] = [(), tuple((b, "full") for b in self.blocks),
                                                      tuple((b, "selective") for b in self.blocks)]
        options += [tuple((b, "full") for b in self.blocks[:k]) for k in range(1, len(self.blocks))]
        return [dataclasses.replace(strategy, checkpoint=tuple(sorted(o))) for o in options]

    def sampler(self, seed: int) -> GuidedSampler:
        """A guided sampler of this space's domain (restarts, the random reference): sharded
        draws at :data:`SHARD_RESTART_PROB` where the space offers ``shard``, none otherwise;
        split draws at :data:`SPLIT_RESTART_PROB` where it offers tensor parallelism."""
        return GuidedSampler(self.model, self.cluster, seed=seed, lossy=self.lossy,
                             shard_prob=SHARD_RESTART_PROB if self.shard else 0.0,
                             tp_prob=SPLIT_RESTART_PROB if self.split_layout is not None else 0.0)

    def data_parallel(self) -> Strategy:
        """TAG's baseline and the tree's root: every variable on one flat all-reduce group
        (sparse ones all-gathered), the batch split evenly."""
        return canonical_groups(Strategy.over(self.model, self.cluster, data_parallel_plans(self)))


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
        """The ``k`` best strategies with their scores, best first, leaving out those whose hash is
        in ``exclude`` (e.g. the ones measured already)."""
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
            if space.blocks:
                steps.append(space.checkpointing)
            if space.split_layout is not None:
                steps.append(space.tensor_parallelism)
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
    # A root over the memory budget scores -inf: rewards are then speed-ups over the first
    # strategy that scores finite, and what scores -inf is worth nothing.
    reference = [base if math.isfinite(base) else None]
    scale = abs(base) if math.isfinite(base) and base else 1.0
    runs = space.coordinates(levels)
    runs.sort(key=lambda run: -sum(space.variables[i].num_bytes for i in run))
    depth_steps: list[Callable[[Strategy], list[Strategy]]] = []
    if space.has_split:
        depth_steps.append(space.splits)
    if space.blocks:
        depth_steps.append(lambda s: [s] + space.checkpointing(s))
    if space.split_layout is not None:
        depth_steps.append(lambda s: [s] + space.tensor_parallelism(s))
    depth_steps += [lambda s, c=run: [s] + space.neighbours(s, c) for run in runs]

    def reward(value: float) -> float:
        if not math.isfinite(value):
            return 0.0
        if reference[0] is None:
            reference[0] = value
        ref = reference[0]
        return (-ref) / max(-value, 1e-12) if value < 0 else value / scale  # predicted speed-up over the root

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
                    finite = np.isfinite(values)
                    if finite.any():
                        logits = np.where(finite, values - values[finite].max(), -np.inf) / (temperature * scale)
                        prior = np.exp(logits)
                    else:
                        prior = np.ones(len(values))
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
