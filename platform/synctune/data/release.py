"""Dataset releases: Parquet files plus ``manifest.json`` (schema version, row counts, sha256 of
every file), pushed to and pulled from a local folder, ``http(s)://`` (pull) or ``s3://``.

A pull downloads into a temporary folder, verifies every file's checksum and row count, and
only then merges the rows into the local dataset (without duplicates): a corrupted or
tampered release is refused and the local dataset stays exactly as it was. A push writes the
data files first and the manifest last, so a reader never sees a manifest naming missing files.

S3 locations take pyarrow's options in the query string, e.g.
``s3://bucket/releases/v0.1?endpoint_override=127.0.0.1:9000&scheme=http``; credentials come
from the usual AWS environment variables.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..spec.errors import InfraError, SpecError
from ..spec.files import MAX_FILE_BYTES, check_path, parse_json, path_under, write_text_atomic
from ..spec.profile import ComputeProfile
from .record import RECORD_SCHEMA_VERSION
from .store import TrialDataset, read_parquet_files

__all__ = ["MANIFEST", "FORMAT", "push_release", "pull_release", "read_manifest"]

MANIFEST = "manifest.json"
FORMAT = "synctune-dataset-release"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Location:
    """Read/write bytes under a local folder, an http(s) URL (read-only) or an S3 prefix."""

    def __init__(self, where: str) -> None:
        self.where = where
        parts = urlsplit(where)
        self.kind = parts.scheme if parts.scheme in ("http", "https", "s3") else "local"
        if self.kind == "s3":
            from pyarrow import fs

            try:
                self.fs, self.base = fs.FileSystem.from_uri(where)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several types here
                raise SpecError(f"{where}: not a usable S3 location: {exc}") from None
            self.base = self.base.rstrip("/")
        elif self.kind in ("http", "https"):
            self.base = where.split("?", 1)[0].rstrip("/")
        else:
            self.base = check_path(str(Path(where)), "release folder")

    def read(self, rel: str, timeout_s: float = 60.0, limit: int = 1 << 34) -> bytes:
        try:
            if self.kind == "local":
                return _read_local(Path(self.base), rel, limit)
            if self.kind == "s3":
                with self.fs.open_input_stream(f"{self.base}/{rel}") as fh:
                    return fh.read()
            import urllib.error
            import urllib.request

            try:
                with urllib.request.urlopen(f"{self.base}/{rel}", timeout=timeout_s) as resp:  # noqa: S310
                    data = resp.read(limit + 1)
                    if len(data) > limit:
                        raise SpecError(f"{self.base}/{rel}: larger than {limit} bytes")
                    return data
            except urllib.error.HTTPError as exc:
                raise SpecError(f"{self.base}/{rel}: HTTP {exc.code} {exc.reason}") from None
            except urllib.error.URLError as exc:
                raise InfraError(f"{self.base}/{rel}: cannot connect: {exc.reason}") from None
            except TimeoutError:
                raise InfraError(f"{self.base}/{rel}: no answer within {timeout_s:g} s") from None
        except FileNotFoundError:
            raise SpecError(f"{self.where}: no file {rel!r}") from None
        except OSError as exc:
            # pyarrow reports S3 connection problems as OSError too: the store, not the input.
            raise (InfraError if self.kind == "s3" else SpecError)(
                f"{self.where}: cannot read {rel!r}: {str(exc)[:300]}") from None

    def write(self, rel: str, data: bytes) -> None:
        if self.kind in ("http", "https"):
            raise SpecError(f"{self.where}: cannot push to http(s); push to a folder or s3:// and serve that")
        try:
            if self.kind == "local":
                base = Path(self.base)
                if base.is_symlink():
                    # Writing through it would put the release wherever the link points, as
                    # atomic_write refuses to for a file.
                    raise SpecError(f"{self.where}: is a symbolic link (to {os.path.realpath(base)}); synctune never "
                                    f"pushes through links: give the folder it points to")
                path = path_under(base, rel)  # no link inside the folder leads out of it either
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(path, data)
            else:
                with self.fs.open_output_stream(f"{self.base}/{rel}") as fh:
                    fh.write(data)
        except OSError as exc:
            raise (InfraError if self.kind == "s3" else SpecError)(
                f"{self.where}: cannot write {rel!r}: {str(exc)[:300]}") from None


def _read_local(base: Path, rel: str, limit: int) -> bytes:
    """The bytes of ``base/rel``, refusing symbolic links anywhere below ``base`` (a release
    never makes the puller read a file outside it)."""
    import os
    import stat

    path = base
    for part in Path(rel).parts:
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise
        if stat.S_ISLNK(mode):
            raise SpecError(f"{base}: {rel}: {path.relative_to(base)} is a symbolic link; releases never follow "
                            f"links")
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise SpecError(f"{base}: {rel} is not a regular file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise SpecError(f"{base}: {rel}: larger than {limit} bytes")
    return data


def read_manifest(source: str) -> dict[str, Any]:
    """The validated manifest of the release at ``source``."""
    loc = _Location(source)
    manifest = parse_json(loc.read(MANIFEST, limit=MAX_FILE_BYTES), f"{source}: {MANIFEST}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecError(f"{source}: {MANIFEST} is not a synctune dataset manifest (format {FORMAT!r})")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > RECORD_SCHEMA_VERSION:
        raise SpecError(f"{source}: release schema version {str(version)[:20]!r} is not one this synctune reads "
                        f"(up to {RECORD_SCHEMA_VERSION}); upgrade synctune")
    files = manifest.get("files")
    if not isinstance(files, list) or len(files) > 1_000_000:
        raise SpecError(f"{source}: {MANIFEST}: files: expected a list of {{path, rows, sha256}}")
    for i, f in enumerate(files):
        where = f"{source}: {MANIFEST}: files[{i}]"
        if not isinstance(f, dict) or not {"path", "rows", "sha256"} <= set(f):
            raise SpecError(f"{where}: expected a mapping with path, rows and sha256")
        path, rows, digest = f["path"], f["rows"], f["sha256"]
        if not isinstance(path, str) or not path or len(path) > 1024 or "\\" in path:
            raise SpecError(f"{where}: path: expected a relative file path, got {str(path)[:60]!r}")
        if path.startswith("/") or ".." in Path(path).parts:
            raise SpecError(f"{where}: file path {path!r} leaves the release")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise SpecError(f"{where}: rows: expected a non-negative integer, got {str(rows)[:40]!r}")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise SpecError(f"{where}: sha256: expected 64 lowercase hex digits, got {str(digest)[:70]!r}")
    return manifest


def push_release(dataset: TrialDataset, dest: str, *, name: str | None = None,
                 profiles: dict[str, dict] | None = None) -> dict[str, Any]:
    """Write the dataset as a release at ``dest``; returns the manifest. ``profiles`` (file
    name -> compute profile as a mapping) travel with it under ``profiles/``: the replay
    simulator's measured inputs for the release's domains."""
    import pyarrow.parquet as pq

    table = dataset.table()
    if table.num_rows == 0:
        raise SpecError(f"{dataset.root}: the dataset is empty, nothing to push")
    loc = _Location(dest)
    files = []
    pairs = sorted(set(zip(table.column("model_name").to_pylist(), table.column("cluster_name").to_pylist())))
    import pyarrow.compute as pc

    from .store import _segment

    for model, cluster in pairs:
        part = table.filter(pc.and_(pc.equal(table.column("model_name"), model),
                                    pc.equal(table.column("cluster_name"), cluster)))
        buf = io.BytesIO()
        pq.write_table(part, buf)
        data = buf.getvalue()
        rel = f"data/{_segment('model', model)}/{_segment('cluster', cluster)}/part-0.parquet"
        loc.write(rel, data)
        files.append({"path": rel, "rows": part.num_rows, "bytes": len(data), "sha256": _sha256(data),
                      "model": model, "cluster": cluster})
    manifest = {
        "format": FORMAT,
        "name": name or f"release-{datetime.date.today().isoformat()}",
        "schema_version": RECORD_SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "total_rows": table.num_rows,
        "files": files,
    }
    if profiles:
        entries = []
        for fname, profile in sorted(profiles.items()):
            if not fname.endswith(".json") or "/" in fname or fname.startswith("."):
                raise SpecError(f"profile file name {fname!r}: expected NAME.json")
            data = (json.dumps(profile, indent=1) + "\n").encode()
            loc.write(f"profiles/{fname}", data)
            entries.append({"path": f"profiles/{fname}", "sha256": _sha256(data)})
        manifest["profiles"] = entries
    loc.write(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _conform_release(table):
    """``table`` cast to the record schema; refused when it lacks a key column or a value does
    not fit (a release is someone else's file: it is checked before anything merges)."""
    from .store import KEY_COLUMNS, conform

    missing = [c for c in KEY_COLUMNS + ("model_name", "cluster_name") if c not in table.column_names]
    if missing:
        raise ValueError(f"missing column(s) {missing}")
    for column in ("model_name", "cluster_name"):
        if table.column(column).null_count:
            raise ValueError(f"null {column}")
    return conform(table)


def pull_release(source: str, dataset: TrialDataset) -> dict[str, int]:
    """Verify the release at ``source`` and merge it into ``dataset``.

    Returns ``{"files", "rows", "new_rows", "profiles"}`` (``profiles``: the release's compute
    profiles, file name -> mapping, checked against their checksums; the caller files them).
    Raises :class:`SpecError` naming the file on any checksum, size or format problem, before
    anything is merged.
    """
    import pyarrow as pa

    from .store import MAX_DECODED_BYTES

    dataset.check_writable()
    manifest = read_manifest(source)
    loc = _Location(source)
    staging = Path(tempfile.mkdtemp(prefix="synctune-pull-"))
    try:
        tables = []
        for entry in manifest["files"]:
            data = loc.read(entry["path"], limit=MAX_DECODED_BYTES)
            digest = _sha256(data)
            if digest != entry["sha256"]:
                raise SpecError(f"{source}: {entry['path']}: checksum mismatch (manifest sha256 "
                                f"{entry['sha256'][:16]}..., file {digest[:16]}...); refused, the local dataset "
                                f"is unchanged")
            local = staging / entry["path"]
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
            try:
                table = read_parquet_files([local])  # refuses a file without the record columns
            except SpecError as exc:  # name the file as the release has it, not the staging copy
                raise SpecError(str(exc).replace(str(local), f"{source}: {entry['path']}")) from None
            if table.num_rows != entry["rows"]:
                raise SpecError(f"{source}: {entry['path']}: {table.num_rows} rows, manifest says {entry['rows']}; "
                                f"refused, the local dataset is unchanged")
            tables.append(table)
        profiles = {}
        listed = manifest.get("profiles") or []
        if not isinstance(listed, list):
            raise SpecError(f"{source}: {MANIFEST}: profiles: expected a list of {{path, sha256}}")
        for i, entry in enumerate(listed):
            path = entry.get("path") if isinstance(entry, dict) else None
            if not (isinstance(path, str) and path.startswith("profiles/") and path.endswith(".json")
                    and "/" not in path[len("profiles/"):] and ".." not in path):
                raise SpecError(f"{source}: {MANIFEST}: profiles[{i}]: expected a path profiles/NAME.json")
            data = loc.read(path, limit=MAX_FILE_BYTES)
            if _sha256(data) != entry.get("sha256"):
                raise SpecError(f"{source}: {path}: checksum mismatch; refused, the local dataset is unchanged")
            profile = parse_json(data, f"{source}: {path}")
            ComputeProfile.from_dict(profile, where=f"{source}: {path}")  # refused before anything merges
            profiles[path[len("profiles/"):]] = profile
        try:
            merged = pa.concat_tables(tables, promote_options="default") if tables else None
            checked = _conform_release(merged) if merged is not None else None
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise SpecError(f"{source}: its files are not synctune trial records: {str(exc)[:300]}") from None
        new_rows = dataset.append_table(checked, skip_existing=True) if checked is not None else 0
        return {"files": len(tables), "rows": sum(t.num_rows for t in tables), "new_rows": new_rows,
                "profiles": profiles}
    finally:
        shutil.rmtree(staging, ignore_errors=True)
