"""``synctune lab up|down|status|calibrate|collect``: emulated clusters with shaped links."""

from __future__ import annotations

import json

import click

from ._group import cli
from ._common import FiniteFloatRange, echo_err, model_option, resolve_cluster_arg, table


def _lab_preset(name: str):
    from ..spec.cluster import CLUSTER_PRESETS, cluster_preset, is_lab_cluster
    from ..spec.errors import SpecError

    if name not in CLUSTER_PRESETS or not is_lab_cluster(cluster_preset(name)):
        labs = [n for n in CLUSTER_PRESETS if n.startswith("lab-")]
        raise SpecError(f"unknown lab preset {name!r}; lab presets: {', '.join(labs)}")
    return cluster_preset(name)


@cli.group("lab")
def lab_group() -> None:
    """Emulated clusters: one network namespace per node, links shaped with tc (needs root): up,
    status, calibrate, collect, down."""


@lab_group.command("up")
@click.argument("preset")
@click.option("--latency-ms", default=0.0, show_default=True, type=FiniteFloatRange(0, 1000),
              help="Added one-way delay per link (netem).")
def up_cmd(preset: str, latency_ms: float) -> None:
    """Create the lab for PRESET (replacing any lab that is up, or left over from a crash)."""
    from ..lab import lab_up

    cluster = _lab_preset(preset)
    state = lab_up(cluster, latency_ms=latency_ms)
    if state["removed_stale"]:
        echo_err(f"removed an earlier lab: {', '.join(state['removed_stale'])}")
    click.echo(f"lab {preset} is up ({cluster.description}); scale {cluster.scale:g}")
    click.echo(table(["node", "namespace", "address", "workers", "link", "CPU per worker"],
                     [[n["node"], n["netns"], n["address"], cluster.node(n["node"]).num_devices,
                       f"{n['rate_mbit']:.0f} Mbit/s" + (f" +{latency_ms:g} ms" if latency_ms else ""),
                       f"{n['cpu_share']:g} core" if n.get("cpu_share") else "unlimited"]
                      for n in state["nodes"]], right=(3,)))


@lab_group.command("down")
def down_cmd() -> None:
    """Remove the lab: its namespaces, links and shaping (also what a crash left behind)."""
    from ..lab import lab_down

    removed = lab_down()
    groups = [r for r in removed if r.startswith("/")]
    removed = [r for r in removed if not r.startswith("/")]
    click.echo(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else "")
               + (f" and {len(groups)} CPU group(s)" if groups else ""))


@lab_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable.")
def status_cmd(as_json: bool) -> None:
    """Whether a lab is up, with which preset, and each link's shaping."""
    from ..lab import lab_status

    status = lab_status()
    if as_json:
        click.echo(json.dumps(status, indent=1))
        return
    state = status["state"]
    if not state and not status["namespaces"]:
        click.echo("no lab is up")
        return
    if status["stale"]:
        click.echo(f"stale lab namespaces (synctune lab down removes them): {', '.join(status['namespaces'])}")
        return
    click.echo(f"lab {state['preset']} is up since {state['created_at']} (scale {state['scale']:g}, "
               f"latency {state['latency_ms']:g} ms)")
    click.echo(table(["node", "namespace", "address", "shaping"],
                     [[n["node"], n["netns"], n["address"], status["qdiscs"].get(n["netns"], "")]
                      for n in state["nodes"]]))


