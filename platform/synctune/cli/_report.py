"""``synctune report``: the search and dataset dashboards as self-contained HTML pages."""

from __future__ import annotations

from pathlib import Path

import click

from ._group import cli
from ._common import echo_err


def search_id_arg(value: str) -> str:
    """A search id, or an experiment file (whose name and seed give the id)."""
    from ..spec.files import check_path

    if value.endswith((".yaml", ".yml")) or Path(check_path(value, "SEARCH")).is_file():
        from ..run import search_id_of
        from ..search.experiment import load_experiment

        return search_id_of(load_experiment(value))
    from ..spec.files import check_name

    return check_name(value, "SEARCH")


@cli.command("report")
@click.argument("search", required=False)
@click.option("--dataset", "dataset", is_flag=True, help="The dataset dashboard instead of a search's.")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), help="Dataset folder (default: the data home's).")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Where to write the page (the only file written there; the list of reports is in the data "
                   "home's reports/index.html).")
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
    from ..spec.files import check_writable

    if dataset == bool(search):
        raise SpecError("give a SEARCH (search id or experiment file) or --dataset, not both or neither")
    if output:
        check_writable(output)
    if dataset:
        from ..report import dataset_report, list_report, report_path
        from ..spec.files import write_text_atomic

        path = Path(output) if output else report_path("dataset")
        write_text_atomic(path, dataset_report(data_dir, template))
        list_report(path)
        click.echo(str(path))
        return
    from ..report import publish_search_report

    search_id = search_id_arg(search)
    path, run_id = publish_search_report(search_id, data_dir=data_dir, output=Path(output) if output else None,
                                         template=template, tracking_uri=tracking_uri, mlflow=mlflow)
    click.echo(str(path))
    if run_id:
        echo_err(f"attached as report.html to MLflow run {run_id} (open it under Artifacts in `synctune ui`)")
    elif mlflow:
        echo_err(f"no MLflow parent run found for search {search_id}; the page was not attached")
