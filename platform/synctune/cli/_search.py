"""``synctune search EXPERIMENT.yaml``: the main job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..spec.errors import SpecError
from ._group import cli
from ._common import echo_err, node_network, resolve_cluster_arg, resolve_workload_arg, start_ray


def _apply_best(summary, workload, cluster, best_path: Path, exp, tracking_uri: str | None):
    """The recommended strategy as a training file next to it, also attached to the search's
    MLflow run; returns (path or None, format used). The file runs what the recommendation's
    runtime ran (:meth:`~synctune.engine.runtime.Runtime.plans_of`), in the format that runs it
    (:meth:`~synctune.engine.runtime.Runtime.training_format`)."""
    from ..data import MlflowLogger
    from ..run.apply import apply_search_result

    chosen = summary.recommended
    runtime = chosen.runtime
    settings = best_path.with_name(best_path.stem + "-result.json")
    fmt = runtime.training_format(chosen.strategy)
    if fmt is None:
        note = runtime.training_note(chosen.strategy, workload.spec())
        echo_err(f"note: {workload.name}: {note}" if note else
                 f"note: the recommendation is {chosen.name}; its settings are in {settings}, and no training file "
                 f"is written")
        return None, ""
    def module():
        import torch

        with torch.device("meta"):
            return workload.build_model()

    # DDP takes replicas and batch split only; the others run a strategy's plans
    strategy = chosen.strategy if fmt == "ddp" else runtime.plans_of(chosen.strategy, module, workload.spec())
    try:
        return apply_search_result(strategy.to_dict(), workload, cluster, best_path, seed=exp.seed,
                                   ddp=runtime.config_dict() if fmt == "ddp" else None, fmt=fmt,
                                   logger=MlflowLogger(exp.name, tracking_uri),
                                   parent_run_id=summary.mlflow_parent_run or "")
    except (SpecError, OSError) as exc:  # the search is done and recorded; the file is a bonus
        retry = (f"the tuned DDP configuration is in {settings}" if fmt == "ddp"
                 else f"`synctune apply {best_path}` retries")
        echo_err(f"warning: the training file could not be written ({exc}); {retry}")
        return None, ""


def _save_links(summary, tracking_uri: str | None):
    """Where the search's results are in the MLflow UI (:mod:`synctune.run.links`), saved beside
    its result for ``synctune ui``; None when MLflow was not reached (the summary says so)."""
    if not summary.mlflow_parent_run:
        return None
    from ..data import TrialDataset, data_home, dataset_dir, default_tracking_uri
    from ..run.links import SearchLinks, compared_records, links_path
    from ..spec.files import path_under, write_text_atomic

    uri = tracking_uri or default_tracking_uri()
    try:
        import mlflow

        experiment_id = mlflow.MlflowClient(uri).get_run(summary.mlflow_parent_run).info.experiment_id
    except Exception as exc:  # noqa: BLE001 - the search is done and recorded; the link is a convenience
        echo_err(f"warning: no MLflow link: the store {uri} did not answer ({' '.join(str(exc).split())[:200]})")
        return None
    try:
        records = TrialDataset(dataset_dir()).records(search_id=summary.search_id)
    except (OSError, SpecError) as exc:  # the rows are there to choose from; without them, the search's run
        echo_err(f"warning: the search's rows could not be read to choose the runs to compare ({exc})")
        records = []
    links = SearchLinks(search_id=summary.search_id, tracking_uri=uri, experiment_id=str(experiment_id),
                        parent_run=summary.mlflow_parent_run,
                        compare=tuple(r.mlflow_run_id for r in compared_records(records, summary.confirmed)))
    try:
        searches = path_under(data_home(), "searches")
        searches.mkdir(parents=True, exist_ok=True)
        write_text_atomic(links_path(searches, summary.search_id),
                          json.dumps(links.to_dict(), indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        echo_err(f"warning: the MLflow links could not be saved for `synctune ui` ({exc})")
    return links


@cli.command("search")
@click.argument("experiment")
@click.option("--resume", is_flag=True, help="Continue an interrupted search (finished trials are kept).")
@click.option("--ray-address", default="local", show_default=True, envvar="RAY_ADDRESS",
              help="'local' starts Ray on this machine; 'auto' or an address joins a running cluster "
                   "(a Ray job gets its cluster's address from $RAY_ADDRESS).")
@click.option("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the SQLite store).")
def search_cmd(experiment: str, resume: bool, ray_address: str, tracking_uri: str | None) -> None:
    """Search the fastest strategy for an experiment's (model, cluster): baselines first, then
    AutoDist's Algorithm 1 (or the variant the file names), every trial real and recorded."""
    from tqdm import tqdm

    from ..data import data_home
    from ..run import prepare_search, run_prepared, search_id_of
    from ..search.experiment import load_experiment
    from ..spec.files import check_parent, make_parent, path_under, write_text_atomic

    exp = load_experiment(experiment)
    workload = resolve_workload_arg(exp.trains, timeout_s=exp.trial.timeout_s)
    cluster = resolve_cluster_arg(exp.domain.cluster)
    node_net = node_network(cluster)
    if cluster.device_kind != "cpu" and ray_address == "local":
        raise SpecError(f"{experiment}: cluster {cluster.name} has GPU nodes; run the search on a Ray cluster "
                        f"that has them (ray job submit ... -- synctune search {experiment} --ray-address auto)")

    def say(message: str) -> None:
        echo_err(f"{exp.name}: {message}")

    # Where the best strategy goes is checked first (nothing is written where the output is
    # refused), then everything the search needs is checked and read before Ray starts (the
    # simulator file, the memory budget, the profile, the dataset rows, the MLflow run).
    output = exp.run.output
    # Absolute now: the user's code runs in this process later (it may change the folder).
    best_path = (Path(os.path.abspath(output)) if output
                 else path_under(data_home(), "searches", f"{search_id_of(exp)}-best.json"))
    check_parent(best_path)
    context = prepare_search(exp, workload, cluster, resume=resume, tracking_uri=tracking_uri, node_net=node_net,
                             say=say)
    make_parent(best_path)
    start_ray(ray_address, cluster.num_devices + 1)
    bar = tqdm(total=exp.num_trials, desc=exp.name, unit="trial", disable=None)
    on_trial = _progress(bar, exp.name)

    def on_phase(message: str) -> None:
        if not bar.disable:
            bar.clear()
        say(message)

    try:
        summary = run_prepared(context, on_trial=on_trial, on_phase=on_phase)
    finally:
        bar.close()
    train_path, used = None, ""
    if summary.recommended:
        write_text_atomic(best_path, json.dumps(summary.recommended.strategy.to_dict(), indent=2, sort_keys=True)
                          + "\n")
        # The whole answer beside it: what to run (a strategy, or a tuned runtime's settings) and why.
        write_text_atomic(best_path.with_name(best_path.stem + "-result.json"),
                          json.dumps(summary.to_dict(), indent=2, sort_keys=True, default=str) + "\n")
        train_path, used = _apply_best(summary, workload, cluster, best_path, exp, tracking_uri)
    _print_summary(summary, exp, workload, best_path)
    if train_path is not None:
        from ..run.apply import FORMAT_NAMES, run_command

        click.echo(f"apply     {train_path} ({FORMAT_NAMES[used]}): "
                   f"{run_command(summary.recommended.strategy, train_path)}")
    links = _save_links(summary, tracking_uri)
    if links is not None:
        click.echo(f"mlflow    {links.compare_url() if links.compare else links.search_url()}"
                   + (" (the confirmed pick and the baselines it was screened against; `synctune ui` serves it)"
                      if links.compare else " (the search's run; `synctune ui` serves it)"))
    echo_err(f"MLflow parent run {summary.mlflow_parent_run or '(MLflow unavailable)'}; "
             f"dataset rows under search id {summary.search_id}")
    if summary.trials:
        _publish_report(summary.search_id, tracking_uri)
    if summary.recommended is None and summary.memory is not None and summary.memory.stopped:
        # Every trial is recorded; the budget, not the machinery, ended the search.
        raise SpecError(f"{experiment}: {summary.memory.stopped}")


