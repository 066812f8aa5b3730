"""Hostile input and signals, tried as a new user would: every bad file, option or environment
ends with one line on stderr and exit status 2 (the user's input) or 1 (the environment), never
a traceback, never a file written outside its root, never a device replaced; SIGTERM and SIGHUP
leave no worker behind. A fuzz test feeds random bytes and random mutations of valid files to
each loader."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from synctune.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict | None = None):
    return CliRunner(env=env).invoke(cli, [str(a) for a in args])


def assert_one_line(result, code: int, fragment: str = "") -> str:
    """Exit status ``code``, exactly one line on stderr starting ``synctune:``, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synctune: "), result.stderr
    assert "Traceback" not in result.output
    assert fragment in lines[0], lines[0]
    return lines[0]


def write(path: Path, data: str | bytes) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


NODE = "  - instance_type: local-cpu\n"

# (file text, the fragment its one-line error names)
CLUSTER_FILES = [
    ("name: c\nnodes:\n  - instance_type: local-cpu\n    count: 1000000000\n", "count: expected a positive integer"),
    ("name: c\nnodes:\n  - instance_type: local-cpu\n    num_devices: 1000000000\n", "num_devices: expected an integer"),
    ("name: c\ndescription: &a [x, x, x]\nnodes:\n" + NODE, "YAML anchors (&a) are not supported"),
    ("name: c\nnodes:\n" + NODE + "name: d\n", "duplicate key 'name'"),
    ("name: c\nnodes:\n  - instance_type: local-cpu\n    nic_gbps: .inf\n", "inf is not a finite number"),
    ("name: c\nnodes:\n  - instance_type: local-cpu\n    nic_gbps: .nan\n", "nan is not a finite number"),
    (b"name: \xff\xfe\nnodes: []\n", "not UTF-8 text"),
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 levels deep"),
    ("name: " + "n" * 5000 + "\nnodes:\n" + NODE, "cluster name: expected a non-empty string"),
    ("", "expected a mapping, got NoneType"),
    ("name: c\nnodes: 3\n", "nodes: expected a non-empty list"),
    ("name: c\nnodes:\n  - 7\n", "nodes[0]: expected a mapping"),
    ("{1: 2, name: c, nodes: [x]}", "unknown key(s)"),
    ("name: c\nnodes:\n  - instance_type: local-cpu\n    count: " + "9" * 5000 + "\n", "Exceeds the limit"),
    ('{"name": "c", "nodes": [{"instance_type": "local-cpu", "count": ' + "9" * 5000 + "}]}", "Exceeds the limit"),
]
BILLION_LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)) + "name: *i\n"


@pytest.mark.parametrize("text, fragment", CLUSTER_FILES, ids=range(len(CLUSTER_FILES)))
def test_bad_cluster_files(tmp_path, text, fragment):
    path = write(tmp_path / "c.yaml", text)
    assert_one_line(run("clusters", path), 2, fragment)


def test_billion_laughs_is_refused_at_once(tmp_path):
    path = write(tmp_path / "c.yaml", BILLION_LAUGHS)
    start = time.monotonic()
    assert_one_line(run("clusters", path), 2, "YAML anchors")
    assert time.monotonic() - start < 5


EXPERIMENT = "name: e\nmodel: cnn-small\ncluster: local-1x2\nbudget: 4\nsimulator: analytic\n"


@pytest.mark.parametrize("extra, fragment", [
    ("baselines: null\n", "baselines: expected a list of builder names"),
    ('baselines: "ab"\n', "baselines: expected a list of builder names"),
    ("baselines: [allreduce, 7]\n", "baselines: expected a list of builder names"),
    ("seed: -1\n", "seed: expected an integer from 0"),
    ("seed: 1.0e+30\n", "seed: expected an integer from 0"),
    ("timeout_s: .nan\n", "nan is not a finite number"),
    ("proposals: 100000000000\n", "proposals: expected an integer from 1"),
    ("warmup: 10000000000\n", "warmup: expected an integer from 0"),
    ("search: {budget: 5}\n", "budget and search.budget are the same setting"),
    ("search: {algorithm: bayes}\n", "search.algorithm: expected one of autodist, random-guided, random, genetic"),
    ("trial: {warmup: -1}\n", "trial.warmup: expected an integer from 0"),
])
def test_bad_experiment_values(tmp_path, extra, fragment):
    path = write(tmp_path / "e.yaml", EXPERIMENT + extra)
    assert_one_line(run("search", path), 2, fragment)


def test_experiment_name_cannot_leave_the_data_folder(tmp_path):
    home = tmp_path / "deep" / "home"
    path = write(tmp_path / "e.yaml", EXPERIMENT.replace("name: e", "name: ../../.."))
    before = set(tmp_path.rglob("*"))
    assert_one_line(run("search", path, env={"SYNCTUNE_HOME": str(home)}), 2,
                    "name: expected a name of letters, digits")
    assert set(tmp_path.rglob("*")) - before <= {home, home.parent}
    assert_one_line(run("report", "../../../x", "--no-mlflow", env={"SYNCTUNE_HOME": str(home)}), 2,
                    "SEARCH: expected a name")


def test_search_checks_its_simulator_file_before_starting_ray(tmp_path):
    path = write(tmp_path / "e.yaml", EXPERIMENT.replace("simulator: analytic", "simulator: nowhere.pt"))
    start = time.monotonic()
    result = run("search", path, env={"SYNCTUNE_HOME": str(tmp_path / "home")})
    assert_one_line(result, 2, "nowhere.pt: no such simulator file")
    assert time.monotonic() - start < 10  # Ray takes longer than that to start


STRATEGY_PROBLEMS = [
    (b'{"schema": 1, "schema": 1}', "duplicate key 'schema'"),
    (b'{"schema": NaN}', "NaN is not a finite number"),
    (b"\xff" * 10, "not UTF-8 text"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"schema": 1, "model": {"name": "m", "hash": "h"}, "cluster": {"name": "c", "hash": "h"}, '
     b'"replicas": [], "batch_split": [], "plans": [{"variable": "v", "partition": [100000, 100000], '
     b'"shards": []}]}', "partition: expected a list of positive integers"),
    (b'{"schema": 1, "model": 3}', "missing key"),
]


@pytest.mark.parametrize("data, fragment", STRATEGY_PROBLEMS, ids=range(len(STRATEGY_PROBLEMS)))
def test_bad_strategy_files(tmp_path, data, fragment):
    path = write(tmp_path / "s.json", data)
    assert_one_line(run("strategy", "validate", path, "-m", "cnn-small", "-c", "local-1x2"), 2, fragment)


def test_bad_model_spec_files(tmp_path):
    spec = json.loads(run("models", "cnn-small", "--json").stdout)
    for change, fragment in [({"name": "m" * 5000}, "model name: expected"),
                             ({"compute_profile": 5}, "compute_profile: expected a list"),
                             ({"batch_size": 10**12}, "batch_size: expected an integer from 1")]:
        path = write(tmp_path / "m.json", json.dumps({**spec, **change}))
        assert_one_line(run("models", path), 2, fragment)


def _manifest(rel: Path, files: list) -> None:
    rel.mkdir(exist_ok=True)
    write(rel / "manifest.json", json.dumps({"format": "synctune-dataset-release", "schema_version": 1,
                                             "files": files}))


@pytest.mark.parametrize("files, fragment", [
    ([{"path": "a.parquet", "rows": 1, "sha256": 5}], "sha256: expected 64 lowercase hex digits"),
    ([{"path": 5, "rows": 1, "sha256": "0" * 64}], "path: expected a relative file path"),
    ([{"path": "a.parquet", "rows": "1", "sha256": "0" * 64}], "rows: expected a non-negative integer"),
    ([["a.parquet"]], "expected a mapping with path, rows and sha256"),
])
def test_bad_release_manifests(tmp_path, files, fragment):
    _manifest(tmp_path / "rel", files)
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "d", tmp_path / "rel"), 2, fragment)


def test_release_manifest_that_is_not_utf8_or_links_out_is_refused(tmp_path):
    rel = tmp_path / "rel"
    rel.mkdir()
    write(rel / "manifest.json", b'{"format": "\xff"}')
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "d", rel), 2, "not UTF-8 text")
    secret = write(tmp_path / "secret.parquet", b"not yours")
    digest = __import__("hashlib").sha256(secret.read_bytes()).hexdigest()
    _manifest(rel, [{"path": "data/part-0.parquet", "rows": 1, "sha256": digest}])
    (rel / "data").mkdir()
    (rel / "data" / "part-0.parquet").symlink_to(secret)
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "d", rel), 2, "is a symbolic link")
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").rglob("*.parquet"))


