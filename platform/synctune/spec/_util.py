"""Small helpers shared by the spec and strategy layers (canonical JSON, hashing, checks)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import SpecError


def canonical_json(obj: Any) -> str:
    """Serialize ``obj`` with sorted keys and no whitespace: the form that hashes are taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_hex(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def require(cond: bool, where: str, expected: str, actual: Any) -> None:
    """Raise :class:`SpecError` ``"<where>: expected <expected>, got <actual>"`` unless ``cond``."""
    if not cond:
        raise SpecError(f"{where}: expected {expected}, got {actual!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, renamed into place,
    so a crash never leaves a half-written file."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{path}: folder {parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
