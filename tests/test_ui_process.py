"""`synctune ui` owns its process tree: stopped the way a service manager or a closing terminal
stops it, it takes the MLflow server and every process that server started down with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _browser import wait_until_serving

from synctune.engine.local import free_port

ROOT = Path(__file__).resolve().parents[1]


def _alive(pids: set[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return alive


def _marked(home: Path) -> list[str]:
    """Processes whose environment names ``home`` as the data home: the UI's whole tree, orphans
    included (every process it starts inherits the variable)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("SYNCTUNE_HOME") == str(home):
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_ui_stopped_by_a_signal_leaves_no_process_of_its_tree(tmp_path, sig):
    port = free_port()
    store = tmp_path / "mlflow.db"
    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    env.pop("MLFLOW_TRACKING_URI", None)
    ui = subprocess.Popen([sys.executable, "-m", "synctune", "ui", "--port", str(port), "--tracking-uri",
                           f"sqlite:///{store}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          start_new_session=True)
    tree: set[int] = set()
    home = tmp_path / "home"
    try:
        wait_until_serving(ui, port, 180)
        # Signalled as soon as it serves, while MLflow still starts its job consumers (the moment
        # a signal to the server alone left four of them running): every process of the tree
        # then, and every process started since that carries this test's data home.
        tree = {p.pid for p in psutil.Process(ui.pid).children(recursive=True)}
        assert len(tree) >= 2, "expected the MLflow server and its workers under synctune ui"
        ui.send_signal(sig)
        ui.wait(timeout=60)
        # Once the command has exited its tree is gone (it waits for it), not draining for
        # seconds more: the old UI's orphans still ran 5 s later, and some never stop.
        deadline = time.monotonic() + 2
        while (_alive(tree) or _marked(home)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(tree) == []
        assert _marked(home) == []
        assert ui.returncode == 128 + sig
        assert ui.stderr.read().decode().strip().splitlines()[-1] == f"synctune: terminated by {sig.name}"
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait(timeout=10)
        for pid in tree | {int(line.split(":")[0]) for line in _marked(home)}:  # ours to stop, by id
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
