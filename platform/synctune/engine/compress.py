"""Compressors as wrappers around a collective (AutoDist §2.2 "message encoding").

What each compressor does lives in its registry entry
(:mod:`synctune.strategy.compressors`); this module turns an entry's implementation into the
engine's handles: a collective on the encoded message whose ``wait()`` leaves the decoded
sum in the buffer, with every byte handed to a collective counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..strategy.schema import Compressor

__all__ = ["Handle", "WireCompressor", "make_compressor"]


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

    def __call__(self, tensor: Any) -> None:
        self.bytes += tensor.numel() * tensor.element_size()


class WireCompressor:
    """A compressor's implementation bound to the engine's byte counter."""

    def __init__(self, impl: Any, lossless: bool, counter: _Counter) -> None:
        self.impl = impl
        self.lossless = lossless
        self.counter = counter

    def all_reduce(self, buf, group=None) -> Handle:
        return Handle(*self.impl.all_reduce(buf, group, self.counter))

    def reduce(self, buf, dst: int, group=None) -> Handle:
        return Handle(*self.impl.reduce(buf, dst, group, self.counter))


def make_compressor(compressor: Compressor, *, members: list[tuple[int, int, int]] | None = None,
                    weight: float = 1.0, seed: int = 0, counter: _Counter | None = None) -> WireCompressor:
    """The engine's compressor for ``compressor`` (``members``: matrices of a merge-group buffer)."""
    info = compressor.info
    impl = info.engine(rank=compressor.rank, members=members or [], weight=weight, seed=seed)
    return WireCompressor(impl, info.lossless, counter or _Counter())
