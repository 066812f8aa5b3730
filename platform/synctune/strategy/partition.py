"""Where the shards of a partitioned variable lie (AutoDist §2.3 "Partitioner"): shard ``i`` is
the i-th cell, in row-major order, of the grid the partition cuts; uneven cuts follow
``torch.tensor_split`` (the first ``n % k`` pieces are one longer). The engine slices
parameters with these, validation and the simulator take their shapes."""

from __future__ import annotations

import itertools

__all__ = ["shard_slices", "shard_shapes", "shard_rows"]


def _sizes(length: int, pieces: int) -> list[int]:
    base, extra = divmod(length, pieces)
    return [base + 1 if i < extra else base for i in range(pieces)]


def _cuts(length: int, pieces: int) -> list[slice]:
    ends = list(itertools.accumulate(_sizes(length, pieces)))
    return [slice(end - size, end) for end, size in zip(ends, _sizes(length, pieces))]


def shard_slices(shape: tuple[int, ...], partition: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples of every shard of a variable of ``shape`` cut by ``partition``, row-major."""
    return list(itertools.product(*(_cuts(length, pieces) for length, pieces in zip(shape, partition))))


def shard_shapes(shape: tuple[int, ...], partition: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of the shards of a variable of ``shape`` cut by ``partition``, row-major."""
    return list(itertools.product(*(_sizes(length, pieces) for length, pieces in zip(shape, partition))))


def shard_rows(length: int, group: int) -> list[slice]:
    """The rows of a variable of ``length`` rows that each member of a shard group of ``group``
    holds under the ``shard`` synchronizer: ``torch.chunk``'s cut, as FSDP2 shards a parameter
    on dim 0 (``ceil(length / group)`` rows each, the last members short or empty)."""
    size = -(-length // group)
    return [slice(min(length, r * size), min(length, (r + 1) * size)) for r in range(group)]
