"""Publishing a search's dashboard: the page in the data home's reports folder (or the one file
the user named), listed in that folder's index, and attached to the search's parent MLflow run as
``report.html``."""

from __future__ import annotations

from pathlib import Path

from ..data.paths import data_home
from ..data.tracking import MlflowLogger
from ..spec.files import check_name, path_under, write_text_atomic
from .page import write_index
from .search import load_search, search_report

__all__ = ["publish_search_report", "report_path", "reports_folder", "list_report"]


def reports_folder() -> Path:
    """``<data home>/reports``: the reports written by default, and the index of all of them."""
    folder = path_under(data_home(), "reports")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def report_path(name: str) -> Path:
    """``<data home>/reports/<name>.html`` (``name``: a search id or ``dataset``)."""
    check_name(name, "report name")
    return path_under(reports_folder(), f"{name}.html")


def list_report(path: Path) -> Path:
    """Add the report just written at ``path`` to the index in the data home's reports folder
    (a named output gets no file beside it); the index's path."""
    folder = reports_folder()
    return write_index(folder, outside=None if path.resolve().parent == folder.resolve() else path)


def publish_search_report(search_id: str, *, data_dir=None, output: Path | None = None, template=None,
                          tracking_uri: str | None = None, mlflow: bool = True) -> tuple[Path, str]:
    """Write the report of ``search_id`` (default: ``<data home>/reports/<id>.html``), refresh the
    folder's index page and attach the page to the search's parent MLflow run.
    Returns the path and the run id ('' when not logged)."""
    check_name(search_id, "search id")
    page = search_report(search_id, data_dir, template)
    path = Path(output) if output else report_path(search_id)
    write_text_atomic(path, page)
    list_report(path)
    run_id = ""
    if mlflow:
        logger = MlflowLogger(load_search(search_id, data_dir).experiment, tracking_uri)
        run_id = logger.find_search(search_id)
        if run_id:
            logger.log_text(run_id, page, "report.html")
    return path, run_id
