"""``synctune trial``: run one strategy for real and print what it measured."""

from __future__ import annotations

import json

import click

from ..engine.runtimes import RUNTIMES
from ..spec.errors import SpecError
from ._group import cli
from ._common import (FiniteFloatRange, echo_err, model_option, node_network, resolve_cluster_arg, resolve_workload_arg,
                      start_ray)
from ._strategy import _parse_options


def _progress_bar(total_hint: int, label: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal) fed by trial progress events."""
    from tqdm import tqdm

    bar = tqdm(total=total_hint, desc=label, unit="it", disable=None, leave=False, dynamic_ncols=True)
    state = {"started": 0}

    def on_progress(msg: dict) -> None:
        if msg.get("event") == "started":
            state["started"] += 1
            bar.set_postfix_str(f"{state['started']} worker(s) up")
        elif msg.get("event") == "iteration":
            bar.total = msg["total"]
            bar.n = msg["iteration"]
            bar.set_postfix_str(f"loss {msg['loss']:.4g}")
            bar.refresh()

    return bar, on_progress


@cli.command("trial")
@model_option(required=True, runnable=True)
@click.option("--cluster", "-c", required=True, help="Cluster preset name or cluster spec YAML file.")
@click.option("--builder", "-b", help="Build the strategy with this builder ...")
@click.option("--strategy", "-s", "strategy_file", help="... or read it from this JSON file.")
@click.option("--option", "-O", "options", multiple=True, metavar="KEY=VALUE", help="Builder option.")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, 1_000_000),
              help="Warm-up iterations (not timed).")
@click.option("--iters", default=40, show_default=True, type=click.IntRange(1, 1_000_000), help="Timed iterations.")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option("--lr", default=0.01, show_default=True, type=FiniteFloatRange(0, 1e6, min_open=True))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, type=FiniteFloatRange(0, 7 * 24 * 3600.0,
              min_open=True), help="Seconds before the trial is a timeout.")
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Local worker processes, or a Ray worker group (placement group, one actor per device).")
@click.option("--ray-address", default="local", show_default=True,
              help="With --launcher ray: 'local' starts Ray on this machine, 'auto' joins a running cluster.")
@click.option("--runtime", type=click.Choice(list(RUNTIMES)), default="engine",
              show_default=True,
              help="What runs the trial: synctune's engine executing the strategy, plain torch DDP, real Horovod "
                   "(scripts/install-horovod.sh), or TensorFlow's MultiWorkerMirroredStrategy for a Keras model "
                   "(keras-* models; all-reduce strategies it executes exactly, others refused), or torch FSDP2 "
                   "(fully_shard; a strategy whose plans are all shard, or its own --fsdp settings), or tp (a "
                   "strategy's tensor parallelism), or Megatron-style TP with FSDP2 across (its own --megatron "
                   "settings). For ddp, horovod, megatron and fsdp with settings the strategy gives replicas and "
                   "batch split only (without one, every device, even split).")
@click.option("--ddp", "ddp_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime ddp: bucket_cap_mb, first_bucket_mb, comm_hook (none, fp16, bf16, powersgd), "
                   "powersgd_rank, gradient_as_bucket_view.")
@click.option("--horovod", "horovod_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime horovod: fusion_threshold_mb, cycle_time_ms, compression (none, fp16), "
                   "hierarchical_allreduce, autotune, sparse_as_dense.")
@click.option("--fsdp", "fsdp_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime fsdp: group (shard-group size, 0 = every replica; k = HSDP mesh "
                   "(replicas/k, k)), reshard_after_forward (true, false or a group size), reduce_dtype (fp32, bf16), "
                   "prefetch (0-1 FSDP2's default, N>=2 explicit), units (blocks, root or module paths, "
                   "comma-separated), checkpoint (none, selective, full: activation checkpointing of every "
                   "block). A --strategy with shard plans configures FSDP2 itself.")
@click.option("--megatron", "megatron_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime megatron: degree (the TP group's devices inside a node), sequence_parallel "
                   "(true, false), reshard (true, false: FSDP2 after forward across the TP groups), checkpoint "
                   "(none, selective, full: every block).")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Log the trial to MLflow and append it to the dataset.")
@click.option("--experiment", default="synctune-trials", show_default=True, help="MLflow experiment of the run.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def trial_cmd(model, cluster: str, builder: str | None,
              strategy_file: str | None, options: tuple[str, ...],
              warmup: int, iters: int, optimizer: str, lr: float, seed: int, timeout_s: float, launcher: str,
              ray_address: str, runtime: str, ddp_options: tuple[str, ...],
              horovod_options: tuple[str, ...], fsdp_options: tuple[str, ...], megatron_options: tuple[str, ...],
              record: bool, experiment: str,
              as_json: bool) -> None:
    """Run one trial: WARMUP + ITERS iterations of a model (a zoo model or your workload) on CLUSTER
    under a strategy, timed.

    Exit status 0 when the trial ran (status ok), 1 when it failed, timed out or ran out of
    memory (the result says why), 2 on bad input.
    """
    from ..engine.runtimes import runtime_class, runtime_from_options
    from ..engine.trial import TrialConfig, check_trial, run_trial_local
    from ..strategy import build_strategy, load_strategy, parse_builder_options

    runs = runtime_class(runtime)
    if builder is not None and strategy_file is not None or (builder is None and strategy_file is None
                                                             and runs.runs_strategy):
        raise SpecError("give exactly one of --builder and --strategy")
    settings = {"ddp": ddp_options, "horovod": horovod_options, "fsdp": fsdp_options,
                "megatron": megatron_options}  # one flag per runtime
    for flag, given in settings.items():
        if given and runtime != flag:
            raise SpecError(f"--{flag} applies to --runtime {flag} only")
    runtime_options = _parse_options(settings.get(runtime, ()))
    if runtime_options:
        # Keys and values are checked again below with the strategy; here they are refused before
        # the model is built (seconds, torch imported), which a typo should not wait for.
        runs.from_options(runtime_options, None, None)
    config = TrialConfig(warmup=warmup, iters=iters, optimizer=optimizer, lr=lr, seed=seed, timeout_s=timeout_s)
    workload = resolve_workload_arg(model, timeout_s=timeout_s)
    model_spec = workload.spec()
    cluster_spec = resolve_cluster_arg(cluster)
    if builder is not None:
        strategy = build_strategy(builder, model_spec, cluster_spec, parse_builder_options(builder, _parse_options(options)))
    elif strategy_file is not None:
        if options:
            raise SpecError("--option applies to --builder only")
        strategy = load_strategy(strategy_file)
    else:
        strategy = build_strategy("allreduce", model_spec, cluster_spec)
    run_config = runtime_from_options(runtime, runtime_options, strategy, model_spec)
    check_trial(workload, strategy, cluster_spec, run_config)
    node_net = node_network(cluster_spec)
    if record:
        _check_records_writable()
    label = f"{strategy.model['name']}@{cluster_spec.name}"
    bar, on_progress = _progress_bar(warmup + iters, label)
    try:
        if launcher == "local":
            result = run_trial_local(strategy, cluster_spec, config, workload=workload, on_progress=on_progress,
                                     node_net=node_net, runtime=run_config)
        else:
            from ..cluster.workers import RayWorkerGroup

            start_ray(ray_address, max(cluster_spec.num_devices, 1))
            with RayWorkerGroup(cluster_spec, node_net=node_net) as group:
                result = group.run_trial(strategy, config, workload=workload, on_progress=on_progress,
                                         runtime=run_config)
    finally:
        bar.close()
    if record:
        # A runtime that takes a strategy is given one (a builder or a file); one that takes only
        # replicas and batch split may run without, on the all-reduce skeleton, named by itself.
        origin = builder or (f"file:{strategy_file}" if strategy_file else runtime)
        _record(result, strategy, model_spec, cluster_spec, origin, experiment, workload.source, run_config)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        _print_result(result, strategy, run_config)
    if result.status != "ok":
        echo_err(f"synctune: trial {result.status}: {result.error}")
        raise SystemExit(1)


def _print_result(result, strategy, runtime) -> None:
    click.echo(runtime.describe(strategy))
    click.echo(f"status {result.status} ({result.launcher}, {result.num_workers} workers, {result.backend or '-'}, "
               f"{result.wall_s:.1f} s wall)")
    if result.cluster_scale != 1.0:
        click.echo(f"cluster    {result.cluster}, link speeds scaled by {result.cluster_scale:g}")
    if result.status == "ok":
        click.echo(f"iteration  mean {result.mean_s * 1e3:.1f} ms  median {result.median_s * 1e3:.1f} ms  "
                   f"std {result.std_s * 1e3:.1f} ms  over {len(result.iteration_times_s)} iterations")
        click.echo(f"throughput {result.samples_per_s:.1f} samples/s (global batch {result.global_batch_size})")
        if result.comm_bytes_per_iter is not None:
            click.echo(f"traffic    {result.comm_bytes_per_iter / 2**20:.1f} MiB handed to collectives per iteration "
                       f"(all ranks)")
        click.echo(f"memory     {result.peak_memory_bytes / 2**20:.0f} MiB peak (largest rank)")


def _check_records_writable() -> None:
    """Before the trial runs: a data folder that cannot take the row would lose the result."""
    from ..data import dataset_dir
    from ..spec.files import check_writable

    folder = dataset_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{folder}: cannot create the dataset folder ({exc.strerror or exc}); set SYNCTUNE_HOME to "
                        f"a writable folder or pass --no-record") from None
    check_writable(folder / "write-check")


def _record(result, strategy, model_spec, cluster_spec, origin: str, experiment: str, workload_source: str,
            runtime) -> None:
    """MLflow first (for the run id), then the dataset row, which lands even if MLflow is down."""
    from ..data import MlflowLogger, TrialDataset, dataset_dir
    from ..run import record_result

    rec = record_result(result, strategy, model_spec, cluster_spec, dataset=TrialDataset(dataset_dir()),
                        logger=MlflowLogger(experiment), origin=origin, experiment=experiment,
                        workload_source=workload_source, runtime=runtime)
    run_id = rec.mlflow_run_id
    echo_err(f"recorded trial {rec.trial_id}: dataset {dataset_dir()}" + (f", MLflow run {run_id}" if run_id else ""))