def test_damaged_simulator_files_are_one_line(tmp_path):
    import torch

    strategy = tmp_path / "s.json"
    assert run("strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    from synctune.simulator.features import GLOBAL_NAMES, PRE_NAMES, RAW_NAMES
    from synctune.simulator.replay import REPLAY_GLOBAL_NAMES, REPLAY_SHARD_NAMES
    from synctune.strategy import compressor_vocabulary

    config = {"epochs": 1, "lr": 0.1, "batch": 2, "partition_penalty": 0.0, "seed": 0, "hidden": 4,
              "raw": len(RAW_NAMES) + len(PRE_NAMES) + len(REPLAY_SHARD_NAMES),
              "global": len(GLOBAL_NAMES) + len(REPLAY_GLOBAL_NAMES), "compressors": compressor_vocabulary()}
    base = {"format": "synctune-simulator", "version": 3, "kind": "rnn", "config": json.dumps(config), "state": {}}
    for payload, fragment in [
        (dict(base, norm={}), "normalisation 'x_mean' missing"),
        (dict(base, config=json.dumps({**config, "compressors": ["none"]}), norm={}), "trained with compressors"),
        (dict(base, version=2, norm={}), "unsupported simulator version"),
        (dict(base, config=json.dumps({**config, "profiles": [{"schema": 1}]}), norm={}), "profile"),
        ({"format": "other"}, "not a synctune simulator file"),
    ]:
        path = tmp_path / "sim.pt"
        torch.save(payload, path)
        assert_one_line(run("sim", "score", path, strategy), 2, fragment)
    write(tmp_path / "sim.pt", b"\x00" * 100)
    assert_one_line(run("sim", "score", tmp_path / "sim.pt", strategy), 2, "not a readable synctune simulator")


def test_outputs_that_are_not_regular_files_are_never_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line(run("dataset", "export", "--data", tmp_path / "d", "--format", "csv", "-o", fifo), 2,
                    "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    assert_one_line(run("strategy", "build", "ps", "-m", "cnn-small", "-c", "local-1x2", "-o", link), 2,
                    "is a symbolic link")
    assert link.is_symlink() and not (tmp_path / "target.json").exists()
    assert_one_line(run("strategy", "build", "ps", "-m", "cnn-small", "-c", "local-1x2", "-o", "/proc/nope.json"),
                    2, "/proc/nope.json")
    assert_one_line(run("strategy", "build", "ps", "-m", "cnn-small", "-c", "local-1x2", "-o", tmp_path), 2,
                    "is a directory")


@pytest.mark.parametrize("args, fragment", [
    (["ui", "--port", "99999"], "Invalid value for '--port'"),
    (["sim", "train", "--held-out", "1.5", "-o", "x.pt"], "Invalid value for '--held-out'"),
    (["trial", "--bogus"], "No such option '--bogus'"),
    (["strategy", "build"], "Missing argument 'BUILDER'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "ps", "--iters", "0"], "Invalid value for '--iters'"),
    (["cluster", "calibrate", "local-1x2", "--mb", "0"], "Invalid value for '--mb'"),
    (["cluster", "calibrate", "no-such-cluster"], "unknown cluster 'no-such-cluster'"),
    (["cluster", "calibrate", "B7"], "has GPU nodes; calibrate it on a Ray cluster"),
    (["cluster", "calibrate", "local-1x2", "--save", "spec.json"], "give a .yaml file"),
    (["sim", "train", "--held-out", "nan", "-o", "x.pt"], "'--held-out': 'nan' is not a finite number"),
    (["sim", "train", "--alpha-ms", "nan", "-o", "x.pt"], "'--alpha-ms': 'nan' is not a finite number"),
    (["cluster", "calibrate", "local-1x2", "--mb", "nan"], "'--mb': 'nan' is not a finite number"),
    (["cluster", "up"], "starts a cluster on this machine only: give --local (on AWS: ray up cluster.yaml)"),
    (["cluster", "down"], "stops the cluster on this machine only: give --local (on AWS: ray down cluster.yaml)"),
    (["cluster", "up", "--local", "no-such.yaml"], "no-such.yaml: no such cluster config file"),
])
def test_usage_errors_are_one_line(args, fragment):
    assert_one_line(run(*args), 2, fragment)


def test_unusable_data_folder_is_found_before_the_trial_runs(tmp_path):
    home = write(tmp_path / "a-file", "not a folder")
    start = time.monotonic()
    result = run("trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "allreduce", env={"SYNCTUNE_HOME": str(home)})
    assert_one_line(result, 2, f"SYNCTUNE_HOME {home}: cannot create it")
    assert time.monotonic() - start < 10 and "status ok" not in result.stdout


def test_an_unknown_worker_start_is_one_line(tmp_path):
    result = run("trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "allreduce", "--iters", "2", "--no-record",
                 env={"SYNCTUNE_HOME": str(tmp_path / "home"), "SYNCTUNE_WORKER_START": "fork"})
    assert_one_line(result, 2, "SYNCTUNE_WORKER_START='fork': 'auto'")


def test_sim_train_checks_its_output_before_training(tmp_path):
    result = run("sim", "train", "--data", tmp_path / "d", "-o", tmp_path / "missing" / "x.pt")
    assert_one_line(result, 2, "folder")


def test_unreachable_stores_are_infrastructure_failures(tmp_path):
    blocker = write(tmp_path / "blocker", "a file where the store's folder should be")
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{blocker / 'mlflow.db'}", "SYNCTUNE_HOME": str(tmp_path / "h")}
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "h" / "dataset").append(make_records(1))
    assert_one_line(run("mlflow", "sync", env=env), 1, "unavailable")
    from synctune.engine.local import free_port

    url = f"http://127.0.0.1:{free_port()}/release"
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "d", url), 1, "cannot connect")


# ------------------------------------------------------------------------------------ signals


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _ranks(pid: int) -> list:
    """The trial's worker processes under ``pid``, started (spawned, or forked from the fork
    server): not multiprocessing's resource tracker, nor the fork server (a child of ``pid`` whose
    children the workers are), nor a child between its fork and its exec (it still shows the
    launcher's command line)."""
    import psutil

    out = []
    for p in _children(pid):
        try:
            line = " ".join(p.cmdline())
            if ("multiprocessing" not in line or "resource_tracker" in line
                    or (p.ppid() == pid and "forkserver" in line)):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_trial_leaves_no_worker_behind(tmp_path, sig):
    import psutil

    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "trial", "-m", "cnn-small", "-c", "local-1x2", "-b",
                             "allreduce", "--iters", "100000", "--no-record"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _ranks(proc.pid)
        assert len(workers) == 2, "the trial's workers never started"
        time.sleep(2.0)  # let them get into the collectives
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=60)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers left running after {sig.name}: {[p.pid for p in alive]}"
        assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
        assert err.strip().splitlines()[-1] == f"synctune: terminated by {sig.name}", err[-2000:]
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_workers_die_with_a_killed_launcher(tmp_path):
    """SIGKILL runs no cleanup at all: the workers still go (spawned, they asked Linux to kill
    them when their launcher dies; forked, they watch the launcher through a pidfd), and so does
    everything else the launcher started (the fork server, the resource tracker)."""
    import psutil

    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "trial", "-m", "cnn-small", "-c", "local-1x2", "-b",
                             "allreduce", "--iters", "100000", "--no-record"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=False)
    try:
        deadline = time.monotonic() + 120

        while len(_ranks(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = _ranks(proc.pid)
        assert len(workers) == 2
        started = _children(proc.pid)  # the ranks, and the fork server they came from where they were forked
        proc.kill()
        proc.wait(timeout=30)
        _gone, alive = psutil.wait_procs(started, timeout=15)
        assert not alive, [" ".join(p.cmdline())[:100] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


# -------------------------------------------------------------------------------------- fuzz

VALID = {
    "cluster.yaml": ("clusters", "name: mine\nnodes:\n  - instance_type: g4dn.12xlarge\n    count: 2\n"
                                 "  - name: small\n    instance_type: g4dn.2xlarge\n    nic_gbps: 20\n"),
    "experiment.yaml": ("report", EXPERIMENT + "baselines: [allreduce, ps-lb]\nproposals: 30\n"),
}


def _loader_args(kind: str, path: Path, tmp: Path) -> list:
    if kind == "clusters":
        return ["clusters", path]
    if kind == "report":
        return ["report", path, "--no-mlflow", "--data", tmp / "empty"]
    if kind == "strategy":
        return ["strategy", "validate", path, "-m", "cnn-small", "-c", "local-1x2"]
    if kind == "model":
        return ["models", path]
    return ["dataset", "pull", "--data", tmp / "d", path.parent]


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("valid")
    out = {}
    for name, (kind, text) in VALID.items():
        out[name] = (kind, text.encode())
    strategy = folder / "s.json"
    assert run("strategy", "build", "parallax", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    out["strategy.json"] = ("strategy", strategy.read_bytes())
    out["model.json"] = ("model", run("models", "ncf-small", "--json").stdout.encode())
    out["manifest.json"] = ("manifest", json.dumps({"format": "synctune-dataset-release", "schema_version": 1,
                                                    "name": "x", "files": []}).encode())
    return out


def _check(kind: str, data: bytes, tmp: Path) -> None:
    folder = tmp / f"case-{time.monotonic_ns()}"
    folder.mkdir()
    name = {"clusters": "c.yaml", "report": "e.yaml", "strategy": "s.json", "model": "m.json"}.get(kind,
                                                                                                    "manifest.json")
    path = write(folder / name, data)
    result = run(*_loader_args(kind, path, folder))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), (result.exit_code, data[:200], result.stderr[-500:])
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("synctune: error: "), result.stderr[-500:]


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                       max_leaves=6)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(name=st.sampled_from(["cluster.yaml", "experiment.yaml", "strategy.json", "model.json", "manifest.json"]),
       data=st.binary(max_size=300))
def test_fuzz_random_bytes(valid_files, tmp_path_factory, name, data):
    _check(valid_files[name][0], data, tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(name=st.sampled_from(["cluster.yaml", "experiment.yaml", "strategy.json", "model.json", "manifest.json"]),
       cuts=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 8), st.binary(max_size=6)), max_size=4))
