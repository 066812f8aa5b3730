"""Reading users' files and writing ours, safely: the one place for both.

Reading: every spec, experiment and strategy file goes through :func:`read_text`, then
:func:`parse_yaml` or :func:`parse_json`, which turn every way a file can be wrong (missing,
a folder, too large, not UTF-8, malformed, nested without end, YAML aliases, duplicate keys,
``NaN``, lone surrogates) into one :class:`SpecError` naming the file.

Writing: :func:`atomic_write` is the only way synctune replaces a file. A unique temporary
name is created next to the target with ``O_CREAT|O_EXCL`` (so the process umask applies, as
for any new file, and an existing file keeps its mode), written, fsynced, renamed over the
target with ``os.replace`` and the folder fsynced, so a crash leaves the old file or the new
one, never half of either. Anything that is not a regular file (a device such as
``/dev/full``, a folder, a symbolic link, a FIFO) is refused rather than replaced.

Names that become paths (experiment names, search ids, presets) go through
:func:`check_name`, and :func:`path_under` proves a path stays under its root. Any name or path
a user gives goes through :func:`check_path` before it touches the file system: a name the file
system cannot hold (a NUL byte, a component longer than its ``NAME_MAX``, a path longer than
``PATH_MAX``) is the user's input at fault, one :class:`SpecError`, not an ``OSError`` from deep
inside ``pathlib``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from .checks import shown
from .errors import InfraError, SpecError

__all__ = ["MAX_FILE_BYTES", "MAX_NAME_LENGTH", "MAX_DEPTH", "read_text", "read_bytes", "check_regular",
           "parse_yaml", "parse_json", "read_yaml", "read_json", "atomic_write", "write_text_atomic", "check_writable",
           "check_parent", "check_folder", "make_parent", "check_name", "check_path", "path_under", "write_via"]

#: Largest spec, experiment, strategy or manifest file read (far above any real one).
MAX_FILE_BYTES = 64 * 1024 * 1024
#: Longest name (model, cluster, node, experiment) accepted: names become file names.
MAX_NAME_LENGTH = 128
#: Deepest nesting of lists and mappings in a YAML or JSON file.
MAX_DEPTH = 64


def read_bytes(path: str | Path, what: str, error: type = SpecError, *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``path``; a missing, unreadable, non-regular or oversized file is one clear ``error``.

    Only regular files are read: a FIFO, socket or device given as an input would block (or
    never end), so it is refused before a byte is read. The file is opened without blocking
    and checked on the open descriptor, so it cannot be swapped for a FIFO in between."""
    path = Path(_checked(path, what, error))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {what} file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{path}: is a folder, not a {what} file")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: is not a regular file (a FIFO, socket or device); the {what} file must be a "
                        f"regular file")
        if info.st_size > limit:
            raise error(f"{path}: {info.st_size} bytes; a {what} file is at most {limit} bytes")
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise error(f"{path}: more than {limit} bytes; a {what} file is at most {limit} bytes")
    return data


def check_regular(path: str | Path, what: str, error: type = SpecError) -> Path:
    """``path`` when it is a regular file (links followed); one clear ``error`` when it is missing
    or anything else, for inputs opened by another library (Parquet, torch, SQLite) that would
    block on a FIFO."""
    path = Path(_checked(path, what, error))
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{path}: is a folder, not a {what} file")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: is not a regular file (a FIFO, socket or device); the {what} file must be a "
                    f"regular file")
    return path


def read_text(path: str | Path, what: str, error: type = SpecError) -> str:
    """The UTF-8 text of ``path``; every way of failing is one clear ``error`` naming ``what``."""
    data = read_bytes(path, what, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}); a {what} file is UTF-8 YAML or JSON") from None


#: Most values a YAML document may expand to through aliases (cluster-launcher configs use them).
MAX_EXPANDED_VALUES = 1_000_000


def _expanded_size(data: Any) -> int:
    """How many values ``data`` holds once every alias is written out (shared objects counted
    each time they are referenced), computed without expanding anything."""
    sizes: dict[int, int] = {}

    def size(obj: Any) -> int:
        if not isinstance(obj, (dict, list)):
            return 1
        key = id(obj)
        if key not in sizes:
            sizes[key] = 0  # a cycle counts once
            children = obj.values() if isinstance(obj, dict) else obj
            sizes[key] = 1 + sum(size(c) for c in children)
        return sizes[key]

    return size(data)


