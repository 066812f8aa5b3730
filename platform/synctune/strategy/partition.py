"""Where the shards of a partitioned variable lie (AutoDist §2.3 "Partitioner"): shard ``i`` is
the i-th cell, in row-major order, of the grid the partition cuts; uneven cuts follow
``torch.tensor_split`` (the first ``n % k`` pieces are one longer). The engine slices
parameters with these, validation and the simulator take their shapes."""

from __future__ import annotations

__all__ = ["shard_slices", "shard_shapes"]


def _cuts(length: int, pieces: int) -> list[slice]:
    base, extra = divmod(length, pieces)
    out, start = [], 0
    for i in range(pieces):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def shard_slices(shape: tuple[int, ...], partition: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Index tuples of every shard of a variable of ``shape`` cut by ``partition``, row-major."""
    result: list[tuple[slice, ...]] = [()]
    for length, pieces in zip(shape, partition):
        result = [prefix + (cut,) for prefix in result for cut in _cuts(length, pieces)]
    return result


def shard_shapes(shape: tuple[int, ...], partition: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of the shards of a variable of ``shape`` cut by ``partition``, row-major."""
    return [tuple(s.stop - s.start for s in cell) for cell in shard_slices(shape, partition)]
