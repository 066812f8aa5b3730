"""``synctune cluster check|show``: the Ray cluster a search runs on."""

from __future__ import annotations

import click

from . import cli
from ._common import echo_err, resolve_cluster_arg, start_ray, table


@cli.group("cluster")
def cluster_group() -> None:
    """Ray clusters: check a cluster-launcher config, describe a running cluster."""


@cluster_group.command("check")
@click.argument("config", default="cluster.yaml", required=False)
@click.option("--experiment", "experiment", help="Experiment file whose cluster the config must be able to form.")
@click.option("--cluster", "cluster_name", help="A cluster preset or spec file to check instead of an experiment's.")
def check_cmd(config: str, experiment: str | None, cluster_name: str | None) -> None:
    """Validate CONFIG (default: cluster.yaml) offline with Ray's own schema, and check that its
    node types can form the experiment's cluster (e.g. B12 needs one g4dn.2xlarge and one
    g4dn.12xlarge)."""
    from ..cluster.config import check_cluster_config
    from ..spec.errors import SpecError

    if experiment and cluster_name:
        raise SpecError("give --experiment or --cluster, not both")
    cluster = None
    if experiment:
        from ..search.experiment import load_experiment

        cluster = resolve_cluster_arg(load_experiment(experiment).cluster)
    elif cluster_name:
        cluster = resolve_cluster_arg(cluster_name)
    report = check_cluster_config(config, cluster)
    click.echo(f"{report.path}: valid Ray cluster config (cluster_name {report.cluster_name!r}, head "
               f"{report.head_type!r}, max_workers {report.max_workers})")
    click.echo(table(["node type", "instance type", "devices", "min", "max"],
                     [[i.name, i.instance_type, i.devices if i.devices is not None else "?", i.min_workers,
                       i.max_workers] for i in report.node_types], right=(2, 3, 4)))
    if cluster is not None:
        needs = ", ".join(f"{n}x {t}" for t, n in report.needs.items())
        click.echo(f"cluster {cluster.name} ({needs}): can be formed")
    for warning in report.warnings:
        echo_err(f"warning: {warning}")


@cluster_group.command("show")
@click.option("--ray-address", default="auto", show_default=True, envvar="RAY_ADDRESS",
              help="The Ray cluster to describe.")
@click.option("--name", default="ray-cluster", show_default=True, help="Name of the derived cluster spec.")
@click.option("--save", type=click.Path(dir_okay=False), help="Write the spec as YAML (usable as --cluster FILE).")
def show_cmd(ray_address: str, name: str, save: str | None) -> None:
    """Derive a cluster spec from a running Ray cluster's nodes (those advertising
    synctune-node:<type>)."""
    import yaml

    from ..spec.errors import SpecError

    if ray_address == "local":
        raise SpecError("--ray-address local would start a new, empty Ray instance; give 'auto' or an address")
    import ray

    from ..cluster.discover import cluster_spec_from_ray

    if save:
        from ..spec.files import check_writable

        check_writable(save)
    start_ray(ray_address, logging_level="ERROR")
    try:
        spec = cluster_spec_from_ray(name)
    finally:
        ray.shutdown()
    if save:
        spec.save(save)
        echo_err(f"saved to {save}")
    click.echo(yaml.safe_dump(spec.to_dict(), sort_keys=False).rstrip())
