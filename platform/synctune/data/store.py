"""The local Parquet dataset of trial records, hive-partitioned by model and cluster.

Layout: ``<root>/model=<name>/cluster=<name>/part-<time>-<uuid>.parquet``. Every append writes
new files only: each under a hidden temporary name (``.part-*.tmp``, which readers ignore),
then renamed into place (``synctune.spec.files.atomic_write``), so a crash never leaves a half-written file visible, and concurrent
writers never touch the same file.

Duplicates (same :func:`dedup_key`) never reach a reader: reads drop them; merging a pulled
release skips rows already present; :meth:`TrialDataset.compact` rewrites each partition as one
file without them. Plain appends do not re-read the partition (that would make N appends cost
O(N^2) file reads); they only drop duplicates within their own batch.
"""

from __future__ import annotations

import datetime
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

from ..spec.errors import SpecError
from ..spec.files import check_folder, check_path, write_via
from .record import RECORD_SCHEMA_VERSION, TrialRecord, arrow_schema, dedup_key

__all__ = ["TrialDataset", "KEY_COLUMNS", "read_parquet_files", "MAX_FILE_ROWS", "MAX_FILE_COLUMNS",
           "MAX_DECODED_BYTES"]

#: Most rows one Parquet file may hold (a partition of a million trials is far beyond any real one).
MAX_FILE_ROWS = 10_000_000
#: Most columns one Parquet file may hold (a record has about a hundred).
MAX_FILE_COLUMNS = 1_000
#: Most bytes one Parquet file may decode to, as its footer declares and as read.
MAX_DECODED_BYTES = 2 * 1024**3
#: Rows decoded at a time, so a file that decodes to more than it declares is stopped early.
_BATCH_ROWS = 16_384

KEY_COLUMNS = ("model_hash", "cluster_hash", "strategy_hash", "search_id", "trial_id", "synctune_version",
               "torch_version", "python_version", "platform", "backend", "device_kind")


def _segment(key: str, value: str) -> str:
    """A partition folder name: ``key=<value, percent-quoted>``; a value too long for a file name
    keeps its start and gets a digest of the whole."""
    quoted = quote(value, safe="")
    if len(quoted) > 180:
        import hashlib

        quoted = f"{quoted[:150]}~{hashlib.sha256(value.encode()).hexdigest()[:16]}"
    return f"{key}={quoted}"


