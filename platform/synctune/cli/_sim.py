"""``synctune sim train|eval|score``."""

from __future__ import annotations

import json

import click

from ..spec.errors import SpecError
from . import cli
from ._common import echo_err, resolve_cluster_arg, resolve_model, table


@cli.group("sim")
def sim_group() -> None:
    """The simulator: train rankers on the dataset, evaluate them, score strategies."""


def _domains(data: str | None, selected: tuple[str, ...]):
    from ..data import TrialDataset, dataset_dir
    from ..simulator import domains_from_records

    ds = TrialDataset(data or dataset_dir())
    domains = domains_from_records(ds.records())
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
@click.option("--model", "kind", type=click.Choice(["linear", "rnn", "gat"]), default="rnn", show_default=True,
              help="Which ranker.")
@_data
@_domain
@click.option("--epochs", default=150, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--held-out", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Share of each domain kept out of training.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="Simulator file to write.")
def train_cmd(kind, data, domains, epochs, seed, held_out, output) -> None:
    """Train a ranker with AutoSync's pairwise ranking loss on dataset trials."""
    from tqdm import tqdm

    from ..simulator import make_simulator, split_domains

    from ..spec.files import check_writable

    check_writable(output)  # before training, not after
    doms = _domains(data, domains)
    if held_out > 0:
        doms, _ = split_domains(doms, held_out, seed)
    sim = make_simulator(kind, epochs=epochs, seed=seed)
    bar = tqdm(total=epochs, desc=f"train {kind}", unit="epoch", disable=None)
    sim.fit(doms, log=lambda epoch, loss: (bar.update(epoch - bar.n), bar.set_postfix_str(f"loss {loss:.3f}")))
    bar.close()
    sim.save(output)
    echo_err(f"trained {kind} on {sum(len(d.strategies) for d in doms)} trials of "
             f"{', '.join(d.key for d in doms)}; wrote {output}")


@sim_group.command("eval")
@click.argument("sim_file")
@_data
@_domain
@click.option("--held-out", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Evaluate on the held-out share only (use the same --seed as training).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, (1 << 63) - 1))
@click.option("--k", default=5, show_default=True, type=click.IntRange(1, 100_000), help="k of the top-k recall.")
@click.option("--json", "as_json", is_flag=True)
def eval_cmd(sim_file, data, domains, held_out, seed, k, as_json) -> None:
    """Ranking accuracy, Kendall's tau and top-k recall of SIM_FILE (or 'analytic'), next to the
    training-free analytic model, per domain."""
    from ..simulator import AnalyticSimulator, evaluate, load_simulator, split_domains

    sim = load_simulator(sim_file)
    doms = _domains(data, domains)
    if held_out > 0:
        _, doms = split_domains(doms, held_out, seed)
    rows, out = [], []
    base = {r["domain"]: r for r in evaluate(AnalyticSimulator(), doms, k)}
    for r in evaluate(sim, doms, k):
        b = base[r["domain"]]
        out.append({**r, "analytic_pairwise_accuracy": b["pairwise_accuracy"]})
        rows.append([r["domain"], r["n"], f"{r['pairwise_accuracy']:.3f}", f"{b['pairwise_accuracy']:.3f}",
                     f"{r['kendall_tau']:.3f}", f"{r[f'top{k}_recall']:.2f}"])
    if as_json:
        click.echo(json.dumps(out, indent=1))
        return
    click.echo(table(["domain", "trials", f"{sim.kind} acc", "analytic acc", "kendall tau", f"top-{k} recall"], rows,
                     right=[1, 2, 3, 4, 5]))
    mean = lambda key: sum(o[key] for o in out) / len(out)  # noqa: E731
    click.echo(f"mean pairwise ranking accuracy: {sim.kind} {mean('pairwise_accuracy'):.3f}, "
               f"analytic {mean('analytic_pairwise_accuracy'):.3f}")


@sim_group.command("score")
@click.argument("sim_file")
@click.argument("strategies", nargs=-1, required=True)
@click.option("--model", "-m", help="Model (default: the one each strategy names).")
@click.option("--cluster", "-c", help="Cluster (default: the preset each strategy names).")
def score_cmd(sim_file, strategies, model, cluster) -> None:
    """Score strategy files (higher is better); the analytic estimate is shown in seconds."""
    from ..simulator import AnalyticSimulator, load_simulator
    from ..strategy import load_strategy, validate

    sim = load_simulator(sim_file)
    rows = []
    for path in strategies:
        s = load_strategy(path)
        m = resolve_model(model or s.model["name"])
        c = resolve_cluster_arg(cluster or s.cluster["name"])
        try:
            validate(s, m, c)
        except SpecError as exc:
            raise SpecError(f"{path}: {exc}") from None
        score = float(sim.score([s], m, c)[0])
        est = float(AnalyticSimulator().predict([s], m, c)[0])
        rows.append([path, f"{score:.4g}", f"{est * 1e3:.1f}", s.summary()[:80]])
    click.echo(table(["strategy", f"{sim.kind} score", "analytic ms", "summary"], rows, right=[1, 2]))