@lab_group.command("calibrate")
@click.argument("preset")
def calibrate_cmd(preset: str) -> None:
    """Measure PRESET's links (the lab must be up with it) and save the calibrated cluster spec:
    from then on `--cluster PRESET` means the measured link speeds."""
    from ..lab import lab_attach, lab_status
    from ..run import calibrate_lab

    cluster = _lab_preset(preset)
    lab_attach(cluster)  # one clear error unless the lab is up with this preset
    _spec, figures, path = calibrate_lab(cluster, lab_status()["state"],
                                         on_step=lambda msg: echo_err(f"measuring {msg}"))
    click.echo(table(["node", "nominal", "ingress", "egress", "latency", "efficiency"],
                     [[n["node"], f"{n['nominal_gbps'] * 1000:.0f} Mbit/s", f"{n['ingress_gbps'] * 1000:.0f} Mbit/s",
                       f"{n['egress_gbps'] * 1000:.0f} Mbit/s", f"{n['latency_ms']:.3f} ms", f"{n['efficiency']:.0%}"]
                      for n in figures["nodes"]], right=(1, 2, 3, 4, 5)))
    if "allreduce" in figures:
        ar = figures["allreduce"]
        click.echo(f"all-reduce of {figures['nbytes'] >> 20} MiB: {ar['seconds'] * 1e3:.1f} ms, bus bandwidth "
                   f"{ar['busbw_gbps'] * 1000:.0f} Mbit/s")
    if "compute" in figures:
        click.echo(table(["node", "CPU per worker", "GFLOP/s per worker", "relative"],
                         [[c["node"], f"{c['cpu_share']:g} core" if c["cpu_share"] else "unlimited",
                           f"{c['gflops']:.2f}", f"{c['relative']:.2f}"] for c in figures["compute"]],
                         right=(1, 2, 3)))
    click.echo(f"calibrated spec: {path}")


#: The presets `lab collect` measures by default: two homogeneous shapes and three heterogeneous
#: ones (links of different speeds; links and compute of different speeds).
COLLECT_PRESETS = ("lab-2x2", "lab-4x1", "lab-b12", "lab-b10c", "lab-b11c")


def _small_models() -> tuple[str, ...]:
    from ..models.zoo import MODELS

    return tuple(name for name, entry in MODELS.items() if entry.small)


def preset_calibration(recorded: dict, models: list[str]):
    """The calibrated cluster every domain of a lab preset is collected on, or None when the
    preset has no recorded rows yet (calibrate it now).

    ``recorded`` maps a model to the cluster its recorded rows were measured on. A domain begun
    later (or after a restart) takes the first recorded model's calibration rather than a fresh
    probe: one preset is one cluster in the dataset, and a re-probe can differ by a spurious
    latency reading, several times the link's recorded latency."""
    return next((recorded[name] for name in models if name in recorded), None)


@lab_group.command("collect")
@click.option("--preset", "-p", "presets", multiple=True, default=COLLECT_PRESETS, show_default=True,
              help="Lab preset (repeatable).")
@model_option(multiple=True, runnable=True, help="Zoo model or your workload's import path (package.module:factory, "
              "path/to/file.py:factory); repeatable; default: every small zoo model.")
@click.option("--random", "num_random", default=25, show_default=True, type=click.IntRange(0, 100_000),
              help="Unconstrained random strategies per domain.")
@click.option("--guided", "num_guided", default=45, show_default=True, type=click.IntRange(0, 100_000),
              help="Guided-sampler strategies per domain (compressors, hierarchical all-reduce, uneven batch "
                   "splits, replica subsets, SFB where they apply).")