def _yaml_loader(aliases: bool):
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader without aliases (a few bytes of them expand to gigabytes), without
        duplicate keys (the last one silently winning hides mistakes) and with bounded depth."""

        def compose_node(self, parent, index):
            if not aliases and self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise SpecError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                f"supported; write the value out")
            if not aliases and self.check_event(yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent):
                event = self.peek_event()
                if getattr(event, "anchor", None):
                    raise SpecError(f"line {event.start_mark.line + 1}: YAML anchors (&{event.anchor}) are not "
                                    f"supported; write the value out")
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise SpecError(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for key_node, _value in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    raise SpecError(f"line {key_node.start_mark.line + 1}: a mapping key must be a plain "
                                    f"value, got a {type(key).__name__}") from None
                if duplicate:
                    raise SpecError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
            return super().construct_mapping(node, deep)

    return StrictLoader


def _field(path: tuple) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")


def _not_text(value: str) -> bool:
    """Whether ``value`` holds a lone surrogate (``"\\ud800"`` in JSON or YAML): valid escapes,
    but no UTF-8 file, hash or Parquet cell can hold it."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _plain(value: Any, where: str, *, finite: bool = True, error: type = SpecError, path: tuple = ()) -> Any:
    """Refuse ``.inf``/``.nan`` (with ``finite``: no size, speed or time is infinite) and text
    that is not text (lone surrogates, in keys or values) anywhere, naming the field."""
    if isinstance(value, float) and finite and not math.isfinite(value):
        raise error(f"{where}: {_field(path) + ': ' if path else ''}{value} is not a finite number")
    if isinstance(value, str) and _not_text(value):
        raise error(f"{where}: {_field(path) or 'value'}: {shown(value, 40)} holds a lone surrogate (an "
                    f"unpaired \\ud800-\\udfff escape), which is not text")
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and _not_text(k):
                raise error(f"{where}: {_field(path) + ': ' if path else ''}key {shown(k, 40)} holds a lone "
                            f"surrogate (an unpaired \\ud800-\\udfff escape), which is not text")
            _plain(v, where, finite=finite, error=error, path=path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, where, finite=finite, error=error, path=path + (i,))
    return value


