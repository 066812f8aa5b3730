"""A registry of named things keyed by plain strings (they survive Parquet and MLflow)."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from .errors import SpecError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object map that rejects duplicates and lists the valid names on a miss."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        """Add ``item`` under ``name``; a second registration of the same name is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        """The item named ``name``; :class:`SpecError` naming the valid choices otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise SpecError(f"unknown {self.kind} {name!r}; valid: {', '.join(self._items)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._items)

    def items(self) -> list[tuple[str, T]]:
        """(name, item) pairs in registration order."""
        return list(self._items.items())
