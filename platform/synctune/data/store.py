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
import time
import uuid
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

from ..spec.errors import SpecError
from ..spec.files import write_via
from .record import RECORD_SCHEMA_VERSION, TrialRecord, arrow_schema, dedup_key

__all__ = ["TrialDataset", "KEY_COLUMNS"]

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
        self.root = Path(root)

    # ------------------------------------------------------------------------------- writing

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
        import pyarrow.dataset as ds

        for part_dir, files in partitions.items():
            files_before += len(files)
            try:
                table = ds.dataset([str(f) for f in files], format="parquet", schema=arrow_schema()).to_table()
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
            import pyarrow.dataset as ds

            files = sorted(part_dir.glob("part-*.parquet")) if part_dir.is_dir() else []
            if not files:
                return set()
            table = ds.dataset([str(f) for f in files], format="parquet", schema=arrow_schema()).to_table(
                columns=list(KEY_COLUMNS))
            return {dedup_key(r) for r in table.to_pylist()}

        return _relisting(load)

    # ------------------------------------------------------------------------------- reading

    def table(self, *, model: str | None = None, cluster: str | None = None, status: str | None = None,
              search_id: str | None = None):
        """All records as an Arrow table (current schema; older rows get nulls), deduplicated."""
        return _relisting(lambda: self._table(model, cluster, status, search_id))

    def _table(self, model, cluster, status, search_id):
        import pyarrow.dataset as ds

        schema = arrow_schema()
        files = self.files()
        if model is not None:
            files = [f for f in files if f.parent.parent.name == _segment("model", model)]
        if cluster is not None:
            files = [f for f in files if f.parent.name == _segment("cluster", cluster)]
        if not files:
            return schema.empty_table()
        dataset = ds.dataset([str(f) for f in files], format="parquet", schema=schema)
        expr = None
        for column, value in (("model_name", model), ("cluster_name", cluster), ("status", status),
                              ("search_id", search_id)):
            if value is not None:
                cond = ds.field(column) == value
                expr = cond if expr is None else expr & cond
        return _dedup(dataset.to_table(filter=expr))

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

    part_dir.mkdir(parents=True, exist_ok=True)
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
