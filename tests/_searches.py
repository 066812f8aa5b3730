"""Helpers for tests that run `synctune search` as a subprocess with its own data home."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_experiment(folder: Path, budget: int, ddp_trials: int = 0, confirm_rounds: int = 0, iters: int = 3) -> Path:
    """A real but tiny search: cnn-small on 2 local workers, the analytic simulator; no tuned
    DDP and no confirmation unless asked for. A test that must catch the search mid-way asks
    for more ``iters``: a warm trial of 3 iterations takes about 0.2 s, so a whole search can
    finish between two looks at its dataset."""
    path = folder / "tiny.yaml"
    path.write_text(f"name: tiny\nmodel: cnn-small\ncluster: local-1x2\nbudget: {budget}\nalgorithm: autodist\n"
                    "simulator: analytic\nproposals: 50\ncandidates: 2\nwarmup: 1\n"
                    f"iters: {iters}\n"
                    f"baselines: [allreduce, ps-lb, partitioned-ps]\nddp_trials: {ddp_trials}\n"
                    f"confirm_rounds: {confirm_rounds}\nconfirm_iters: 2\n")
    return path


def search_env(home: Path) -> dict:
    """The environment of a `synctune search` subprocess with its own data home."""
    env = dict(os.environ, SYNCTUNE_HOME=str(home), PYTHONPATH=str(ROOT / "platform"))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return env
