"""The compressor registry: everything synctune knows about a compressor, in one entry
(AutoDist §2.2 "message encoding"; compression as a wrapper around a synchronizer).

An entry says what the strategy language accepts (name, parameters, which synchronizers it
wraps, which shard shapes it fits, lossless or not), what the simulator needs (its code, the
bytes it puts on the wire per byte of gradient), what the conformance suite holds it to (its
tolerance), and how the engine runs it (its implementation, below). Adding a compressor
touches this module only; saved simulators record the registry's names and refuse to score
with a different vocabulary.

Implementations wrap ``torch.distributed`` collectives: ``all_reduce(buf, group, count)`` and
``reduce(buf, dst, group, count)`` are generators that hand the engine, one at a time, the
collectives to launch on the encoded message (see below); once exhausted, ``buf`` holds the
decoded sum. ``count(t)`` is told every tensor handed to a collective (the engine's byte
counter). torch is imported only when an implementation is built, so the strategy layer stays
light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..spec.registry import Registry

__all__ = ["CompressorInfo", "COMPRESSORS", "compressor_vocabulary", "lossy_compressors"]


def _cols(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:]) if len(shape) > 1 else 1


# ----------------------------------------------------------------------------- implementations
#
# An implementation's ``all_reduce(buf, group, count)`` and ``reduce(buf, dst, group, count)`` are
# generators: each ``yield`` hands the engine one ``launch`` function that starts a collective on
# ``group`` and returns its work; the code after the ``yield`` runs once that work completed.
# ``stages`` says how many collectives one call launches (the engine orders them across units).


class _Identity:
    """``none``: the gradient as it is."""

    stages = 1

    def all_reduce(self, buf, group, count):
        import torch.distributed as dist

        count(buf)
        yield lambda: dist.all_reduce(buf, group=group, async_op=True)

    def reduce(self, buf, dst, group, count):
        import torch.distributed as dist

        count(buf)
        yield lambda: dist.reduce(buf, dst=dst, group=group, async_op=True)


class _Cast:
    """Cast to a 16-bit float for the wire and back (the sum is taken in 16 bits)."""

    stages = 1

    def __init__(self, dtype: str) -> None:
        import torch

        self.dtype = getattr(torch, dtype)

    def all_reduce(self, buf, group, count):
        import torch.distributed as dist

        wire = buf.to(self.dtype)
        count(wire)
        yield lambda: dist.all_reduce(wire, group=group, async_op=True)
        buf.copy_(wire)

    def reduce(self, buf, dst, group, count):
        import torch.distributed as dist

        wire = buf.to(self.dtype)
        count(wire)
        yield lambda: dist.reduce(wire, dst=dst, group=group, async_op=True)
        buf.copy_(wire)


class _PowerSGD:
    """Rank-r PowerSGD of the matrices in one merge-group buffer, with error feedback (Vogels
    et al. 2019, as torch's ``powerSGD_hook``).

    ``members`` are ``(offset, rows, cols)`` of each matrix in the flat buffer; all their P
    factors travel in one all-reduce, then all Q factors in a second (two chained stages: the
    second starts when the first completed, without holding up other units). ``weight`` is this
    rank's share of the global batch: messages arrive pre-scaled, so the error kept is the local
    message minus its share of the decoded sum.
    """

    stages = 2

    def __init__(self, rank: int, members: list[tuple[int, int, int]], weight: float, seed: int) -> None:
        import torch

        self.members = [(off, rows, cols, min(rank, rows, cols)) for off, rows, cols in members]
        self.weight = weight
        gen = torch.Generator().manual_seed(seed)
        # Every rank draws the same Q: the sum of the P_i = M_i Q is then (sum M_i) Q.
        self.qs = [torch.randn(cols, r, generator=gen) for _off, _rows, cols, r in self.members]
        self.errors: list | None = None

    def all_reduce(self, buf, group, count):
        import torch
        import torch.distributed as dist

        ms = [buf[off:off + rows * cols].view(rows, cols) for off, rows, cols, _r in self.members]
        if self.qs[0].device != buf.device:
            self.qs = [q.to(buf.device) for q in self.qs]
        if self.errors is None:
            self.errors = [torch.zeros_like(m) for m in ms]
        for m, e in zip(ms, self.errors):
            m.add_(e)
        local = [m.clone() for m in ms]
        p_flat = torch.cat([(m @ q).flatten() for m, q in zip(ms, self.qs)])
        count(p_flat)
        yield lambda: dist.all_reduce(p_flat, group=group, async_op=True)
        ps, at = [], 0
        for (_off, rows, _cols, r) in self.members:
            p, _ = torch.linalg.qr(p_flat[at:at + rows * r].view(rows, r))
            ps.append(p)
            at += rows * r
        q_flat = torch.cat([(m.t() @ p).flatten() for m, p in zip(ms, ps)])
        count(q_flat)
        yield lambda: dist.all_reduce(q_flat, group=group, async_op=True)
        at = 0
        for i, ((_off, _rows, cols, r), m, p) in enumerate(zip(self.members, ms, ps)):
            q = q_flat[at:at + cols * r].view(cols, r)
            at += cols * r
            self.qs[i] = q.clone()
            approx = p @ q.t()
            self.errors[i] = local[i] - self.weight * approx
            m.copy_(approx)

    def reduce(self, buf, dst, group, count):  # pragma: no cover - refused by validation (synchronizers)
        raise NotImplementedError("powersgd needs every rank to hold the projection; it wraps allreduce only")


# ---------------------------------------------------------------------------------- registry


@dataclass(frozen=True, kw_only=True)
class CompressorInfo:
    """One compressor.

    ``params``: the :class:`~synctune.strategy.Compressor` fields it takes (``rank``).
    ``synchronizers``: the synchronizer kinds it can wrap (``wraps_any``: every kind, one
    registered later too: the identity). ``tolerance``: relative error
    (max |error| / max |exact|) of one reduction the conformance suite holds it to (0:
    bit-exact). ``wire_ratio(shape, rank)``: bytes on the wire per byte of a shard of
    ``shape``. ``problem(shape, rank)``: why it cannot encode such a shard, or None.
    ``fit(shape, rank)``: the ``rank`` to use on such a shard when a builder asks for
    ``rank`` (None: the compressor does not apply there). ``engine(rank, members, weight,
    seed)``: its implementation for one collective (members: ``(offset, rows, cols)`` of the
    matrices of a flat merge-group buffer). ``stages``: how many chained collectives that
    implementation launches per unit (its own ``stages``; the replay prices each one).
    ``low_rank``: it encodes by matrix products (the replay prices its encoding apart from a
    cast's one pass over the bytes).
    """

    name: str
    lossless: bool
    description: str
    params: tuple[str, ...] = ()
    synchronizers: tuple[str, ...] = ("ps", "allreduce", "allgather")
    tolerance: float = 0.0
    wire_ratio: Callable[[tuple[int, ...], Any], float] = lambda shape, rank: 1.0
    problem: Callable[[tuple[int, ...], Any], str | None] = lambda shape, rank: None
    fit: Callable[[tuple[int, ...], Any], Any] = lambda shape, rank: 0
    engine: Callable[..., Any] = lambda **_: _Identity()
    stages: int = 1
    low_rank: bool = False
    wraps_any: bool = False

    def wraps(self, kind: str) -> bool:
        """Whether it can wrap a synchronizer of ``kind``."""
        return self.wraps_any or kind in self.synchronizers

    @property
    def code(self) -> int:
        """Index of the compressor in the registry: its one-hot position in simulator features."""
        return _CODES.setdefault(self.name, COMPRESSORS.names().index(self.name))


def _powersgd_problem(shape: tuple[int, ...], rank: int) -> str | None:
    if len(shape) < 2:
        return f"powersgd needs a shard of 2 or more dimensions, got shape {list(shape)}"
    if rank > min(shape[0], _cols(shape)):
        return (f"powersgd rank {rank} exceeds min(rows, cols) = {min(shape[0], _cols(shape))} of shard shape "
                f"{list(shape)}")
    return None


def _powersgd_ratio(shape: tuple[int, ...], rank: int) -> float:
    n = max(1, math.prod(shape))
    return min(1.0, rank * (shape[0] + n // max(1, shape[0])) / n)


COMPRESSORS: Registry[CompressorInfo] = Registry("compressor")
_CODES: dict[str, int] = {}
for _info in (
    CompressorInfo(name="none", lossless=True, description="send gradients as they are",
                   synchronizers=("ps", "allreduce", "allgather", "sfb", "shard"), wraps_any=True),
    CompressorInfo(name="fp16", lossless=False, tolerance=2e-3, wire_ratio=lambda shape, rank: 0.5,
                   description="cast to float16 for the wire, back to float32 after",
                   engine=lambda **_: _Cast("float16")),
    CompressorInfo(name="bf16", lossless=False, tolerance=1.6e-2, wire_ratio=lambda shape, rank: 0.5,
                   description="cast to bfloat16 for the wire (NCCL only in torch hooks)",
                   engine=lambda **_: _Cast("bfloat16")),
    CompressorInfo(name="powersgd", lossless=False, params=("rank",), synchronizers=("allreduce",),
                   description="PowerSGD low-rank approximation with error feedback (Vogels et al. 2019)",
                   wire_ratio=_powersgd_ratio, problem=_powersgd_problem,
                   fit=lambda shape, rank: min(rank, shape[0], _cols(shape)) if len(shape) >= 2 else None,
                   engine=lambda rank, members, weight, seed, **_: _PowerSGD(rank, members, weight, seed),
                   stages=_PowerSGD.stages, low_rank=True),
):
    COMPRESSORS.register(_info.name, _info)


def compressor_vocabulary() -> list[str]:
    """The compressor names in registry order (what a saved simulator was trained with)."""
    return COMPRESSORS.names()


def lossy_compressors(synchronizer: str | None = None) -> list[str]:
    """The lossy compressors in registry order (what a search may try on dense messages, AutoSync
    §3.2's "message encoding"); with ``synchronizer``, only those that can wrap that kind."""
    return [name for name, info in COMPRESSORS.items()
            if not info.lossless and (synchronizer is None or synchronizer in info.synchronizers)]
