"""Shared fixtures: the source root is importable without an install (pytest's pythonpath)."""

from __future__ import annotations

import os

import pytest

# Tests never join a Ray instance running elsewhere on the machine.
os.environ.setdefault("RAY_ADDRESS", "local")


@pytest.fixture(scope="session")
def zoo_specs():
    """Model specs of every zoo model (built once, on the meta device)."""
    from synctune.models import MODELS, model_spec

    return {name: model_spec(name) for name in MODELS}
