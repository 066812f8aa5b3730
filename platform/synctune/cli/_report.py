"""``synctune report``: the search and dataset dashboards as self-contained HTML pages."""

from __future__ import annotations

from pathlib import Path

import click

from . import cli
from ._common import echo_err


def search_id_arg(value: str) -> str:
    """A search id, or an experiment file (whose name and seed give the id)."""
    if value.endswith((".yaml", ".yml")) or Path(value).is_file():
        from ..cluster.search_runner import search_id_of
        from ..search.experiment import load_experiment

        return search_id_of(load_experiment(value))
    return value


def publish_search_report(search_id: str, *, data_dir=None, output: Path | None = None, template=None,
                          tracking_uri: str | None = None, mlflow: bool = True) -> tuple[Path, str]:
    """Write the report of ``search_id`` (default: ``<data home>/reports/<id>.html``), refresh the
    folder's index page and attach the page to the search's parent MLflow run.
    Returns the path and the run id ('' when not logged)."""
    from ..data import MlflowLogger, data_home
    from ..report import load_search, search_report, write_index
    from ..spec._util import write_text_atomic

    page = search_report(search_id, data_dir, template)
    path = Path(output) if output else data_home() / "reports" / f"{search_id}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, page)
    write_index(path.parent)
    run_id = ""
    if mlflow:
        logger = MlflowLogger(load_search(search_id, data_dir).experiment, tracking_uri)
        run_id = logger.find_search(search_id)
        if run_id:
            logger.log_text(run_id, page, "report.html")
    return path, run_id


@cli.command("report")
@click.argument("search", required=False)
@click.option("--dataset", "dataset", is_flag=True, help="The dataset dashboard instead of a search's.")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), help="Dataset folder (default: the data home's).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Where to write the page.")
@click.option("--template", type=click.Path(exists=True, dir_okay=False),
              help="An adapted copy of the page template (see dashboards/README.md).")
@click.option("--mlflow/--no-mlflow", default=True, show_default=True,
              help="Attach a search's page to its parent MLflow run (report.html).")
@click.option("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the SQLite store).")
def report_cmd(search: str | None, dataset: bool, data_dir: str | None, output: str | None, template: str | None,
               mlflow: bool, tracking_uri: str | None) -> None:
    """Build the dashboard of SEARCH (a search id such as quickstart-seed0, or its experiment
    file), or with --dataset the dataset's: one self-contained HTML page, no network needed."""
    from ..spec.errors import SpecError

    if dataset == bool(search):
        raise SpecError("give a SEARCH (search id or experiment file) or --dataset, not both or neither")
    if dataset:
        from ..data import data_home
        from ..report import dataset_report, write_index
        from ..spec._util import write_text_atomic

        path = Path(output) if output else data_home() / "reports" / "dataset.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, dataset_report(data_dir, template))
        write_index(path.parent)
        click.echo(str(path))
        return
    search_id = search_id_arg(search)
    path, run_id = publish_search_report(search_id, data_dir=data_dir, output=Path(output) if output else None,
                                         template=template, tracking_uri=tracking_uri, mlflow=mlflow)
    click.echo(str(path))
    if run_id:
        echo_err(f"attached as report.html to MLflow run {run_id} (open it under Artifacts in `synctune ui`)")
    elif mlflow:
        echo_err(f"no MLflow parent run found for search {search_id}; the page was not attached")
