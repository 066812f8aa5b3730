"""The strategy engine: executes any composed strategy with torch.distributed (AutoDist §2.3).

Wraps an ordinary ``nn.Module`` in a process group (gloo on CPU; NCCL for CUDA tensors with
gloo beside it for CPU ones; same code)::

    engine = StrategyEngine(model, strategy, model_spec, cluster, lambda ps: torch.optim.Adam(ps, 1e-3))
    loss = model(*batch); loss.backward(); engine.step(); engine.zero_grad()

Each shard of each trainable variable gets a parameter that aliases its slice of the model
parameter. Gradient hooks feed the synchronizer units during backward (a small variable on
all-reduce has its ``.grad`` in its bucket slot, which autograd accumulates into, as torch DDP's
``gradient_as_bucket_view``: its hook copies nothing; a larger one is copied in, scaled, in one
pass); ``step`` completes their
collectives, runs the optimizer over the shards this rank updates (all all-reduce and all-gather
shards, and the PS shards placed on it: the placement owns their optimizer state), then PS
placements broadcast the new values and rank 0 its buffers. With an element-wise optimizer
(SGD, Adam, AdamW, Adagrad, RMSprop, ...) this is single-process training on the concatenated
batch, which the equivalence tests check.

The habits of real training loops are supported and exact: frozen parameters (left alone),
gradient accumulation (``with engine.no_sync():`` for all micro-batches but the last, as with
torch DDP; a second backward outside it is an error, never a wrong result), buffers broadcast
from rank 0 (DDP's ``broadcast_buffers``), ``torch.autocast`` with a ``GradScaler`` whose
inf/nan verdict every rank shares (``engine.step(scaler)``), clipping by the global norm of
the synchronized gradient (``engine.clip_grad_norm_``), and checkpoints that do not depend on
the strategy (``engine.state_dict()`` / ``load_state_dict``).

What a loop does wrong is refused by every rank together, never by some while others wait in a
collective: a hook that finds a misuse (a second backward before ``step``, a backward inside
``no_sync`` after the synchronized one, a backward after ``clip_grad_norm_``) only records it; the
step's collectives all run to completion on every rank as usual, and the SynchronizationError is
raised from ``step`` (or ``clip_grad_norm_``) with that step's gradients dropped, so the engine and
the process group go on to the next step (or the next engine) cleanly. What a hook records
depends only on the gradients this rank's backward passes produced, never on when its
collectives launched, so ranks that run the same loop refuse the same step with the same
message without exchanging anything. Agreeing on it every step would cost a small all-reduce on
the critical path of every step, a barrier after the last collective that torch DDP does not
pay either; a loop in which ranks run different numbers of backward passes (data-dependent control
flow around ``backward``) is outside what a refusal can catch on every rank. Checkpoints
(``state_dict``/``load_state_dict`` between a backward and ``step``), rare calls, are agreed
collectively: there a rank with no gradient in flight cannot see the misuse by itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..spec.cluster import ClusterSpec
from ..spec.model import ModelSpec
from ..strategy.kinds import units_of
from ..strategy.partition import shard_slices
from ..strategy.schema import Strategy, StrategyError
from ..strategy.validate import validate
from .compress import ByteCounter
from .kinds import ENGINE_KINDS, BuildContext, check_refusals
from .layout import RankLayout
from .runtime import per_world
from .units import GradView, Member, Scheduler, SparsePSUnit, SynchronizationError

__all__ = ["StrategyEngine", "check_supported", "SynchronizationError", "PROFILE_PHASES"]

#: Whether ``step`` marks its phases (waiting for the collectives, setting the synchronized
#: gradients, the refusal verdict, the broadcasts) as ``torch.profiler.record_function`` ranges
#: named ``synctune.*``. Off by default: a range is a dispatcher call on entry and on exit even
#: when no profiler is active. ``benchmarks/engine_overhead.py --breakdown`` turns it on.
PROFILE_PHASES = False
_NO_RANGE = contextlib.nullcontext()


def _phase(name: str):
    """A profiler range named ``name`` while :data:`PROFILE_PHASES` is on, else a no-op context."""
    return torch.profiler.record_function(name) if PROFILE_PHASES else _NO_RANGE


def check_supported(strategy: Strategy, model: ModelSpec) -> None:
    """Reject, before launch, what the engine does not execute, with a message naming the variable:
    each unit's kind says what it refuses (:data:`synctune.engine.kinds.ENGINE_KINDS`): staleness
    > 0 (the engine is synchronous), merge groups mixing dtypes, and ``shard`` with ``reshard:
    true`` (ZeRO-3: the engine keeps parameters whole between forward and backward; the FSDP2
    runtime, ``--runtime fsdp``, runs resharded units)."""
    check_refusals(units_of(strategy), model)


def _shared_group(ranks: tuple[int, ...], backend: str | None = None):
    """The process group of ``ranks`` (with ``backend``, default the world's), made once per
    world and shared by every engine of a worker (:func:`~synctune.engine.runtime.per_world`)."""
    return per_world(("group", ranks, backend),
                     lambda: dist.new_group(list(ranks), backend=backend) if backend else dist.new_group(list(ranks)))


class StrategyEngine:
    """Executes ``strategy`` for ``module`` on this rank of the default process group.

    ``optimizer_factory`` receives the shard parameters this rank updates and returns the
    optimizer (it is not called when the list is empty). ``rank`` is the process group's rank;
    rank r runs replica ``strategy.replicas[r]`` with batch ``batch_split[r]``.
    ``broadcast_buffers``: rank 0's buffers (BatchNorm statistics) go to every replica after each
    step, as torch DDP's option of that name (the buffers of the modules that held any when the
    engine was built, as DDP finds its buffers once). ``overlap=False`` launches only the first stage of
    each unit during backward and the rest inside ``step``, one unit at a time (the unchained
    schedule ``benchmarks/engine_overhead.py`` compares chained stages with).
    """

    def __init__(self, module: nn.Module, strategy: Strategy, model_spec: ModelSpec, cluster: ClusterSpec,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer | None], *,
                 seed: int = 0, broadcast_initial: bool = True, broadcast_buffers: bool = True,
                 overlap: bool = True) -> None:
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
        # Walking a large module tree costs milliseconds of host time per step (zero_grad).
        self._module_params = list(module.parameters())
        # The modules holding buffers, found once as torch DDP finds its buffers once: a buffer
        # one of them replaces is broadcast as it is then, one registered later on a module that
        # had none is not (as with DDP).
        self._buffer_owners = [m for m in module.modules() if m._buffers]
        self.strategy = strategy
        self.spec = model_spec
        self.weight = strategy.batch_split[self.rank] / strategy.global_batch_size
        self.counter = ByteCounter()
        self.broadcast_buffers = broadcast_buffers
        params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._check_module(module, params, model_spec)
        device = next(iter(params.values())).device
        self.device = device

        if broadcast_initial:
            # Replicas must start from the same point (as DDP does at construction), frozen
            # parameters and buffers included.
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    self._broadcast_in_place(t.data, 0)
        # Checkpoint verdicts travel apart from the units' collectives: on the world group they
        # would be issued between unit stages that ranks launch in different interleavings. gloo
        # on CPU whatever the device: a verdict is host state, and it then costs no device sync.
        self._verdict_group = _shared_group(tuple(range(self.world)), "gloo") if self.world > 1 else None

        self._params = params
        self.units = []
        self._building: list = []
        try:
            self._build(strategy, model_spec, params, device, seed, optimizer_factory, overlap)
        except BaseException:
            # SFB units hook the module's layers as they are built: leave it as it was.
            for u in self.units + self._building:
                u.close()
            raise

    def _build(self, strategy, model_spec, params, device, seed, optimizer_factory, overlap) -> None:
        self.units = self._build_units(strategy, model_spec, params, device, seed)
        self._building = []
        # NCCL: one launch order across all process groups (concurrent communicators issued in
        # different orders on different ranks can deadlock); gloo keeps an order per group.
        self.scheduler = Scheduler(self.units, chain=overlap, one_order="nccl" in str(dist.get_backend()))
        self._member_units: dict[str, list[tuple[Member, object]]] = {}
        self._members: dict[tuple[str, int], Member] = {}
        for unit in self.units:
            for m in unit.members:
                self._member_units.setdefault(m.variable, []).append((m, unit))
                self._members[(m.variable, m.shard)] = m
        # Units with new values to send after the optimizer's step (parameter servers, shards).
        self._broadcasting = [u for u in self.units if u.broadcasts]
        # Gradients autograd accumulates straight into a unit's bucket slot: the parameter's
        # .grad is the slot from now on (one the module holds already is left to accumulate as
        # it would, and copied at its hook; zero_grad attaches the slot then).
        self._bucket_grads = [(params[m.variable], slot) for u in self.units for m, slot in u.bucket_grads()]
        in_bucket = {id(p) for p, _slot in self._bucket_grads}
        self._loose_params = [p for p in self._module_params if id(p) not in in_bucket]
        for p, slot in self._bucket_grads:
            if p.grad is None:
                p.grad = slot
        owned = [m.view for u in self.units for m in u.owned()]
        self.optimizer = optimizer_factory(owned) if owned else None
        self._mark_full_broadcast()
        self._sync_enabled = True
        self._synchronized = False
        self._refusal: str | None = None  # this rank's first refused misuse in this step
        self._scaler_dummy: torch.optim.Optimizer | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in params.items()]

    # ------------------------------------------------------------------------------------ build

    @staticmethod
    def _check_module(module: nn.Module, params: dict[str, nn.Parameter], spec: ModelSpec) -> None:
        names = set(params)
        expected = {v.name for v in spec.variables}
        if names != expected:
            frozen = sorted(n for n, p in module.named_parameters() if not p.requires_grad and n in expected)
            if frozen:
                raise StrategyError(f"variable {frozen[0]!r} is frozen in the module (requires_grad=False) but in model "
                                    f"spec {spec.name!r}: extract the spec from the module as it trains "
                                    f"(frozen parameters are not variables)")
            extra, missing = sorted(names - expected), sorted(expected - names)
            raise StrategyError(f"module does not match model spec {spec.name!r}: trainable parameters not in the "
                                f"spec {extra[:3]}, spec variables not in the module {missing[:3]}")
        for v in spec.variables:
            if tuple(params[v.name].shape) != tuple(v.shape):
                raise StrategyError(f"variable {v.name!r}: module has shape {list(params[v.name].shape)}, "
                                    f"model spec says {list(v.shape)}")

    @staticmethod
    def _broadcast_in_place(t: torch.Tensor, src: int) -> None:
        if t.is_contiguous():
            dist.broadcast(t, src=src)
        else:  # collectives need contiguous memory: go through a buffer and copy back
            buf = t.contiguous()
            dist.broadcast(buf, src=src)
            t.copy_(buf)

    def _group(self, ranks: Iterable[int]):
        # new_group is collective over the whole world: every rank asks for the same groups in
        # the same (sorted) order, see _build_units; each is made once per world.
        return _shared_group(tuple(sorted(set(ranks))))

    def _build_units(self, strategy: Strategy, spec: ModelSpec, params, device, seed: int) -> list:
        """One engine unit per unit of the strategy (:func:`~synctune.strategy.kinds.units_of`, in
        backward order of their first members), each built by its kind's
        :class:`~synctune.engine.kinds.EngineKind`, after every process sub-group they need."""
        plan_units = units_of(strategy, spec)
        needed: set[tuple[int, ...]] = set()
        for unit in plan_units:
            kind = ENGINE_KINDS.get(unit.kind)
            for member in unit.members:
                needed.update(kind.subgroups(self.world, self.layout, member.synchronizer))
        for key in sorted(needed):  # new_group is collective: one order on every rank
            self._group(key)
        ctx = BuildContext(rank=self.rank, world=self.world, weight=self.weight, counter=self.counter, device=device,
                           layout=self.layout, seed=seed, module=self.module, spec=spec, group=self._group,
                           linear_layer=self._linear_layer)
        units: list = []
        cuts: dict[str, list] = {}  # each plan's shard slices, worked out once
        for unit in plan_units:
            members = []
            for m in unit.members:
                if m.variable not in cuts:
                    cuts[m.variable] = shard_slices(spec[m.variable].shape, m.plan.partition)
                slices = cuts[m.variable][m.index]
                view = nn.Parameter(params[m.variable].detach()[slices], requires_grad=False)
                members.append(Member(variable=m.variable, shard=m.index, slices=slices, shape=tuple(view.shape),
                                      view=view, whole=len(m.plan.shards) == 1))
            built = ENGINE_KINDS.get(unit.kind).build(ctx, unit, members)
            self._building.append(built)  # closed if a later unit cannot be built
            units.append(built)
        return units

    def _linear_layer(self, name: str) -> nn.Linear:
        """The ``nn.Linear`` whose weight is variable ``name`` (sfb's factors are its input and
        output gradient), or a StrategyError naming the variable, the field and the fix."""
        path, _, attr = name.rpartition(".")
        layer = self.module.get_submodule(path) if path else self.module
        if attr != "weight" or not isinstance(layer, nn.Linear):
            raise StrategyError(f"variable {name!r}: synchronizer sfb needs the weight of an nn.Linear layer, and this "
                                f"is {attr!r} of a {type(layer).__name__}; use allreduce or ps for it")
        owners = sum(1 for m in self.module.modules() for p in m.parameters(recurse=False) if p is layer.weight)
        if owners > 1:
            raise StrategyError(f"variable {name!r}: synchronizer sfb: the weight is shared by {owners} modules (tied), "
                                f"and sufficient factors carry only the linear layer's part of its gradient; use "
                                f"allreduce or ps for it")
        return layer

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
        for u in self.units:
            if isinstance(u, SparsePSUnit):
                flag = torch.tensor([0 if row_sparse or self.rank != u.placement else 1], device=self.device)
                dist.all_reduce(flag)
                u.full_broadcast = bool(flag.item())

    # ----------------------------------------------------------------------------------- runtime

    def _hook(self, name: str):
        # A misuse is recorded, not raised: raising here would stop this rank's backward (and its
        # launches) while its peers, which may see no misuse of their own, go on into collectives
        # it never joins. ``_settle`` raises it once every collective of the step completed.
        entries = self._member_units[name]
        scheduler = self.scheduler

        def misuse(param: torch.Tensor) -> bool:
            """Record this backward's misuse, if any; whether the gradient is to be left alone."""
            if self._refusal is not None:
                return True  # the step is refused: its gradients are dropped at the verdict
            if self._synchronized:
                self._refusal = (f"variable {name!r} got a gradient after the step's synchronization "
                                 f"(clip_grad_norm_) and before engine.step(): call engine.step() first")
                return True
            stored = any(unit.stored(member) for member, unit in entries)
            if not self._sync_enabled:
                if stored:
                    self._refusal = (
                        f"variable {name!r}: a backward inside engine.no_sync() after a synchronized one in the "
                        f"same step; the synchronized gradient would miss it. Run every micro-batch but the "
                        f"last inside no_sync(), and the last outside it")
                return True  # the gradient accumulates in .grad; the next synchronized backward sends the sum
            if stored:
                self._refusal = (
                    f"variable {name!r} got a second gradient before engine.step(), and its synchronization "
                    f"already started: a second backward would be lost or mixed into a collective in flight. Run "
                    f"the micro-batches that should not communicate inside `with engine.no_sync():` (all but the "
                    f"last, as with torch DDP), or call engine.step() between backward passes")
                return True
            return False

        if len(entries) == 1:
            # The common case, one unit holding the whole variable, kept to a few attribute reads:
            # this runs once per parameter and backward, in Python where torch DDP's hooks are C++.
            (member, unit), = entries
            key = id(member)

            def hook(param: torch.Tensor) -> None:
                if (self._refusal is not None or self._synchronized or not self._sync_enabled
                        or key not in unit.pending):
                    if misuse(param):
                        return
                if unit.take(member, param.grad):
                    scheduler.add(unit)
                    scheduler.progress()
                elif scheduler.active:  # later stages of units in flight may be due
                    scheduler.progress()

            return hook

        def hook(param: torch.Tensor) -> None:
            if misuse(param):
                return
            view = GradView(param.grad) if param.grad is not None else None
            for member, unit in entries:
                if unit.member_ready(member, view):
                    scheduler.add(unit)
            scheduler.progress()

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block only accumulate gradients locally (torch DDP's
        ``no_sync``): gradient accumulation over micro-batches, the last one outside the block."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _synchronize(self, settle: bool = True) -> None:
        """Complete every unit's collectives (launching, with zero gradients, those of parameters
        the forward pass did not use) and set the shard parameters' gradients; then (``settle``)
        raise a refusal recorded during the step."""
        if self._synchronized:
            return
        views: dict[str, GradView | None] = {}
        with _phase("synctune.wait"):
            for unit in self.units:
                for member in unit.unready():
                    # No hook fired for it in the synchronized backward: unused there, but maybe used
                    # by a micro-batch inside no_sync, whose gradient waits in .grad.
                    if member.variable not in views:
                        grad = self._params[member.variable].grad
                        views[member.variable] = GradView(grad) if grad is not None else None
                    if unit.member_ready(member, views[member.variable]):
                        self.scheduler.add(unit)
            self.scheduler.progress(block=True)
        with _phase("synctune.finish"):
            self.scheduler.reset()
            for unit in self.units:
                unit.finish()
        self._synchronized = True
        if settle:
            with _phase("synctune.verdict"):
                self._settle(None, self._unit_refusal())

    def _unit_refusal(self) -> str | None:
        # A unit's own refusal (SFB's check) is the same on every rank already: its verdicts
        # travelled with its row counts.
        return next((u.refusal for u in self.units if u.refusal), None)

    def _start_verdict(self) -> tuple[Any, torch.Tensor, bool]:
        """The lowest rank that refused (the world size when none did), agreed by an all-reduce
        over every rank, launched here."""
        first = torch.tensor([self.rank if self._refusal is not None else self.world], dtype=torch.long)
        work = None
        if self._verdict_group is not None:
            work = dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self._verdict_group, async_op=True)
        return work, first, self._verdict_group is not None

    def _settle(self, verdict: tuple[Any, torch.Tensor, bool] | None, shared: str | None = None) -> None:
        """Complete ``verdict`` (None: this rank's own refusal, which its peers hold alike, as the
        module's notes say; nothing is exchanged or allocated, the case of every step); when it
        names a refusing rank (or ``shared``, a refusal every rank holds already, is given), drop
        the step and raise the refusal: a collective verdict's, the lowest refusing rank's
        message on every rank."""
        if verdict is None:
            message = self._refusal if self._refusal is not None else shared
        else:
            work, first, collective = verdict
            if work is not None:
                work.wait()
            who = int(first[0])
            message = shared
            if who < self.world:
                if not collective:
                    message = self._refusal
                else:
                    box = [self._refusal if who == self.rank else None]
                    dist.broadcast_object_list(box, src=who, group=self._verdict_group)
                    message = f"{box[0]} (on rank {who}; every rank refuses this checkpoint)"
        if message is None:
            return
        # The step's gradients mix what the loop did wrong: dropped, so that the next step (or a
        # loop that catches the error and goes on) starts clean on every rank alike.
        self.zero_grad()
        for unit in self.units:
            unit.reset()
        self.scheduler.reset()
        self._synchronized = False
        self._refusal = None
        raise SynchronizationError(message)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, scaler: Any = None) -> torch.Tensor:
        """Clip the synchronized gradient by its global norm, as ``torch.nn.utils.clip_grad_norm_``
        would on one process (each shard counted once); returns the total norm. Call it between
        the last backward and :meth:`step`. With a ``GradScaler``, pass it: the gradient is
        unscaled first (every rank sharing the inf/nan verdict), as torch's recipe
        ``scaler.unscale_(optimizer)`` before clipping does."""
        self._synchronize()
        if scaler is not None and scaler.is_enabled():
            self._agreed_unscale(scaler)
        norm_type = float(norm_type)
        counted = [g for u in self.units for g in u.norm_grads(self.rank)]
        values = [g.coalesce().values() if g.is_sparse else g for g in counted]
        if norm_type == float("inf"):
            local = max((v.abs().max().double() for v in values if v.numel()), default=torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(self.device, torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum((v.double().abs().pow(norm_type).sum() for v in values), torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(self.device, torch.float64)
            dist.all_reduce(total)
            norm = total[0].pow(1.0 / norm_type)
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for unit in self.units:
            for grad in unit.synchronized_grads():
                grad.mul_(coef)
        return norm.to(torch.float32)

    def _scaled_optimizer(self) -> torch.optim.Optimizer:
        optimizer = self.optimizer
        if optimizer is None:  # this rank updates nothing but must still take part in the verdict
            if self._scaler_dummy is None:
                dummy = nn.Parameter(torch.zeros(1, device=self.device))
                dummy.grad = torch.zeros_like(dummy)
                self._scaler_dummy = torch.optim.SGD([dummy], lr=0.0)
            optimizer = self._scaler_dummy
        return optimizer

    def _agreed_unscale(self, scaler) -> None:
        """``scaler.unscale_`` with one inf/nan verdict for all ranks: a PS shard's gradient lives
        on its server only, so a local check would let ranks disagree about skipping the step."""
        optimizer = self._scaled_optimizer()
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"].name == "UNSCALED":
            return  # done already (clip_grad_norm_ with this scaler)
        scaler.unscale_(optimizer)
        # GradScaler keeps its per-device verdicts here; torch's ShardedGradScaler all-reduces the same.
        found = state["found_inf_per_device"]
        flag = torch.zeros(1, device=self.device)
        for value in found.values():
            flag += value.to(self.device).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not found:
            found[self.device] = torch.zeros(1, device=self.device)
        for value in found.values():
            value.copy_(flag.to(value.device).reshape(value.shape))

    def _agreed_step(self, scaler) -> None:
        """``scaler.step``, after the agreed unscale: skipped on every rank or on none."""
        self._agreed_unscale(scaler)
        scaler.step(self._scaled_optimizer())

    def step(self, scaler: Any = None) -> None:
        """Complete all synchronization, update, and bring every replica to the new values.
        With a ``torch.amp.GradScaler``, pass it here instead of calling ``scaler.step``: the
        step is skipped on every rank when any rank found an inf or nan (then ``scaler.update()``
        as usual). A misused step (see the module's notes) raises SynchronizationError here on
        every rank alike, its gradients dropped, nothing updated."""
        synchronized = self._synchronized  # by clip_grad_norm_: a backward since then is refused now
        self._synchronize()
        if synchronized:
            self._settle(None)
        if scaler is not None and scaler.is_enabled():
            self._agreed_step(scaler)
        elif self.optimizer is not None:
            self.optimizer.step()
        if self._broadcasting:
            with _phase("synctune.param_broadcast"):
                for phase in (0, 1):
                    handles = [h for unit in self._broadcasting for h in unit.broadcast_phase(phase)]
                    for h in handles:
                        h.wait()
        if self.broadcast_buffers and self.world > 1 and self._buffer_owners:
            with _phase("synctune.buffer_broadcast"), torch.no_grad():
                seen: set[int] = set()
                for owner in self._buffer_owners:
                    for buf in owner._buffers.values():
                        if buf is not None and id(buf) not in seen:
                            seen.add(id(buf))
                            self._broadcast_in_place(buf.data, 0)
        for unit in self._broadcasting:
            unit.after_broadcast()
        for unit in self.units:
            unit.reset()
        self._synchronized = False

    def zero_grad(self) -> None:
        """Drop local and synchronized gradients (and the sufficient factors kept for them). A
        small variable on all-reduce keeps a ``.grad``, zeros in its bucket slot, which the next
        backward accumulates into (as torch DDP's ``gradient_as_bucket_view``); the others' are None."""
        for p in self._loose_params:
            p.grad = None
        for unit in self.units:
            unit.drop_grads()
            unit.forget()
            unit.zero_bucket_grads()
        for p, slot in self._bucket_grads:
            if p.grad is not slot:  # set to None (or replaced) by other code since
                p.grad = slot

    # ----------------------------------------------------------------------------- checkpoints

    def _require_between_steps(self, what: str) -> None:
        """Checkpoints are taken between steps, never with gradients in flight; decided by every
        rank together (collective), as a rank whose backward stored no gradient sees no misuse."""
        if self._refusal is None and (self._synchronized or self.scheduler.entries or any(
                unit.stored(m) for unit in self.units for m in unit.members)):
            self._refusal = (f"{what} between a backward pass and engine.step(): gradients are being "
                             f"synchronized; call it after engine.step()")
        work, first, _collective = self._start_verdict()
        if work is not None:
            work.wait()
        if int(first[0]) == self.world:
            return
        if not self._synchronized:
            # Some rank has collectives in flight: complete every unit on every rank (a rank with
            # nothing stored sends zeros), so none is left behind, then raise the agreed refusal.
            self._synchronize(settle=False)
        self._settle(self._start_verdict(), self._unit_refusal())

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state that do not depend on the strategy (collective: every rank
        calls it and gets the whole state). Optimizer state is per variable, stitched from the
        shards of whichever ranks own it, so it loads under any other strategy."""
        self._require_between_steps("state_dict()")
        mine: dict[tuple[str, int], dict] = {}
        opt = self.optimizer
        for unit in self.units:
            for m in unit.state_members(self.rank):
                if opt is not None and m.view in opt.state:
                    # slices as (start, stop) pairs: a slice is not hashable before Python 3.12.
                    bounds = tuple((c.start, c.stop) for c in m.slices)
                    mine[(m.variable, m.shard, bounds)] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                                             for k, v in opt.state[m.view].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] if opt else None
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, {"state": mine, "param_groups": groups})
        state: dict[str, dict[str, Any]] = {}
        for contribution in everyone:
            for (name, _index, bounds), shard_state in contribution["state"].items():
                slices = tuple(slice(a, b) for a, b in bounds)
                full = state.setdefault(name, {})
                shape = tuple(torch.empty(self.spec[name].shape, device="meta")[slices].shape)
                for key, value in shard_state.items():
                    if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == shape:
                        if key not in full:
                            full[key] = torch.zeros(self.spec[name].shape, dtype=value.dtype)
                        full[key][slices] = value
                    else:  # per-variable scalars (Adam's step): the same in every shard
                        full[key] = value
        param_groups = next((c["param_groups"] for c in everyone if c["param_groups"]), [])
        model = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return {"model": model, "optimizer": {"state": state, "param_groups": param_groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave, under this engine's strategy (which may differ from
        the one it was saved under). Collective: every rank loads."""
        self._require_between_steps("load_state_dict()")
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        opt = self.optimizer
        if opt is None:
            return
        saved = state["optimizer"]["state"]
        for unit in self.units:
            for m in unit.owned():
                if m.variable not in saved:
                    continue
                shape = tuple(self.spec[m.variable].shape)
                opt.state[m.view] = {
                    k: (v[m.slices].clone().to(m.view.device) if torch.is_tensor(v) and v.dim() > 0
                        and tuple(v.shape) == shape else (v.clone() if torch.is_tensor(v) else v))
                    for k, v in saved[m.variable].items()}
        for group, saved_group in zip(opt.param_groups, state["optimizer"]["param_groups"]):
            group.update(saved_group)

    # ----------------------------------------------------------------------------------- misc

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
        for u in self.units:
            u.close()
