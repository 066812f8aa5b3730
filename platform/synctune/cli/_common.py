"""Helpers shared by CLI commands: resolving --model/--cluster, tables, atomic output files."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import click

from ..spec.cluster import ClusterSpec, resolve_cluster
from ..spec.errors import SpecError
from ..spec.files import read_json, write_text_atomic
from ..spec.model import ModelSpec

__all__ = ["resolve_model", "resolve_workload_arg", "resolve_cluster_arg", "node_network", "table",
           "write_text_atomic", "echo_err"]


def resolve_model(name_or_path: str) -> ModelSpec:
    """A zoo model by name, or a model spec JSON file (as written by ``synctune models NAME --json``)."""
    from ..models.zoo import MODELS
    from ..workload import zoo_workload

    if name_or_path in MODELS:
        return zoo_workload(name_or_path).spec()
    path = Path(name_or_path)
    if path.suffix.lower() == ".json" or path.exists():
        return ModelSpec.from_dict(read_json(path, "model spec"), where=str(path))
    raise SpecError(f"unknown model {name_or_path[:60]!r}: not in the zoo ({', '.join(MODELS)}) nor a .json "
                    f"model spec")


def resolve_workload_arg(name: str):
    """The workload a trial or search runs: a zoo model by name, or a user's workload by import
    path (a model spec file describes a model but cannot train it). The user's code is imported,
    and one step of it run, here: every failure is one line before any trial starts."""
    from ..models.zoo import MODELS
    from ..workload import resolve_workload

    if name not in MODELS and Path(name).suffix.lower() == ".json":
        raise SpecError(f"{name}: a model spec file describes a model, it cannot run one; trials need a zoo model "
                        f"({', '.join(MODELS)}) or a workload (package.module:factory, file.py:factory)")
    workload = resolve_workload(name)
    workload.spec()
    return workload


def resolve_cluster_arg(name_or_path: str) -> ClusterSpec:
    """A cluster preset by name or a cluster spec YAML file. A lab preset that was calibrated
    (``synctune lab calibrate``) resolves to its calibrated spec: measured link speeds."""
    cluster = resolve_cluster(name_or_path)
    from ..spec.cluster import is_lab_cluster

    if is_lab_cluster(cluster) and name_or_path == cluster.name:
        from ..run.lab import calibrated_cluster

        return calibrated_cluster(cluster.name) or cluster
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


#: Whether :func:`start_ray` initialized Ray in this process (the command then shuts it down).
RAY_STARTED_HERE = False


def start_ray(address: str, num_cpus: int | None = None, **kwargs) -> None:
    """Join (or, with ``local``, start) Ray; a cluster that cannot be reached is one line, exit 1."""
    import ray

    from ..spec.errors import InfraError

    if ray.is_initialized():
        return
    options = {"address": address, "log_to_driver": False, **kwargs}
    if address == "local":
        options.update(num_cpus=num_cpus, include_dashboard=False)
    global RAY_STARTED_HERE
    try:
        ray.init(**options)
        RAY_STARTED_HERE = True
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InfraError(f"cannot {'start' if address == 'local' else 'connect to'} Ray at {address!r}: "
                         f"{first[:300]}") from None
    # Ray's core installs a handler that aborts on SIGTERM: take SIGTERM and SIGHUP back, so the
    # command unwinds (slices released, Ray shut down) and says so in one line.
    from . import install_signal_handlers

    install_signal_handlers()
