"""``synctune sim train|eval|score``."""

from __future__ import annotations

import json
import time

import click

from ..spec.errors import SpecError
from ._group import cli
from ._common import FiniteFloatRange, echo_err, model_option, resolve_cluster_arg, table


@cli.group("sim")
def sim_group() -> None:
    """The simulator: train rankers on the dataset, eval them, score strategies, profile a workload's
    compute, and check the memory model against recorded trials."""


def _domains(data: str | None, selected: tuple[str, ...], *, tensor_parallel: bool = False):
    """The dataset's domains (``--domain``: only those); with ``tensor_parallel``, their
    strategies that split modules too (only the replay predicts those)."""
    from ..data import TrialDataset, dataset_dir
    from ..simulator import domains_from_records

    ds = TrialDataset(data or dataset_dir())
    domains = domains_from_records(ds.records(), tensor_parallel=tensor_parallel)
    if selected:
        for want in selected:
            if "@" not in want:
                raise SpecError(f"--domain {want!r}: expected MODEL@CLUSTER")
        known = {d.key for d in domains}
        missing = [w for w in selected if w not in known]
        if missing:
            raise SpecError(f"{ds.root}: no successful trials for domain(s) {', '.join(missing)}; "
                            f"domains there: {', '.join(sorted(known)) or 'none'}")
        domains = [d for d in domains if d.key in selected]
    if not domains:
        raise SpecError(f"{ds.root}: no successful trials to learn from (run trials or `synctune dataset pull`)")
    return domains


_data = click.option("--data", metavar="DIR", help="Dataset folder (default: the local dataset).")
_domain = click.option("--domain", "domains", multiple=True, metavar="MODEL@CLUSTER",
                       help="Only these domains (repeatable; default all).")


@sim_group.command("train")
@click.option("--model", "kind", type=click.Choice(["linear", "rnn", "gat", "residual"]), default="rnn",
              show_default=True, help="Which ranker (residual: the calibrated replay with a learned correction; "
                                      "it predicts seconds).")
@_data
@_domain
@click.option("--epochs", default=150, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--held-out", default=0.0, show_default=True, type=FiniteFloatRange(0, 1, max_open=True),
              help="Share of each domain kept out of training.")