def _progress(bar, name: str):
    """The ``on_trial`` of a search: the bar's position and the figures so far (one line per
    trial when there is no terminal: a Ray job's log, CI)."""

    def on_trial(result, summary) -> None:
        bar.n = summary.all_trials
        parts = []
        if summary.best_mean_s:
            parts.append(f"best {summary.best_mean_s * 1e3:.1f} ms")
        baseline = summary.runtime_best()
        if baseline:
            parts.append(f"{baseline.runtime.label} {baseline.mean_s * 1e3:.1f} ms")
        if summary.speedup_over_best_baseline:
            parts.append(f"x{summary.speedup_over_best_baseline:.2f} vs baselines")
        if summary.hit_rate is not None:
            parts.append(f"hit rate {summary.hit_rate:.0%}")
        if bar.disable:
            this = f"{result.mean_s * 1e3:.1f} ms" if result.ok and result.mean_s else result.status
            echo_err(f"{name}: trial {bar.n}/{bar.total}: {this}; " + ", ".join(parts))
            return
        bar.set_postfix_str(", ".join(parts))
        bar.refresh()

    return on_trial


def _print_summary(summary, exp, workload, best_path: Path) -> None:
    """The search's figures, one line each."""
    speed = summary.speedup_over_best_baseline
    click.echo(f"search {summary.search_id}: {summary.trials} trials ({summary.failed} failed) "
               f"in {summary.wall_s:.0f} s")
    if summary.best_mean_s:
        from ..engine.runtimes import strategy_runtime_class

        runner = strategy_runtime_class(workload.framework).label
        click.echo(f"best      {summary.best_mean_s * 1e3:.1f} ms/iteration ({summary.best_origin}), "
                   f"fastest single trial of {runner}")
    if summary.best_builder_baseline_s:
        click.echo(f"builders  {summary.best_builder_baseline_s * 1e3:.1f} ms/iteration (best hand-optimised builder)")
    for name in dict.fromkeys(t.runtime.name for t in summary.baselines):
        best = summary.runtime_best(name)
        if best is not None:
            runtime = best.runtime
            click.echo(f"{runtime.label or name:<9} {best.mean_s * 1e3:.1f} ms/iteration (best of "
                       f"{summary.runtime_trials(name)} {runtime.trials_noun}: {runtime.summary()})")
    click.echo(f"single    {speed:.3f}x over the best baseline, trial against trial (not confirmed)" if speed
               else "single    n/a")
    _print_confirmation(summary.confirmed)
    _print_selection(summary, exp)
    hits = summary.hit_rate
    click.echo(f"hit rate  {hits:.0%} of searched strategies beat the best baseline" if hits is not None else
               "hit rate  n/a")
    click.echo(f"trials to 1.1x: {summary.trials_to_1_1x or '-'}, to 1.2x: {summary.trials_to_1_2x or '-'}")
    if summary.recommended:
        click.echo(f"result    {summary.recommended.name} ({summary.recommended.why}), saved to {best_path}")
        if summary.recommended.differs:
            click.echo(f"why       it {summary.recommended.differs}")
    _print_memory(summary.memory)


