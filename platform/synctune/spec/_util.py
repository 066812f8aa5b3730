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


def _mode_for(path: Path) -> int:
    """The permission bits a plain ``open(path, "w")`` would leave: the existing file's, or
    0666 less the process umask for a new file."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, renamed into place,
    so a crash never leaves a half-written file."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{path}: folder {parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; a report or strategy file must stay readable by whoever the
        # user's umask lets read it (a web server, a colleague), and an overwritten file keeps
        # its mode.
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_text(path: str | Path, what: str, error: type = SpecError) -> str:
    """The text of ``path``; a missing or unreadable file is one clear ``error`` naming ``what``."""
    path = Path(path)
    try:
        return path.read_text()
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None


def read_yaml(path: str | Path, what: str) -> Any:
    """Parsed YAML of ``path``; malformed YAML is reported with its line and column."""
    import yaml

    text = read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}: malformed YAML{at}: {getattr(exc, 'problem', None) or 'malformed YAML'}") from None