class TrialDataset:
    """The dataset at ``root`` (created on first append)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(check_path(root, "dataset folder"))

    # ------------------------------------------------------------------------------- writing

    def check_writable(self) -> "TrialDataset":
        """Refuse, before any work, a dataset folder that cannot be created or written: a file
        where it or a folder above it should be (one :class:`SpecError` naming it)."""
        check_folder(self.root, "dataset folder")
        return self

    def files(self) -> list[Path]:
        """The committed data files (temporary files excluded), in a stable order."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("model=*/cluster=*/part-*.parquet"))

    def append(self, records: Iterable[TrialRecord], *, skip_existing: bool = False) -> int:
        """Append records; returns how many rows were written (duplicates within the batch, and
        with ``skip_existing`` those already in the dataset, are skipped)."""
        import pyarrow as pa

        rows = [r.to_row() for r in records]
        if not rows:
            return 0
        return self.append_table(pa.Table.from_pylist(rows, schema=arrow_schema()), skip_existing=skip_existing)

    def append_table(self, table, *, skip_existing: bool = False) -> int:
        """Append an Arrow table of records (any schema version up to this one)."""
        import pyarrow.compute as pc

        if table.num_rows == 0:
            return 0
        versions = set(table.column("schema_version").to_pylist()) if "schema_version" in table.column_names else {0}
        if max(v or 0 for v in versions) > RECORD_SCHEMA_VERSION:
            raise SpecError(f"records of schema version {max(versions)} are newer than this synctune "
                            f"(version {RECORD_SCHEMA_VERSION}); upgrade synctune to read them")
        table = conform(table)
        written = 0
        pairs = sorted(set(zip(table.column("model_name").to_pylist(), table.column("cluster_name").to_pylist())))
        for model, cluster in pairs:
            mask = pc.and_(pc.equal(table.column("model_name"), model), pc.equal(table.column("cluster_name"), cluster))
            part = table.filter(mask)
            part_dir = self.root / _segment("model", model) / _segment("cluster", cluster)
            part = _dedup(part, self._keys(part_dir) if skip_existing else set(), order=False)
            if part.num_rows == 0:
                continue
            _write_file(part, part_dir)
            written += part.num_rows
        return written

    def compact(self, *, model: str | None = None, cluster: str | None = None) -> dict[str, int]:
        """Rewrite every partition with several files (only the ``model`` / ``cluster`` one where
        given) as one file without duplicates.

        Safe with concurrent readers (they drop duplicates while both old and new files are
        visible) and writers (files committed after the listing are left alone).
        """
        files_before = rows_after = 0
        partitions: dict[Path, list[Path]] = {}
        for f in self.files():
            if (model is not None and f.parent.parent.name != _segment("model", model)) or (
                    cluster is not None and f.parent.name != _segment("cluster", cluster)):
                continue
            partitions.setdefault(f.parent, []).append(f)
        for part_dir, files in partitions.items():
            files_before += len(files)
            try:
                table = read_parquet_files(files, arrow_schema())
            except FileNotFoundError:
                continue  # another compaction took this partition since the listing: leave it to that one
            table = _dedup(table)
            rows_after += table.num_rows
            if len(files) == 1:
                continue
            _write_file(table, part_dir)
            for f in files:
                f.unlink(missing_ok=True)
        return {"files_before": files_before, "files_after": sum(len(list(d.glob("part-*.parquet")))
                                                                 for d in partitions), "rows": rows_after}

    def _keys(self, part_dir: Path) -> set:
        def load():
            files = sorted(part_dir.glob("part-*.parquet")) if part_dir.is_dir() else []
            if not files:
                return set()
            table = read_parquet_files(files, arrow_schema(), columns=list(KEY_COLUMNS))
            return {dedup_key(r) for r in table.to_pylist()}

        return _relisting(load)

    # ------------------------------------------------------------------------------- reading

    def table(self, *, model: str | None = None, cluster: str | None = None, status: str | None = None,
              search_id: str | None = None):
        """All records as an Arrow table (current schema; older rows get nulls), deduplicated."""
        return _relisting(lambda: self._table(model, cluster, status, search_id))

    def _table(self, model, cluster, status, search_id):
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        schema = arrow_schema()
        files = self.files()
        if model is not None:
            files = [f for f in files if f.parent.parent.name == _segment("model", model)]
        if cluster is not None:
            files = [f for f in files if f.parent.name == _segment("cluster", cluster)]
        if not files:
            return schema.empty_table()
        expr = None
        for column, value in (("model_name", model), ("cluster_name", cluster), ("status", status),
                              ("search_id", search_id)):
            if value is not None:
                cond = ds.field(column) == value
                expr = cond if expr is None else expr & cond
        table = read_parquet_files(files, schema, filter=expr)
        versions = pc.min_max(table.column("schema_version"))
        low, high = versions["min"].as_py(), versions["max"].as_py()
        if (high is not None and high > RECORD_SCHEMA_VERSION) or (low is not None and low < 0):
            bad = high if high is not None and high > RECORD_SCHEMA_VERSION else low
            raise SpecError(f"{self.root}: holds records of schema version {bad}; this synctune reads versions up to "
                            f"{RECORD_SCHEMA_VERSION}" + ("; upgrade synctune to read them" if bad > 0 else ""))
        return _dedup(table)

    def read(self, **filters: Any):
        """All records as a pandas DataFrame; filters: ``model``, ``cluster``, ``status``, ``search_id``."""
        return self.table(**filters).to_pandas()

    def records(self, **filters: Any) -> list[TrialRecord]:
        """All records as :class:`TrialRecord` objects."""
        return [TrialRecord.from_row(r) for r in self.table(**filters).to_pylist()]

    def stats(self):
        """Rows per (model, cluster): counts by status and the best mean iteration time."""
        import pandas as pd

        df = self.read()
        if df.empty:
            return pd.DataFrame(columns=["model", "cluster", "rows", "ok", "failed", "timeout", "oom",
                                         "best_mean_s", "best_origin"])
        out = []
        for (model, cluster), group in df.groupby(["model_name", "cluster_name"], sort=True):
            ok = group[group["status"] == "ok"]
            best = ok.loc[ok["mean_s"].idxmin()] if not ok.empty else None
            out.append({
                "model": model, "cluster": cluster, "rows": len(group),
                **{s: int((group["status"] == s).sum()) for s in ("ok", "failed", "timeout", "oom")},
                "best_mean_s": float(best["mean_s"]) if best is not None else None,
                "best_origin": best["origin"] if best is not None else "",
            })
        return pd.DataFrame(out)


