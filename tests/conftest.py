"""Shared fixtures: the source root is importable without an install (pytest's pythonpath)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from _optional import MARK, optional_mark, require_optional
from _searches import search_env, tiny_experiment

# Tests never join a Ray instance running elsewhere on the machine.
os.environ.setdefault("RAY_ADDRESS", "local")


def pytest_collection_modifyitems(config, items):
    """The gpu tier runs where CUDA is. On a machine without a GPU (no ``nvidia-smi``) its tests
    are skipped with the reason; on a GPU machine whose torch has no CUDA the install is broken,
    so they are marked as a missing optional part (skip outside CI, fail under it)."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    if shutil.which("nvidia-smi") is None:
        mark = pytest.mark.skip(reason="no CUDA device here: the gpu tier (python3 -m pytest -m gpu) runs on a GPU machine")
    else:
        mark = optional_mark("a CUDA build of torch", f"nvidia-smi is here but torch {torch.__version__} sees no CUDA "
                             f"device (torch.version.cuda={torch.version.cuda}); install torch's CUDA wheel")
    for item in gpu:
        item.add_marker(mark)


def pytest_runtest_setup(item):
    """Modules and tests marked by ``_optional.optional_mark`` need their optional part: the one rule
    of ``_optional.require_optional`` decides skip or fail."""
    for mark in item.iter_markers(MARK):
        require_optional(*mark.args)


@pytest.fixture(scope="module")
def local_ray():
    """Ray on this machine for one test module: 4 CPUs and 2 local-cpu nodes' worth of the node
    type resource (what a local-1x2 worker group reserves)."""
    import ray

    from synctune.cluster.workers import node_type_resource

    # address="local": never join another Ray instance running on this machine.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             resources={node_type_resource("local-cpu"): 2})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def zoo_specs():
    """Model specs of every zoo model (built once, on the meta device)."""
    from synctune.models import MODELS, model_spec

    return {name: model_spec(name) for name in MODELS}


@pytest.fixture(autouse=True, scope="session")
def _isolated_data_home(tmp_path_factory):
    """Tests never write into the user's synctune data folder or MLflow store."""
    home = tmp_path_factory.mktemp("synctune-home")
    saved = {k: os.environ.get(k) for k in ("SYNCTUNE_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["SYNCTUNE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_search(tmp_path_factory):
    """One real `synctune search` of 6 trials after 2 tuned-DDP trials, confirmed in 3 rounds,
    run once per session: (data home, experiment file, completed process). The search tests, the report tests and the browser checks read it."""
    folder = tmp_path_factory.mktemp("tiny-search")
    experiment = tiny_experiment(folder, 6, ddp_trials=2, confirm_rounds=3)
    done = subprocess.run([sys.executable, "-m", "synctune", "search", str(experiment)], env=search_env(folder / "home"),
                          capture_output=True, text=True, timeout=900, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "home", experiment, done


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process without interpreter teardown once TensorFlow is loaded in it.

    The Keras tests load TensorFlow into this process (specs, references), beside torch, Ray and
    Horovod. One full run ended with SIGSEGV after pytest had printed "398 passed": a native
    destructor at exit, not a test. The results are final here, so the exit status is pytest's
    own and nothing that matters is skipped."""
    if "tensorflow" in sys.modules:
        status = getattr(config, "_synctune_exitstatus", None)
        sys.stdout.flush()
        sys.stderr.flush()
        if status is not None:
            os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config._synctune_exitstatus = exitstatus