def _mib(values) -> str:
    shown = [f"{v / 2**20:.1f}" for v in values or [] if v is not None]
    return "/".join(shown) + " MiB" if shown else "n/a"


def _print_memory(memory) -> None:
    """The budget, and what the recommendation costs per rank, predicted and measured."""
    if memory is None:
        return
    limits = [x for x in memory.limit_bytes if x is not None]
    click.echo(f"memory    budget {memory.budget}" + (f" = {min(limits) / 2**20:.1f} MiB per rank" if limits else "")
               + f"; recommended: predicted {_mib(memory.predicted_peak_bytes)}, measured "
               f"{_mib(memory.measured_peak_bytes)} per rank; {memory.oom_trials} oom trial(s)")
    if memory.over_budget_builders:
        click.echo(f"          builders over the budget, never trialled: {', '.join(memory.over_budget_builders)}")


_STOPPED = {"verdict": "the interval excluded 1", "narrow": "the interval was narrow enough", "cap": "the cap"}


def _print_confirmation(confirmed) -> None:
    if confirmed is None:
        return
    if not confirmed.measured:
        click.echo(f"confirmed n/a ({confirmed.error or 'no result'})")
        return
    interval, rule = confirmed.interval, confirmed.rule
    looks = " sequential" if confirmed.sequential else ""
    click.echo(f"confirmed {interval.ratio:.3f}x [{interval.low:.3f}, {interval.high:.3f}] (95%{looks}): "
               f"{confirmed.candidate} against {confirmed.baseline}, {confirmed.rounds} interleaved rounds "
               f"of {confirmed.per_round} iterations on the same processes: {confirmed.verdict}")
    if looks and confirmed.stopped:
        click.echo(f"          rounds {rule.min_rounds} to {rule.max_rounds}, stopped at "
                   f"{confirmed.rounds}: {_STOPPED.get(confirmed.stopped, confirmed.stopped)} (each look "
                   f"at {100 * interval.confidence:.2f}%, so the interval holds at 95% whenever it stops)")
    if confirmed.screened:
        click.echo(f"          picked by a screening of the {len(confirmed.screened)} fastest searched strategies "
                   f"({', '.join(confirmed.screened)}) and the {len(confirmed.screened_baselines)} "
                   f"fastest baselines ({', '.join(confirmed.screened_baselines)}) on rounds of their own")
    for failure in confirmed.retried:
        click.echo(f"          run again from the start on fresh workers after: {failure[:160]}")


def _print_selection(summary, exp) -> None:
    selection = summary.simulator_selection
    if not selection:
        return
    last = selection[-1]
    switched = next((s["trials"] for s in selection if s["scoring"] == "learned"), None)
    acc = ", ".join(f"{name} {last[key]:.0%}" for name, key in (("learned", "learned_accuracy"),
                                                              ("training-free", "training_free_accuracy"))
                    if last[key] is not None)
    click.echo(f"simulator {exp.search.simulator} scored proposals "
               + (f"from trial {switched}" if switched else "never")
               + f"; held-out pairwise accuracy over {last['held_out_pairs']} pairs: {acc or 'n/a'} "
               f"(training-free: {summary.training_free_simulator or 'analytic'})")


def _publish_report(search_id: str, tracking_uri: str | None) -> None:
    from ..report import publish_search_report

    try:
        path, run_id = publish_search_report(search_id, tracking_uri=tracking_uri)
        echo_err(f"report {path}" + (" (also report.html of the MLflow parent run)" if run_id else ""))
    except (SpecError, OSError) as exc:  # the search is done and recorded; the page is a bonus
        echo_err(f"warning: the report could not be made ({type(exc).__name__}: {exc}); "
                 f"`synctune report {search_id}` retries")
