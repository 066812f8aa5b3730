"""Lab calibration run for real: the lab layer says what to measure, the engine's local
launcher runs the probes inside the lab's namespaces, the data home keeps the result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.paths import data_home
from ..engine.local import run_local
from ..lab.calibrate import calibrate, calibrated_spec, save_calibration
from ..spec.cluster import ClusterSpec

__all__ = ["calibrate_lab", "calibrated_cluster"]


def calibrate_lab(cluster: ClusterSpec, state: dict[str, Any], *, on_step=None, save: bool = True
                  ) -> tuple[ClusterSpec, dict[str, Any], Path | None]:
    """Measure the lab ``state`` describes (``lab_status()['state']``); with ``save``, keep the
    calibrated spec in the data home, where ``--cluster PRESET`` then finds it."""
    spec, figures = calibrate(cluster, state, run_local, on_step=on_step)
    path = save_calibration(spec, figures, data_home()) if save else None
    return spec, figures, path


def calibrated_cluster(preset: str) -> ClusterSpec | None:
    """The calibrated spec of lab preset ``preset`` in the data home, or None."""
    return calibrated_spec(preset, data_home())
