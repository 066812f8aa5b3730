"""Synchronizers as communication units (AutoDist §2.3 "Synchronizer" kernels, in eager PyTorch).

A unit owns the shards it synchronizes. Gradient hooks hand it each member's gradient as soon
as autograd has accumulated it; the unit launches its collective when all members are in,
so communication overlaps the rest of backward. ``finish`` completes the collective and sets
the shard parameters' gradients; ``broadcast_phase`` sends updated values back (PS only).

Every gradient arrives multiplied by this rank's share of the global batch, so the summed
message is the gradient of the global mean loss, also with uneven batch splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compress import Handle, WireCompressor

__all__ = ["Member", "AllReduceUnit", "PSUnit", "SparseAllGatherUnit", "SparsePSUnit"]


@dataclass(eq=False)
class Member:
    """One shard of one variable: where it sits in the parameter and the parameter aliasing it."""

    variable: str
    shard: int
    slices: tuple
    shape: tuple[int, ...]
    view: torch.nn.Parameter  # shares storage with the model parameter
    sparse: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Unit:
    members: list[Member]

    def __init__(self, members: list[Member], weight: float) -> None:
        self.members = members
        self.weight = weight
        self.pending: set[int] = set()
        self.launched = False
        self.reset()

    def reset(self) -> None:
        self.pending = {id(m) for m in self.members}
        self.launched = False

    def member_ready(self, member: Member, grad: torch.Tensor | None) -> None:
        self._store(member, grad)
        self.pending.discard(id(member))
        if not self.pending and not self.launched:
            self.launched = True
            self._launch()

    def force_launch(self) -> None:
        """Launch with zero gradients for members that got none this iteration (unused parameters)."""
        for m in self.members:
            if id(m) in self.pending:
                self.member_ready(m, None)

    def owned(self) -> list[Member]:
        """Members whose optimizer update this rank performs."""
        return self.members

    def broadcast_phase(self, phase: int) -> list[Handle]:
        return []

    def after_broadcast(self) -> None:
        pass

    def _store(self, member: Member, grad: torch.Tensor | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _launch(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class AllReduceUnit(_Unit):
    """A merge group: members flattened into one bucket, one (compressed) all-reduce."""

    def __init__(self, members: list[Member], weight: float, compressor: WireCompressor, device, dtype,
                 group=None) -> None:
        self.offsets = []
        total = 0
        for m in members:
            self.offsets.append(total)
            total += m.numel
        self.bucket = torch.zeros(total, device=device, dtype=dtype)
        self.compressor = compressor
        self.group = group
        self.handle: Handle | None = None
        self._index = {id(m): i for i, m in enumerate(members)}
        super().__init__(members, weight)

    def _store(self, member, grad):
        i = self._index[id(member)]
        dst = self.bucket[self.offsets[i]:self.offsets[i] + member.numel].view(member.shape)
        if grad is None:
            dst.zero_()
        else:
            dst.copy_(grad.to_dense()[member.slices] if grad.is_sparse else grad[member.slices])

    def _launch(self):
        self.bucket.mul_(self.weight)
        self.handle = self.compressor.all_reduce(self.bucket, group=self.group)

    def finish(self):
        self.handle.wait()
        for i, m in enumerate(self.members):
            m.view.grad = self.bucket[self.offsets[i]:self.offsets[i] + m.numel].view(m.shape)


class PSUnit(_Unit):
    """A dense shard on a parameter server: reduce to the placement rank, which updates it and
    broadcasts the new value. With local aggregation the reduce (and broadcast) goes through a
    root per node first: intra-node group, then the group of node roots."""

    def __init__(self, member: Member, weight: float, compressor: WireCompressor, *, rank: int, placement: int,
                 device, counter, intra=None, roots=None, local_root: int | None = None) -> None:
        self.rank = rank
        self.placement = placement
        self.compressor = compressor
        self.counter = counter
        self.buffer = torch.zeros(member.shape, device=device, dtype=member.view.dtype)
        self.intra = intra  # (group, ranks) of this rank's node, or None
        self.roots = roots  # (group, ranks) of the node roots, or None
        self.local_root = local_root
        self.handle: Handle | None = None
        super().__init__([member], weight)

    @property
    def member(self) -> Member:
        return self.members[0]

    def _store(self, member, grad):
        if grad is None:
            self.buffer.zero_()
        else:
            self.buffer.copy_(grad.to_dense()[member.slices] if grad.is_sparse else grad[member.slices])

    def _launch(self):
        self.buffer.mul_(self.weight)
        if self.intra is None and self.roots is None:
            self.handle = self.compressor.reduce(self.buffer, dst=self.placement)
        elif self.intra is not None:
            self.handle = self.compressor.reduce(self.buffer, dst=self.local_root, group=self.intra[0])
        else:
            self.handle = None

    def finish(self):
        if self.handle is not None:
            self.handle.wait()
        if self.roots is not None and self.rank in self.roots[1]:
            self.compressor.reduce(self.buffer, dst=self.placement, group=self.roots[0]).wait()
        self.member.view.grad = self.buffer if self.rank == self.placement else None

    def owned(self):
        return self.members if self.rank == self.placement else []

    def _broadcast(self, src: int, group) -> Handle:
        self.counter.bytes += self.buffer.numel() * self.buffer.element_size()
        return Handle(dist.broadcast(self.buffer, src=src, group=group, async_op=True))

    def broadcast_phase(self, phase):
        if phase == 0 and self.rank == self.placement:
            self.buffer.copy_(self.member.view.detach())
        if self.intra is None and self.roots is None:
            return [self._broadcast(self.placement, None)] if phase == 0 else []
        if phase == 0:
            if self.roots is not None and self.rank in self.roots[1]:
                return [self._broadcast(self.placement, self.roots[0])]
            return []
        if phase == 1 and self.intra is not None:
            return [self._broadcast(self.local_root, self.intra[0])]
        return []

    def after_broadcast(self):
        if self.rank != self.placement:
            with torch.no_grad():
                self.member.view.copy_(self.buffer)


def _rows(member: Member, grad: torch.Tensor | None, weight: float, device):
    """(local row indices, scaled row values) of a sparse gradient restricted to the member's rows."""
    lo, hi = member.slices[0].start, member.slices[0].stop
    width = member.shape[1]
    if grad is None:
        return (torch.zeros(0, dtype=torch.long, device=device),
                torch.zeros(0, width, dtype=member.view.dtype, device=device))
    grad = grad.coalesce()
    idx, vals = grad.indices()[0], grad.values()
    mask = (idx >= lo) & (idx < hi)
    return idx[mask] - lo, vals[mask] * weight


