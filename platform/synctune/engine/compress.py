"""Compressors as wrappers around a collective (AutoDist §2.2 "message encoding").

A compressor takes a flat gradient buffer and a collective (all-reduce to every rank, or
reduce to one), runs the collective on the encoded message and gives back a handle whose
``wait()`` leaves the decoded sum in the buffer. ``none`` is lossless; ``fp16``/``bf16``
(cast for the wire) and ``powersgd`` (low rank with error feedback, Vogels et al. 2019, as
torch's ``powerSGD_hook``) are lossy, with the tolerances the conformance suite holds them to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Handle", "WireCompressor", "CastCompressor", "PowerSGDCompressor", "make_compressor", "LOSSY_TOLERANCE"]

#: Relative error (max |error| / max |exact|) each lossy compressor is held to on one reduction.
LOSSY_TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2}


class Handle:
    """An in-flight (possibly multi-stage) collective; ``wait()`` completes it."""

    def __init__(self, work, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self._work = self._finish = None


@dataclass
class _Counter:
    bytes: int = 0


class WireCompressor:
    """Base: the identity encoding (lossless ``none``)."""

    lossless = True

    def __init__(self, counter: _Counter | None = None) -> None:
        self.counter = counter or _Counter()

    def _count(self, t: torch.Tensor) -> None:
        self.counter.bytes += t.numel() * t.element_size()

    def all_reduce(self, buf: torch.Tensor, group=None) -> Handle:
        self._count(buf)
        return Handle(dist.all_reduce(buf, group=group, async_op=True))

    def reduce(self, buf: torch.Tensor, dst: int, group=None) -> Handle:
        self._count(buf)
        return Handle(dist.reduce(buf, dst=dst, group=group, async_op=True))


class CastCompressor(WireCompressor):
    """Cast to a 16-bit float for the wire and back (the sum is taken in 16 bits)."""

    lossless = False

    def __init__(self, dtype: torch.dtype, counter: _Counter | None = None) -> None:
        super().__init__(counter)
        self.dtype = dtype

    def _wrap(self, buf: torch.Tensor, launch) -> Handle:
        wire = buf.to(self.dtype)
        self._count(wire)
        return Handle(launch(wire), lambda: buf.copy_(wire))

    def all_reduce(self, buf, group=None):
        return self._wrap(buf, lambda w: dist.all_reduce(w, group=group, async_op=True))

    def reduce(self, buf, dst, group=None):
        return self._wrap(buf, lambda w: dist.reduce(w, dst=dst, group=group, async_op=True))


class PowerSGDCompressor(WireCompressor):
    """Rank-r PowerSGD of the matrices in one merge-group buffer, with error feedback.

    ``members`` are ``(offset, rows, cols)`` of each matrix in the flat buffer; all their P
    factors travel in one all-reduce, then all Q factors in a second. ``weight`` is this
    rank's share of the global batch: messages arrive pre-scaled, so the error kept is the
    local message minus its share of the decoded sum.
    """

    lossless = False

    def __init__(self, rank: int, members: list[tuple[int, int, int]], weight: float, seed: int = 0,
                 counter: _Counter | None = None) -> None:
        super().__init__(counter)
        self.rank = rank
        self.members = [(off, rows, cols, min(rank, rows, cols)) for off, rows, cols in members]
        self.weight = weight
        gen = torch.Generator().manual_seed(seed)
        # Every rank draws the same Q: the sum of the P_i = M_i Q is then (sum M_i) Q.
        self.qs = [torch.randn(cols, r, generator=gen) for _off, _rows, cols, r in self.members]
        self.errors: list[torch.Tensor] | None = None

    def all_reduce(self, buf, group=None):
        ms = [buf[off:off + rows * cols].view(rows, cols) for off, rows, cols, _r in self.members]
        if self.qs[0].device != buf.device:
            self.qs = [q.to(buf.device) for q in self.qs]
        if self.errors is None:
            self.errors = [torch.zeros_like(m) for m in ms]
        for m, e in zip(ms, self.errors):
            m.add_(e)
        local = [m.clone() for m in ms]
        p_flat = torch.cat([(m @ q).flatten() for m, q in zip(ms, self.qs)])
        self._count(p_flat)
        work = dist.all_reduce(p_flat, group=group, async_op=True)

        def finish():
            work.wait()
            ps, at = [], 0
            for (_off, rows, _cols, r) in self.members:
                p, _ = torch.linalg.qr(p_flat[at:at + rows * r].view(rows, r))
                ps.append(p)
                at += rows * r
            q_flat = torch.cat([(m.t() @ p).flatten() for m, p in zip(ms, ps)])
            self._count(q_flat)
            dist.all_reduce(q_flat, group=group)
            at = 0
            for i, ((_off, _rows, cols, r), m, p) in enumerate(zip(self.members, ms, ps)):
                q = q_flat[at:at + cols * r].view(cols, r)
                at += cols * r
                self.qs[i] = q.clone()
                approx = p @ q.t()
                self.errors[i] = local[i] - self.weight * approx
                m.copy_(approx)

        return Handle(None, finish)

    def reduce(self, buf, dst, group=None):  # pragma: no cover - rejected before launch
        raise NotImplementedError("powersgd needs all ranks to hold the projection; use it with allreduce")


def make_compressor(kind: str, *, rank: int | None = None, members: list[tuple[int, int, int]] | None = None,
                    weight: float = 1.0, seed: int = 0, counter: _Counter | None = None) -> WireCompressor:
    """The wire compressor for strategy compressor ``kind``."""
    if kind == "none":
        return WireCompressor(counter)
    if kind == "fp16":
        return CastCompressor(torch.float16, counter)
    if kind == "bf16":
        return CastCompressor(torch.bfloat16, counter)
    if kind == "powersgd":
        return PowerSGDCompressor(rank, members or [], weight, seed, counter)
    raise ValueError(f"unknown compressor {kind!r}")
