"""The strategy engine: executes any composed strategy with torch.distributed (AutoDist §2.3).

Wraps an ordinary ``nn.Module`` in a process group (gloo on CPU, NCCL on GPU, same code)::

    engine = StrategyEngine(model, strategy, model_spec, cluster, lambda ps: torch.optim.Adam(ps, 1e-3))
    loss = model(*batch); loss.backward(); engine.step(); engine.zero_grad()

Each shard of each variable gets a parameter that aliases its slice of the model parameter.
Gradient hooks feed the synchronizer units during backward; ``step`` completes their
collectives, runs the optimizer over the shards this rank updates (all all-reduce and
all-gather shards, and the PS shards placed on it: the placement owns their optimizer
state), then PS placements broadcast the new values. With an element-wise optimizer (SGD,
Adam, AdamW, Adagrad, RMSprop, ...) this is single-process training on the concatenated
batch, which the equivalence tests check.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.schema import AllGatherSynchronizer, AllReduceSynchronizer, PSSynchronizer, Strategy, StrategyError
from ..strategy.validate import validate
from .compress import _Counter, make_compressor
from ..strategy.partition import shard_slices
from .layout import RankLayout
from .units import AllReduceUnit, Member, PSUnit, SparseAllGatherUnit, SparsePSUnit

__all__ = ["StrategyEngine", "check_supported"]


def check_supported(strategy: Strategy, model: ModelSpec, backend: str | None = None) -> None:
    """Reject, before launch, what the engine does not execute, with a message naming the variable.

    Not executed: staleness > 0 (the engine is synchronous), merge groups mixing dtypes.
    """
    group_dtype: dict[int, tuple[str, str]] = {}
    for plan, i, shard in strategy.iter_shards():
        sync = shard.synchronizer
        where = f"variable {plan.variable!r}: shards[{i}]"
        if isinstance(sync, PSSynchronizer) and sync.staleness > 0:
            raise StrategyError(
                f"{where}.synchronizer.staleness: {sync.staleness} is not supported; the engine runs synchronous "
                f"training only (staleness 0)"
            )
        if isinstance(sync, AllReduceSynchronizer):
            dtype = model[plan.variable].dtype
            first = group_dtype.setdefault(sync.group, (dtype, plan.variable))
            if first[0] != dtype:
                raise StrategyError(f"{where}.synchronizer.group: group {sync.group} mixes {dtype} with {first[0]} "
                                    f"of variable {first[1]!r}")


class StrategyEngine:
    """Executes ``strategy`` for ``module`` on this rank of the default process group.

    ``optimizer_factory`` receives the shard parameters this rank updates and returns the
    optimizer (it may return None when the list is empty). ``rank`` defaults to the process
    group's rank; rank r runs replica ``strategy.replicas[r]`` with batch ``batch_split[r]``.
    """

    def __init__(self, module: nn.Module, strategy: Strategy, model_spec: ModelSpec, cluster: ClusterSpec,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer | None], *,
                 seed: int = 0, broadcast_initial: bool = True) -> None:
        validate(strategy, model_spec, cluster)
        check_supported(strategy, model_spec)
        if not dist.is_initialized():
            raise RuntimeError("StrategyEngine needs an initialized torch.distributed process group")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.layout = RankLayout.of(strategy, cluster)
        if self.world != self.layout.world_size:
            raise StrategyError(f"strategy has {self.layout.world_size} replicas but the process group has "
                                f"{self.world} ranks")
        self.module = module
        self.strategy = strategy
        self.weight = strategy.batch_split[self.rank] / strategy.global_batch_size
        self.counter = _Counter()
        params = dict(module.named_parameters())
        self._check_module(params, model_spec)
        device = next(iter(params.values())).device
        self.device = device

        if broadcast_initial:
            # Replicas must start from the same point (as DDP does at construction).
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    if t.is_contiguous():
                        dist.broadcast(t.data, src=0)
                    else:  # collectives need contiguous memory: go through a buffer and copy back
                        buf = t.data.contiguous()
                        dist.broadcast(buf, src=0)
                        t.data.copy_(buf)

        self._groups_cache: dict[tuple[int, ...], object] = {}
        self.units = self._build_units(strategy, model_spec, params, device, seed)
        self._member_units: dict[str, list[tuple[Member, object]]] = {}
        for unit in self.units:
            for m in unit.members:
                self._member_units.setdefault(m.variable, []).append((m, unit))
        owned = [m.view for u in self.units for m in u.owned()]
        self.optimizer = optimizer_factory(owned) if owned else None
        self._mark_full_broadcast()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in params.items()]

    # ------------------------------------------------------------------------------------ build

    @staticmethod
    def _check_module(params: dict[str, nn.Parameter], spec: ModelSpec) -> None:
        names = set(params)
        expected = {v.name for v in spec.variables}
        if names != expected:
            extra, missing = sorted(names - expected), sorted(expected - names)
            raise StrategyError(f"module does not match model spec {spec.name!r}: parameters not in the spec "
                                f"{extra[:3]}, spec variables not in the module {missing[:3]}")
        for v in spec.variables:
            if tuple(params[v.name].shape) != tuple(v.shape):
                raise StrategyError(f"variable {v.name!r}: module has shape {list(params[v.name].shape)}, "
                                    f"model spec says {list(v.shape)}")

    def _group(self, ranks: Iterable[int]):
        key = tuple(sorted(set(ranks)))
        if key not in self._groups_cache:
            # new_group is collective over the whole world: every rank creates the same groups
            # in the same (sorted) order, see _build_units.
            self._groups_cache[key] = dist.new_group(list(key))
        return self._groups_cache[key]

    def _build_units(self, strategy: Strategy, spec: ModelSpec, params, device, seed: int) -> list:
        plans = sorted(strategy.plans, key=lambda p: spec.position(p.variable))
        layout = self.layout
        # Sub-groups for local aggregation, created in one deterministic order on every rank.
        needed: set[tuple[int, ...]] = set()
        nodes = layout.nodes()
        for plan in plans:
            for shard in plan.shards:
                s = shard.synchronizer
                if isinstance(s, PSSynchronizer) and s.local_aggregation and not spec[plan.variable].sparse:
                    placement = layout.rank_of(s.placement)
                    for node in nodes:
                        ranks = layout.ranks_on_node(node)
                        if len(ranks) > 1:
                            needed.add(tuple(ranks))
                    if len(nodes) > 1:
                        needed.add(tuple(sorted(layout.local_root(n, placement) for n in nodes)))
        for key in sorted(needed):
            self._group(key)

        groups: dict[int, list[Member]] = {}
        group_comp: dict[int, object] = {}
        units: list = []
        order: list[tuple[str, object]] = []  # units in order of their first member (backward order)
        for plan in plans:
            var = spec[plan.variable]
            param = params[plan.variable]
            slices = shard_slices(var.shape, plan.partition)
            for i, shard in enumerate(plan.shards):
                view = nn.Parameter(param.detach()[slices[i]], requires_grad=False)
                shape = tuple(view.shape)
                member = Member(variable=plan.variable, shard=i, slices=slices[i], shape=shape, view=view,
                                sparse=var.sparse)
                sync = shard.synchronizer
                if isinstance(sync, AllReduceSynchronizer):
                    if sync.group not in groups:
                        groups[sync.group] = []
                        group_comp[sync.group] = shard.compressor
                        order.append(("group", sync.group))
                    groups[sync.group].append(member)
                elif isinstance(sync, AllGatherSynchronizer):
                    order.append(("unit", SparseAllGatherUnit(member, self.weight, world=self.world, device=device,
                                                              counter=self.counter)))
                elif var.sparse:
                    order.append(("unit", SparsePSUnit(member, self.weight, rank=self.rank,
                                                       placement=layout.rank_of(sync.placement), world=self.world,
                                                       device=device, counter=self.counter)))
                else:
                    placement = layout.rank_of(sync.placement)
                    comp = make_compressor(shard.compressor, counter=self.counter)
                    intra = roots = None
                    local_root = None
                    if sync.local_aggregation:
                        node = layout.node_of_rank[self.rank]
                        local_root = layout.local_root(node, placement)
                        node_ranks = layout.ranks_on_node(node)
                        if len(node_ranks) > 1:
                            intra = (self._group(node_ranks), node_ranks)
                        if len(nodes) > 1:
                            root_ranks = sorted(layout.local_root(n, placement) for n in nodes)
                            roots = (self._group(root_ranks), root_ranks)
                    order.append(("unit", PSUnit(member, self.weight, comp, rank=self.rank, placement=placement,
                                                 device=device, counter=self.counter, intra=intra, roots=roots,
                                                 local_root=local_root)))
        for kind, item in order:
            if kind == "unit":
                units.append(item)
                continue
            members = groups[item]
            comp_spec = group_comp[item]
            offsets, at = [], 0
            for m in members:
                if len(m.shape) >= 2:
                    cols = m.numel // m.shape[0]
                    offsets.append((at, m.shape[0], cols))
                at += m.numel
            comp = make_compressor(comp_spec, members=offsets, weight=self.weight,
                                   seed=seed * 7919 + item, counter=self.counter)
            units.append(AllReduceUnit(members, self.weight, comp, device, members[0].view.dtype))
        return units

    def _mark_full_broadcast(self) -> None:
        """Sparse PS shards broadcast only the rows they updated when the optimizer is row-sparse."""
        opt = self.optimizer
        row_sparse = False
        if isinstance(opt, torch.optim.SGD):
            row_sparse = all(g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0 for g in opt.param_groups)
        elif isinstance(opt, (torch.optim.SparseAdam,)):
            row_sparse = True
        elif isinstance(opt, torch.optim.Adagrad):
            row_sparse = all(g.get("weight_decay", 0) == 0 for g in opt.param_groups)
        # Every rank must agree: the placement decides, then tells the others (it owns the optimizer).
        flags = {}
        for u in self.units:
            if isinstance(u, SparsePSUnit):
                flag = torch.tensor([0 if row_sparse or self.rank != u.placement else 1], device=self.device)
                dist.all_reduce(flag)
                flags[id(u)] = bool(flag.item())
                u.full_broadcast = flags[id(u)]

    # ----------------------------------------------------------------------------------- runtime

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            for member, unit in self._member_units[name]:
                unit.member_ready(member, grad)

        return hook

    def step(self) -> None:
        """Complete all synchronization, update, and bring every replica to the new values."""
        for unit in self.units:
            unit.force_launch()
        for unit in self.units:
            unit.finish()
        if self.optimizer is not None:
            self.optimizer.step()
        for phase in (0, 1):
            handles = [h for unit in self.units for h in unit.broadcast_phase(phase)]
            for h in handles:
                h.wait()
        for unit in self.units:
            unit.after_broadcast()
            unit.reset()

    def zero_grad(self) -> None:
        """Drop local and synchronized gradients."""
        for p in self.module.parameters():
            p.grad = None
        for unit in self.units:
            for m in unit.members:
                m.view.grad = None

    def take_comm_bytes(self) -> int:
        """Payload bytes this rank handed to collectives since the last call."""
        n = self.counter.bytes
        self.counter.bytes = 0
        return n

    def close(self) -> None:
        """Remove the gradient hooks (the module is then an ordinary module again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
