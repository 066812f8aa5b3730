"""``synctune models`` and ``synctune clusters``."""

from __future__ import annotations

import json

import click

from ._group import cli
from ._common import MODEL, model_option, resolve_cluster_arg, table


def _human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


class _NameArgument(click.Argument):
    def get_error_hint(self, ctx: click.Context) -> str:  # noqa: ARG002 - click's signature
        return "'NAME'"


@cli.command("models")
@click.argument("name", cls=_NameArgument, required=False, type=MODEL, metavar="[NAME]")
@model_option(help="The model to show, as NAME: a zoo model, a model spec file or your workload "
                   "(package.module:factory, path/to/file.py:factory).")
@click.option("--json", "as_json", is_flag=True, help="Print the model spec as JSON (with a model).")
def models_cmd(name, model, as_json: bool) -> None:
    """List the model zoo, or show the variables of a model in backward order.

    The model (NAME, or --model / --workload) is a zoo model, a model spec file, or your own
    workload by import path: `synctune models -w my_job.py:workload --json > spec.json` writes
    your model's spec, and `synctune models bert-large --json > spec.json` a zoo model's; --model
    accepts such files wherever a spec is enough (strategy build, validate, show; sim score).
    """
    from ..models.zoo import MODELS

    if name is not None and model is not None:
        raise click.UsageError(f"give the model once: NAME {name.text!r} or --model {model.text!r}")
    source = name or model
    if source is None:
        if as_json:
            raise click.UsageError("--json needs a model: NAME or --model")
        rows = []
        for entry_name, entry in MODELS.items():
            rows.append([entry_name, entry.family, _human(entry.expected_params), entry.batch_size,
                         "small" if entry.small else "paper", entry.description])
        click.echo(table(["model", "family", "params", "batch", "kind", "description"], rows, right=[2, 3]))
        return
    spec = source.spec()
    if as_json:
        click.echo(json.dumps(spec.to_dict(), indent=1))
        return
    click.echo(f"{spec.name}: {spec.num_parameters:,} parameters, {len(spec.variables)} variables "
               f"({spec.num_sparse} sparse), {spec.num_bytes / 2**20:.1f} MiB, batch {spec.batch_size}, "
               f"hash {spec.hash[:12]}")
    rows = [[i, v.name, "x".join(map(str, v.shape)) or "scalar", v.dtype, "sparse" if v.sparse else "",
             f"{v.num_bytes:,}"] for i, v in enumerate(spec.variables)]
    click.echo(table(["#", "variable (backward order)", "shape", "dtype", "grad", "bytes"], rows, right=[0, 5]))


@cli.command("clusters")
@click.argument("name", required=False)
@click.option("--yaml", "as_yaml", is_flag=True, help="Print the cluster spec as YAML (with NAME).")
def clusters_cmd(name: str | None, as_yaml: bool) -> None:
    """List cluster presets (AutoDist Table 1 and local ones), or show preset/file NAME.

    `synctune clusters B12 --yaml > my-cluster.yaml` gives a file to edit; --cluster accepts
    such files everywhere.
    """
    from ..spec.cluster import CLUSTER_PRESETS, INSTANCE_TYPES

    if name is None:
        if as_yaml:
            raise click.UsageError("--yaml needs a cluster NAME")
        rows = []
        for preset_name, spec in CLUSTER_PRESETS.items():
            types = sorted({n.instance_type for n in spec.nodes})
            bws = "/".join(f"{b:g}" for b in sorted({n.nic_gbps for n in spec.nodes}))
            rows.append([preset_name, len(spec.nodes), spec.num_devices, spec.gpu_distribution() if len(spec.nodes) <= 4
                         else f"[{spec.nodes[0].num_devices}] x {len(spec.nodes)}", f"{bws} Gb/s", ", ".join(types)])
        click.echo(table(["preset", "nodes", "devices", "devices per node", "NIC", "instance types"], rows,
                         right=[1, 2]))
        click.echo("\ninstance types: " + ", ".join(INSTANCE_TYPES))
        return
    spec = resolve_cluster_arg(name)
    if as_yaml:
        import yaml

        click.echo(yaml.safe_dump(spec.to_dict(), sort_keys=False), nl=False)
        return
    click.echo(f"{spec.name}: {len(spec.nodes)} nodes, {spec.num_devices} devices ({spec.device_kind}), "
               f"hash {spec.hash[:12]}" + (f" - {spec.description}" if spec.description else ""))
    rows = [[n.name, n.instance_type, f"{n.num_devices}x {n.device_model}", f"{n.nic_gbps:g}", f"{n.single_flow_gbps:g}",
             f"{n.intra_node_gbps:g}"] for n in spec.nodes]
    click.echo(table(["node", "instance type", "devices", "NIC Gb/s", "1-flow Gb/s", "intra Gb/s"], rows,
                     right=[3, 4, 5]))
