"""``synctune dataset ...``, ``synctune mlflow sync`` and ``synctune ui``."""

from __future__ import annotations

import sys

import click

from ..spec.errors import SpecError
from ._group import cli
from ._common import echo_err, model_option, table


def _dataset(path: str | None):
    from ..data import TrialDataset, dataset_dir

    return TrialDataset(path or dataset_dir())


_data_option = click.option("--data", "data_path", metavar="DIR",
                            help="Dataset folder (default: the dataset in the synctune data folder).")


@cli.group("dataset")
def dataset_group() -> None:
    """The (model, cluster, strategy, runtime) dataset: its path, stats, compact, export, collect
    trials locally, push a release and pull one."""


@dataset_group.command("path")
@_data_option
def path_cmd(data_path: str | None) -> None:
    """Print where the dataset and the MLflow store are."""
    from ..data import default_tracking_uri

    click.echo(f"dataset  {_dataset(data_path).root}")
    click.echo(f"mlflow   {default_tracking_uri()}")


@dataset_group.command("stats")
@_data_option
def stats_cmd(data_path: str | None) -> None:
    """Rows per model x cluster, statuses, and the best mean iteration time per domain."""
    ds = _dataset(data_path)
    stats = ds.stats()
    if stats.empty:
        click.echo(f"{ds.root}: no records")
        return
    rows = [[r.model, r.cluster, r.rows, r.ok, r.failed, r.timeout, r.oom,
             f"{r.best_mean_s * 1e3:.1f}" if r.best_mean_s == r.best_mean_s and r.best_mean_s is not None else "-",
             r.best_origin] for r in stats.itertuples()]
    click.echo(table(["model", "cluster", "rows", "ok", "failed", "timeout", "oom", "best ms", "best origin"], rows,
                     right=[2, 3, 4, 5, 6, 7]))
    click.echo(f"{int(stats['rows'].sum())} rows in {len(stats)} domain(s) at {ds.root}")


@dataset_group.command("export")
@_data_option
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), required=True)
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="File to write.")
@click.option("--model", help="Only this model.")
@click.option("--cluster", help="Only this cluster.")
@click.option("--status", type=click.Choice(["ok", "failed", "timeout", "oom"]), help="Only this status.")
def export_cmd(data_path, fmt, output, model, cluster, status) -> None:
    """Write the (filtered) dataset to one CSV or Parquet file."""
    import json

    import pyarrow.parquet as pq

    from ..spec.files import check_writable, write_text_atomic, write_via

    check_writable(output)
    ds = _dataset(data_path)
    tbl = ds.table(model=model, cluster=cluster, status=status)
    if fmt == "parquet":
        write_via(output, lambda fh: pq.write_table(tbl, fh))
    else:
        df = tbl.to_pandas()
        for col in ("compressors", "iteration_times_s"):
            df[col] = [json.dumps(list(v) if v is not None else []) for v in df[col]]
        write_text_atomic(output, df.to_csv(index=False))
    echo_err(f"wrote {tbl.num_rows} rows to {output}")


@dataset_group.command("push")
@_data_option
@click.argument("dest")
@click.option("--name", help="Release name recorded in the manifest (default: release-<date>).")
@click.option("--profiles", "profile_dirs", multiple=True, metavar="DIR",
              help="Also publish every compute profile in DIR, whatever its model (a GPU's profiles "
                   "measured apart from the trials); repeatable.")
def push_cmd(data_path: str | None, dest: str, name: str | None, profile_dirs: tuple[str, ...]) -> None:
    """Publish the dataset as a release (Parquet files + manifest.json) to DEST: a folder or s3://.

    The release carries the data folder's compute profiles of its models, and those of --profiles."""
    from ..data import push_release
    from ..run import profiles_for_release, profiles_in_folders

    ds = _dataset(data_path)
    models = set(ds.table().column("model_name").to_pylist())
    profiles = profiles_in_folders(profile_dirs, profiles_for_release(models))  # checked before anything is written
    manifest = push_release(ds, dest, name=name, profiles=profiles)
    click.echo(f"pushed {manifest['total_rows']} rows in {len(manifest['files'])} file(s) and "
               f"{len(manifest.get('profiles', []))} compute profile(s) to {dest} (release {manifest['name']})")


@dataset_group.command("pull")
@_data_option
@click.argument("source")
def pull_cmd(data_path: str | None, source: str) -> None:
    """Verify the release at SOURCE (folder, http(s)://, s3://) and merge it into the dataset."""
    from ..data import pull_release
    from ..run import file_release_profiles

    counts = pull_release(source, _dataset(data_path))
    filed = file_release_profiles(counts["profiles"], source)
    click.echo(f"pulled {counts['rows']} rows in {counts['files']} file(s) from {source}: "
               f"{counts['new_rows']} new, {counts['rows'] - counts['new_rows']} already present"
               + (f"; filed {len(filed)} compute profile(s)" if counts["profiles"] else ""))


@cli.group("mlflow")
def mlflow_group() -> None:
    """MLflow housekeeping: sync logs every dataset row that has no MLflow run yet."""


