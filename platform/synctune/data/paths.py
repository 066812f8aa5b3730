"""Where synctune keeps its data: ``$SYNCTUNE_HOME``, else ``$XDG_DATA_HOME/synctune``, else
``~/.local/share/synctune``. Inside: ``dataset/`` (the local Parquet dataset), ``mlflow.db``
(the default SQLite MLflow store) and ``mlartifacts/`` (its artifacts)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_home", "dataset_dir", "default_tracking_uri", "artifact_root"]


def data_home() -> Path:
    """The synctune data folder (created on first use)."""
    if os.environ.get("SYNCTUNE_HOME"):
        home = Path(os.environ["SYNCTUNE_HOME"])
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        home = base / "synctune"
    home.mkdir(parents=True, exist_ok=True)
    return home


def dataset_dir() -> Path:
    """The local Parquet dataset."""
    return data_home() / "dataset"


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a SQLite store in the data folder (MLflow 3.17
    refuses a plain ``./mlruns`` file store)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_home() / 'mlflow.db'}"


def artifact_root() -> Path:
    """Where MLflow experiments created by synctune keep their artifacts."""
    return data_home() / "mlartifacts"
