"""``synctune trial``: run one strategy for real and print what it measured."""

from __future__ import annotations

import json

import click

from ..spec.errors import SpecError
from . import cli
from ._common import echo_err, node_network, resolve_cluster_arg, resolve_workload_arg, start_ray
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
@click.option("--model", "-m", help="Zoo model name ...")
@click.option("--workload", "-w", "workload_path", metavar="IMPORT_PATH",
              help="... or your own workload: package.module:factory or path/to/file.py:factory.")
@click.option("--cluster", "-c", required=True, help="Cluster preset name or cluster spec YAML file.")
@click.option("--builder", "-b", help="Build the strategy with this builder ...")
@click.option("--strategy", "-s", "strategy_file", help="... or read it from this JSON file.")
@click.option("--option", "-O", "options", multiple=True, metavar="KEY=VALUE", help="Builder option.")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(0, 1_000_000),
              help="Warm-up iterations (not timed).")
@click.option("--iters", default=40, show_default=True, type=click.IntRange(1, 1_000_000), help="Timed iterations.")
@click.option("--optimizer", type=click.Choice(["sgd", "adam"]), default="sgd", show_default=True)
@click.option("--lr", default=0.01, show_default=True, type=click.FloatRange(0, 1e6, min_open=True))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, type=click.FloatRange(0, 7 * 24 * 3600.0,
              min_open=True), help="Seconds before the trial is a timeout.")
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Local worker processes, or a Ray worker group (placement group, one actor per device).")
@click.option("--ray-address", default="local", show_default=True,
              help="With --launcher ray: 'local' starts Ray on this machine, 'auto' joins a running cluster.")
@click.option("--runtime", type=click.Choice(["engine", "ddp", "horovod", "tensorflow"]), default="engine",
              show_default=True,
              help="What runs the trial: synctune's engine executing the strategy, plain torch DDP, real Horovod "
                   "(scripts/install-horovod.sh), or TensorFlow's MultiWorkerMirroredStrategy for a Keras model "
                   "(keras-* models; all-reduce strategies it executes exactly, others refused). For ddp and "
                   "horovod the strategy gives replicas and batch split only (without one, every device, even "
                   "split).")
@click.option("--ddp", "ddp_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime ddp: bucket_cap_mb, first_bucket_mb, comm_hook (none, fp16, bf16, powersgd), "
                   "powersgd_rank, gradient_as_bucket_view.")
@click.option("--horovod", "horovod_options", multiple=True, metavar="KEY=VALUE",
              help="With --runtime horovod: fusion_threshold_mb, cycle_time_ms, compression (none, fp16), "
                   "hierarchical_allreduce, autotune, sparse_as_dense.")
@click.option("--record/--no-record", default=True, show_default=True,
              help="Log the trial to MLflow and append it to the dataset.")
@click.option("--experiment", default="synctune-trials", show_default=True, help="MLflow experiment of the run.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def trial_cmd(model: str | None, workload_path: str | None, cluster: str, builder: str | None,
              strategy_file: str | None, options: tuple[str, ...],
              warmup: int, iters: int, optimizer: str, lr: float, seed: int, timeout_s: float, launcher: str,
              ray_address: str, runtime: str, ddp_options: tuple[str, ...],
              horovod_options: tuple[str, ...], record: bool, experiment: str,
              as_json: bool) -> None:
    """Run one trial: WARMUP + ITERS iterations of a model (zoo MODEL or your WORKLOAD) on CLUSTER
    under a strategy, timed.

    Exit status 0 when the trial ran (status ok), 1 when it failed, timed out or ran out of
    memory (the result says why), 2 on bad input.
    """
    from ..engine.trial import TrialConfig, check_trial, run_trial_local
    from ..strategy import build_strategy, load_strategy, parse_builder_options

    if builder is not None and strategy_file is not None or (builder is None and strategy_file is None
                                                             and runtime in ("engine", "tensorflow")):
        raise SpecError("give exactly one of --builder and --strategy")
    if ddp_options and runtime != "ddp":
        raise SpecError("--ddp applies to --runtime ddp only")
    if horovod_options and runtime != "horovod":
        raise SpecError("--horovod applies to --runtime horovod only")
    if (model is None) == (workload_path is None):
        raise SpecError("give exactly one of --model (a zoo model) and --workload (your workload's import path)")
    config = TrialConfig(warmup=warmup, iters=iters, optimizer=optimizer, lr=lr, seed=seed, timeout_s=timeout_s)
    workload = resolve_workload_arg(model or workload_path)
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
    if runtime == "tensorflow":
        from ..engine.tensorflow import tensorflow_runtime

        run_config = tensorflow_runtime(strategy, model_spec)
    else:
        run_config = (_ddp_runtime(ddp_options) if runtime == "ddp"
                      else _horovod_runtime(horovod_options) if runtime == "horovod" else None)
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
        origin = runtime if run_config and not (builder or strategy_file) else (builder or f"file:{strategy_file}")
        _record(result, strategy, model_spec, cluster_spec, origin, experiment, workload.source, run_config)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
    else:
        _print_result(result, strategy, run_config)
    if result.status != "ok":
        echo_err(f"synctune: trial {result.status}: {result.error}")
        raise SystemExit(1)