def test_fuzz_byte_mutations_of_valid_files(valid_files, tmp_path_factory, name, cuts):
    kind, data = valid_files[name]
    data = bytearray(data)
    for at, drop, insert in cuts:
        at = at % (len(data) + 1)
        data[at:at + drop] = insert
    _check(kind, bytes(data), tmp_path_factory.mktemp("fuzz"))


@FUZZ
@given(name=st.sampled_from(["cluster.yaml", "experiment.yaml", "strategy.json", "model.json", "manifest.json"]),
       path=st.lists(st.integers(0, 20), min_size=1, max_size=4), value=JSONISH)
def test_fuzz_value_mutations_of_valid_files(valid_files, tmp_path_factory, name, path, value):
    """Replace one value somewhere in a valid file with another JSON-like value (type confusion)."""
    import yaml

    kind, data = valid_files[name]
    tree = yaml.safe_load(data.decode())
    node = tree
    for step in path[:-1]:
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else None
        if not children:
            break
        child = children[step % len(children)]
        if not isinstance(child, (dict, list)) or not child:
            break
        node = child
    if isinstance(node, dict) and node:
        node[list(node)[path[-1] % len(node)]] = value
    elif isinstance(node, list) and node:
        node[path[-1] % len(node)] = value
    try:
        text = json.dumps(tree)
    except ValueError:
        return
    _check(kind, text.encode(), tmp_path_factory.mktemp("fuzz"))


def test_a_signalled_search_stops_ray_and_its_workers(tmp_path):
    """Ray's core installs a SIGTERM handler that aborts with a stack dump; the search takes the
    signal back: one line, status 143, Ray and every worker gone, the rows recorded so far whole."""
    import psutil

    from _searches import search_env, tiny_experiment

    from synctune.data import TrialDataset

    experiment = tiny_experiment(tmp_path, 40, iters=30)
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "search", str(experiment)],
                            env=search_env(tmp_path / "home"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "home").glob("dataset/*/*/part-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.5)
        children = _children(proc.pid)
        assert children, "the search never recorded a trial"
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [" ".join(p.cmdline())[:100] for p in alive]
        assert proc.returncode == 143, err[-2000:]
        assert err.strip().splitlines()[-1] == "synctune: terminated by SIGTERM" and "Traceback" not in err
        rows = TrialDataset(tmp_path / "home" / "dataset").read()
        assert len(rows) >= 1 and (rows["status"] == "ok").all()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


# ------------------------------------------------------------------------- special files as inputs


def _cli_subprocess(tmp_path: Path, *args, env: dict | None = None, timeout_s: float = 90):
    """The CLI in its own process, so an input that blocks fails the test instead of hanging it."""
    full_env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"),
                    **(env or {}))
    try:
        return subprocess.run([sys.executable, "-m", "synctune", *map(str, args)], env=full_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"synctune {' '.join(map(str, args))} still running after {timeout_s} s (blocked?)")


@pytest.mark.parametrize("args", [
    ["clusters", "{fifo}"],
    ["search", "{fifo}"],
    ["models", "{fifo}"],
    ["strategy", "validate", "{fifo}", "-m", "cnn-small", "-c", "local-1x2"],
    ["report", "--dataset", "--data", "{data}", "-o", "{out}", "--template", "{fifo}"],
    ["sim", "score", "{fifo}", "{fifo}"],
], ids=["cluster", "experiment", "model", "strategy", "template", "simulator"])
def test_fifos_as_inputs_are_refused_not_waited_on(tmp_path, args):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    fifo = tmp_path / "input.json"  # the extension spec files are recognised by
    os.mkfifo(fifo)
    TrialDataset(tmp_path / "d").append(make_records(2))
    args = [a.format(fifo=fifo, data=tmp_path / "d", out=tmp_path / "out") for a in args]
    result = _cli_subprocess(tmp_path, *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a regular file" in lines[0] and str(fifo) in lines[0], result.stderr[-1000:]


def test_a_fifo_as_the_mlflow_store_is_refused(tmp_path):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "home" / "dataset").append(make_records(1))
    fifo = tmp_path / "mlflow.db"
    os.mkfifo(fifo)
    result = _cli_subprocess(tmp_path, "mlflow", "sync", env={"MLFLOW_TRACKING_URI": f"sqlite:///{fifo}"})
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{fifo}: is not a regular file" in lines[0], result.stderr[-1000:]


# ------------------------------------------------------------------------- hostile releases


def _release_with_profile(tmp_path: Path, profile: dict) -> Path:
    """A release of two records whose one compute profile is ``profile`` (checksums right)."""
    from synctune.data import TrialDataset, push_release

    from test_dataset import make_records

    src = TrialDataset(tmp_path / "src")
    src.append(make_records(2))
    rel = tmp_path / "rel"
    push_release(src, str(rel), profiles={"p.json": profile})
    return rel


@pytest.mark.parametrize("field, value", [("model", "../../ESCAPED"), ("model", "/tmp/ESCAPED"),
                                          ("device", "../../../ESCAPED"), ("model", "..")])
def test_a_release_profile_cannot_be_filed_outside_the_data_folder(tmp_path, field, value):
    profile = {"schema": 1, "model": "cnn-small", "device": "cpu", "workers": 1, "batch_size": 8, "forward_s": 0.01,
               "backward_s": 0.02, "step_s": 0.001, "ready_s": [0.001]}
    rel = _release_with_profile(tmp_path, {**profile, field: value})
    home = tmp_path / "a" / "b" / "home"
    before = {p for p in tmp_path.rglob("*") if not p.is_relative_to(rel)}
    result = run("dataset", "pull", "--data", tmp_path / "d", rel, env={"SYNCTUNE_HOME": str(home)})
    assert_one_line(result, 2, f"{rel}: profiles/p.json: compute profile")
    assert f"{field}: expected a" in result.stderr
    created = {p for p in tmp_path.rglob("*") if not p.is_relative_to(rel)} - before
    assert not [p for p in created if "ESCAPED" in p.name or p.suffix == ".json"], created
    assert not Path("/tmp/ESCAPED@cpu-w1.json").exists()
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").rglob("*.parquet"))  # nothing merged


