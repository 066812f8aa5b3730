"""Checks and canonical forms every layer shares: input bounds, canonical JSON, hashes, field checks."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from .errors import SpecError

#: Bounds no real input reaches; they stop a few bytes of YAML from asking for gigabytes.
LIMITS = {
    "nodes": 4096,  # nodes of a cluster
    "devices_per_node": 1024,
    "devices": 65536,  # devices of a cluster (replicas of a strategy)
    "batch": 1 << 24,  # per-replica batch
    "shards": 4096,  # shards of one variable
    "budget": 1_000_000,  # trials of a search
    "iterations": 1_000_000,  # warm-up or timed iterations
    "proposals": 10_000_000,
    "seed": (1 << 63) - 1,
    "timeout_s": 7 * 24 * 3600.0,
}


def canonical_json(obj: Any) -> str:
    """Serialize ``obj`` with sorted keys and no whitespace: the form that hashes are taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_hex(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a user's 5,000-character name quoted in an
    error would bury the message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def require(cond: bool, where: str, expected: str, actual: Any) -> None:
    """Raise :class:`SpecError` ``"<where>: expected <expected>, got <actual>"`` unless ``cond``."""
    if not cond:
        raise SpecError(f"{where}: expected {expected}, got {shown(actual)}")


def is_int(value: Any) -> bool:
    """An int, never a bool (``True`` is an int to Python, never a count or a size to a spec)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a finite float (never a bool, an infinity or NaN)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (isinstance(value, int) or math.isfinite(value)))


def in_range(value: Any, low: float, high: float, *, integer: bool = True) -> bool:
    """Whether ``value`` is an int (or, with ``integer=False``, a finite number) in [low, high]."""
    return (is_int(value) if integer else is_number(value)) and low <= value <= high


def check_keys(data: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = (),
               error: type = SpecError) -> Any:
    """``data`` if it is a mapping with every ``required`` key and no key outside ``required +
    optional``; else one ``error`` naming ``where`` and the offending key."""
    from collections.abc import Mapping

    if not isinstance(data, Mapping):
        raise error(f"{where}: expected a mapping, got {type(data).__name__}")
    valid = set(required) | set(optional)
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in data if k not in valid)
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise error(f"{where}: unknown key(s) [{shown}]; valid: {', '.join(required + optional)}")
    for key in required:
        if key not in data:
            raise error(f"{where}: missing key {key!r}")
    return data

