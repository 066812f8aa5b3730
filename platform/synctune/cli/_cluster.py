"""``synctune cluster check|show|calibrate|up|down``: the Ray cluster a search runs on, and a local
autoscaling one to try it on."""

from __future__ import annotations

import click

from ._group import cli
from ._common import FiniteFloatRange, echo_err, node_network, resolve_cluster_arg, start_ray, table


@cli.group("cluster")
def cluster_group() -> None:
    """Ray clusters: check a cluster-launcher config offline, bring a local autoscaling cluster of
    its node types up and down, show the cluster spec of a running cluster, calibrate its links
    and devices."""


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

        cluster = resolve_cluster_arg(load_experiment(experiment).domain.cluster)
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


@cluster_group.command("calibrate")
@click.argument("cluster_name", metavar="CLUSTER")
@click.option("--ray-address", default="local", show_default=True, envvar="RAY_ADDRESS",
              help="'local' starts Ray on this machine (CPU clusters); 'auto' or an address joins a running cluster.")
@click.option("--save", type=click.Path(dir_okay=False),
              help="Write the calibrated spec as YAML (usable as --cluster FILE), its figures beside it as JSON.")
@click.option("--mb", "megabytes", type=FiniteFloatRange(0.001, 4096), default=16.0, show_default=True,
              help="MiB per point-to-point exchange and all-reduce.")
@click.option("--reps", type=click.IntRange(1, 1000), default=5, show_default=True, help="Timed exchanges per figure.")
def calibrate_cmd(cluster_name: str, ray_address: str, save: str | None, megabytes: float, reps: int) -> None:
    """Measure what CLUSTER's slice of a Ray cluster achieves (per-node link bandwidth and latency,
    intra-node bandwidth, device compute speed) with the process group trials use, and print
    the calibrated cluster spec: the simulators then read measured alpha-beta links and speeds
    instead of nominal ones."""
    import json
    from pathlib import Path

    import ray
    import yaml

    from ..cluster.calibrate import calibrate_ray
    from ..cluster.workers import RayWorkerGroup
    from ..spec.errors import SpecError
    from ..spec.files import check_writable, write_text_atomic

    cluster = resolve_cluster_arg(cluster_name)
    if cluster.device_kind != "cpu" and ray_address == "local":
        raise SpecError(f"cluster {cluster.name} has GPU nodes; calibrate it on a Ray cluster that has them "
                        f"(--ray-address auto)")
    if save:
        if Path(save).suffix.lower() not in (".yaml", ".yml"):
            raise SpecError(f"--save {save}: give a .yaml file (the figures go beside it, as .json)")
        check_writable(save)
        check_writable(Path(save).with_suffix(".json"))  # the second file it writes, refused before measuring
    node_net = node_network(cluster)
    start_ray(ray_address, cluster.num_devices + 1, logging_level="ERROR")
    try:
        with RayWorkerGroup(cluster, node_net=node_net) as group:
            spec, figures = calibrate_ray(group, nbytes=int(megabytes * 2**20), reps=reps,
                                          on_step=lambda step: echo_err(f"calibrating {cluster.name}: {step}"))
    finally:
        ray.shutdown()
    rows = []
    for fig in figures["nodes"]:
        rows.append([fig["node"], f"{fig['nominal_gbps']:g}", f"{fig['gbps']:.3f}" if "gbps" in fig else "-",
                     f"{fig['latency_ms']:.3f}" if "latency_ms" in fig else "-",
                     f"{fig['intra_gbps']:.3f}" if "intra_gbps" in fig else "-", f"{fig['gflops']:.1f}"])
    echo_err(table(["node", "spec Gbit/s", "measured Gbit/s", "latency ms", "intra-node Gbit/s", "GFLOP/s"], rows,
                   right=(1, 2, 3, 4, 5)))
    if "allreduce" in figures:
        echo_err(f"all-reduce of {megabytes:g} MiB over {cluster.num_devices} devices: "
                 f"{figures['allreduce']['seconds'] * 1e3:.1f} ms (bus bandwidth {figures['allreduce']['busbw_gbps']:.3f} "
                 f"Gbit/s)")
    if save:
        spec.save(save)
        write_text_atomic(Path(save).with_suffix(".json"), json.dumps(figures, indent=1) + "\n")
        echo_err(f"saved to {save} (figures in {Path(save).with_suffix('.json')})")
    click.echo(yaml.safe_dump(spec.to_dict(), sort_keys=False).rstrip())


def _local_state_dir():
    """Where the local cluster's record, autoscaling config and head log live."""
    from ..data.paths import data_home

    return data_home() / "local-cluster"


@cluster_group.command("up")
@click.argument("config", default="cluster.yaml", required=False)
@click.option("--local", "local", is_flag=True,
              help="Start the cluster on this machine (required: on AWS, `ray up CONFIG`).")
def up_cmd(config: str, local: bool) -> None:
    """Start a local autoscaling Ray cluster from CONFIG (default: cluster.yaml): a head on
    127.0.0.1 whose autoscaler launches CONFIG's node types as nodes on this machine when
    slices ask for them, and removes them after its idle timeout. GPU node types become nodes
    with as many CPUs, keeping their synctune-node:<type> resource. Prints the commands that
    submit a search to it (jobs run in this folder)."""
    from ..cluster.local import start_local_cluster
    from ..spec.errors import SpecError

    if not local:
        raise SpecError("synctune cluster up starts a cluster on this machine only: give --local (on AWS: "
                        "ray up cluster.yaml)")
    cluster = start_local_cluster(config, _local_state_dir(), log=echo_err)
    rows = [[name, node["resources"].get("CPU", 0), node["min_workers"], node["max_workers"]]
            for name, node in cluster.node_types.items()]
    echo_err(table(["node type", "CPUs", "min", "max"], rows, right=(1, 2, 3)))
    echo_err(f"idle nodes removed after {cluster.idle_timeout_minutes:g} min; stop it all: "
             f"synctune cluster down --local")
    auth = "RAY_AUTH_MODE=token " if cluster.token_auth else ""
    click.echo(f"{auth}ray job submit --address {cluster.dashboard_url} -- synctune search EXPERIMENT")
    click.echo(f"{auth}synctune search EXPERIMENT --ray-address {cluster.address}")


@cluster_group.command("down")
@click.option("--local", "local", is_flag=True,
              help="Stop the cluster `synctune cluster up --local` started (required: on AWS, `ray down CONFIG`).")
def down_cmd(local: bool) -> None:
    """Stop the local cluster `synctune cluster up --local` started: its head, the nodes its
    autoscaler launched and every process they started, by process id (other Ray instances on
    this machine are left alone)."""
    from ..cluster.local import stop_local_cluster
    from ..spec.errors import SpecError

    if not local:
        raise SpecError("synctune cluster down stops the cluster on this machine only: give --local (on AWS: "
                        "ray down cluster.yaml)")
    stopped = stop_local_cluster(_local_state_dir())
    echo_err(f"local cluster stopped ({stopped} processes)" if stopped else "no local cluster is running")