def test_push_into_a_symbolic_link_is_refused(tmp_path):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "rel"
    link.symlink_to(elsewhere)
    env = {"SYNCTUNE_HOME": str(tmp_path / "home")}
    assert_one_line(run("dataset", "push", "--data", tmp_path / "d", link, env=env), 2,
                    f"{link}: is a symbolic link (to {elsewhere})")
    assert not list(elsewhere.iterdir())
    real = tmp_path / "real"
    (real / "data").mkdir(parents=True)
    (real / "data" / "model=cnn-small").symlink_to(elsewhere)  # a link inside the folder, out of it
    assert_one_line(run("dataset", "push", "--data", tmp_path / "d", real, env=env), 2, "leaves")
    assert not list(elsewhere.iterdir())


# ------------------------------------------------------------------------- hostile dataset files


def _dataset_with(tmp_path: Path, name: str = "part-zz-hostile.parquet") -> tuple[Path, Path]:
    """A dataset of two good records, and the path of one more part file in their partition."""
    from synctune.data import TrialDataset

    from test_dataset import make_records

    ds = TrialDataset(tmp_path / "d")
    ds.append(make_records(2))
    return ds.root, ds.files()[0].parent / name


def _decode_bomb(rows: int, value_bytes: int):
    """A record-like table of ``rows`` rows whose strategy_json is one ``value_bytes`` string,
    dictionary-encoded: kilobytes on disk, ``rows * value_bytes`` once decoded."""
    import numpy as np
    import pyarrow as pa

    big = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), pa.array(["x" * value_bytes]))
    keys = {c: pa.array(["x"] * rows) for c in ("cluster_name", "model_hash", "cluster_hash", "strategy_hash")}
    return pa.table({"model_name": pa.array(["cnn-small"] * rows), **keys, "strategy_json": big})


@pytest.mark.parametrize("command", ["stats", "compact"])
def test_a_damaged_or_special_part_file_is_one_line(tmp_path, command):
    root, part = _dataset_with(tmp_path)
    write(part, b"PAR1" + b"\x00garbage" * 20 + b"PAR1")
    assert_one_line(run("dataset", command, "--data", root), 2, f"{part}: not a readable Parquet file")
    part.unlink()
    os.mkfifo(part)
    result = _cli_subprocess(tmp_path, "dataset", command, "--data", root)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, (result.returncode, result.stderr[-1000:])
    assert f"{part}: is not a regular file" in result.stderr


def test_a_part_file_declaring_too_many_rows_is_refused_before_decoding(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from synctune.data.store import MAX_FILE_ROWS

    root, part = _dataset_with(tmp_path)
    pq.write_table(pa.table({"model_name": pa.nulls(MAX_FILE_ROWS + 1)}), part)  # null type: no memory
    assert part.stat().st_size < 100_000
    result = _cli_subprocess(tmp_path, "dataset", "stats", "--data", root, timeout_s=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, (result.returncode, result.stderr[-1000:])
    assert f"{part}: {MAX_FILE_ROWS + 1} rows; a dataset file holds at most {MAX_FILE_ROWS}" in result.stderr


def test_a_part_file_that_expands_on_read_is_stopped(tmp_path, monkeypatch):
    """Its footer looks small (the value is stored once); decoding is what grows, and is cut."""
    import pyarrow.parquet as pq

    import synctune.data.store as store

    monkeypatch.setattr(store, "MAX_DECODED_BYTES", 64 * 1024**2)  # the bound, scaled to a test's memory
    root, part = _dataset_with(tmp_path)
    pq.write_table(_decode_bomb(200, 1024**2), part, compression="zstd")  # 200 MiB decoded
    assert part.stat().st_size < 1024**2
    assert_one_line(run("dataset", "stats", "--data", root), 2, f"{part}: decodes to more than {64 * 1024**2} bytes")
    # the same file in a release: refused with the release's name for it, nothing merged
    rel = tmp_path / "rel"
    monkeypatch.setattr(store, "MAX_DECODED_BYTES", 2 * 1024**3)
    part.unlink()
    assert run("dataset", "push", "--data", root, rel, env={"SYNCTUNE_HOME": str(tmp_path / "h")}).exit_code == 0
    (shipped,) = rel.glob("data/*/*/part-0.parquet")
    pq.write_table(_decode_bomb(200, 1024**2), shipped, compression="zstd")
    manifest = json.loads((rel / "manifest.json").read_text())
    manifest["files"][0].update(rows=200, sha256=__import__("hashlib").sha256(shipped.read_bytes()).hexdigest())
    write(rel / "manifest.json", json.dumps(manifest))
    monkeypatch.setattr(store, "MAX_DECODED_BYTES", 64 * 1024**2)
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "mine", rel), 2,
                    f"{rel}: {manifest['files'][0]['path']}: decodes to more than")
    assert not (tmp_path / "mine").exists() or not list((tmp_path / "mine").rglob("*.parquet"))


def test_records_of_a_newer_schema_version_are_refused_on_read(tmp_path):
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from synctune.data import RECORD_SCHEMA_VERSION, TrialDataset

    root, part = _dataset_with(tmp_path)
    table = TrialDataset(root).table()
    newer = table.set_column(table.schema.get_field_index("schema_version"), "schema_version",
                             pc.add(table.column("schema_version"), pa.scalar(RECORD_SCHEMA_VERSION, pa.int32())))
    newer = newer.set_column(newer.schema.get_field_index("trial_id"), "trial_id",
                             pc.binary_join_element_wise(newer.column("trial_id"), "-v", ""))
    pq.write_table(newer, part)
    assert_one_line(run("dataset", "stats", "--data", root), 2,
                    f"schema version {2 * RECORD_SCHEMA_VERSION}; this synctune reads versions up to "
                    f"{RECORD_SCHEMA_VERSION}; upgrade synctune")


def test_a_named_report_is_the_only_file_written_outside_the_data_folder(tmp_path):
    """``-o userdir/page.html`` writes that page and nothing beside it (a user's own index.html
    there is neither replaced nor a reason to refuse); the list of reports is the data home's."""
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    home = tmp_path / "home"
    site = tmp_path / "site"
    site.mkdir()
    theirs = write(site / "index.html", "<html>my own home page</html>")
    for name in ("dataset.html", "index.html"):  # even a page the user calls index.html is theirs to name
        before = set(tmp_path.rglob("*"))
        result = run("report", "--dataset", "--data", tmp_path / "d", "-o", site / name,
                     env={"SYNCTUNE_HOME": str(home)})
        assert result.exit_code == 0, result.stderr
        created = {p for p in set(tmp_path.rglob("*")) - before if not p.is_relative_to(home)}
        assert created <= {site / name}, created
    assert "synctune-chart" in theirs.read_text()  # the second report was named index.html
    listing = (home / "reports" / "index.html").read_text()
    assert (site / "dataset.html").as_uri() in listing and (site / "index.html").as_uri() in listing
    assert set(os.listdir(site)) == {"dataset.html", "index.html"}


def test_report_never_replaces_an_index_html_it_did_not_write(tmp_path):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    home = tmp_path / "home"
    (home / "reports").mkdir(parents=True)
    theirs = write(home / "reports" / "index.html", "<html>my own home page</html>")
    assert_one_line(run("report", "--dataset", "--data", tmp_path / "d", env={"SYNCTUNE_HOME": str(home)}), 2,
                    f"{theirs}: exists and was not written by synctune")
    assert theirs.read_text() == "<html>my own home page</html>"
    theirs.unlink()
    for _ in range(2):  # synctune's own index is refreshed
        result = run("report", "--dataset", "--data", tmp_path / "d", env={"SYNCTUNE_HOME": str(home)})
        assert result.exit_code == 0, result.stderr
    assert 'href="dataset.html"' in (home / "reports" / "index.html").read_text()


@pytest.mark.parametrize("leaf", ["x" * 300 + ".json", "is-a-folder"])
def test_a_refused_search_output_creates_no_folders(tmp_path, leaf):
    if leaf == "is-a-folder":
        (tmp_path / "is-a-folder").mkdir()
        output = tmp_path / "is-a-folder"
    else:
        output = tmp_path / "new" / "deeper" / leaf
    path = write(tmp_path / "e.yaml", EXPERIMENT + f"run: {{output: {output}}}\n")
    before = set(tmp_path.rglob("*"))
    result = run("search", path, env={"SYNCTUNE_HOME": str(tmp_path / "home")})
    assert_one_line(result, 2, str(output)[:60])
    assert {p for p in set(tmp_path.rglob("*")) - before if not p.is_relative_to(tmp_path / "home")} == set()


# ------------------------------------------------------------- names and kinds of the wrong kind