def parse_yaml(text: str, where: str, *, aliases: bool = False) -> Any:
    """Parsed YAML (a JSON file parses too); malformed input is reported with its line and column.

    Our own files (specs, experiments) take no aliases; with ``aliases`` (other tools' files,
    such as a Ray cluster-launcher config) they are allowed while what they expand to stays
    under :data:`MAX_EXPANDED_VALUES` values."""
    import yaml

    try:
        data = yaml.load(text, Loader=_yaml_loader(aliases))  # noqa: S506 - a SafeLoader subclass
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{where}: malformed YAML{at}: {getattr(exc, 'problem', None) or 'malformed YAML'}") from None
    except RecursionError:
        raise SpecError(f"{where}: nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits (Python's conversion limit)
        raise SpecError(f"{where}: {str(exc)[:120]}") from None
    if aliases and _expanded_size(data) > MAX_EXPANDED_VALUES:
        raise SpecError(f"{where}: its aliases expand to more than {MAX_EXPANDED_VALUES} values")
    try:
        return _plain(data, where, finite=not aliases)
    except RecursionError:  # an alias that contains itself
        raise SpecError(f"{where}: nested too deeply (an alias inside itself?)") from None


def parse_json(text: str | bytes, where: str, error: type = SpecError) -> Any:
    """Parsed JSON without duplicate keys, ``NaN`` or ``Infinity``; nesting that would exhaust the stack is refused."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where}: not UTF-8 text (byte {exc.start})") from None

    def pairs(items: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for key, value in items:
            if key in out:
                raise error(f"{where}: duplicate key {key!r}")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise error(f"{where}: {name} is not a finite number")

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise error(f"{where}: nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits (Python's conversion limit)
        if isinstance(exc, error):
            raise
        raise error(f"{where}: {str(exc)[:120]}") from None
    try:
        return _plain(data, where, error=error)
    except RecursionError:  # parsed just under the stack's depth, too deep to walk
        raise error(f"{where}: nested too deeply") from None


def read_yaml(path: str | Path, what: str, *, aliases: bool = False) -> Any:
    """Parsed YAML of ``path`` (errors name the file)."""
    return parse_yaml(read_text(path, what), str(path), aliases=aliases)


def read_json(path: str | Path, what: str, error: type = SpecError) -> Any:
    """Parsed JSON of ``path`` (errors name the file)."""
    return parse_json(read_text(path, what, error), str(path), error)


def _check_target(path: Path) -> int | None:
    """The mode to keep when ``path`` exists as a regular file, None when it does not exist;
    :class:`SpecError` when it is anything else."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SpecError(f"{path}: cannot write: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise SpecError(f"{path}: is a symbolic link; synctune replaces files atomically and never writes through "
                        f"links: give the path it points to ({os.path.realpath(path)})")
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise SpecError(f"{path}: is {kind}; synctune only replaces regular files: write to a file and copy it "
                        f"there yourself if you mean it")
    return stat.S_IMODE(info.st_mode)


def check_writable(path: str | Path) -> Path:
    """Check, before any work starts, that :func:`atomic_write` will be able to write ``path``
    (its folder exists and takes a new file; the target is absent or a regular file)."""
    path = Path(check_path(path, "output"))
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{path}: folder {parent} does not exist")
    _check_target(path)
    probe = parent / f".{path.name[:100]}.{uuid.uuid4().hex[:8]}.probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise SpecError(f"{path}: cannot write in {parent}: {exc.strerror or exc}") from None
    return path


def check_parent(path: str | Path) -> Path:
    """Refuse, creating nothing, an output ``path`` that :func:`make_parent` would refuse: the
    target is absent or a regular file, the nearest existing folder is one that takes new
    entries, and no name is too long for the file system."""
    path = Path(check_path(path, "output"))
    _check_target(path)
    missing = []
    ancestor = path.parent if str(path.parent) else Path(".")
    while not os.path.lexists(ancestor):
        missing.append(ancestor.name)
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecError(f"{path}: {ancestor} is not a folder")
    try:
        name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for name in [*missing, path.name]:
        if len(os.fsencode(name)) > name_max:
            raise SpecError(f"{path}: the name {name[:40]!r}... is longer than this file system takes "
                            f"({name_max} bytes)")
    if missing and not os.access(ancestor, os.W_OK | os.X_OK):
        raise SpecError(f"{path}: cannot create folders in {ancestor}: permission denied")
    return path


def check_folder(path: str | Path, what: str) -> Path:
    """``path`` when it is a folder, or can be made one: each part of it that exists is a folder
    (not a file, where ``mkdir`` would fail with ``NotADirectoryError``), and the nearest existing
    one takes new entries. One :class:`SpecError` naming ``what`` otherwise; nothing is created."""
    path = Path(check_path(path, what))
    ancestor = path
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not os.path.isdir(ancestor):
        where = "is" if ancestor == path else f"is under {ancestor}, which is"
        raise SpecError(f"{what} {path}: {where} not a folder")
    if ancestor != path and not os.access(ancestor, os.W_OK | os.X_OK):
        raise SpecError(f"{what} {path}: cannot create folders in {ancestor}: permission denied")
    return path


def make_parent(path: str | Path) -> Path:
    """Create the missing folders above ``path`` only once :func:`atomic_write` could then write
    it (:func:`check_parent`), so a refused output leaves no folders behind."""
    path = check_parent(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(path, exc) from None
    return check_writable(path)


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """Open a binary file that replaces ``path`` atomically when the block ends without error
    (and vanishes when it raises). Refuses targets that are not regular files."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{path}: folder {parent} does not exist")
    keep_mode = _check_target(path)
    tmp = parent / f".{path.name[:100]}.{uuid.uuid4().hex}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        raise _write_error(path, exc) from None
    try:
        if keep_mode is not None:
            os.fchmod(fd, keep_mode)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename is durable once the folder is
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


#: Write errors that say the machine failed, not the path the user gave (exit 1, not 2).
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.ENOMEM}


def _write_error(path: str | Path, exc: OSError) -> Exception:
    message = f"{path}: cannot write: {exc.strerror or exc}"
    return InfraError(message) if exc.errno in _ENVIRONMENT_ERRNOS else SpecError(message)


def write_text_atomic(path: str | Path, text: str | bytes) -> None:
    """Replace ``path`` with ``text`` atomically (see :func:`atomic_write`); OS errors while
    writing are one :class:`SpecError` naming the file."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with atomic_write(path) as fh:
            fh.write(data)
    except OSError as exc:
        raise _write_error(path, exc) from None


def _limit(path: Path, name: str, default: int) -> int:
    """``os.pathconf`` of the nearest existing folder above ``path`` (``default`` where the
    platform does not say)."""
    folder = path if path.is_absolute() else Path.cwd() / path
    for ancestor in (folder, *folder.parents):
        try:
            return os.pathconf(ancestor, name)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EACCES, errno.ELOOP):
                continue
            return default
        except ValueError:
            return default
    return default


def _checked(path: Any, what: str, error: type) -> str:
    """:func:`check_path` for a ``what`` file, raising ``error``."""
    try:
        return check_path(path, f"{what} file")
    except SpecError as exc:
        raise exc if isinstance(exc, error) else error(str(exc)) from None


def _shortened(text: str) -> str:
    """``text`` as an error shows it: each name longer than 60 characters cut to its start, and
    the whole to 300 characters (a user's 100 KB name would bury the message)."""
    parts = [p if len(p) <= 60 else f"{p[:40]}...({len(p)} characters)" for p in text.split("/")]
    out = "/".join(parts).replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    return out if len(out) <= 300 else out[:297] + "..."


def check_path(value: Any, what: str) -> str:
    """``value`` when the file system can hold it as a path: a string without NUL bytes whose
    every component fits ``NAME_MAX`` bytes (255 on common file systems) and whose whole fits
    ``PATH_MAX``; else one :class:`SpecError` naming ``what`` and the problem, the name cut short.

    Called on every name or path a user gives before it is looked up (``Path.exists()`` raises
    ``ENAMETOOLONG`` where it returns False for a missing file)."""
    if not isinstance(value, (str, os.PathLike)):
        raise SpecError(f"{what}: expected a name or path, got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    shown_path = _shortened(text)
    if "\x00" in text:
        raise SpecError(f"{what} {shown_path}: holds a NUL byte, which no file name can")
    try:
        data = os.fsencode(text)
    except UnicodeEncodeError:
        raise SpecError(f"{what} {shown_path}: holds characters no file name can (a lone surrogate)") from None
    path = Path(text)
    name_max = _limit(path.parent, "PC_NAME_MAX", 255)
    for part in data.split(b"/"):
        if len(part) > name_max:
            raise SpecError(f"{what} {shown_path}: a name of {len(part)} bytes in it; the file system takes "
                            f"at most {name_max}")
    path_max = _limit(path.parent, "PC_PATH_MAX", 4096)
    if len(data) >= path_max:
        raise SpecError(f"{what} {shown_path}: {len(data)} bytes; the file system takes paths of at most "
                        f"{path_max - 1}")
    return text


def check_name(value: Any, what: str) -> str:
    """A name that becomes part of a path: letters, digits and ``. _ - + @ =``, not starting with
    a dot, at most :data:`MAX_NAME_LENGTH` characters."""
    ok = (isinstance(value, str) and 0 < len(value) <= MAX_NAME_LENGTH and not value.startswith(".")
          and all(c.isascii() and (c.isalnum() or c in "._-+@=") for c in value))
    if not ok:
        shown = value if not isinstance(value, str) or len(value) <= 60 else value[:60] + "..."
        raise SpecError(f"{what}: expected a name of letters, digits and . _ - + @ = (not starting with '.', "
                        f"at most {MAX_NAME_LENGTH} characters), got {shown!r}")
    return value


def path_under(root: str | Path, *parts: str) -> Path:
    """``root/parts...``, refused unless it stays under ``root`` once resolved (no ``..``, no
    absolute part, no link out of it)."""
    root_path = Path(root).resolve()
    path = root_path.joinpath(*parts).resolve()
    if not path.is_relative_to(root_path):
        raise SpecError(f"{Path(root).joinpath(*parts)}: leaves {root}")
    return path


def write_via(path: str | Path, writer: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` atomically with what ``writer(fh)`` writes (pyarrow, torch.save, ...)."""
    try:
        with atomic_write(path) as fh:
            writer(fh)
    except OSError as exc:
        raise _write_error(path, exc) from None
