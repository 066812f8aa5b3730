"""``synctune apply``: a strategy as a training file to run (plain DDP when it can)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ._group import cli
from ._common import echo_err, model_option, resolve_cluster_arg, resolve_workload_arg


@cli.command("apply")
@click.argument("strategy_file", metavar="STRATEGY.json")
@model_option(required=True, runnable=True, help="What the strategy was searched for: a zoo model or your workload "
                                                "(package.module:factory, path/to/file.py:factory).")
@click.option("--cluster", "-c", help="Cluster preset or spec file (default: the preset the strategy names).")
@click.option("--format", "fmt", type=click.Choice(["auto", "ddp", "fsdp", "engine"]), default="auto",
              show_default=True,
              help="ddp: plain torch DDP (when the strategy allows it); fsdp: torch FSDP2's fully_shard (a strategy "
                   "whose plans are all shard, units at module boundaries); engine: the synctune engine; auto: FSDP2 "
                   "or DDP when one can.")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="The training file (default: next to "
              "STRATEGY.json, ending in -train.py).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
def apply_cmd(strategy_file: str, model, cluster: str | None, fmt: str, output: str | None, seed: int) -> None:
    """Turn a strategy (the best one of a search) into a runnable training file: torch FSDP2
    (fully_shard per unit) for a strategy of shard plans FSDP2 expresses, plain torch DDP with
    the bucket size and comm hook that reproduce it when DDP can express it, else the synctune
    engine. Run the file with torchrun, one process per replica."""
    from ..run.apply import FORMAT_NAMES, run_command, write_training_file
    from ..spec.files import check_writable
    from ..strategy import load_strategy

    strategy = load_strategy(strategy_file)
    target = Path(output) if output else Path(strategy_file).with_name(Path(strategy_file).stem + "-train.py")
    check_writable(target)
    workload = resolve_workload_arg(model)
    cluster_spec = resolve_cluster_arg(cluster or strategy.cluster["name"])
    used = write_training_file(strategy, workload, cluster_spec, target, fmt, seed)
    click.echo(f"wrote {target} ({FORMAT_NAMES[used]})")
    echo_err(f"run it: {run_command(strategy, target if target.is_absolute() else Path(os.curdir) / target)}")
