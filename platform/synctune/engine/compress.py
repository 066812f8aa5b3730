"""Compressors as wrappers around a collective (AutoDist §2.2 "message encoding").

What each compressor does lives in its registry entry
(:mod:`synctune.strategy.compressors`); this module binds an entry's implementation to the
engine's byte counter. Its ``all_reduce(buf, group)`` and ``reduce(buf, dst, group)`` give the
compressor's stages (collectives to launch one after another); once they are done, ``buf``
holds the decoded sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..strategy.schema import Compressor

__all__ = ["WireCompressor", "make_compressor", "ByteCounter"]


@dataclass
class ByteCounter:
    """Bytes handed to collectives (the payload a trial reports)."""

    bytes: int = 0

    def __call__(self, tensor: Any) -> None:
        self.bytes += tensor.numel() * tensor.element_size()


class WireCompressor:
    """A compressor's implementation bound to the engine's byte counter."""

    def __init__(self, impl: Any, lossless: bool, counter: ByteCounter) -> None:
        self.impl = impl
        self.lossless = lossless
        self.counter = counter
        self.stages: int = impl.stages

    def all_reduce(self, buf, group=None) -> Iterator[Callable]:
        """The stages that all-reduce ``buf`` over ``group``, each a ``launch`` function that starts
        one collective; once the last completed, ``buf`` holds the decoded sum on every rank."""
        return self.impl.all_reduce(buf, group, self.counter)

    def reduce(self, buf, dst: int, group=None) -> Iterator[Callable]:
        """The stages that reduce ``buf`` over ``group`` to rank ``dst`` (as :meth:`all_reduce`;
        only ``dst``'s ``buf`` then holds the decoded sum)."""
        return self.impl.reduce(buf, dst, group, self.counter)


def make_compressor(compressor: Compressor, *, members: list[tuple[int, int, int]] | None = None,
                    weight: float = 1.0, seed: int = 0, counter: ByteCounter | None = None) -> WireCompressor:
    """The engine's compressor for ``compressor`` (``members``: matrices of a merge-group buffer)."""
    info = compressor.info
    impl = info.engine(rank=compressor.rank, members=members or [], weight=weight, seed=seed)
    return WireCompressor(impl, info.lossless, counter or ByteCounter())
