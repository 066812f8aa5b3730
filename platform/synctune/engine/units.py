"""Synchronizers as communication units (AutoDist §2.3 "Synchronizer" kernels, in eager PyTorch).

A unit owns the shards it synchronizes. Gradient hooks hand it each member's gradient as soon
as autograd has accumulated it; once every member is in, the unit's *pipeline* runs: a
generator that yields, one after another, the collectives to launch (``(group, launch)``), each
the moment the previous one completed, so communication overlaps the rest of backward and a
multi-stage synchronizer (local aggregation, hierarchical all-reduce, PowerSGD, sparse
gathers) never blocks other units. :class:`Scheduler` launches the stages of all units in one
order every rank agrees on. ``finish`` sets the shard parameters' gradients;
``broadcast_phase`` sends updated values back (PS only).

Every gradient arrives multiplied by this rank's share of the global batch, so the summed
message is the gradient of the global mean loss, also with uneven batch splits.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor (the same collectives, the
# old names deprecated) to *_single; the older names keep the engine running on an earlier torch
# (a GPU machine's image, say).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["Member", "GradView", "Scheduler", "Handle", "AllReduceUnit", "HierarchicalAllReduceUnit", "PSUnit",
           "SparseAllGatherUnit", "SparsePSUnit", "SFBUnit", "ShardUnit", "SynchronizationError"]


class SynchronizationError(RuntimeError):
    """A training loop did something the engine cannot synchronize exactly (the message says
    which variable and what to do instead)."""


class Handle:
    """In-flight collectives of a broadcast phase; ``wait()`` completes them."""

    def __init__(self, work) -> None:
        self._work = work

    def wait(self) -> None:
        """Complete the phase's collectives (a second call does nothing)."""
        if self._work is not None:
            self._work.wait()
        self._work = None


