"""Helpers shared by CLI commands: resolving --model/--cluster, tables, atomic output files."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import click

from ..spec._util import write_text_atomic
from ..spec.cluster import ClusterSpec, resolve_cluster
from ..spec.errors import SpecError
from ..spec.model import ModelSpec

__all__ = ["resolve_model", "resolve_cluster_arg", "node_network", "table", "write_text_atomic", "echo_err"]


def resolve_model(name_or_path: str) -> ModelSpec:
    """A zoo model by name, or a model spec JSON file (as written by ``synctune models NAME --json``)."""
    from ..models.zoo import MODELS, model_spec

    if name_or_path in MODELS:
        return model_spec(name_or_path)
    path = Path(name_or_path)
    if path.suffix.lower() == ".json" or path.exists():
        import json

        try:
            text = path.read_text()
        except FileNotFoundError:
            raise SpecError(f"{path}: no such model spec file") from None
        except OSError as exc:
            raise SpecError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        return ModelSpec.from_dict(data, where=str(path))
    raise SpecError(f"unknown model {name_or_path!r}: not in the zoo ({', '.join(MODELS)}) nor a .json model spec")


def resolve_cluster_arg(name_or_path: str) -> ClusterSpec:
    """A cluster preset by name or a cluster spec YAML file. A lab preset that was calibrated
    (``synctune lab calibrate``) resolves to its calibrated spec: measured link speeds."""
    cluster = resolve_cluster(name_or_path)
    from ..spec.cluster import is_lab_cluster

    if is_lab_cluster(cluster) and name_or_path == cluster.name:
        from ..lab.calibrate import calibrated_spec

        return calibrated_spec(cluster.name) or cluster
    return cluster


def node_network(cluster: ClusterSpec):
    """The lab network a lab cluster's workers run in (None for other clusters); one clear
    error when the lab is not up with this preset."""
    from ..spec.cluster import is_lab_cluster

    if not is_lab_cluster(cluster):
        return None
    from ..lab.netns import lab_attach

    return lab_attach(cluster)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = ()) -> str:
    """Plain-text table with aligned columns (``right`` lists the right-aligned column indices)."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    right = set(right)

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def echo_err(message: str) -> None:
    """One line to stderr (progress and notes that must not mix with JSON on stdout)."""
    click.echo(message, err=True)
