"""Where a search's results are in the MLflow UI: the runs to compare and the links to them.

Opened at its home page, MLflow shows an overview of traces, and a search's trial runs are
nested under its parent run: the search names the runs that matter instead. Its summary prints
the link to MLflow's compare view of the confirmed pick (its trial and its confirmation) and the
baselines it was screened against, and saves it beside the search's result
(``searches/<search id>-mlflow.json``), where ``synctune ui`` finds the latest one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import quote

from ..data.confirmation import Confirmation
from ..data.record import TrialRecord
from ..spec.errors import SpecError
from .baselines import BaselineTrial

__all__ = ["ui_base", "compare_runs_url", "run_url", "compared_records", "SearchLinks", "latest_links", "links_path"]

#: Where ``synctune ui`` serves by default.
DEFAULT_PORT = 5000


def ui_base(tracking_uri: str, port: int = DEFAULT_PORT) -> str:
    """The MLflow UI's address for ``tracking_uri``: the tracking server itself, or where
    ``synctune ui`` serves a local store."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return f"http://127.0.0.1:{port}"


def _ids(values: Iterable[str]) -> str:
    return quote(json.dumps(list(values), separators=(",", ":")), safe="")


def compare_runs_url(base: str, run_ids: Iterable[str], experiment_ids: Iterable[str]) -> str:
    """MLflow's compare view of ``run_ids`` (its route ``/compare-runs?runs=[...]&experiments=[...]``)."""
    return f"{base}/#/compare-runs?runs={_ids(run_ids)}&experiments={_ids(experiment_ids)}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """MLflow's page of one run: for a search's parent run, its figures and its dashboard."""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def compared_records(records: list[TrialRecord], confirmation: Confirmation | None) -> list[TrialRecord]:
    """The rows to compare after a search: the confirmation's row, the confirmed pick's own
    trial, and each baseline the confirmation screened (the one confirmed against first), each
    as its fastest finished trial; only rows with an MLflow run. Empty without a confirmation."""
    if confirmation is None or not confirmation.measured:
        return []
    ok = [r for r in records if r.status == "ok" and r.mlflow_run_id]
    chosen: list[TrialRecord] = []

    def add(found: list[TrialRecord]) -> None:
        if found:
            best = min(found, key=lambda r: (r.mean_s if r.mean_s is not None else float("inf"), r.trial_id))
            if best not in chosen:
                chosen.append(best)

    add([r for r in ok if r.origin == "confirmation"][-1:])
    add([r for r in ok if r.trial_id == confirmation.candidate.split(" ")[0]])
    baselines = [confirmation.baseline] + [b for b in confirmation.screened_baselines if b != confirmation.baseline]
    for label in baselines:
        if label.startswith("builder "):  # a builder's trials carry its name (with options) as their origin
            add([r for r in ok if r.origin == label.removeprefix("builder ")])
        else:  # a tuned runtime's trial, named as the confirmation named it
            add([r for r in ok if r.origin != "confirmation" and _baseline_label(r) == label])
    return chosen


def _baseline_label(record: TrialRecord) -> str | None:
    """How a confirmation names the baseline trial of ``record``; None for a row whose runtime
    cannot be read back (an older row: it is then not compared, nothing else fails)."""
    try:
        return BaselineTrial.from_record(record).label
    except (SpecError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, kw_only=True)
class SearchLinks:
    """A search's place in MLflow: the search, the store (``tracking_uri``), its experiment and
    parent run, and the run ids to compare (``compare``, :func:`compared_records`)."""

    search_id: str
    tracking_uri: str
    experiment_id: str
    parent_run: str
    compare: tuple[str, ...] = ()

    def compare_url(self, port: int = DEFAULT_PORT) -> str:
        """The compare view of the confirmed pick and the screened baselines."""
        return compare_runs_url(ui_base(self.tracking_uri, port), self.compare, [self.experiment_id])

    def search_url(self, port: int = DEFAULT_PORT) -> str:
        """The search's parent run."""
        return run_url(ui_base(self.tracking_uri, port), self.experiment_id, self.parent_run)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, as the links file holds it."""
        return {"search_id": self.search_id, "tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id,
                "parent_run": self.parent_run, "compare": list(self.compare)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchLinks":
        """The links of :meth:`to_dict`'s plain data."""
        return cls(search_id=str(data["search_id"]), tracking_uri=str(data["tracking_uri"]),
                   experiment_id=str(data["experiment_id"]), parent_run=str(data["parent_run"]),
                   compare=tuple(str(x) for x in data["compare"]))


def links_path(searches: Path, search_id: str) -> Path:
    """Where a search's links are saved, beside its result."""
    return searches / f"{search_id}-mlflow.json"


def latest_links(searches: Path, tracking_uri: str) -> SearchLinks | None:
    """The links of the latest search logged to ``tracking_uri`` (by when they were saved), or None."""
    found = []
    for path in searches.glob("*-mlflow.json") if searches.is_dir() else ():
        try:
            links = SearchLinks.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged or foreign file is not a search's links
        if links.tracking_uri == tracking_uri:
            found.append((path.stat().st_mtime, links))
    return max(found, key=lambda f: f[0])[1] if found else None