@click.option("--sharded", "num_sharded", default=0, show_default=True, type=click.IntRange(0, 100),
              help="Sharded (ZeRO-2) settings per domain: the shard builder's unit depth, HSDP group and reduce "
                   "dtype, in a fixed order.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0, 1_000_000))
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Timed iterations (at least this many with --target-ci).")
@click.option("--target-ci", default=0.03, show_default=True, type=FiniteFloatRange(0, 1, max_open=True),
              help="Measure each trial until the 95% interval of its median iteration time is within this share "
                   "of it (0: exactly --iters).")
@click.option("--max-iters", default=200, show_default=True, type=click.IntRange(1, 1_000_000),
              help="With --target-ci: at most this many timed iterations.")
@click.option("--max-timed-s", default=10.0, show_default=True, type=FiniteFloatRange(0, 86_400, min_open=True),
              help="With --target-ci: at most this many seconds of timed iterations.")
@click.option("--pin-cpus/--no-pin-cpus", default=True, show_default=True,
              help="Bind each worker to one CPU, so which workers share a core is the same in every trial.")
@click.option("--data", "data_path", type=click.Path(file_okay=False), help="Dataset folder (default: the data home's).")
@click.option("--release", help="Then publish the dataset as a release here (folder or s3://).")
@click.option("--name", help="Release name (with --release).")
def collect_cmd(presets, model, num_random, num_guided, num_sharded, seed, warmup, iters, target_ci, max_iters,
                max_timed_s, pin_cpus, data_path, release, name) -> None:
    """For each preset: bring the lab up, calibrate it, measure each model's compute profile
    (once per model and worker count), trial every builder, RANDOM unconstrained and GUIDED
    guided-sampler strategies of each model over the shaped links; then take the lab down.

    Resumable: the same command again (same --seed) runs only the trials not yet recorded, on
    the calibration the recorded rows of that preset were measured with (so a domain stays one
    cluster), and skips presets whose domains are complete."""
    import json

    from ..data import TrialDataset, dataset_dir, push_release
    from ..lab import lab_down, lab_status, lab_up
    from ..run import calibrate_lab, collect_domain, ensure_profile
    from ..run.collect import collect_search_id, collection_plan
    from ..spec.cluster import ClusterSpec
    from ._common import node_network, resolve_workload_arg

    from ..spec.errors import SpecError

    if target_ci and max_iters < iters:
        raise SpecError(f"--max-iters {max_iters}: at least --iters ({iters}) expected")
    measure = {"target_ci": target_ci, "max_iters": max_iters, "max_timed_s": max_timed_s,
               "pin_cpus": pin_cpus}
    ds = TrialDataset(data_path or dataset_dir())
    workloads = [resolve_workload_arg(m) for m in (model or _small_models())]
    clusters = [_lab_preset(p) for p in presets]
    try:
        for nominal in clusters:
            recorded, todo = {}, 0  # per model: the calibration its recorded rows were measured on
            for workload in workloads:
                spec = workload.spec()
                plan = collection_plan(spec, nominal, num_random=num_random, num_guided=num_guided, seed=seed,
                                       num_sharded=num_sharded)
                rows = ds.table(model=spec.name, cluster=nominal.name,
                                search_id=collect_search_id(spec.name, nominal.name, seed))
                todo += len(plan) - len(set(rows.column("trial_id").to_pylist()) & {t for t, _o, _s in plan})
                if rows.num_rows:
                    recorded[spec.name] = ClusterSpec.from_dict(
                        json.loads(rows.column("cluster_spec_json")[0].as_py()), where="recorded cluster_spec_json")
            if not todo:
                click.echo(f"{nominal.name}: every trial already recorded")
                continue
            lab_up(nominal)
            fresh = preset_calibration(recorded, [w.spec().name for w in workloads])
            if fresh is None:
                _spec, figures, _path = calibrate_lab(nominal, lab_status()["state"])
                fresh = resolve_cluster_arg(nominal.name)  # the calibrated spec
                echo_err(f"{fresh.name}: links at " + ", ".join(f"{n['node']} {n['efficiency']:.0%}"
                                                                for n in figures["nodes"]) + " of nominal")
            if recorded:  # a domain continues on the calibration its recorded rows were measured with
                echo_err(f"{nominal.name}: continuing {', '.join(sorted(recorded))} on their recorded calibration"
                         + ("; new domains on the same one" if len(recorded) < len(workloads) else ""))
            for workload in workloads:
                cluster = recorded.get(workload.spec().name) or fresh
                ensure_profile(workload, workload.spec(), cluster, echo_err, node_net=node_network(cluster),
                               pin_cpus=pin_cpus)
                results = collect_domain(ds, workload, cluster, num_random=num_random, num_guided=num_guided,
                                         num_sharded=num_sharded, builders=True, seed=seed, warmup=warmup, iters=iters,
                                         node_net=node_network(cluster), say=echo_err, measure=measure)
                ok = sum(r.status == "ok" for r in results)
                click.echo(f"{workload.name}@{cluster.name}: {ok}/{len(results)} trials ok now, recorded in {ds.root}")
    finally:
        lab_down()
    if release:
        from ..run import profiles_for_release

        models = set(ds.table().column("model_name").to_pylist())
        manifest = push_release(ds, release, name=name, profiles=profiles_for_release(models))
        click.echo(f"released {manifest['total_rows']} rows as {manifest['name']} at {release}")
