"""``synctune strategy build|validate|show|builders``."""

from __future__ import annotations

import click

from ..spec.errors import SpecError
from ._group import cli
from ._common import echo_err, model_option, resolve_cluster_arg, table, write_text_atomic


@cli.group("strategy")
def strategy_group() -> None:
    """Build, validate and show strategies (plain JSON files); builders lists the hand-optimised ones."""


def _parse_options(pairs: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"--option {pair!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


@strategy_group.command("builders")
def builders_cmd() -> None:
    """List the hand-optimised builders and their options."""
    import dataclasses

    from ..strategy.builders import BUILDERS

    rows = []
    for name, info in BUILDERS.items():
        opts = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(info.options))
        rows.append([name, opts, info.description])
    click.echo(table(["builder", "options (defaults)", "reproduces"], rows))


@strategy_group.command("build")
@click.argument("builder")
@model_option(required=True)
@click.option("--cluster", "-c", required=True, help="Cluster preset name or cluster spec YAML file.")
@click.option("--option", "-O", "options", multiple=True, metavar="KEY=VALUE",
              help="Builder option, e.g. -O chunk=64 (see `synctune strategy builders`).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write the JSON here instead of stdout.")
def build_cmd(builder: str, model, cluster: str, options: tuple[str, ...], output: str | None) -> None:
    """Build a strategy with BUILDER (allreduce, horovod, ps, ps-lb, parallax, ...) for a model
    (a zoo model, a model spec file or your workload, e.g. -w my_job.py:workload)."""
    from ..strategy import build_strategy, parse_builder_options, validate
    from ..strategy.builders import BUILDERS

    BUILDERS.get(builder)  # unknown builder: fail before the (slower) model spec
    opts = parse_builder_options(builder, _parse_options(options))
    cluster_spec = resolve_cluster_arg(cluster)
    model_spec = model.spec()
    strategy = build_strategy(builder, model_spec, cluster_spec, opts)
    validate(strategy, model_spec, cluster_spec)
    text = strategy.to_json() + "\n"
    if output:
        write_text_atomic(output, text)
        echo_err(f"wrote {output}: {strategy.summary()}")
    else:
        click.echo(text, nl=False)


@strategy_group.command("validate")
@click.argument("file")
@model_option(required=True)
@click.option("--cluster", "-c", required=True, help="Cluster preset name or cluster spec YAML file.")
def validate_cmd(file: str, model, cluster: str) -> None:
    """Check strategy FILE against a model and a cluster; exit 2 naming the first problem."""
    from ..strategy import load_strategy, validate

    strategy = load_strategy(file)
    cluster_spec = resolve_cluster_arg(cluster)
    model_spec = model.spec()
    try:
        validate(strategy, model_spec, cluster_spec)
    except SpecError as exc:
        raise SpecError(f"{file}: {exc}") from None
    click.echo(f"valid: {strategy.summary()}")
    click.echo(f"strategy hash {strategy.hash}")


@strategy_group.command("show")
@click.argument("file")
@model_option(help="Also show shard shapes from this model: a zoo model, a model spec file or your workload "
                   "(package.module:factory, path/to/file.py:factory).")
def show_cmd(file: str, model) -> None:
    """Summarise strategy FILE and list each variable's plan in backward order."""
    from ..strategy import load_strategy
    from ..strategy.partition import shard_shapes

    strategy = load_strategy(file)
    spec = model.spec() if model is not None else None
    click.echo(strategy.summary())
    click.echo(f"strategy hash {strategy.hash}  model {strategy.model['name']} ({strategy.model['hash'][:12]})  "
               f"cluster {strategy.cluster['name']} ({strategy.cluster['hash'][:12]})")
    rows = []
    for plan in strategy.plans:
        shapes = None
        if spec is not None and plan.variable in spec:
            shapes = shard_shapes(spec[plan.variable].shape, plan.partition)
        for i, shard in enumerate(plan.shards):
            how = shard.synchronizer.label
            name = plan.variable if i == 0 else ""
            part = "x".join(map(str, plan.partition)) if plan.is_partitioned and i == 0 else ""
            shape = "x".join(map(str, shapes[i])) if shapes else ""
            rows.append([name, part, f"{i}" if plan.is_partitioned else "", shape, how, shard.compressor.label])
    click.echo(table(["variable", "partition", "shard", "shape", "synchronizer", "compressor"], rows))