@dataclass(eq=False)
class Member:
    """One shard of one variable: where it sits in the parameter and the parameter aliasing it."""

    variable: str
    shard: int
    slices: tuple
    shape: tuple[int, ...]
    view: torch.nn.Parameter  # shares storage with the model parameter
    whole: bool = False  # the shard is the whole variable: its gradient needs no indexing

    def of(self, grad: torch.Tensor) -> torch.Tensor:
        """This shard's part of the variable's (dense) gradient."""
        return grad if self.whole else grad[self.slices]

    @property
    def numel(self) -> int:
        """Number of scalars in the shard."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(eq=False)
class GradView:
    """One variable's gradient of one backward pass, prepared once for all its shards: a sparse
    gradient is coalesced once (and densified once, for shards that need it dense)."""

    grad: torch.Tensor | None
    _coalesced: torch.Tensor | None = field(default=None, repr=False)
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def coalesced(self) -> torch.Tensor:
        """The gradient as a coalesced sparse tensor (a dense one's non-zero rows), made once."""
        if self._coalesced is None:
            # A sparse variable also used densely (tied to a dense layer) gets a dense gradient:
            # its non-zero rows are the rows to send.
            grad = self.grad if self.grad.is_sparse else self.grad.to_sparse(1)
            self._coalesced = grad.coalesce()
        return self._coalesced

    @property
    def dense(self) -> torch.Tensor:
        """The gradient as a dense tensor, made once."""
        if self._dense is None:
            self._dense = self.coalesced.to_dense() if self.grad.is_sparse else self.grad
        return self._dense


class _Works:
    """Several collectives launched together, completed together."""

    def __init__(self, works: list) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class _Unit:
    members: list[Member]
    #: Why this step cannot be synchronized exactly, decided by every rank alike (a verdict that
    #: travelled with the unit's own collectives); the engine raises it once the step completed.
    refusal: str | None = None
    #: Whether the unit sends new values after the optimizer's step (:meth:`broadcast_phase`,
    #: :meth:`after_broadcast`); the engine asks only those units.
    broadcasts: bool = False

    def __init__(self, members: list[Member], weight: float) -> None:
        self.members = members
        self.weight = weight
        self._ids = frozenset(id(m) for m in members)
        self.pending: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Forget the step: every member pending again, no refusal."""
        self.pending = set(self._ids)
        self.refusal = None

    def member_ready(self, member: Member, grad: GradView | None) -> bool:
        """Store ``member``'s gradient; True once every member is in (the unit can start)."""
        if id(member) not in self.pending:
            raise SynchronizationError(
                f"variable {member.variable!r} got a second gradient before engine.step(), and its synchronization "
                f"already started: a second backward would be lost or mixed into a collective in flight. Run the "
                f"micro-batches that should not communicate inside `with engine.no_sync():` (all but the last, as "
                f"with torch DDP), or call engine.step() between backward passes")
        self._store(member, grad)
        self.pending.discard(id(member))
        return not self.pending

    def take(self, member: Member, grad: torch.Tensor | None) -> bool:
        """:meth:`member_ready` with the parameter's ``.grad`` as it is (the gradient hook's call)."""
        return self.member_ready(member, GradView(grad) if grad is not None else None)

    def stored(self, member: Member) -> bool:
        return id(member) not in self.pending

    def unready(self) -> list[Member]:
        """Members that got no gradient in this step (parameters unused by the forward pass)."""
        pending = self.pending
        return [m for m in self.members if id(m) in pending] if pending else []

    def stage_groups(self) -> list:
        """The process groups of this rank's pipeline stages, in order (for the scheduler)."""
        raise NotImplementedError  # pragma: no cover

    def pipeline(self) -> Iterator[tuple[Any, Callable]]:
        """The unit's collectives, one ``(group, launch)`` at a time: each launched when the one
        before it completed (the scheduler orders them across units)."""
        raise NotImplementedError  # pragma: no cover

    def owned(self) -> list[Member]:
        """Members whose optimizer update this rank performs."""
        return self.members

    def source_of(self, member: Member) -> int:
        """The rank whose copy of ``member``'s optimizer state is authoritative."""
        return 0

    def counts_in_norm(self, rank: int) -> bool:
        """Whether this rank counts the unit's gradients in a global norm (each shard once)."""
        return rank == 0

    def synchronized_grads(self) -> list[torch.Tensor]:
        """The synchronized gradients this rank holds after ``finish`` (what clipping scales)."""
        return [m.view.grad for m in self.members if m.view.grad is not None]

    def norm_grads(self, rank: int) -> list[torch.Tensor]:
        """The gradients this rank counts in a global norm (every element once over all ranks)."""
        return self.synchronized_grads() if self.counts_in_norm(rank) else []

    def drop_grads(self) -> None:
        """Drop the synchronized gradients of the members (``zero_grad``)."""
        for m in self.members:
            m.view.grad = None

    def state_members(self, rank: int) -> list[Member]:
        """Members whose optimizer state this rank contributes to a checkpoint."""
        return [m for m in self.members if self.source_of(m) == rank]

    def broadcast_phase(self, phase: int) -> list[Handle]:
        """The collectives this unit starts in broadcast ``phase`` (0, then 1) after the
        optimizer's step: the new values of the shards it updates, sent to every replica."""
        return []

    def after_broadcast(self) -> None:
        """Put what the broadcast phases received into the members' parameters."""

    def bucket_grads(self) -> list[tuple[Member, torch.Tensor]]:
        """``(member, slot)`` for each member whose gradient autograd should accumulate straight
        into the unit's buffer: the engine makes ``slot`` the parameter's ``.grad`` (a whole,
        dense variable; torch DDP's ``gradient_as_bucket_view``). None by default."""
        return []

    def zero_bucket_grads(self) -> None:
        """Zero the slots of :meth:`bucket_grads` (``zero_grad``: autograd adds into them)."""

    def forget(self) -> None:
        """Drop what the unit kept of this step beyond the gradients (``zero_grad``)."""

    def close(self) -> None:
        """Undo what the unit did to the module (hooks); the engine calls it when it closes."""

    def _store(self, member: Member, grad: GradView | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:  # pragma: no cover - abstract
        """Once the pipeline completed: set the members' synchronized gradients."""
        raise NotImplementedError


def _staged(group, stages: Iterator[Callable]) -> Iterator[tuple[Any, Callable]]:
    """A compressor's launches as pipeline stages on ``group``."""
    for launch in stages:
        yield group, launch


class AllReduceUnit(_Unit):
    """A merge group: members flattened into one bucket, one (compressed) all-reduce."""

    def __init__(self, members: list[Member], weight: float, compressor, device, dtype, group=None,
                 bucket: torch.Tensor | None = None, in_bucket: Iterable[Member] = ()) -> None:
        self.offsets = []
        total = 0
        for m in members:
            self.offsets.append(total)
            total += m.numel
        self.bucket = torch.zeros(total, device=device, dtype=dtype) if bucket is None else bucket
        self.compressor = compressor
        self.group = group
        # The weight as a 0-dim tensor of the dtype torch computes in (float32 for float16,
        # bfloat16 and float32; float64 for float64), made once: a Python float is wrapped into a
        # tensor on every call (a few µs, as much as copying a small gradient), and ``_foreach_mul_``
        # would round it to a half-precision bucket's dtype first. Bit for bit what ``mul_(weight)`` gives.
        self._scale = torch.tensor(weight, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        # Views made once: on a GPU each view is a dispatch on the host, per member and step.
        self._slots = {id(m): self._slot(i, m) for i, m in enumerate(members)}
        # Members whose .grad is their bucket slot (torch DDP's gradient_as_bucket_view): autograd
        # accumulates into it, and the hook has nothing to copy (see :meth:`bucket_grads`).
        chosen = {id(m) for m in in_bucket}
        self._in_bucket = [m for m in members if id(m) in chosen]
        self._bucket_slots = [self._slots[id(m)] for m in self._in_bucket]
        self._grad_slots = [(m.view, self._slots[id(m)]) for m in members]
        self._raw: list[torch.Tensor] = []  # slots holding this rank's unscaled gradient this step
        super().__init__(members, weight)

    def _slot(self, i: int, member: Member) -> torch.Tensor:
        return self.bucket[self.offsets[i]:self.offsets[i] + member.numel].view(member.shape)

    def reset(self) -> None:
        """Forget the step, including the slots whose gradient is still to be scaled."""
        super().reset()
        self._raw = []

    def bucket_grads(self) -> list[tuple[Member, torch.Tensor]]:
        return [(m, self._slots[id(m)]) for m in self._in_bucket]

    def zero_bucket_grads(self) -> None:
        if len(self._in_bucket) == len(self.members):
            self.bucket.zero_()
        elif self._bucket_slots:
            torch._foreach_zero_(self._bucket_slots)

    def _store(self, member, grad):
        dst = self._slots[id(member)]
        if grad is None:
            dst.zero_()
            return
        self._put(dst, member.of(grad.dense))

    def _put(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Bring a dense gradient ``src`` into its slot ``dst``, scaled by this rank's weight."""
        if src is dst:  # accumulated in place by autograd: scaled with the others in the pipeline
            self._raw.append(dst)
        elif src.dtype == dst.dtype:
            # Scaled as it is copied, one pass over the gradient (torch DDP's ``mul_out`` into its
            # bucket), the same rounding as copying and scaling the bucket after.
            torch.mul(src, self._scale, out=dst)
        else:
            dst.copy_(src)
            dst.mul_(self._scale)

    def take(self, member, grad):
        # The hook's path for a dense gradient, without the GradView a sparse one needs: it runs
        # once per parameter and backward, in Python where torch DDP's is C++.
        key = id(member)
        pending = self.pending
        dst = self._slots[key]
        if key not in pending or grad is None or grad.is_sparse:
            return self.member_ready(member, GradView(grad) if grad is not None else None)
        self._put(dst, member.of(grad))
        pending.discard(key)
        return not pending

    def _scale_raw(self) -> None:
        """Scale the slots autograd accumulated into by this rank's weight (the others were
        scaled as they were copied): the whole bucket at once when they are all of it."""
        if len(self._raw) == len(self.members):
            self.bucket.mul_(self._scale)
        elif self._raw:
            torch._foreach_mul_(self._raw, self._scale)
        self._raw = []

    def stage_groups(self):
        return [self.group] * self.compressor.stages

    def pipeline(self):
        self._scale_raw()  # every slot then holds this rank's weighted share
        yield from _staged(self.group, self.compressor.all_reduce(self.bucket, self.group))

    def finish(self):
        for view, slot in self._grad_slots:
            view.grad = slot


class HierarchicalAllReduceUnit(AllReduceUnit):
    """A merge group all-reduced in three stages (Horovod's hierarchical all-reduce): each piece
    of the bucket is reduced inside each node to the local rank that owns it (a reduce-scatter,
    as one reduce per piece: gloo's reduce_scatter cannot say when it completed), each piece
    all-reduced across the nodes among the ranks owning it, then all-gathered inside each node.
    Lossless; every node holds the same number of replicas (validation checks it)."""

    def __init__(self, members, weight, counter, device, dtype, *, intra, intra_ranks: list[int], cross,
                 rank: int, in_bucket: Iterable[Member] = ()) -> None:
        self.local_size = len(intra_ranks)
        used = sum(m.numel for m in members)
        self.padded = torch.zeros(used + (-used) % self.local_size, device=device, dtype=dtype)
        super().__init__(members, weight, None, device, dtype, bucket=self.padded[:used], in_bucket=in_bucket)
        self.counter = counter
        self.intra, self.intra_ranks, self.cross = intra, intra_ranks, cross
        self.pieces = list(self.padded.view(self.local_size, -1))
        self.local_index = intra_ranks.index(rank)
        self.mine = torch.empty_like(self.pieces[0])

    def stage_groups(self):
        stages = []
        if self.local_size > 1:
            stages.append(self.intra)
        if self.cross is not None:
            stages.append(self.cross)
        if self.local_size > 1:
            stages.append(self.intra)
        return stages

    def _reduce_pieces(self) -> _Works:
        return _Works([dist.reduce(piece, dst=dst, group=self.intra, async_op=True)
                       for piece, dst in zip(self.pieces, self.intra_ranks)])

    def pipeline(self):
        self._scale_raw()
        if self.local_size > 1:
            self.counter(self.padded)
            yield self.intra, self._reduce_pieces
        self.mine.copy_(self.pieces[self.local_index])
        if self.cross is not None:
            self.counter(self.mine)
            yield self.cross, lambda: dist.all_reduce(self.mine, group=self.cross, async_op=True)
        if self.local_size > 1:
            self.counter(self.mine)
            yield self.intra, lambda: dist.all_gather(self.pieces, self.mine, group=self.intra, async_op=True)
        else:
            self.pieces[0].copy_(self.mine)


class PSUnit(_Unit):
    """A dense shard on a parameter server: reduce to the placement rank, which updates it and
    broadcasts the new value. With local aggregation the reduce (and broadcast) goes through a
    root per node: a reduce inside the node, then, chained as soon as it completed, a reduce
    among the node roots to the server."""

    broadcasts = True

    def __init__(self, member: Member, weight: float, compressor, *, rank: int, placement: int,
                 device, counter, intra=None, roots=None, local_root: int | None = None) -> None:
        self.rank = rank
        self.placement = placement
        self.compressor = compressor
        self.counter = counter
        self.buffer = torch.zeros(member.shape, device=device, dtype=member.view.dtype)
        self.intra = intra  # (group, ranks) of this rank's node, or None
        self.roots = roots  # (group, ranks) of the node roots, or None
        self.local_root = local_root
        super().__init__([member], weight)

    @property
    def member(self) -> Member:
        """The unit's one shard."""
        return self.members[0]

    @property
    def _hierarchical(self) -> bool:
        return self.intra is not None or self.roots is not None

    def _store(self, member, grad):
        if grad is None:
            self.buffer.zero_()
        else:
            self.buffer.copy_(member.of(grad.dense))

    def _at_root(self) -> bool:
        return self.roots is not None and self.rank in self.roots[1]

    def stage_groups(self):
        n = self.compressor.stages
        if not self._hierarchical:
            return [None] * n
        stages = [self.intra[0]] * n if self.intra is not None else []
        return stages + ([self.roots[0]] * n if self._at_root() else [])

    def pipeline(self):
        self.buffer.mul_(self.weight)
        if not self._hierarchical:
            yield from _staged(None, self.compressor.reduce(self.buffer, self.placement, None))
            return
        if self.intra is not None:
            yield from _staged(self.intra[0], self.compressor.reduce(self.buffer, self.local_root, self.intra[0]))
        if self._at_root():
            yield from _staged(self.roots[0], self.compressor.reduce(self.buffer, self.placement, self.roots[0]))

    def finish(self):
        self.member.view.grad = self.buffer if self.rank == self.placement else None

    def owned(self):
        return self.members if self.rank == self.placement else []

    def source_of(self, member):
        return self.placement

    def counts_in_norm(self, rank):
        return rank == self.placement

    def _broadcast(self, src: int, group) -> Handle:
        self.counter(self.buffer)
        return Handle(dist.broadcast(self.buffer, src=src, group=group, async_op=True))

    def broadcast_phase(self, phase):
        if phase == 0 and self.rank == self.placement:
            self.buffer.copy_(self.member.view.detach())
        if not self._hierarchical:
            return [self._broadcast(self.placement, None)] if phase == 0 else []
        if phase == 0:
            return [self._broadcast(self.placement, self.roots[0])] if self._at_root() else []
        if phase == 1 and self.intra is not None:
            return [self._broadcast(self.local_root, self.intra[0])]
        return []

    def after_broadcast(self):
        if self.rank != self.placement:
            with torch.no_grad():
                self.member.view.copy_(self.buffer)


def _rows(member: Member, grad: GradView | None, weight: float, device):
    """(local row indices, scaled row values) of a sparse gradient restricted to the member's rows."""
    lo, hi = member.slices[0].start, member.slices[0].stop
    width = member.shape[1]
    if grad is None:
        return (torch.zeros(0, dtype=torch.long, device=device),
                torch.zeros(0, width, dtype=member.view.dtype, device=device))
    coalesced = grad.coalesced
    idx, vals = coalesced.indices()[0], coalesced.values()
    mask = (idx >= lo) & (idx < hi)
    return idx[mask] - lo, vals[mask] * weight


class _SparseUnit(_Unit):
    """Shared by the sparse synchronizers: the rows of this rank's gradient inside the shard,
    sent in two chained stages (every rank's row count, then the rows padded to the longest,
    as collectives of tensors need equal sizes on every rank)."""

    def __init__(self, member: Member, weight: float, *, world: int, device, counter) -> None:
        self.world = world
        self.device = device
        self.counter = counter
        super().__init__([member], weight)

    def _store(self, member, grad):
        self.idx, self.vals = _rows(member, grad, self.weight, self.device)

    def stage_groups(self):
        return [None, None]

    def pipeline(self):
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(self.world)]
        mine = torch.tensor([len(self.idx)], dtype=torch.long, device=self.device)
        self.counter(mine)
        yield None, lambda: dist.all_gather(sizes, mine, async_op=True)
        self.sizes = [int(s.item()) for s in sizes]
        longest = max(self.sizes)
        pad_idx = torch.zeros(longest, dtype=torch.long, device=self.device)
        pad_val = torch.zeros(longest, self.members[0].shape[1], dtype=self.vals.dtype, device=self.device)
        pad_idx[: len(self.idx)] = self.idx
        pad_val[: len(self.idx)] = self.vals
        self.counter(pad_idx)
        self.counter(pad_val)
        yield None, lambda: _Works(self._send_rows(pad_idx, pad_val))

    def _send_rows(self, pad_idx, pad_val) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def _gathered_grad(self) -> torch.Tensor:
        """The summed sparse gradient of the shard from every rank's gathered rows."""
        m = self.members[0]
        idx = torch.cat([t[:n] for t, n in zip(self.all_idx, self.sizes)])
        vals = torch.cat([t[:n] for t, n in zip(self.all_val, self.sizes)])
        return torch.sparse_coo_tensor(idx[None], vals, m.shape, check_invariants=False).coalesce()


class SparseAllGatherUnit(_SparseUnit):
    """A sparse shard synchronized by all-gather of (row indices, row values); every rank sums
    the gathered rows into the same sparse gradient and applies it itself."""

    def _send_rows(self, pad_idx, pad_val):
        self.all_idx = [torch.empty_like(pad_idx) for _ in range(self.world)]
        self.all_val = [torch.empty_like(pad_val) for _ in range(self.world)]
        return [dist.all_gather(self.all_idx, pad_idx, async_op=True),
                dist.all_gather(self.all_val, pad_val, async_op=True)]

    def finish(self):
        self.members[0].view.grad = self._gathered_grad()


class SFBUnit(_Unit):
    """Sufficient-factor broadcasting (TAG §2.3, §4.2.3) of one ``nn.Linear`` weight.

    A forward hook keeps each call's input rows X and hooks the output for its gradient dY
    (summed over backward passes through it). At synchronization every rank sends [w·dY | X]
    (w: its batch weight) in two chained all-gathers (row counts, then the rows padded to the
    longest: replicas of an uneven split have different counts) and every rank computes the same
    Σ dYᵀX, in rank order, itself. Every step checks, on a random projection (O(N·(H_in + H_out))
    work, not a second matmul), that the layer's local gradient is its local dYᵀX; the verdicts
    travel with the row counts, so every rank refuses together a weight also used outside its
    layer (tied, passed to ``F.linear``, a penalty on it) or a backward through the layer that
    did not reach the weight (``autograd.grad``), instead of losing or adding that part of its
    gradient. Contributions below the check's tolerance (1e-4 of the gradient's norm in float32,
    2e-2 in 16-bit types) are not told apart from rounding. A step whose gradient is not finite
    (a loss scaler's overflow) is not checked."""

    def __init__(self, member: Member, weight: float, *, layer: torch.nn.Module, world: int, device,
                 counter) -> None:
        self.world = world
        self.device = device
        self.counter = counter
        self.calls: list[list] = []
        gen = torch.Generator().manual_seed(0x5FB)
        self.probe = torch.randn(member.shape[1], generator=gen, dtype=torch.float64).to(
            device=device, dtype=member.view.dtype)
        half = member.view.dtype in (torch.float16, torch.bfloat16)
        self.tolerance = 2e-2 if half else 1e-4
        self.handle = layer.register_forward_hook(self._forward)
        super().__init__([member], weight)

    def _forward(self, _layer, inputs, output) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        x = inputs[0].detach()
        call = [x.reshape(-1, x.shape[-1]), None]
        self.calls.append(call)

        def grad_out(g, _call=call):
            g = g.detach().reshape(-1, g.shape[-1])
            _call[1] = g if _call[1] is None else _call[1] + g  # several backward passes through it

        output.register_hook(grad_out)

    def forget(self) -> None:
        """Drop the factors kept so far (``engine.zero_grad``: their gradients are dropped too)."""
        self.calls = []

    def _store(self, member, grad):
        out_features, in_features = member.shape
        dtype = member.view.dtype
        # A forward pass without a backward through it (a loss never backpropagated) adds nothing.
        pairs = [(x, dy) for x, dy in self.calls if dy is not None]
        self.calls = []
        if pairs:
            x = torch.cat([x for x, _ in pairs]).to(dtype)
            dy = torch.cat([dy for _, dy in pairs]).to(dtype)
        else:
            x = torch.zeros(0, in_features, dtype=dtype, device=self.device)
            dy = torch.zeros(0, out_features, dtype=dtype, device=self.device)
        local = grad.dense @ self.probe if grad is not None else torch.zeros(out_features, dtype=dtype,
                                                                              device=self.device)
        factors = dy.t() @ (x @ self.probe)
        scale = torch.maximum(local.norm(), factors.norm())
        self.inconsistent = ((local - factors).norm() > self.tolerance * scale) & torch.isfinite(local).all()
        self.packed = torch.cat([dy * self.weight, x], dim=1)

    def stage_groups(self):
        return [None, None]

    def pipeline(self):
        sizes = [torch.zeros(2, dtype=torch.long, device=self.device) for _ in range(self.world)]
        mine = torch.stack([torch.tensor(len(self.packed), dtype=torch.long, device=self.device),
                            self.inconsistent.to(torch.long)])
        self.counter(mine)
        yield None, lambda: dist.all_gather(sizes, mine, async_op=True)
        gathered = [s.tolist() for s in sizes]
        bad = [r for r, (_n, flag) in enumerate(gathered) if flag]
        if bad:
            # Every rank gathered the same flags: every rank refuses, after the second stage
            # (declared to the scheduler, so later units' turns come) has run on all of them.
            self.refusal = (
                f"variable {self.members[0].variable!r}: synchronizer sfb: on rank(s) {bad} its local gradient is not "
                f"the product of its layer's output gradients and inputs (the weight is also used outside the "
                f"layer's forward: tied to another module, passed to F.linear, a penalty on it; or a backward "
                f"reached the layer but not the weight); use allreduce or ps for this variable")
        self.sizes = [n for n, _flag in gathered]
        # gloo gathers equal sizes only; one row at least, as an empty tensor is no message.
        pad = torch.zeros(max(1, max(self.sizes)), self.packed.shape[1], dtype=self.packed.dtype, device=self.device)
        pad[: len(self.packed)] = self.packed
        self.packed = None
        self.counter(pad)
        self.gathered = [torch.empty_like(pad) for _ in range(self.world)]
        yield None, lambda: dist.all_gather(self.gathered, pad, async_op=True)

    def finish(self):
        member = self.members[0]
        rows = torch.cat([t[:n] for t, n in zip(self.gathered, self.sizes)])
        self.gathered = []
        out_features = member.shape[0]
        member.view.grad = rows[:, :out_features].t() @ rows[:, out_features:]

    def close(self) -> None:
        self.handle.remove()


class SparsePSUnit(_SparseUnit):
    """A sparse shard on a parameter server: rows gathered to the placement, which applies the
    update and broadcasts the rows it changed (all rows if its optimizer is not row-sparse)."""

    broadcasts = True

    def __init__(self, member: Member, weight: float, *, rank: int, placement: int, world: int, device, counter,
                 full_broadcast: bool = False) -> None:
        self.rank = rank
        self.placement = placement
        self.full_broadcast = full_broadcast
        super().__init__(member, weight, world=world, device=device, counter=counter)

    def _send_rows(self, pad_idx, pad_val):
        root = self.rank == self.placement
        self.all_idx = [torch.empty_like(pad_idx) for _ in range(self.world)] if root else None
        self.all_val = [torch.empty_like(pad_val) for _ in range(self.world)] if root else None
        return [dist.gather(pad_idx, self.all_idx, dst=self.placement, async_op=True),
                dist.gather(pad_val, self.all_val, dst=self.placement, async_op=True)]

    def finish(self):
        self.members[0].view.grad = self._gathered_grad() if self.rank == self.placement else None

    def owned(self):
        return self.members if self.rank == self.placement else []

    def source_of(self, member):
        return self.placement

    def counts_in_norm(self, rank):
        return rank == self.placement

    def broadcast_phase(self, phase):
        if phase != 0:
            return []
        m = self.members[0]
        if self.full_broadcast:
            self.rows = None
            self.values = m.view.detach().contiguous() if self.rank == self.placement else torch.empty(
                m.shape, dtype=m.view.dtype, device=self.device)
        else:
            count = torch.zeros(1, dtype=torch.long, device=self.device)
            if self.rank == self.placement:
                self.rows = m.view.grad.indices()[0] if m.view.grad is not None else count[:0]
                count[0] = len(self.rows)
            self.counter(count)
            dist.broadcast(count, src=self.placement)
            if self.rank != self.placement:
                self.rows = torch.empty(int(count.item()), dtype=torch.long, device=self.device)
            self.values = m.view.detach()[self.rows].contiguous() if self.rank == self.placement else torch.empty(
                len(self.rows), m.shape[1], dtype=m.view.dtype, device=self.device)
            self.counter(self.rows)
        self.counter(self.values)
        handles = [Handle(dist.broadcast(self.values, src=self.placement, async_op=True))]
        if self.rows is not None:
            handles.insert(0, Handle(dist.broadcast(self.rows, src=self.placement, async_op=True)))
        return handles

    def after_broadcast(self):
        if self.rank == self.placement:
            return
        m = self.members[0]
        with torch.no_grad():
            if self.rows is None:
                m.view.copy_(self.values)
            else:
                m.view[self.rows] = self.values


class ShardUnit(_Unit):
    """Sharded data parallelism for one unit (ZeRO stage 2, Rajbhandari et al. SC'20 §5; FSDP2's
    ``fully_shard`` with ``reshard_after_forward=False``): the unit's gradients go into one
    bucket laid out by shard-group member (member r's segment holds rows ``shard_rows(n, k)[r]``
    of every variable, padded to the same length), one reduce-scatter over the shard group (in
    ``reduce_dtype``) leaves each rank the summed rows it owns, and with HSDP (groups of k < all
    replicas) one all-reduce of that segment across the groups completes the sum. The
    optimizer updates only those rows (``owned``: row views of the parameters, so its state is a
    slice too); after the step one all-gather over the shard group brings every rank the
    updated rows of the others. With an element-wise optimizer this is single-process training."""

    broadcasts = True

    def __init__(self, members: list[Member], weight: float, *, rank: int, shard_ranks: list[int], group, cross,
                 reduce_dtype: torch.dtype, device, counter) -> None:
        self.size = len(shard_ranks)
        self.index = shard_ranks.index(rank)
        # Shard groups are runs of consecutive ranks; the one starting at rank 0 is "the first".
        self.first_group = shard_ranks[0] == 0
        self.group, self.cross, self.counter = group, cross, counter
        self.reduce_dtype = reduce_dtype
        self.layout = []  # per member: (offset in a segment, rows per member, row elements)
        at = 0
        for m in members:
            rows = m.shape[0]
            per = -(-rows // self.size)
            elems = m.numel // rows
            self.layout.append((at, per, elems))
            at += per * elems
        self.segment = max(at, 1)  # a collective needs one element at least
        dtype = members[0].view.dtype
        self.bucket = torch.zeros(self.size * self.segment, device=device, dtype=dtype)
        self.out = torch.zeros(self.segment, device=device, dtype=dtype)
        self._wire = None if reduce_dtype == dtype else torch.zeros(self.size * self.segment, device=device,
                                                                    dtype=reduce_dtype)
        self._wire_out = None if self._wire is None else torch.zeros(self.segment, device=device, dtype=reduce_dtype)
        grid = self.bucket.view(self.size, self.segment)
        # Views made once: (this member's rows of every segment as (k, per, elems), this rank's rows).
        self._slots = {}
        self.slices: list[Member] = []
        # Per slice: where its rows sit in this rank's segment (the gradient's, then the update's).
        self._segment_views: list[torch.Tensor] = []
        for m, (off, per, elems) in zip(members, self.layout):
            rows = m.shape[0]
            self._slots[id(m)] = grid[:, off:off + per * elems].view(self.size, per, elems)
            lo, hi = min(rows, self.index * per), min(rows, (self.index + 1) * per)
            if hi > lo:
                view = torch.nn.Parameter(m.view.detach()[lo:hi], requires_grad=False)
                piece = Member(variable=m.variable, shard=m.shard, slices=(slice(lo, hi),), shape=tuple(view.shape),
                               view=view)
                self._segment_views.append(self.out[off:off + (hi - lo) * elems].view(piece.shape))
                self.slices.append(piece)
        super().__init__(members, weight)

    def _copy_rows(self, member: Member, tensor: torch.Tensor, dst: torch.Tensor, to_bucket: bool) -> None:
        """Between a variable (rows first) and its slot (k, per, elems) of the bucket. Writes into
        the variable go through row slices of it, never a reshape: a parameter that is not
        contiguous (channels_last) would take them in a copy, and replicas would drift apart."""
        rows = member.shape[0]
        per = dst.shape[1]
        if rows == self.size * per and tensor.is_contiguous():
            grid = tensor.view(self.size, per, -1)
            (dst.copy_(grid) if to_bucket else grid.copy_(dst))
            return
        rest = tuple(tensor.shape[1:])
        for r in range(self.size):
            lo, hi = min(rows, r * per), min(rows, (r + 1) * per)
            if hi > lo:
                if to_bucket:
                    dst[r, :hi - lo].copy_(tensor[lo:hi].reshape(hi - lo, -1))
                else:
                    tensor[lo:hi].copy_(dst[r, :hi - lo].view(hi - lo, *rest))

    def _store(self, member, grad):
        slot = self._slots[id(member)]
        if grad is None:
            slot.zero_()  # padding rows are zero already and stay so
        else:
            self._copy_rows(member, member.of(grad.dense), slot, to_bucket=True)

    def stage_groups(self):
        return [self.group] + ([self.cross] if self.cross is not None else [])

    def pipeline(self):
        self.bucket.mul_(self.weight)
        send, out = self.bucket, self.out
        if self._wire is not None:
            send, out = self._wire, self._wire_out
            send.copy_(self.bucket)
        self.counter(send)
        # gloo's reduce_scatter never reports itself completed before wait(): a stage after it
        # (the HSDP all-reduce) is launched when the step waits for it, not during backward.
        yield self.group, lambda: _reduce_scatter(out, send, group=self.group, async_op=True)
        if self.cross is not None:
            self.counter(out)
            yield self.cross, lambda: dist.all_reduce(out, group=self.cross, async_op=True)

    def finish(self):
        if self._wire_out is not None:
            self.out.copy_(self._wire_out)
        for piece, segment in zip(self.slices, self._segment_views):
            piece.view.grad = segment

    def owned(self):
        return self.slices

    def synchronized_grads(self):
        return [p.view.grad for p in self.slices if p.view.grad is not None]

    def counts_in_norm(self, rank):
        # Every shard group holds the whole sum; the first one's members count it, once.
        return self.first_group

    def drop_grads(self):
        for p in self.slices:
            p.view.grad = None
        for m in self.members:
            m.view.grad = None

    def state_members(self, rank):
        return self.slices if self.first_group else []

    def broadcast_phase(self, phase):
        if phase != 0:
            return []
        # The updated rows travel in the segment that brought their gradient (spent by the step: the
        # slices' gradients are the engine's own, dropped here), so a unit holds no third buffer.
        with torch.no_grad():
            for piece, segment in zip(self.slices, self._segment_views):
                piece.view.grad = None
                segment.copy_(piece.view)
        self.counter(self.bucket)
        return [Handle(_all_gather(self.bucket, self.out, group=self.group, async_op=True))]

    def after_broadcast(self):
        with torch.no_grad():
            for m in self.members:
                self._copy_rows(m, m.view.detach(), self._slots[id(m)], to_bucket=False)


@dataclass(eq=False)
class _Entry:
    stages: Iterator[tuple[Any, Callable]]
    launched: int = 0
    next_stage: tuple[Any, Callable] | None = None
    work: Any = None
    waited: bool = False  # work.wait() returned (gloo's is_completed() stays False for some ops)
    done: bool = False


class Scheduler:
    """Launches the pipeline stages of the units that are ready, in one order all ranks agree on.

    Collectives on one process group must be issued in the same order on every rank of it, and
    which units are ready when differs between ranks (timing; parameters one rank's forward did
    not use). So the order is fixed in advance, from the units alone, as torch DDP fixes its
    buckets': per process group, the stages of the units in unit order (``chain``: each unit's
    stages together, a stage starting as soon as the previous one completed) or stage by stage
    (not ``chain``: every unit's first stage during backward, then, inside ``step``, every later
    stage one at a time, each waited for: the engine's ``overlap=False``). A stage
    launches once it is next in its group's order, its unit is ready and its previous stage
    completed. With ``one_order`` every group shares one order (NCCL: communicators that run
    concurrently in different orders on different ranks can deadlock).
    """

    def __init__(self, units: list, *, chain: bool = True, one_order: bool = False) -> None:
        self.units = units
        self.chain = chain
        self.one_order = one_order
        self._index = {id(u): i for i, u in enumerate(units)}
        self.groups = [[self._key(g) for g in u.stage_groups()] for u in units]
        self.order: dict[int, list[tuple[int, int]]] = {}
        if chain:
            slots = [(i, k) for i, groups in enumerate(self.groups) for k in range(len(groups))]
        else:
            deepest = max((len(g) for g in self.groups), default=0)
            slots = [(i, k) for k in range(deepest) for i, groups in enumerate(self.groups) if k < len(groups)]
        for i, k in slots:
            self.order.setdefault(self.groups[i][k], []).append((i, k))
        self.reset()

    def _key(self, group) -> int:
        return 0 if group is None or self.one_order else id(group)

    def reset(self) -> None:
        """Forget the step (after every unit finished)."""
        self.position = {g: 0 for g in self.order}
        self.entries: dict[int, _Entry] = {}
        # Indices of entries not done, in unit order: every gradient hook advances the scheduler,
        # so a pass must not revisit (or re-sort) the units already finished.
        self.active: list[int] = []

    def add(self, unit: _Unit) -> None:
        """``unit`` is ready: every member's gradient is in."""
        i = self._index[id(unit)]
        self.entries[i] = _Entry(unit.pipeline())
        bisect.insort(self.active, i)

    @property
    def idle(self) -> bool:
        """Whether no unit has a collective in flight or waiting to launch."""
        return not self.active

    def _advance(self, block: bool) -> bool:
        """Collect completed stages, launch the stages whose turn it is; whether anything moved."""
        moved = False
        finished = False
        # Groups whose earlier collective in flight is not complete: a later unit on them that has
        # nothing left to launch is not asked (it is collected later; a unit with stages left
        # still is). A step of a large model has dozens of units in flight while the host runs
        # ahead of the device, and asking each of them at every gradient hook cost more host time
        # than torch DDP's whole iteration overhead (bert-large on a GPU).
        stalled: set[int] = set()
        for i in self.active:
            e = self.entries[i]
            while not e.done:
                if e.work is not None:
                    if not e.waited:
                        key = self.groups[i][e.launched - 1]
                        if key in stalled and e.launched == len(self.groups[i]):
                            break
                        if not e.work.is_completed():
                            stalled.add(key)
                            break
                    e.work.wait()
                    e.work, e.waited = None, False
                    moved = True
                if e.next_stage is None:
                    e.next_stage = next(e.stages, None)  # runs the code after the previous stage
                    if e.next_stage is None:
                        e.done = moved = finished = True
                        break
                key = self._key(e.next_stage[0])
                if e.launched >= len(self.groups[i]) or key != self.groups[i][e.launched]:
                    raise AssertionError(f"unit {i}: a stage on group {key} where {self.groups[i][e.launched:]} "
                                         f"was declared")
                turn = self.order[key][self.position[key]] == (i, e.launched)
                if not turn or not (self.chain or block or e.launched == 0):
                    break
                if not self.chain and e.launched > 0 and any(
                        o.work is not None and o.launched > 1 for o in self.entries.values()):
                    break  # unchained: later stages one at a time, each waited for (the engine before chaining)
                e.work = e.next_stage[1]()
                e.next_stage = None
                e.launched += 1
                self.position[key] += 1
                moved = True
        if finished:
            self.active = [i for i in self.active if not self.entries[i].done]
        return moved

    def progress(self, block: bool = False) -> None:
        """Launch what may be launched and collect what completed; with ``block``, until every
        unit that was added is done (waiting on the earliest collective in flight)."""
        while self._advance(block):
            pass
        while block and not self.idle:
            in_flight = [self.entries[i] for i in self.active if self.entries[i].work is not None]
            if not in_flight:
                raise AssertionError("the scheduler is stuck: no collective in flight and none may start")
            in_flight[0].work.wait()
            in_flight[0].waited = True
            while self._advance(block):
                pass