#: What a name or a kind can be instead of one: a list (unhashable: ``x in registry`` raises
#: TypeError), a mapping, a lone surrogate (valid JSON, not encodable as UTF-8: no hash, file
#: name or Parquet cell can hold it) and a name longer than any file system takes.
HOSTILE_NAMES = {"list": ["allreduce"], "mapping": {"a": 1}, "surrogate": "\ud800", "too-long": "n" * 5000}


def _string_paths(tree, prefix=()):
    """The path of every string value in ``tree``, one per pattern (list positions after the
    first collapse), so each field is tried once."""
    seen: set = set()
    out = []

    def walk(node, path, pattern):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, path + (key,), pattern + (key,))
        elif isinstance(node, list):
            for i, value in enumerate(node[:2]):
                walk(value, path + (i,), pattern + ("*",))
        elif isinstance(node, str) and pattern not in seen:
            seen.add(pattern)
            out.append(path)

    walk(tree, prefix, prefix)
    return out


def _replaced(tree, path, value):
    import copy

    tree = copy.deepcopy(tree)
    node = tree
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return tree


def _hostile_cases(valid_files):
    import yaml

    cases = []
    for name in ("cluster.yaml", "experiment.yaml", "strategy.json", "model.json", "manifest.json"):
        kind, data = valid_files[name]
        tree = yaml.safe_load(data.decode())
        for path in _string_paths(tree):
            for label, value in HOSTILE_NAMES.items():
                cases.append((name, path, label, kind, json.dumps(_replaced(tree, path, value)).encode()))
    return cases


