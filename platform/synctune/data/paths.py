"""Where synctune keeps its data: ``$SYNCTUNE_HOME``, else ``$XDG_DATA_HOME/synctune``, else
``~/.local/share/synctune``. Inside: ``dataset/`` (the local Parquet dataset), ``mlflow.db``
(the default SQLite MLflow store) and ``mlartifacts/`` (its artifacts)."""

from __future__ import annotations

import os
from pathlib import Path

from ..spec.errors import SpecError
from ..spec.files import check_path

__all__ = ["data_home", "dataset_dir", "profiles_dir", "default_tracking_uri", "artifact_root"]


def data_home() -> Path:
    """The synctune data folder (created on first use); one clear error when it cannot be."""
    if os.environ.get("SYNCTUNE_HOME"):
        home, what = Path(check_path(os.environ["SYNCTUNE_HOME"], "SYNCTUNE_HOME")), "SYNCTUNE_HOME"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        home, what = base / "synctune", "the synctune data folder"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{what} {home}: cannot create it ({exc.strerror or exc}); set SYNCTUNE_HOME to a "
                        f"writable folder") from None
    if not os.access(home, os.W_OK | os.X_OK):
        raise SpecError(f"{what} {home}: not writable; set SYNCTUNE_HOME to a writable folder")
    return home


def dataset_dir() -> Path:
    """The local Parquet dataset."""
    return data_home() / "dataset"


def profiles_dir() -> Path:
    """Measured compute profiles (``synctune sim profile``), one JSON file per (model, device,
    workers): the replay simulator's compute input."""
    return data_home() / "profiles"


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a SQLite store in the data folder (MLflow 3.17
    refuses a plain ``./mlruns`` file store)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_home() / 'mlflow.db'}"


def artifact_root() -> Path:
    """Where MLflow experiments created by synctune keep their artifacts."""
    return data_home() / "mlartifacts"