def _exchange_sizes(n: int, device, world: int, counter) -> list[int]:
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    mine = torch.tensor([n], dtype=torch.long, device=device)
    counter.bytes += 8
    dist.all_gather(sizes, mine)
    return [int(s.item()) for s in sizes]


def _pad_rows(unit) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Every rank's row count, and this rank's (indices, rows) zero-padded to the longest, as
    collectives of tensors need equal sizes on every rank."""
    sizes = _exchange_sizes(len(unit.idx), unit.device, unit.world, unit.counter)
    longest = max(sizes)
    pad_idx = torch.zeros(longest, dtype=torch.long, device=unit.device)
    pad_val = torch.zeros(longest, unit.members[0].shape[1], dtype=unit.vals.dtype, device=unit.device)
    pad_idx[: len(unit.idx)] = unit.idx
    pad_val[: len(unit.idx)] = unit.vals
    unit.counter.bytes += pad_idx.numel() * 8 + pad_val.numel() * pad_val.element_size()
    return sizes, pad_idx, pad_val


class _SparseUnit(_Unit):
    """Shared by the sparse synchronizers: the rows of this rank's gradient inside the shard."""

    def __init__(self, member: Member, weight: float, *, world: int, device, counter) -> None:
        self.world = world
        self.device = device
        self.counter = counter
        self.works = []
        super().__init__([member], weight)

    def _store(self, member, grad):
        self.idx, self.vals = _rows(member, grad, self.weight, self.device)

    def _gathered_grad(self) -> torch.Tensor:
        """The summed sparse gradient of the shard from every rank's gathered rows."""
        for w in self.works:
            w.wait()
        m = self.members[0]
        idx = torch.cat([t[:n] for t, n in zip(self.all_idx, self.sizes)])
        vals = torch.cat([t[:n] for t, n in zip(self.all_val, self.sizes)])
        return torch.sparse_coo_tensor(idx[None], vals, m.shape, check_invariants=False).coalesce()


class SparseAllGatherUnit(_SparseUnit):
    """A sparse shard synchronized by all-gather of (row indices, row values); every rank sums
    the gathered rows into the same sparse gradient and applies it itself."""

    def _launch(self):
        self.sizes, pad_idx, pad_val = _pad_rows(self)
        self.all_idx = [torch.empty_like(pad_idx) for _ in range(self.world)]
        self.all_val = [torch.empty_like(pad_val) for _ in range(self.world)]
        self.works = [dist.all_gather(self.all_idx, pad_idx, async_op=True),
                      dist.all_gather(self.all_val, pad_val, async_op=True)]

    def finish(self):
        self.members[0].view.grad = self._gathered_grad()


class SparsePSUnit(_SparseUnit):
    """A sparse shard on a parameter server: rows gathered to the placement, which applies the
    update and broadcasts the rows it changed (all rows if its optimizer is not row-sparse)."""

    def __init__(self, member: Member, weight: float, *, rank: int, placement: int, world: int, device, counter,
                 full_broadcast: bool = False) -> None:
        self.rank = rank
        self.placement = placement
        self.full_broadcast = full_broadcast
        super().__init__(member, weight, world=world, device=device, counter=counter)

    def _launch(self):
        self.sizes, pad_idx, pad_val = _pad_rows(self)
        root = self.rank == self.placement
        self.all_idx = [torch.empty_like(pad_idx) for _ in range(self.world)] if root else None
        self.all_val = [torch.empty_like(pad_val) for _ in range(self.world)] if root else None
        self.works = [dist.gather(pad_idx, self.all_idx, dst=self.placement, async_op=True),
                      dist.gather(pad_val, self.all_val, dst=self.placement, async_op=True)]

    def finish(self):
        if self.rank == self.placement:
            self.members[0].view.grad = self._gathered_grad()
        else:
            for w in self.works:
                w.wait()
            self.members[0].view.grad = None

    def owned(self):
        return self.members if self.rank == self.placement else []

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
            self.counter.bytes += 8
            dist.broadcast(count, src=self.placement)
            if self.rank != self.placement:
                self.rows = torch.empty(int(count.item()), dtype=torch.long, device=self.device)
            self.values = m.view.detach()[self.rows].contiguous() if self.rank == self.placement else torch.empty(
                len(self.rows), m.shape[1], dtype=m.view.dtype, device=self.device)
            self.counter.bytes += self.rows.numel() * 8
        self.counter.bytes += self.values.numel() * self.values.element_size()
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