#: Columns every record of every schema version has: a Parquet file without them is not
#: records (another tool's file in the folder), and is refused rather than read as empty rows.
RECORD_COLUMNS = ("model_name", "cluster_name", "model_hash", "cluster_hash", "strategy_hash")


def read_parquet_files(files: list[Path], schema=None, *, columns: list[str] | None = None, filter=None,
                       where: str = "", required: Iterable[str] = RECORD_COLUMNS):
    """The rows of ``files`` read as ``schema`` (default: the first file's), each file bounded
    before and while it decodes.

    These files may come from someone else (a pulled release, a shared folder): a few kilobytes
    of Parquet can declare or expand to gigabytes. Each file's footer is read first (rows,
    columns, uncompressed size against :data:`MAX_FILE_ROWS`, :data:`MAX_FILE_COLUMNS`,
    :data:`MAX_DECODED_BYTES`), then it is decoded in batches, stopped as soon as it exceeds
    :data:`MAX_DECODED_BYTES`. A file that is not Parquet, or not records (without the
    ``required`` columns), is one :class:`SpecError` naming it; a file gone since the listing
    raises ``FileNotFoundError``."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    prefix = f"{where}: " if where else ""
    batches = []
    for f in files:
        name = f"{prefix}{f}"
        # A FIFO named part-*.parquet would block the read for ever; a file gone since the
        # listing stays a FileNotFoundError (a compaction replaced it: list again).
        if not stat.S_ISREG(os.stat(f).st_mode):
            raise SpecError(f"{name}: is not a regular file (a folder, FIFO, socket or device); a dataset holds "
                            f"only the Parquet files synctune writes")
        try:
            meta = pq.read_metadata(f)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError) as exc:
            raise SpecError(f"{name}: not a readable Parquet file: {str(exc)[:200]}") from None
        declared = sum(meta.row_group(i).column(j).total_uncompressed_size
                       for i in range(meta.num_row_groups) for j in range(meta.num_columns))
        for what, value, limit in (("rows", meta.num_rows, MAX_FILE_ROWS), ("columns", meta.num_columns,
                                   MAX_FILE_COLUMNS), ("uncompressed bytes", declared, MAX_DECODED_BYTES)):
            if value > limit:
                raise SpecError(f"{name}: {value} {what}; a dataset file holds at most {limit}: refused")
        missing = [c for c in required if c not in meta.schema.names]
        if missing:
            has = ", ".join(meta.schema.names[:8]) + (", ..." if len(meta.schema.names) > 8 else "")
            raise SpecError(f"{name}: not trial records (no column {', '.join(missing)}; it has {has[:200]}): a "
                            f"dataset holds only the Parquet files synctune writes")
        decoded = 0
        try:
            if schema is None:
                # Dictionary columns read as their plain values, so the bound counts what a
                # later cast to the record schema would expand them to.
                schema = pa.schema([pa.field(fd.name, fd.type.value_type if pa.types.is_dictionary(fd.type)
                                             else fd.type) for fd in ds.dataset(str(f), format="parquet").schema])
            fragment = ds.dataset(str(f), format="parquet", schema=schema)
            for batch in fragment.to_batches(columns=columns, filter=filter, batch_size=_BATCH_ROWS):
                decoded += batch.nbytes
                if decoded > MAX_DECODED_BYTES:
                    raise SpecError(f"{name}: decodes to more than {MAX_DECODED_BYTES} bytes; a dataset file "
                                    f"holds at most that: refused")
                _check_json_columns(batch, name)
                batches.append(batch)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError, ValueError) as exc:
            if isinstance(exc, SpecError):
                raise
            # ArrowInvalid/ArrowTypeError: damaged pages, or columns that are not a record's.
            raise SpecError(f"{name}: not a readable dataset file: {str(exc)[:200]}") from None
    if schema is None:
        raise ValueError("read_parquet_files: no files and no schema")
    out_schema = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    return pa.Table.from_batches(batches, schema=out_schema)


#: The columns that hold JSON objects, and whether an empty string stands for "none" (rows
#: written before ``extra_json`` and ``runtime_json`` existed, and engine trials, leave them empty).
JSON_COLUMNS = {"strategy_json": False, "model_spec_json": False, "cluster_spec_json": False, "extra_json": True,
                "runtime_json": True}


def _check_json_columns(batch, name: str) -> None:
    """Every cell of the JSON columns in ``batch`` is a JSON object (or null, or empty where that
    means none): a damaged or hand-made file is refused here, naming it and the column, rather
    than wherever a simulator, report or search later parses the cell. Each distinct value is
    parsed once (the spec columns repeat on every row of a domain)."""
    import json

    import pyarrow.compute as pc

    for column, may_be_empty in JSON_COLUMNS.items():
        index = batch.schema.get_field_index(column)
        if index < 0:
            continue
        for i, text in enumerate(pc.unique(batch.column(index)).to_pylist()):
            if text is None or (may_be_empty and text == ""):
                continue
            try:
                value = json.loads(text)
            except (ValueError, RecursionError) as exc:
                reason = f"not JSON ({str(exc)[:80]})" if isinstance(exc, ValueError) else "nested too deeply"
                raise SpecError(f"{name}: column {column}: a cell is {reason}: {text[:60]!r}") from None
            if not isinstance(value, dict):
                raise SpecError(f"{name}: column {column}: a cell holds a JSON {type(value).__name__}, expected "
                                f"an object: {text[:60]!r}")


def _relisting(read, attempts: int = 50):
    """``read()``, listed and read again when a file vanished between listing and reading (a
    concurrent compaction replaced it: its merged file is already committed, so a new listing
    sees every row)."""
    for attempt in range(attempts):
        try:
            return read()
        except FileNotFoundError:
            if attempt + 1 == attempts:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


def _write_file(table, part_dir: Path) -> Path:
    """Commit ``table`` as a new file of ``part_dir``: temporary name, fsync, atomic rename."""
    import pyarrow.parquet as pq

    try:
        part_dir.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError):  # a file where a folder of the dataset should be
        check_folder(part_dir, "dataset folder")
        raise
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = part_dir / f"part-{stamp}-{uuid.uuid4().hex}.parquet"
    write_via(path, lambda fh: pq.write_table(table, fh))
    return path


def _dedup(table, seen: set | None = None, order: bool = True):
    """The first row of each dedup key not already in ``seen``; with ``order``, rows sorted by
    (created_at, record_id) first, so the earliest measurement is the one kept."""
    import pyarrow as pa

    if table.num_rows == 0:
        return table
    if order:
        table = table.sort_by([("created_at", "ascending"), ("record_id", "ascending")])
    seen = set() if seen is None else seen
    keep = []
    for i, row in enumerate(table.select(list(KEY_COLUMNS)).to_pylist()):
        key = dedup_key(row)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return table.take(pa.array(keep, type=pa.int64())) if len(keep) != table.num_rows else table


def conform(table):
    """Cast a table of any earlier schema version to the current schema (missing columns null)."""
    import pyarrow as pa

    schema = arrow_schema()
    columns = []
    for f in schema:
        if f.name in table.column_names:
            columns.append(table.column(f.name).cast(f.type))
        else:
            columns.append(pa.nulls(table.num_rows, type=f.type))
    return pa.Table.from_arrays(columns, schema=schema)