def _ddp_runtime(options: tuple[str, ...]) -> dict:
    """``--ddp KEY=VALUE`` options as a trial runtime (values typed as DDPConfig's fields)."""
    from ..engine.ddp import DDP_DEFAULT, DDPConfig, ddp_runtime

    values = DDP_DEFAULT.to_dict()
    parsed = _parse_options(options)
    if "bucket_cap_mb" in parsed and "first_bucket_mb" not in parsed:
        values["first_bucket_mb"] = None  # a cap given alone caps every bucket, as in DDP
    for key, text in parsed.items():
        if key not in values:
            raise SpecError(f"--ddp: unknown key {key!r}; valid: {', '.join(k for k in values if k != 'num_groups')}")
        if key in ("bucket_cap_mb", "first_bucket_mb"):
            try:
                values[key] = None if text.lower() in ("null", "none") and key == "first_bucket_mb" else float(text)
            except ValueError:
                raise SpecError(f"--ddp: {key}: expected a number of MiB, got {text!r}") from None
        elif key == "powersgd_rank":
            if not text.isdigit():
                raise SpecError(f"--ddp: powersgd_rank: expected a positive integer, got {text!r}")
            values[key] = int(text)
        elif key == "gradient_as_bucket_view":
            if text.lower() not in ("true", "false"):
                raise SpecError(f"--ddp: gradient_as_bucket_view: expected true or false, got {text!r}")
            values[key] = text.lower() == "true"
        else:
            values[key] = text
    if values["comm_hook"] == "powersgd":
        values["first_bucket_mb"] = None
        values["powersgd_rank"] = values["powersgd_rank"] or 4
    return ddp_runtime(DDPConfig.from_dict(values))


def _horovod_runtime(options: tuple[str, ...]) -> dict:
    """``--horovod KEY=VALUE`` options as a trial runtime (values typed as HorovodConfig's fields)."""
    from ..engine.horovod import HorovodConfig, horovod_runtime

    try:
        return horovod_runtime(HorovodConfig.from_options(_parse_options(options)))
    except SpecError as exc:
        raise SpecError(f"--horovod: {exc}") from None


def _print_result(result, strategy, runtime: dict | None = None) -> None:
    if runtime and runtime["kind"] == "ddp":
        from ..engine.ddp import DDPConfig

        click.echo(f"torch DDP: {DDPConfig.from_dict(runtime['ddp']).summary()} (replicas and batch split of "
                   f"{strategy.summary()})")
    elif runtime and runtime["kind"] == "tensorflow":
        pack = runtime["tensorflow"]["bytes_per_pack"]
        click.echo(f"TensorFlow MultiWorkerMirroredStrategy, ring, bytes_per_pack {pack} "
                   f"({'one pack' if pack == 0 else 'packs as the merge groups'}): {strategy.summary()}")
    elif runtime:
        from ..engine.horovod import HorovodConfig

        click.echo(f"Horovod: {HorovodConfig.from_dict(runtime['horovod']).summary()} (replicas and batch split of "
                   f"{strategy.summary()})")
    else:
        click.echo(strategy.summary())
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
            runtime: dict | None = None) -> None:
    """MLflow first (for the run id), then the dataset row, which lands even if MLflow is down."""
    from ..data import MlflowLogger, TrialDataset, dataset_dir
    from ..run import record_result

    rec = record_result(result.to_dict(), strategy, model_spec, cluster_spec, dataset=TrialDataset(dataset_dir()),
                        logger=MlflowLogger(experiment), origin=origin, experiment=experiment,
                        workload_source=workload_source, runtime=runtime["kind"] if runtime else "engine",
                        runtime_json=json.dumps(runtime[runtime["kind"]], sort_keys=True) if runtime else "")
    run_id = rec.mlflow_run_id
    echo_err(f"recorded trial {rec.trial_id}: dataset {dataset_dir()}" + (f", MLflow run {run_id}" if run_id else ""))