@mlflow_group.command("sync")
@_data_option
@click.option("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the SQLite store).")
def sync_cmd(data_path: str | None, tracking_uri: str | None) -> None:
    """Log to MLflow every dataset record that has no run there yet (e.g. after an outage)."""
    from ..data import sync_records
    from ..spec.errors import InfraError

    try:
        counts = sync_records(_dataset(data_path).records(), tracking_uri)
    except ConnectionError as exc:
        raise InfraError(str(exc)) from None
    click.echo(f"logged {counts['logged']} run(s); {counts['present']} were already in MLflow")


def _open_when_serving(url: str, port: int, server, timeout_s: float = 120.0) -> None:
    """Open ``url`` in the user's browser once the UI answers on ``port`` (in a thread of its own)."""
    import socket
    import threading
    import time
    import webbrowser

    def wait_then_open() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    webbrowser.open(url)
                    return
            except OSError:
                time.sleep(0.5)

    threading.Thread(target=wait_then_open, daemon=True).start()


@cli.command("ui")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--tracking-uri", help="Backend store (default: $MLFLOW_TRACKING_URI or the SQLite store).")
@click.option("--open", "open_browser", is_flag=True, help="Open the latest search's runs in the browser.")
def ui_cmd(port: int, tracking_uri: str | None, open_browser: bool) -> None:
    """Start the MLflow UI for synctune's store on 127.0.0.1 (Ctrl-C stops it); print (and with
    --open, open) the latest search's runs: its confirmed pick beside the baselines it was
    screened against."""
    from ..data import artifact_root, data_home, default_tracking_uri
    from ..run.links import latest_links
    from ..spec.files import path_under

    uri = tracking_uri or default_tracking_uri()
    if uri.startswith(("http://", "https://")):
        raise SpecError(f"{uri} is a tracking server already: open it in a browser")
    artifact_root().mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1",
            "--port", str(port), "--artifacts-destination", str(artifact_root())]
    echo_err(f"MLflow UI for {uri} at http://127.0.0.1:{port}")
    links = latest_links(path_under(data_home(), "searches"), uri)
    url = f"http://127.0.0.1:{port}"
    if links is not None:
        url = links.compare_url(port) if links.compare else links.search_url(port)
        echo_err(f"latest search {links.search_id}: {url}")
    sys.stdout.flush()
    import subprocess

    from ..spec.errors import InfraError
    from ..workload.isolate import stop_process_group

    # The server gets a session of its own and this command stays its parent: MLflow starts
    # job-consumer processes that a signal to this process alone would leave running, orphaned.
    # Ctrl-C, SIGTERM and SIGHUP (a service manager, a terminal closing) take the whole tree down.
    server = subprocess.Popen(args, start_new_session=True)
    if open_browser:
        _open_when_serving(url, port, server)
    try:
        code = server.wait()
    finally:
        stop_process_group(server)
    if code != 0:
        raise InfraError(f"the MLflow UI exited with status {code}")


@dataset_group.command("compact")
@_data_option
def compact_cmd(data_path: str | None) -> None:
    """Rewrite each partition as one file without duplicates (safe while others read or append)."""
    counts = _dataset(data_path).compact()
    click.echo(f"{counts['rows']} rows: {counts['files_before']} file(s) -> {counts['files_after']}")


@dataset_group.command("collect")
@_data_option
@model_option(required=True, multiple=True, runnable=True)
@click.option("--cluster", "-c", "clusters", multiple=True, required=True,
              help="Local (CPU) cluster preset or spec file (repeatable).")
@click.option("--random", "num_random", default=50, show_default=True, type=click.IntRange(0, 100_000), help="Random strategies per domain.")
@click.option("--guided", "num_guided", default=0, show_default=True, type=click.IntRange(0, 100_000),
              help="Guided-sampler strategies per domain (compressors, hierarchical all-reduce, batch splits).")
@click.option("--builders/--no-builders", default=True, show_default=True, help="Also run every builder.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--mlflow/--no-mlflow", "use_mlflow", default=False, show_default=True,
              help="Also log every trial to MLflow (experiment collect-<model>@<cluster>).")
def collect_cmd(data_path, model, clusters, num_random, num_guided, builders, seed, warmup, iters,
                use_mlflow) -> None:
    """Measure builders and sampled strategies for real on local clusters and add them to the dataset.

    Trials of one domain share one process group (start-up paid once); each row lands as soon
    as its trial ends, and the same command again (same --seed) runs only the trials not yet
    recorded, so an interrupted collection continues where it stopped.
    """
    from ..run import collect_domain
    from ._common import node_network, resolve_cluster_arg, resolve_workload_arg

    ds = _dataset(data_path)
    workloads = [resolve_workload_arg(m) for m in model]
    cluster_specs = [resolve_cluster_arg(c) for c in clusters]
    for workload in workloads:
        for cluster in cluster_specs:
            results = collect_domain(ds, workload, cluster, num_random=num_random, num_guided=num_guided,
                                     builders=builders, seed=seed, warmup=warmup, iters=iters, use_mlflow=use_mlflow,
                                     node_net=node_network(cluster), say=echo_err)
            ok = sum(r.status == "ok" for r in results)
            click.echo(f"{workload.name}@{cluster.name}: {ok}/{len(results)} trials ok, recorded in {ds.root}")
