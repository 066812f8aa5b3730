"""A user's workload is untrusted code: whatever way it leaves (sys.exit, KeyboardInterrupt, a
BaseException, os._exit, a hang, a thread or a process left running, a NaN loss), the command
ends within a bound with one line naming the step and status 2, and nothing it started remains."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every case ends well within this; the hanging ones at the trial timeout given below.
BOUND_S = 120
TIMEOUT_S = 8
# The command as the ``synctune`` script starts it: ``-P`` keeps the current folder off sys.path.
# ``python -m`` would put it first before any of synctune runs, so a user's ``types.py`` there
# shadows Python's during the interpreter's own start (a fresh virtual environment shows it).
SYNCTUNE = [sys.executable, "-P", "-m", "synctune"]

GOOD = """
import torch, torch.nn as nn
import synctune.workload as sw

def batch(n, rank, g):
    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)

def loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])

def workload():
    return sw.define(name="tiny", model=lambda: nn.Linear(4, 2), batch=batch, loss=loss, batch_size=8)
"""

# name -> (code appended to GOOD or replacing it, the step the error must name, more it must say)
CASES = {
    "import-exit-0": ("import sys\nsys.exit(0)\n", "import", "sys.exit"),
    "import-exit-3": ("import sys\nsys.exit(3)\n", "import", "sys.exit"),
    "import-keyboard-interrupt": ("raise KeyboardInterrupt\n", "import", "KeyboardInterrupt"),
    "import-base-exception": ("class Boom(BaseException):\n    pass\nraise Boom('no')\n", "import", "Boom"),
    "import-non-daemon-thread": (GOOD + "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), "
                                 "name='stuck').start()\n", "import", "non-daemon thread"),
    "import-child-process": (GOOD + "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                             "'import time; time.sleep(3600)', MARKER])\n", "import", "child process"),
    "import-child-own-session": (GOOD + "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                                 "'import time; time.sleep(3600)', MARKER], start_new_session=True)\n", "import",
                                 "child process"),
    "factory-exit-0": (GOOD + "def workload():\n    import sys\n    sys.exit(0)\n", "factory", "sys.exit(0)"),
    "factory-os-exit": (GOOD + "def workload():\n    import os\n    os._exit(0)\n", "factory", "exited with status 0"),
    "factory-never-returns": (GOOD + "def workload():\n    import time\n    time.sleep(3600)\n", "factory",
                              f"did not finish within {TIMEOUT_S} s"),
    "loss-exit-0": (GOOD + "def loss(m, b):\n    import sys\n    sys.exit(0)\n", "loss", "sys.exit(0)"),
    "loss-never-returns": (GOOD + "def loss(m, b):\n    import time\n    time.sleep(3600)\n", "loss",
                           f"did not finish within {TIMEOUT_S} s"),
    "loss-nan": (GOOD + "def loss(m, b):\n    return nn.functional.cross_entropy(m(b[0]), b[1]) * float('nan')\n",
                 "first step", "loss is nan"),
}
STEP_WORDS = {"import": "importing", "factory": "factory", "loss": "loss", "first step": "first step"}


def _env(home: Path) -> dict:
    env = dict(os.environ, SYNCTUNE_HOME=str(home), PYTHONPATH=str(ROOT / "platform"))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("RAY_ADDRESS", None)
    return env


def _left_behind(marker: str) -> list[str]:
    """Processes whose command line holds ``marker`` (the case's folder): the checker and what
    the workload started, both named by it."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or ()):
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}")
        except psutil.Error:
            continue
    return found


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([*SYNCTUNE, *args], cwd=cwd, env=_env(cwd / "home"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail(f"synctune {' '.join(args)} did not end within {BOUND_S} s")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _write_case(folder: Path, name: str) -> str:
    code = CASES[name][0]
    (folder / "job.py").write_text(f"MARKER = {str(folder)!r}\n" + textwrap.dedent(code))
    return "job.py:workload"


def _assert_refused(done: subprocess.CompletedProcess, name: str, folder: Path) -> None:
    _code, step, detail = CASES[name]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("synctune: error: workload '") and "job.py:workload'" in lines[0], lines[0]
    assert STEP_WORDS[step] in lines[0] and detail in lines[0], lines[0]
    assert done.stdout == ""
    deadline = time.monotonic() + 5  # a process killed a moment ago may still be in the table
    while _left_behind(str(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _left_behind(str(folder)) == []


@pytest.mark.parametrize("name", list(CASES))
def test_trial_refuses_a_hostile_workload_in_one_line(tmp_path, name):
    path = _write_case(tmp_path, name)
    started = time.monotonic()
    done = _run(["trial", "-w", path, "-c", "local-1x2", "--builder", "allreduce", "--timeout", str(TIMEOUT_S),
                 "--no-record", "--warmup", "1", "--iters", "1"], tmp_path)
    _assert_refused(done, name, tmp_path)
    assert time.monotonic() - started < TIMEOUT_S + 60


@pytest.mark.parametrize("name", ["import-exit-0", "loss-exit-0", "import-child-process"])
def test_models_refuses_a_hostile_workload_in_one_line(tmp_path, name):
    done = _run(["models", "-w", _write_case(tmp_path, name), "--json"], tmp_path)
    _assert_refused(done, name, tmp_path)


@pytest.mark.parametrize("name", ["import-exit-0", "factory-never-returns", "loss-nan"])
def test_search_refuses_a_hostile_workload_before_any_trial(tmp_path, name):
    path = _write_case(tmp_path, name)
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(f"name: hostile\nworkload: {path}\ncluster: local-1x2\nbudget: 2\nalgorithm: autodist\n"
                          f"simulator: analytic\nwarmup: 1\niters: 1\ntimeout_s: {TIMEOUT_S}\n")
    done = _run(["search", str(experiment)], tmp_path)
    _assert_refused(done, name, tmp_path)
    assert not (tmp_path / "home" / "dataset").exists() or not any((tmp_path / "home" / "dataset").rglob("*.parquet"))


def test_a_good_workload_checks_in_a_child_and_gives_the_same_spec(tmp_path):
    """The spec the child process extracts is the one extracted in this process, and the command
    that checked it never imported the user's code (its name and batch come from the check)."""
    from synctune.workload import ImportedWorkload
    from synctune.workload.extract import workload_spec

    (tmp_path / "job.py").write_text(textwrap.dedent(GOOD))
    path = str(tmp_path / "job.py") + ":workload"
    workload = ImportedWorkload(path, str(tmp_path))
    before = {name for name in sys.modules if name.startswith("synctune_workload_")}
    checked = workload.check(60)
    # Other tests of the same session import workloads in this process; this check adds none.
    assert {name for name in sys.modules if name.startswith("synctune_workload_")} == before
    assert (workload.name, workload.batch_size) == ("tiny", 8)
    assert checked == workload_spec(ImportedWorkload(path, str(tmp_path)))
    assert [v.name for v in checked.variables] == ["bias", "weight"]


# ------------------------------------------------- a folder whose files are named like Python's modules

#: File names common in a research folder that are also Python's modules; each raises when
#: imported, so importing one instead of Python's fails the command.
STDLIB_NAMES = ["tokenize", "queue", "profile", "code", "trace", "pickle", "socket", "types", "json", "random"]


def _shadowing_folder(folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "mylayers.py").write_text("WIDTH = 4\n")  # a neighbour the workload imports: still found
    (folder / "job.py").write_text("import mylayers\n" + textwrap.dedent(GOOD))
    for name in STDLIB_NAMES:
        (folder / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s {name}.py was imported')\n")


@pytest.mark.parametrize("where", ["in-its-folder", "from-elsewhere"])
def test_files_named_like_standard_modules_beside_a_workload_change_nothing(tmp_path, where):
    """The workload's folder never goes before Python's own modules: synctune, torch and the
    checking process import Python's ``tokenize``, ``queue``, ``pickle``..., not the user's."""
    folder = tmp_path / "research"
    _shadowing_folder(folder)
    cwd = folder if where == "in-its-folder" else tmp_path
    path = "job.py:workload" if where == "in-its-folder" else f"{folder / 'job.py'}:workload"
    done = _run(["models", "-w", path, "--json"], cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "was imported" not in done.stderr


@pytest.mark.parametrize("start", ["auto", "spawn"])
def test_a_trial_in_a_folder_of_standard_module_names_runs(tmp_path, start):
    """The trial's workers (forked from the fork server, or fresh interpreters) and
    multiprocessing's resource tracker start in that folder and still import Python's modules."""
    _shadowing_folder(tmp_path)
    env = dict(_env(tmp_path / "home"), SYNCTUNE_WORKER_START=start)
    done = subprocess.run([*SYNCTUNE, "trial", "-w", "job.py:workload", "-c", "local-1x2",
                           "-b", "allreduce", "--warmup", "1", "--iters", "2", "--no-record"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "status ok" in done.stdout and "was imported" not in done.stderr, done.stderr[-2000:]


def test_a_workload_file_named_like_a_standard_module_is_imported_by_its_location(tmp_path):
    (tmp_path / "json.py").write_text(textwrap.dedent(GOOD))
    done = _run(["models", "-w", "json.py:workload", "--json"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_workload_importing_its_own_module_named_like_pythons_is_one_line(tmp_path, form):
    """The module it means is not the one it would get: one line naming the file to rename."""
    (tmp_path / "queue.py").write_text("SIZE = 3\n")
    (tmp_path / "job.py").write_text("import queue\n" + textwrap.dedent(GOOD))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "__init__.py").write_text(textwrap.dedent(GOOD))
    path = "job.py:workload" if form == "file" else "code:workload"
    done = _run(["models", "-w", path, "--json"], tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert f"{tmp_path / ('queue.py' if form == 'file' else 'code')} has the name of Python's" in lines[0], lines[0]