@click.option("--alpha-ms", default=0.1, show_default=True, type=FiniteFloatRange(0, 10_000),
              help="Replay features: message latency of links whose cluster spec has no calibrated latency_ms.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="Simulator file to write.")
def train_cmd(kind, data, domains, epochs, seed, held_out, alpha_ms, output) -> None:
    """Train a ranker with AutoSync's pairwise ranking loss on dataset trials."""
    from tqdm import tqdm

    from ..simulator import make_simulator, split_domains

    from ..spec.files import check_writable

    check_writable(output)  # before training, not after
    doms = _domains(data, domains)
    if held_out > 0:
        doms, _ = split_domains(doms, held_out, seed)
    if kind == "residual":
        from ..simulator import ResidualReplay

        sim = ResidualReplay(seed=seed)
        sim.use_profiles(_replay(alpha_ms))
        echo_err(f"calibrating the replay and fitting its correction on {len(doms)} domains")
        sim.fit(doms)
    else:
        sim = make_simulator(kind, epochs=epochs, seed=seed)
        sim.use_profiles(_replay(alpha_ms))  # the replay under the learned model uses the measured profiles
        bar = tqdm(total=epochs, desc=f"train {kind}", unit="epoch", disable=None)
        tenth = max(1, epochs // 10)

        def log(epoch: int, loss: float) -> None:
            bar.update(epoch - bar.n)
            bar.set_postfix_str(f"loss {loss:.3f}")
            if bar.disable and (epoch % tenth == 0 or epoch == epochs):  # a log: a line per tenth
                echo_err(f"train {kind}: epoch {epoch}/{epochs}, loss {loss:.3f}")

        sim.fit(doms, log=log)
        bar.close()
    sim.save(output)
    echo_err(f"trained {kind} on {sum(len(d.strategies) for d in doms)} trials of "
             f"{', '.join(d.key for d in doms)}; wrote {output}")


def _replay(alpha_ms: float):
    """The replay simulator with the compute profiles measured in the data folder."""
    from ..data import profiles_dir
    from ..simulator import ReplayConstants, ReplaySimulator

    return ReplaySimulator.from_folder(profiles_dir(), ReplayConstants(alpha_s=alpha_ms / 1e3))


def _load_for_eval(name: str, alpha_ms: float):
    """A simulator by name: ``analytic``, ``replay`` (with the measured profiles of the data
    folder) or a saved file (learned: its replay features also use those profiles)."""
    from ..simulator import load_simulator

    if name == "replay":
        return _replay(alpha_ms)
    sim = load_simulator(name)
    if getattr(sim, "learned", False):
        sim.use_profiles(_replay(alpha_ms))
    return sim


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


@sim_group.command("eval")
@click.argument("sim_files", nargs=-1, metavar="[SIM_FILE|analytic|replay]...")
@_data
@_domain
@click.option("--held-out", default=0.0, show_default=True, type=FiniteFloatRange(0, 1, max_open=True),
              help="Evaluate on the held-out share only (use the same --seed as training; with --protocol "
                   "held-out: the share, default 0.3).")
@click.option("--protocol", "protocols", multiple=True, type=click.Choice(["held-out", "unseen-model",
              "unseen-cluster", "unseen-both"]), help="Train the --train kinds on part of the data and test on "
              "the rest: a held-out share of each domain, or whole domains of a model, a cluster, or both never "
              "seen in training (repeatable; each protocol is one block of the table).")
@click.option("--train", "train_kinds", multiple=True,
              type=click.Choice(["linear", "rnn", "gat", "replay", "residual"]),
              help="With --protocol: learned simulators trained per fold (repeatable); replay: the replay with "
                   "its communication CPU costs and compute scale calibrated on the fold's training trials; "
                   "residual: that calibrated replay times a correction learned on the same trials.")
@click.option("--epochs", default=150, show_default=True, type=click.IntRange(1, 100_000),
              help="Training epochs of the --train kinds.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--k", default=5, show_default=True, type=click.IntRange(1, 100_000), help="k of the top-k recall.")
@click.option("--alpha-ms", default=0.1, show_default=True, type=FiniteFloatRange(0, 10_000),
              help="Replay: message latency of links whose cluster spec has no calibrated latency_ms.")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(sim_files, data, domains, held_out, protocols, train_kinds, epochs, seed, k, alpha_ms, as_json) -> None:
    """Every simulator side by side, per domain and overall: pairwise ranking accuracy, Kendall's
    tau, top-k recall, and for those that predict seconds the absolute error |predicted -
    measured| / measured (median and 90th percentile). The training-free models (analytic, and
    replay from the profiles `synctune sim profile` measured) are always shown; add saved
    learned simulators as SIM_FILEs, and with --protocol and --train, learned simulators
    trained here on each fold's training domains and tested on its test domains (held out, or
    an unseen model, cluster or both: AutoSync §3.3's transfer)."""
    from tqdm import tqdm

    from ..simulator import CalibratedReplay, ResidualReplay, make_simulator, protocol_folds, split_domains

    if train_kinds and not protocols:
        raise SpecError("--train needs --protocol: which data the simulators train on and which they are tested on")
    names = ["analytic", "replay"] + [n for n in sim_files if n not in ("analytic", "replay")]
    sims = [(name, _load_for_eval(name, alpha_ms)) for name in names]
    fixed = [(name if name in ("analytic", "replay") else f"{sim.kind} ({name})", sim) for name, sim in sims]
    # Strategies that split modules (tensor_parallel) are not priced as columns: every simulator is trained
    # and scored without them, and those that replay them (the replay, calibrated or not) scored
    # on them apart.
    split = [d.subset(d.split_mask().nonzero()[0].tolist()) for d in _domains(data, domains, tensor_parallel=True)
             if d.split_mask().any()]
    doms = _domains(data, domains)
    blocks = []  # (protocol, [(label, sim, test domains)])
    if not protocols:
        if held_out > 0:
            _, doms = split_domains(doms, held_out, seed)
        blocks.append(("all" if not held_out else "held-out", [(label, sim, doms) for label, sim in fixed]))
    folds_of = {p: protocol_folds(doms, p, held_out=held_out or 0.3, seed=seed) for p in protocols}
    bar = tqdm(total=sum(len(f) for f in folds_of.values()) * len(train_kinds), desc="train per fold",
               unit="model", disable=None if train_kinds else True)
    done, started = 0, time.monotonic()
    for protocol in protocols:
        folds = folds_of[protocol]
        if not folds:
            raise SpecError(f"--protocol {protocol}: no fold has both training and test domains "
                            f"(domains: {', '.join(d.key for d in doms)})")
        entries = [(label, sim, [d for _n, _tr, test in folds for d in test]) for label, sim in fixed]
        for kind in train_kinds:
            for fold, train, test in folds:
                sim = (CalibratedReplay() if kind == "replay" else ResidualReplay(seed=seed) if kind == "residual"
                       else make_simulator(kind, epochs=epochs, seed=seed))
                sim.use_profiles(_replay(alpha_ms))
                bar.set_postfix_str(f"{protocol} {fold}")
                sim.fit(train)
                bar.update(1)
                done += 1
                label = {"replay": "replay (calibrated)", "residual": "replay + learned residual"}.get(
                    kind, f"{kind} (trained)")
                if bar.disable:  # not a terminal (a log): a line per model, so a long run is not silent
                    echo_err(f"[{done}/{bar.total}] {protocol} {fold}: {label} trained "
                             f"({time.monotonic() - started:.0f} s so far)")
                entries.append((label, sim, test))
        blocks.append((protocol, entries))
    bar.close()
    rows, out, mix_rows = _eval_tables(blocks, k)
    split_rows = _split_table(blocks, split, out)
    _say_unscored_split(blocks, split)
    for _label, sim in fixed:
        if getattr(sim, "fallbacks", None):
            echo_err(f"replay: no measured compute profile for {', '.join(sorted(sim.fallbacks))}: counted FLOPs "
                     f"stand in (synctune sim profile -m MODEL -c CLUSTER measures one)")
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(table(["protocol", "domain", "simulator", "trials", "pairwise acc", "kendall tau", f"top-{k} recall",
                      "|err| median", "|err| p90"], rows, right=[3, 4, 5, 6, 7, 8]))
    # Per synchronizer kind mix (pairs never cross domains): how each simulator ranks and times
    # strategies that shard beside those that do not.
    click.echo(table(["kind mix", "protocol", "simulator", "trials", "pairs", "pairwise acc", "|err| median",
                      "|err| p90"], mix_rows, right=[3, 4, 5, 6, 7]))
    if split_rows:
        # The folds train without them: every one is unseen (the calibrated replay's TP collectives
        # cost their alpha-beta terms and an all-reduce unit's costs, tp_collective_s unfitted).
        click.echo(table(["tensor parallel", "protocol", "simulator", "trials", "signed median", "|err| median",
                          "|err| p90"], split_rows, right=[3, 4, 5, 6]))
    for protocol, _entries in blocks:
        means = ", ".join(f"{o['simulator']} {o['pairwise_accuracy']:.3f}" for o in out
                          if o["domain"] == "overall" and o["protocol"] == protocol)
        click.echo(f"{protocol}: mean pairwise ranking accuracy: {means}")


def _say_unscored_split(blocks: list, split: list) -> None:
    """One line on stderr naming the simulators scored without the tensor-parallel trials of
    ``split`` (only the replay predicts strategies that split modules)."""
    if not split:
        return
    left = sorted({label for _p, entries in blocks for label, sim, _t in entries
                   if not getattr(sim, "replays_tensor_parallel", False)})
    if left:
        echo_err(f"{sum(len(d.strategies) for d in split)} tensor-parallel trials: only the replay predicts "
                 f"strategies that split modules; {', '.join(left)} scored without them")


def _eval_tables(blocks: list, k: int) -> tuple[list, list, list]:
    """Every (protocol, simulator) evaluated: the per-domain table's rows (with each simulator's
    overall row), the JSON records, and the per-kind-mix table's rows."""
    from ..simulator import evaluate
    from ..simulator.evaluate import by_kind_mix

    rows, out, mix_rows = [], [], []
    for protocol, entries in blocks:
        by_label: dict[str, list] = {}
        for label, sim, test in entries:
            by_label.setdefault(label, []).extend(evaluate(sim, test, k))
        for label, results in by_label.items():
            for r in sorted(results, key=lambda r: r["domain"]):
                rows.append([protocol, r["domain"], label, r["n"], f"{r['pairwise_accuracy']:.3f}",
                             f"{r['kendall_tau']:.3f}", f"{r[f'top{k}_recall']:.2f}", _pct(r["abs_err_median"]),
                             _pct(r["abs_err_p90"])])
            overall = _overall(results, k, protocol, label)
            rows.append([protocol, "overall", label, overall["n"], f"{overall['pairwise_accuracy']:.3f}",
                         f"{overall['kendall_tau']:.3f}", f"{overall[f'top{k}_recall']:.2f}",
                         _pct(overall["abs_err_median"]), _pct(overall["abs_err_p90"])])
            out += [{**{key: v for key, v in r.items() if key not in _ARRAYS}, "simulator": label, "protocol": protocol}
                    for r in results]
            out.append(overall)
            for m in by_kind_mix(results):
                mix_rows.append([m["mix"], protocol, label, m["n"], m["pairs"], f"{m['pairwise_accuracy']:.3f}",
                                 _pct(m["abs_err_median"]), _pct(m["abs_err_p90"])])
                out.append({"domain": "by-mix", **m, "simulator": label, "protocol": protocol})
    return rows, out, mix_rows


def _split_table(blocks: list, split: list, out: list) -> list:
    """Per protocol, simulator that replays strategies with ``tensor_parallel`` and test domain,
    its error on the domain's such strategies (``split``: domains of those only): the table's rows;
    their JSON records are appended to ``out``."""
    import numpy as np

    rows = []
    for protocol, entries in blocks:
        for label, sim, test in entries:
            if not getattr(sim, "replays_tensor_parallel", False):
                continue
            keys = {d.key for d in test}
            for d in split:
                if d.key not in keys:
                    continue
                signed = np.asarray(sim.predict_domain(d), float) / d.times_s - 1
                rows.append([d.key, protocol, label, len(signed), f"{np.median(signed):+.1%}",
                             _pct(float(np.median(np.abs(signed)))), _pct(float(np.percentile(np.abs(signed), 90)))])
                out.append({"domain": d.key, "tensor_parallel": True, "simulator": label, "protocol": protocol,
                            "n": len(signed), "signed_err_median": float(np.median(signed)),
                            "abs_err_median": float(np.median(np.abs(signed))),
                            "abs_err_p90": float(np.percentile(np.abs(signed), 90))})
    return rows


#: Per-strategy arrays of :func:`~synctune.simulator.evaluate` results, not printed as JSON.
_ARRAYS = ("errors", "pred", "truth", "mixes")


def _overall(results: list[dict], k: int, protocol: str, label: str) -> dict:
    """Means of the per-domain metrics; absolute errors pooled over every strategy."""
    import numpy as np

    errors = [r["errors"] for r in results if r["errors"] is not None]
    pooled = np.concatenate(errors) if errors else None
    return {"domain": "overall", "simulator": label, "protocol": protocol, "n": sum(r["n"] for r in results),
            **{key: float(np.nanmean([r[key] for r in results]))
               for key in ("pairwise_accuracy", "kendall_tau", f"top{k}_recall")},
            "abs_err_median": float(np.median(pooled)) if pooled is not None else None,
            "abs_err_p90": float(np.percentile(pooled, 90)) if pooled is not None else None}


@sim_group.command("profile")
@model_option(required=True, runnable=True)
@click.option("--cluster", "-c", required=True, help="Cluster preset or spec: its devices set the workers.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(0, 10_000))
@click.option("--iters", default=10, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--batch-size", type=click.IntRange(1, 1 << 24), help="Per-worker batch (default: the model's).")
def profile_cmd(model, cluster, warmup, iters, batch_size) -> None:
    """Measure a workload's compute profile (the replay simulator's input) with as many
    concurrent CPU workers as CLUSTER has devices, and file it in the data folder."""
    from ..engine.local import WorkerFailure
    from ..engine.profile import profile_compute
    from ..run.profiles import save_profile
    from ..spec.errors import InfraError
    from ._common import resolve_workload_arg

    spec_cluster = resolve_cluster_arg(cluster)
    if spec_cluster.device_kind != "cpu":
        raise SpecError(f"--cluster {cluster}: profiles are measured on this machine's CPU workers; cluster "
                        f"{spec_cluster.name} has GPU nodes (a trial on them records theirs)")
    workload = resolve_workload_arg(model)
    workers = spec_cluster.num_devices
    echo_err(f"profiling {workload.name} with {workers} concurrent workers: {warmup} warm-up + {iters} timed "
             f"iterations")
    try:
        profile = profile_compute(workload, workers=workers, batch_size=batch_size, warmup=warmup, iters=iters)
    except WorkerFailure as exc:
        raise InfraError(f"profiling {workload.name}: {exc}") from None
    path = save_profile(profile)
    click.echo(f"{profile.model} on {workers} {profile.device} workers (batch {profile.batch_size} each): forward "
               f"{profile.forward_s * 1e3:.1f} ms, backward {profile.backward_s * 1e3:.1f} ms, step "
               f"{profile.step_s * 1e3:.1f} ms; wrote {path}")


def _named_model(path: str, name: str):
    """The zoo model a strategy file names; a model outside the zoo has to be given."""
    from ..workload.source import model_source

    try:
        source = model_source(name)
    except SpecError:
        source = None
    if source is None or source.kind != "zoo":
        raise SpecError(f"{path}: built for model {name[:60]!r}, which is not in the zoo: give it with --model "
                        f"(its spec file or workload import path)")
    return source.spec()


@sim_group.command("score")
@click.argument("sim_file")
@click.argument("strategies", nargs=-1, required=True)
@model_option(help="Model: a zoo model, a model spec file or your workload (package.module:factory, "
                   "path/to/file.py:factory); default: the zoo model each strategy names.")
@click.option("--cluster", "-c", help="Cluster (default: the preset each strategy names).")
def score_cmd(sim_file, strategies, model, cluster) -> None:
    """Score strategy files (higher is better); the analytic estimate is shown in seconds."""
    from ..simulator import AnalyticSimulator, load_simulator
    from ..strategy import load_strategy, validate

    sim = load_simulator(sim_file)
    given = model.spec() if model is not None else None
    rows = []
    for path in strategies:
        s = load_strategy(path)
        m = given if given is not None else _named_model(path, s.model["name"])
        c = resolve_cluster_arg(cluster or s.cluster["name"])
        try:
            validate(s, m, c)
        except SpecError as exc:
            raise SpecError(f"{path}: {exc}") from None
        score = float(sim.score([s], m, c)[0])
        est = float(AnalyticSimulator().predict([s], m, c)[0])
        rows.append([path, f"{score:.4g}", f"{est * 1e3:.1f}", s.summary()[:80]])
    click.echo(table(["strategy", f"{sim.kind} score", "analytic ms", "summary"], rows, right=[1, 2]))


@sim_group.command("memory")
@_data
@click.option("--activations", type=click.Choice(["reference", "measured"]), default="reference", show_default=True,
              help="Where the strategy-independent memory (activations, batch, temporaries) comes from: the "
                   "all-reduce trials of the same model and batch, or each row's own saved activations.")
@click.option("--json", "as_json", is_flag=True)
def memory_cmd(data, activations, as_json) -> None:
    """The memory model's error on recorded trials: per cluster, the median and 90th percentile of
    |predicted - measured| / measured over every rank of every trial that measured its memory part by
    part (rows without a breakdown are skipped)."""
    import statistics

    from ..data import TrialDataset, dataset_dir
    from ..simulator.memory import memory_errors

    ds = TrialDataset(data or dataset_dir())
    rows = memory_errors(ds.records(), activations=activations)
    if not rows:
        raise SpecError(f"{ds.root}: no successful trial with a per-rank memory breakdown (run trials with this "
                        f"version: `synctune trial`)")
    by_cluster: dict[str, list[float]] = {}
    for r in rows:
        by_cluster.setdefault(r["cluster"], []).append(r["error"])
    summary = [{"cluster": c, "ranks": len(e), "median_error": statistics.median(e),
                "p90_error": sorted(e)[min(len(e) - 1, int(0.9 * len(e)))]} for c, e in sorted(by_cluster.items())]
    if as_json:
        click.echo(json.dumps({"clusters": summary, "ranks": rows}, indent=1, default=str))
        return
    click.echo(table(["cluster", "ranks", "median |pred-meas|/meas", "p90"],
                     [[s["cluster"], s["ranks"], _pct(s["median_error"]), _pct(s["p90_error"])] for s in summary],
                     right=(1, 2, 3)))
