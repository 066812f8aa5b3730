"""Shared by the findings scripts: bringing a lab preset up for the duration of a block."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def lab(preset: str):
    """The lab up with ``preset`` (replacing whatever was up), calibrated; down afterwards.
    Yields (calibrated cluster spec, node network)."""
    from synctune.cli._common import node_network, resolve_cluster_arg
    from synctune.lab import lab_down, lab_status, lab_up
    from synctune.run import calibrate_lab
    from synctune.spec import cluster_preset

    nominal = cluster_preset(preset)
    try:
        lab_up(nominal)
        calibrate_lab(nominal, lab_status()["state"])
        cluster = resolve_cluster_arg(preset)
        yield cluster, node_network(cluster)
    finally:
        lab_down()


def load_benchmark(name: str):
    """A module of benchmarks/ (a folder of scripts, not a package), imported by name so that
    worker processes (spawned: they re-import by name, with this sys.path) find it too."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (what the dataset card and the notes paste)."""
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
