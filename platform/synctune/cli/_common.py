"""Helpers shared by CLI commands: the --model option and --cluster, tables, atomic output files."""

from __future__ import annotations

from typing import Iterable, Sequence

import click

from ..spec.cluster import ClusterSpec, resolve_cluster
from ..spec.errors import SpecError
from ..spec.files import write_text_atomic
from ..spec.model import ModelSpec

__all__ = ["FiniteFloatRange", "MODEL", "RUNNABLE_MODEL", "ModelType", "model_option", "resolve_model", "resolve_workload_arg",
           "resolve_cluster_arg", "node_network", "table", "write_text_atomic", "echo_err"]


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` (which passes every comparison of a range
    check) and ``inf``: no fraction, size or time given on the command line is either."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


class ModelType(click.ParamType):
    """A model as the user names it on the command line: a zoo model, a model spec file or a
    workload import path, converted to a :class:`~synctune.workload.ModelSource`. Converting
    reads no file and imports no user code (nor torch); with ``runnable``, a spec file is
    refused at once (a trial needs something it can train)."""

    name = "model"

    def __init__(self, *, runnable: bool = False) -> None:
        self.runnable = runnable

    def get_metavar(self, param, ctx=None) -> str:  # noqa: ARG002 - click's signature
        return "MODEL"

    def convert(self, value, param, ctx):
        from ..workload.source import ModelSource, model_source

        if isinstance(value, ModelSource):
            return value
        try:
            source = model_source(value)
            if self.runnable and not source.runnable:
                source.workload()  # says why a spec file cannot run
        except SpecError as exc:
            self.fail(str(exc), param, ctx)
        return source


MODEL = ModelType()
RUNNABLE_MODEL = ModelType(runnable=True)

MODEL_HELP = ("Zoo model, model spec file (.json, .yaml) or your workload's import path (package.module:factory, "
              "path/to/file.py:factory).")
RUNNABLE_MODEL_HELP = "Zoo model or your workload's import path (package.module:factory, path/to/file.py:factory)."


def _one_model(ctx: click.Context, param: click.Parameter, value: tuple):
    if len(value) > 1:
        raise click.BadParameter(f"give one model, got {len(value)}: {', '.join(v.text for v in value)}", ctx, param)
    return value[0] if value else None


class _ModelOption(click.Option):
    """The model option; its errors name it by its two long spellings, not all four."""

    def get_error_hint(self, ctx: click.Context) -> str:  # noqa: ARG002 - click's signature
        return "'--model' / '--workload'"


def model_option(*, required: bool = False, multiple: bool = False, runnable: bool = False, help: str | None = None):
    """The one option every command that takes a model uses: ``--model``/``-m``, also spelled
    ``--workload``/``-w``, whose value is a zoo model, a model spec file or a workload import
    path (only a zoo model or a workload with ``runnable``). The command gets a
    :class:`~synctune.workload.ModelSource` (a tuple of them with ``multiple``; None when the
    option is optional and absent); giving it twice without ``multiple`` is a usage error."""
    text = help or (RUNNABLE_MODEL_HELP if runnable else MODEL_HELP) + (" Repeatable." if multiple else "")
    return click.option("--model", "-m", "--workload", "-w", "model", cls=_ModelOption,
                        type=RUNNABLE_MODEL if runnable else MODEL, multiple=True, required=required,
                        callback=None if multiple else _one_model, help=text)


def _source(model):
    from ..workload.source import ModelSource, model_source

    return model if isinstance(model, ModelSource) else model_source(model)


def resolve_model(model) -> ModelSpec:
    """The model spec of ``model``: a :class:`~synctune.workload.ModelSource` (a ``--model``'s
    value) or its text (a zoo model, a model spec file, a workload import path)."""
    return _source(model).spec()


def resolve_workload_arg(model, *, timeout_s: float | None = None):
    """The workload a trial or search runs: a zoo model by name, or a user's workload by import
    path (a model spec file describes a model but cannot train it); ``model`` is a
    :class:`~synctune.workload.ModelSource` or its text. The user's code is imported, and one
    step of it run, here, in a child process bounded by ``timeout_s`` (the trial's timeout;
    default the default one): every failure is one line, naming the step, before any trial
    starts, and nothing the code started outlives the check."""
    from ..workload.define import ImportedWorkload

    workload = _source(model).workload()
    if isinstance(workload, ImportedWorkload):
        workload.check(timeout_s)
    else:
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
    from ..cluster.local import join_loopback

    join_loopback(address)
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
    from ._signals import install_signal_handlers

    install_signal_handlers()