def test_every_string_field_refuses_lists_surrogates_and_long_names(valid_files, tmp_path):
    """Every string of every loader's valid file replaced, in turn, by each hostile name: exit 0
    or 2 with one line that names the file, never 'unexpected TypeError/UnicodeEncodeError'."""
    failures = []
    for name, path, label, kind, data in _hostile_cases(valid_files):
        folder = tmp_path / f"case-{len(failures)}-{time.monotonic_ns()}"
        folder.mkdir()
        file = write(folder / {"clusters": "c.yaml", "report": "e.yaml", "strategy": "s.json",
                               "model": "m.json"}.get(kind, "manifest.json"), data)
        result = run(*_loader_args(kind, file, folder), env={"SYNCTUNE_HOME": str(folder / "home")})
        lines = result.stderr.strip().splitlines()
        ok = (result.exception is None or isinstance(result.exception, SystemExit)) and (
            result.exit_code == 0 or (result.exit_code == 2 and len(lines) == 1 and len(lines[0]) < 1000
                                      and str(file if kind != "manifest" else folder) in lines[0]))
        if not ok:
            failures.append(f"{name} {'.'.join(map(str, path))} <- {label}: exit {result.exit_code}: "
                            f"{(lines or [repr(result.exception)])[-1][:200]}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ malformed JSON cells in a dataset


def _dataset_with_cell(tmp_path: Path, column: str, cell: str) -> Path:
    """A dataset of four good records whose second row's ``column`` is ``cell``; its part file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, _ = _dataset_with(tmp_path)
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(root).append(make_records(4, writer=1))
    part = TrialDataset(root).files()[-1]
    table = pq.read_table(part)
    cells = table.column(column).to_pylist()
    cells[1] = cell
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(cells, pa.string())), part)
    return part


@pytest.mark.parametrize("column, cell, command", [
    ("strategy_json", "{not json", "train"),
    ("strategy_json", "[1, 2]", "eval"),
    ("extra_json", "not json", "train"),
    ("extra_json", "7", "eval"),
    ("runtime_json", "{'bucket_cap_mb': 25}", "eval"),
    ("runtime_json", '["ddp"]', "train"),
    ("model_spec_json", '"cnn-small"', "train"),
])
def test_malformed_json_cells_name_the_part_file_and_column(tmp_path, column, cell, command):
    part = _dataset_with_cell(tmp_path, column, cell)
    args = ["sim", command, "--data", part.parents[2]] + (["--epochs", "1", "-o", tmp_path / "x.pt"]
                                                          if command == "train" else [])
    result = _cli_subprocess(tmp_path, *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-1000:]
    assert f"{part}: column {column}: a cell" in lines[0], lines[0]
    assert not (tmp_path / "x.pt").exists()


# ------------------------------------------------------------------ outputs under /proc, DDP options

_DATA = ["--data", "{data}"]


@pytest.mark.parametrize("args", [
    ["strategy", "build", "ps", "-m", "cnn-small", "-c", "local-1x2", "-o", "/proc/synctune-out.json"],
    ["dataset", "export", *_DATA, "--format", "csv", "-o", "/proc/synctune-out.csv"],
    ["dataset", "export", *_DATA, "--format", "parquet", "-o", "/proc/self/synctune-out.parquet"],
    ["sim", "train", *_DATA, "--epochs", "1", "-o", "/proc/synctune-out.pt"],
    ["report", "--dataset", *_DATA, "-o", "/proc/synctune-out.html"],
    ["apply", "{strategy}", "-m", "cnn-small", "-o", "/proc/synctune-out.py"],
    ["cluster", "calibrate", "local-1x2", "--save", "/proc/synctune-out.yaml"],
    ["dataset", "push", *_DATA, "/proc/synctune-release"],
], ids=["strategy", "export-csv", "export-parquet", "sim", "report", "apply", "calibrate", "push"])
def test_outputs_under_proc_are_one_line(tmp_path, args):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(3))
    strategy = tmp_path / "s.json"
    assert run("strategy", "build", "ps", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    args = [a.format(data=tmp_path / "d", strategy=strategy) for a in args]
    result = _cli_subprocess(tmp_path, *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-1000:]
    assert lines[0].startswith("synctune: error: /proc/") and "cannot write" in lines[0], lines[0]


@pytest.mark.parametrize("option, fragment", [
    ("bucket_cap_mb=-1", "bucket_cap_mb: expected a positive number of MiB"),
    ("bucket_cap_mb=nan", "bucket_cap_mb: expected a positive number of MiB"),
    ("bucket_cap_mb=inf", "bucket_cap_mb: expected a positive number of MiB"),
    ("bucket_cap_mb=" + "9" * 5000, "bucket_cap_mb: expected a positive number of MiB"),
    ("first_bucket_mb=-inf", "first_bucket_mb: expected a positive number of MiB or null"),
    ("powersgd_rank=" + "9" * 5000, "powersgd_rank: expected a positive integer"),
    ("powersgd_rank=²", "powersgd_rank: expected a positive integer"),
    ("comm_hook=[fp16]", "comm_hook: expected one of none, fp16, bf16, powersgd"),
], ids=["negative", "nan", "inf", "5000-digits", "first-inf", "rank-5000-digits", "rank-superscript", "hook"])
def test_ddp_options_out_of_range_are_one_line(tmp_path, option, fragment):
    result = _cli_subprocess(tmp_path, "trial", "-m", "cnn-small", "-c", "local-1x2", "--runtime", "ddp", "--ddp",
                             option, "--no-record", timeout_s=60)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and len(lines[0]) < 300, result.stderr[-1000:]


@pytest.mark.parametrize("runtime, option, fragment", [
    ("ddp", "bucket=3", "--ddp: unknown key 'bucket'"),
    ("ddp", "comm_hook=bf17", "comm_hook: expected one of none, fp16, bf16, powersgd"),
    ("fsdp", "grp=2", "--fsdp: unknown key 'grp'"),
    ("horovod", "fusion=1", "--horovod: unknown key 'fusion'"),
])
def test_runtime_settings_are_refused_before_the_workload_is_imported(tmp_path, runtime, option, fragment):
    """A typo in --ddp/--fsdp/--horovod does not wait for the user's model to be imported and
    stepped (seconds to minutes): the workload file leaves a mark when imported, and must not."""
    mark = tmp_path / "imported"
    (tmp_path / "my_job.py").write_text(f"open({str(mark)!r}, 'w').close()\n"
                                        "def workload():\n    raise RuntimeError('built')\n")
    result = _cli_subprocess(tmp_path, "trial", "-m", "my_job.py:workload", "-c", "local-1x2", "--runtime", runtime,
                             f"--{runtime}", option, "--no-record", timeout_s=60)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr[-1000:]
    assert not mark.exists(), "the workload was imported before its runtime settings were checked"


# ------------------------------------------------------- special files inside a dataset or a release


@pytest.mark.parametrize("special", ["fifo", "folder"])
def test_a_special_file_inside_a_dataset_folder_is_one_line(tmp_path, special):
    root, part = _dataset_with(tmp_path)
    os.mkfifo(part) if special == "fifo" else part.mkdir()
    for args in (["dataset", "stats", "--data", root], ["sim", "train", "--data", root, "-o", tmp_path / "x.pt"],
                 ["dataset", "export", "--data", root, "--format", "csv", "-o", tmp_path / "x.csv"]):
        result = _cli_subprocess(tmp_path, *args, timeout_s=60)
        assert result.returncode == 2, (args, result.returncode, result.stderr[-1000:])
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{part}: is not a regular file" in lines[0], result.stderr[-1000:]
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("special", ["fifo", "folder"])
@pytest.mark.parametrize("which", ["data", "profile"])
def test_a_special_file_inside_a_pulled_release_is_one_line(tmp_path, special, which):
    profile = {"schema": 1, "model": "cnn-small", "device": "cpu", "workers": 1, "batch_size": 8, "forward_s": 0.01,
               "backward_s": 0.02, "step_s": 0.001, "ready_s": [0.001]}
    rel = _release_with_profile(tmp_path, profile)
    (shipped,) = rel.glob("data/*/*/part-0.parquet") if which == "data" else [rel / "profiles" / "p.json"]
    shipped.unlink()
    os.mkfifo(shipped) if special == "fifo" else shipped.mkdir()
    result = _cli_subprocess(tmp_path, "dataset", "pull", "--data", tmp_path / "mine", rel, timeout_s=60)
    assert result.returncode == 2, (result.returncode, result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{rel}: {shipped.relative_to(rel)}" in lines[0], result.stderr[-1000:]
    assert "not a regular file" in lines[0], lines[0]
    assert not (tmp_path / "mine").exists() or not list((tmp_path / "mine").rglob("*.parquet"))


SHARD_PROBLEMS = [
    # (variable, synchronizer fields or a plan edit, cluster, what the one line names)
    ("fc.weight", {"partition": [2, 1]}, "local-2x2", "shard slices the whole variable by rows itself"),
    ("fc.weight", {"group": 3}, "local-2x2", "synchronizer.group: a shard group of 3 does not divide the 4 replicas"),
    ("fc.weight", {"group": 2}, "3x2", "(replicas 2..3) takes part of node 'node0''s replicas together with another"),
    ("fc.weight", {"prefetch": 2}, "local-2x2", "prefetch: expected 0 when reshard is false"),
    ("fc.weight", {"reduce_dtype": "fp8"}, "local-2x2", "reduce_dtype: expected one of ('fp32', 'bf16')"),
    ("fc.weight", {"compressor": "fp16"}, "local-2x2", "fp16 is not executed with shard"),
    ("fc.bias", {"unit": 0, "group": 2}, "local-2x2", "synchronizer.group: unit 0 has group 2 on variable 'fc.bias' and 0 here"),
]


@pytest.mark.parametrize("variable, edit, cluster, fragment", SHARD_PROBLEMS, ids=range(len(SHARD_PROBLEMS)))
def test_bad_shard_plans_are_one_line_exit_2(tmp_path, variable, edit, cluster, fragment):
    """A shard plan the engine cannot run as written (a variable sliced another way, a group that
    does not divide the replicas or straddles nodes, a unit whose variables disagree): one line,
    exit 2, from ``strategy validate`` and from ``trial`` before any worker starts."""
    path = tmp_path / "s.json"
    if cluster == "3x2":  # two nodes of three devices: groups of two straddle them
        cluster = str(write(tmp_path / "c.yaml", json.dumps({"name": "c3x2", "nodes": [
            {"instance_type": "local-cpu", "num_devices": 3}, {"instance_type": "local-cpu", "num_devices": 3}]})))
    assert run("strategy", "build", "shard", "-m", "cnn-small", "-c", cluster, "-o", path).exit_code == 0
    data = json.loads(path.read_text())
    plan = next(p for p in data["plans"] if p["variable"] == variable)
    sync = plan["shards"][0]["synchronizer"]
    assert sync["kind"] == "shard"
    if "partition" in edit:
        plan["partition"] = edit["partition"]
        plan["shards"] = plan["shards"] * 2
    elif "compressor" in edit:
        plan["shards"][0]["compressor"] = {"kind": edit["compressor"]}
    else:
        sync.update(edit)
    path.write_text(json.dumps(data))
    assert_one_line(run("strategy", "validate", path, "-m", "cnn-small", "-c", cluster), 2, fragment)
    start = time.monotonic()
    assert_one_line(run("trial", "-m", "cnn-small", "-c", cluster, "-s", path, "--iters", "1", "--warmup", "0"), 2,
                    fragment)
    assert time.monotonic() - start < 20


def test_reshard_in_the_engine_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "s.json"
    assert run("strategy", "build", "shard", "-m", "cnn-small", "-c", "local-1x2", "-O", "reshard=true",
               "-o", path).exit_code == 0
    assert_one_line(run("trial", "-m", "cnn-small", "-c", "local-1x2", "-s", path, "--iters", "1", "--warmup", "0"),
                    2, "reshard: true (unit 0) is not executed by the engine")


# ------------------------------------------------------------- names too long for the file system

#: Names no file system holds: one component over NAME_MAX (255 bytes), and a whole path over
#: PATH_MAX in one name.
LONG_NAMES = {"300": "n" * 300, "100k": "n" * 100_000, "deep": "/".join(["d" * 200] * 30)}


@pytest.mark.parametrize("args", [
    ["models", "{name}"],
    ["models", "{name}.json"],
    ["clusters", "{name}"],
    ["clusters", "{name}.yaml"],
    ["strategy", "build", "allreduce", "-m", "{name}", "-c", "local-1x2"],
    ["strategy", "build", "allreduce", "-m", "cnn-small", "-c", "{name}"],
    ["strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", "{name}"],
    ["strategy", "validate", "{name}", "-m", "cnn-small", "-c", "local-1x2"],
    ["report", "{name}", "--no-mlflow"],
    ["report", "{name}.yaml", "--no-mlflow"],
    ["report", "--dataset", "--data", "{name}", "-o", "{tmp}/r.html"],
    ["report", "--dataset", "--data", "{tmp}/d", "-o", "{name}"],
    ["dataset", "stats", "--data", "{name}"],
    ["dataset", "pull", "--data", "{tmp}/mine", "{name}"],
    ["dataset", "push", "--data", "{tmp}/d", "{name}"],
    ["dataset", "export", "--data", "{tmp}/d", "--format", "csv", "-o", "{name}"],
    ["sim", "score", "{name}", "{name}"],
    ["sim", "train", "--data", "{tmp}/d", "-o", "{name}"],
    ["search", "{name}"],
    ["trial", "-m", "{name}", "-c", "local-1x2"],
    ["trial", "-m", "cnn-small", "-c", "{name}"],
    ["apply", "{name}", "-m", "cnn-small"],
], ids=lambda a: "-".join(x for x in a if not x.startswith(("{", "-")))[:40])
@pytest.mark.parametrize("length", LONG_NAMES)
def test_names_too_long_for_the_file_system_are_one_line(tmp_path, args, length):
    """Any name or path given on the command line that no file system holds is the user's
    input at fault: one short line, exit 2, nothing written."""
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    before = set(tmp_path.rglob("*"))
    args = [a.format(name=LONG_NAMES[length], tmp=tmp_path) for a in args]
    result = run(*args, env={"SYNCTUNE_HOME": str(tmp_path / "home")})
    line = assert_one_line(result, 2)
    assert len(line) < 1000 and "unexpected" not in line, line
    assert {p for p in set(tmp_path.rglob("*")) - before if not p.is_relative_to(tmp_path / "home")} == set()


@pytest.mark.parametrize("key", ["cluster", "model", "simulator", "name"])
def test_an_experiment_naming_something_too_long_is_one_line(tmp_path, key):
    value = {"name": "n" * 300}.get(key, "n" * 300 + (".pt" if key == "simulator" else ""))
    text = "\n".join(f"{k}: {value if k == key else v}" for k, v in
                     [("name", "e"), ("model", "cnn-small"), ("cluster", "local-1x2"), ("budget", 4),
                      ("simulator", "analytic")]) + "\n"
    path = write(tmp_path / "e.yaml", text)
    line = assert_one_line(run("search", path, env={"SYNCTUNE_HOME": str(tmp_path / "home")}), 2)
    assert len(line) < 1000 and "unexpected" not in line, line


def test_a_data_home_too_long_for_the_file_system_is_one_line(tmp_path):
    line = assert_one_line(run("trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "allreduce",
                               env={"SYNCTUNE_HOME": str(tmp_path / ("h" * 300))}), 2, "SYNCTUNE_HOME")
    assert len(line) < 1000, line


# ------------------------------------------------------------------ shared files bounded before use


def _simulator_payload(**config_changes) -> dict:
    from synctune.simulator.features import GLOBAL_NAMES, PRE_NAMES, RAW_NAMES
    from synctune.simulator.replay import REPLAY_GLOBAL_NAMES, REPLAY_SHARD_NAMES
    from synctune.strategy import compressor_vocabulary

    config = {"epochs": 1, "lr": 0.1, "batch": 2, "partition_penalty": 0.0, "seed": 0, "hidden": 4,
              "raw": len(RAW_NAMES) + len(PRE_NAMES) + len(REPLAY_SHARD_NAMES),
              "global": len(GLOBAL_NAMES) + len(REPLAY_GLOBAL_NAMES), "compressors": compressor_vocabulary(),
              **config_changes}
    import torch

    norm = {k: torch.zeros(config["raw" if k[0] == "x" else "global"]) for k in ("x_mean", "x_std", "g_mean", "g_std")}
    return {"format": "synctune-simulator", "version": 3, "kind": "rnn", "config": json.dumps(config), "state": {},
            "norm": norm}


@pytest.mark.parametrize("hidden", [3000, 10**12, "4", -1])
def test_a_simulator_file_is_checked_before_its_network_is_built(tmp_path, hidden):
    """A file of a few KB whose config asks for a network of gigabytes: refused, one line, from
    the config's sizes against the state's shapes, with no network built (the process's peak
    memory stays that of torch itself)."""
    import torch

    strategy = tmp_path / "s.json"
    assert run("strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    path = tmp_path / "sim.pt"
    torch.save(_simulator_payload(hidden=hidden), path)
    assert path.stat().st_size < 20_000
    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.Popen([sys.executable, "-m", "synctune", "sim", "score", str(path), str(strategy)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, err[-2000:]
    assert f"{path}: " in lines[0] and "hidden" in lines[0], lines[0]


def test_a_simulator_file_that_builds_a_large_network_stays_within_memory(tmp_path):
    import torch

    strategy = tmp_path / "s.json"
    assert run("strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    path = tmp_path / "sim.pt"
    torch.save(_simulator_payload(hidden=3000), path)
    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    # The command's own high-water mark (VmHWM of its process image, written as it exits): the
    # rusage of a child also counts what the forking test process held, which grows over a suite.
    probe = ("import atexit, runpy, sys; atexit.register(lambda: sys.stderr.write(next(l for l in "
             "open('/proc/self/status') if l.startswith('VmHWM')))); sys.argv = ['synctune'] + sys.argv[1:]; "
             "runpy.run_module('synctune', run_name='__main__')")
    ran = subprocess.run([sys.executable, "-c", probe, "sim", "score", str(path), str(strategy)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert ran.returncode == 2, ran.stderr[-2000:]
    peak_mib = int(re.search(r"VmHWM:\s+(\d+) kB", ran.stderr).group(1)) / 1024
    assert peak_mib < 900, f"peak {peak_mib:.0f} MiB: the network was built"


def test_a_compressed_simulator_file_that_unpacks_past_the_bound_is_refused_before_loading(tmp_path, monkeypatch):
    """torch reads deflated archives too: a file of KB may declare far more than it holds."""
    import zipfile

    import torch

    import synctune.simulator.models as models

    monkeypatch.setattr(models, "MAX_SIMULATOR_BYTES", 16 * 1024**2)  # the bound, scaled to a test
    strategy = tmp_path / "s.json"
    assert run("strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy).exit_code == 0
    plain = tmp_path / "plain.pt"
    torch.save({**_simulator_payload(), "padding": torch.zeros(8 * 1024**2)}, plain)
    bomb = tmp_path / "sim.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
    assert bomb.stat().st_size < 200_000
    loaded = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loaded.append(a) or {})
    assert_one_line(run("sim", "score", bomb, strategy), 2, f"{bomb}: unpacks to ")
    assert not loaded


# ------------------------------------------------------------------ datasets: foreign files, bad targets


def _foreign_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": [1, 2], "y": ["a", "b"]}), path)
    return path


@pytest.mark.parametrize("alone", [True, False], ids=["only-file", "beside-records"])
def test_a_parquet_file_of_another_schema_in_a_dataset_is_named(tmp_path, alone):
    """Not read as rows of nulls (and so as "no records", exit 0): the file is named, and why."""
    if alone:
        root = tmp_path / "d"
        part = _foreign_parquet(root / "model=a" / "cluster=b" / "part-0.parquet")
    else:
        root, part = _dataset_with(tmp_path)
        _foreign_parquet(part)
    for args in (["dataset", "stats", "--data", root], ["dataset", "export", "--data", root, "--format", "csv",
                                                         "-o", tmp_path / "x.csv"],
                 ["sim", "train", "--data", root, "-o", tmp_path / "x.pt"],
                 ["report", "--dataset", "--data", root, "-o", tmp_path / "x.html"]):
        line = assert_one_line(run(*args, env={"SYNCTUNE_HOME": str(tmp_path / "home")}), 2,
                               f"{part}: not trial records (no column model_name")
        assert "it has x, y" in line, line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("x.")]


def test_a_release_of_another_schema_names_its_file(tmp_path):
    import hashlib

    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    rel = tmp_path / "rel"
    assert run("dataset", "push", "--data", tmp_path / "d", rel, env={"SYNCTUNE_HOME": str(tmp_path / "h")}
               ).exit_code == 0
    (shipped,) = rel.glob("data/*/*/part-0.parquet")
    _foreign_parquet(shipped)
    manifest = json.loads((rel / "manifest.json").read_text())
    manifest["files"][0].update(rows=2, sha256=hashlib.sha256(shipped.read_bytes()).hexdigest())
    write(rel / "manifest.json", json.dumps(manifest))
    assert_one_line(run("dataset", "pull", "--data", tmp_path / "mine", rel), 2,
                    f"{rel}: {manifest['files'][0]['path']}: not trial records")
    assert not (tmp_path / "mine").exists() or not list((tmp_path / "mine").rglob("*.parquet"))


@pytest.mark.parametrize("target", ["file", "under-a-file"])
def test_pull_into_a_path_that_is_a_file_is_one_line(tmp_path, target):
    from synctune.data import TrialDataset

    from test_dataset import make_records

    TrialDataset(tmp_path / "d").append(make_records(2))
    rel = tmp_path / "rel"
    assert run("dataset", "push", "--data", tmp_path / "d", rel, env={"SYNCTUNE_HOME": str(tmp_path / "h")}
               ).exit_code == 0
    blocker = write(tmp_path / "blocker", "a file")
    data = blocker if target == "file" else blocker / "d"
    assert_one_line(run("dataset", "pull", "--data", data, rel, env={"SYNCTUNE_HOME": str(tmp_path / "h")}), 2,
                    str(blocker))
    assert blocker.read_text() == "a file"


# ------------------------------------------------------------- user code that changes the folder


def test_paths_are_resolved_before_user_code_can_change_the_folder(tmp_path, monkeypatch):
    """A workload whose import calls ``os.chdir('..')`` runs in the search's process (the
    preparation, the training file): the experiment's relative ``output:`` and a relative
    SYNCTUNE_HOME still mean the folder the command was started in."""
    import synctune.cli._search as search_cli
    import synctune.run as run_module

    start = tmp_path / "project"
    start.mkdir()
    monkeypatch.chdir(start)
    path = write(start / "e.yaml", EXPERIMENT + "run: {output: out/best.json}\n")

    def prepare(*args, **kwargs):
        os.chdir(tmp_path)  # what the user's code did on import
        from synctune.data.paths import dataset_dir

        dataset_dir()  # the preparation opens the dataset in the data home

    from synctune.spec.errors import SpecError

    monkeypatch.setattr(run_module, "prepare_search", prepare)
    monkeypatch.setattr(search_cli, "start_ray", lambda *a, **k: (_ for _ in ()).throw(SpecError("stopped")))
    result = run("search", path, env={"SYNCTUNE_HOME": "home"})
    assert_one_line(result, 2, "stopped")
    assert (start / "out").is_dir() and not (tmp_path / "out").exists()
    assert (start / "home").is_dir() and not (tmp_path / "home").exists()


# ------------------------------------------------- property tests: long names, standard-module folders

#: Characters of a name a user might type or paste: letters, digits, separators, dots, spaces
#: and a few beyond ASCII (several bytes each in UTF-8).
NAME_CHARS = st.sampled_from(list("abcxyz019-_./ ") + ["é", "ß", "東"])
LONG = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _long_name(draw_length: int, chars: str) -> str:
    return (chars * (draw_length // max(1, len(chars)) + 1))[:draw_length]


@LONG
@given(length=st.integers(256, 100_000), chars=st.text(NAME_CHARS.filter(lambda c: c != "/"), min_size=1, max_size=12),
       around=st.tuples(st.text(NAME_CHARS, max_size=20), st.text(NAME_CHARS, max_size=20)),
       slot=st.sampled_from(["models", "clusters", "strategy-model", "strategy-cluster", "validate", "report",
                             "search", "pull", "stats", "sim-score", "experiment-cluster", "experiment-model",
                             "experiment-simulator", "experiment-output"]))
def test_names_of_256_to_100000_characters_are_one_line(tmp_path_factory, length, chars, around, slot):
    """Any name holding a part of 256 to 100,000 characters (so no file system holds it),
    wherever a loader takes a name or a path: exit 2, one short line, nothing written."""
    tmp = tmp_path_factory.mktemp("long")
    name = around[0] + _long_name(length, chars) + around[1]
    experiment = {"name": "e", "model": "cnn-small", "cluster": "local-1x2", "budget": 4, "simulator": "analytic"}
    if slot.startswith("experiment-"):
        key = slot.split("-", 1)[1]
        if key == "output":
            experiment["run"] = {"output": name}
        else:
            experiment[key] = name
        write(tmp / "e.yaml", json.dumps(experiment))
    args = {"models": ["models", name], "clusters": ["clusters", name],
            "strategy-model": ["strategy", "build", "ps", "-m", name, "-c", "local-1x2"],
            "strategy-cluster": ["strategy", "build", "ps", "-m", "cnn-small", "-c", name],
            "validate": ["strategy", "validate", name, "-m", "cnn-small", "-c", "local-1x2"],
            "report": ["report", name, "--no-mlflow"], "search": ["search", name],
            "pull": ["dataset", "pull", "--data", tmp / "d", name], "stats": ["dataset", "stats", "--data", name],
            "sim-score": ["sim", "score", name, name]}.get(slot, ["search", tmp / "e.yaml"])
    before = set(tmp.rglob("*"))
    cwd = os.getcwd()
    os.chdir(tmp)  # a relative name resolves here, not in the repository
    try:
        result = run(*args, env={"SYNCTUNE_HOME": str(tmp / "home")})
    finally:
        os.chdir(cwd)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (slot, result.exit_code, result.stderr[-300:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synctune: error: ") and len(lines[0]) < 1000, lines[-1:]
    assert "unexpected" not in lines[0], lines[0]
    assert {p for p in set(tmp.rglob("*")) - before if not p.is_relative_to(tmp / "home")} == set()


#: Standard modules often named by a research folder's own files.
RESEARCH_NAMES = ["tokenize", "queue", "profile", "code", "trace", "pickle", "types", "random", "json", "copy",
                  "logging", "inspect", "io", "abc", "string", "numbers", "signal", "select", "test", "this"]
WORKLOAD = ("import torch, torch.nn as nn\nimport synctune.workload as sw\n{imports}\n"
            "def batch(n, rank, g):\n    return torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)\n"
            "def loss(m, b):\n    return nn.functional.cross_entropy(m(b[0]), b[1])\n"
            "def workload():\n    return sw.define(name='tiny', model=lambda: nn.Linear(4, 2), batch=batch, loss=loss, "
            "batch_size=8)\n")


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(beside=st.lists(st.sampled_from(RESEARCH_NAMES), min_size=1, max_size=8, unique=True),
       imported=st.lists(st.sampled_from(RESEARCH_NAMES), max_size=3, unique=True),
       as_package=st.booleans())
@example(beside=["tokenize", "queue", "json", "pickle"], imported=[], as_package=False)
@example(beside=["queue", "code"], imported=["queue"], as_package=False)
@example(beside=["code"], imported=["code", "copy"], as_package=True)
def test_a_workload_beside_files_named_like_standard_modules(tmp_path_factory, beside, imported, as_package):
    """Files (or packages) named like Python's modules beside a workload change nothing unless
    the workload imports one of them itself: then one line names it."""
    folder = tmp_path_factory.mktemp("research")
    for name in beside:
        body = f"raise RuntimeError('the user\\'s {name} was imported')\n"
        if as_package:
            (folder / name).mkdir()
            write(folder / name / "__init__.py", body)
        else:
            write(folder / f"{name}.py", body)
    write(folder / "job.py", WORKLOAD.format(imports="\n".join(f"import {n}" for n in imported)))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        result = run("models", "-w", "job.py:workload", "--json", env={"SYNCTUNE_HOME": str(folder / "home")})
    finally:
        os.chdir(cwd)
    shadowing = sorted(set(beside) & set(imported))
    if shadowing:
        line = assert_one_line(result, 2, f"imports {shadowing[0]!r}")
        assert "has the name of Python's" in line, line
    else:
        assert result.exit_code == 0, result.stderr[-1000:]
        assert "was imported" not in result.output


def test_a_killed_launcher_leaves_no_temporary_folder_the_next_run_keeps(tmp_path):
    """SIGKILL runs no cleanup: multiprocessing's ``pymp-*`` folders (the launcher's, the fork
    server's, the workers') are left where they were made. They are made in a folder of the
    launcher's own under synctune's temporary folder, which the next run removes once its
    launcher is gone; nothing is left directly in the temporary folder."""
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="st-"))  # short: the fork server listens on a Unix socket in it
    try:
        _killed_launcher_case(tmp_path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _killed_launcher_case(tmp_path: Path, tmp: Path) -> None:
    import psutil

    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"), TMPDIR=str(tmp))
    args = [sys.executable, "-m", "synctune", "trial", "-m", "cnn-small", "-c", "local-1x2", "-b", "allreduce",
            "--no-record"]
    proc = subprocess.Popen([*args, "--iters", "100000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        started = _children(proc.pid)
        assert len(_ranks(proc.pid)) == 2
        time.sleep(1.0)
        proc.kill()
        proc.wait(timeout=30)
        _gone, alive = psutil.wait_procs(started, timeout=15)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("pymp-")]
    done = subprocess.run([*args, "--iters", "2", "--warmup", "1"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left = [str(p.relative_to(tmp)) for p in tmp.rglob("*")]
    assert not [p for p in left if "pymp-" in p or f"launcher-{proc.pid}" in p], left


@pytest.mark.parametrize("key", ["cluster", "model", "workload", "simulator", "output"])
def test_an_experiment_naming_a_path_with_a_nul_byte_is_one_line(tmp_path, key):
    """JSON and YAML can hold a NUL byte; no file name can (``os`` raises ValueError)."""
    experiment = {"name": "e", "model": "cnn-small", "cluster": "local-1x2", "budget": 4, "simulator": "analytic"}
    value = {"workload": "a\x00b.py:workload", "simulator": "a\x00b.pt", "output": "a\x00b.json"}.get(key, "a\x00b")
    if key == "workload":
        del experiment["model"]
    experiment.update({"run": {"output": value}} if key == "output" else {key: value})
    path = write(tmp_path / "e.yaml", json.dumps(experiment))
    assert_one_line(run("search", path, env={"SYNCTUNE_HOME": str(tmp_path / "home")}), 2, "NUL byte")


def test_calibrate_checks_both_files_it_saves_before_measuring(tmp_path):
    """``--save x.yaml`` also writes the figures as x.json beside it: that one is checked too,
    before the cluster is measured (a link there is never written through)."""
    link = tmp_path / "c.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    start = time.monotonic()
    assert_one_line(run("cluster", "calibrate", "local-1x2", "--save", tmp_path / "c.yaml"), 2,
                    f"{link}: is a symbolic link")
    assert time.monotonic() - start < 10 and not (tmp_path / "c.yaml").exists()
    assert not (tmp_path / "elsewhere.json").exists()
