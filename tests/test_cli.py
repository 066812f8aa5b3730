"""The command line: the issue's walkthrough, bad input (one line, exit 2), and a light start."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from synctune.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_build_validate_show_parallax_lm1b_b7(tmp_path):
    out = tmp_path / "parallax.json"
    result = run("strategy", "build", "parallax", "--model", "lm1b", "--cluster", "B7", "-o", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for plan in data["plans"]:
        kind = plan["shards"][0]["synchronizer"]["kind"]
        assert kind == ("ps" if plan["variable"] in ("embedding.weight", "softmax_w.weight", "softmax_b.weight")
                        else "allreduce")
    result = run("strategy", "validate", str(out), "--model", "lm1b", "--cluster", "B7")
    assert result.exit_code == 0 and result.output.startswith("valid: lm1b on B7")
    result = run("strategy", "show", str(out), "--model", "lm1b")
    assert result.exit_code == 0 and "embedding.weight" in result.output and "793471x512" in result.output

    broken = tmp_path / "broken.json"
    data["plans"][2]["variable"] = "W_Q"
    broken.write_text(json.dumps(data))
    result = run("strategy", "validate", str(broken), "--model", "lm1b", "--cluster", "B7")
    assert result.exit_code == 2
    assert "variable 'W_Q' is not a variable of model 'lm1b'" in result.output


def test_show_names_each_synchronizer_kind_of_a_sharded_strategy(tmp_path):
    """``strategy show`` describes a ``shard`` plan as sharding (it was shown as "allgather")."""
    out = tmp_path / "shard.json"
    result = run("strategy", "build", "shard", "--model", "cnn-small", "--cluster", "local-1x2", "-o", str(out))
    assert result.exit_code == 0, result.output
    result = run("strategy", "show", str(out), "--model", "cnn-small")
    from synctune.models import model_spec

    rows = [line for line in result.output.splitlines() if line.split()[:1] in ([v.name] for v in
                                                                                 model_spec("cnn-small").variables)]
    assert result.exit_code == 0 and len(rows) == len(model_spec("cnn-small").variables)
    assert all(re.search(r"shard unit \d+ over every replica", row) for row in rows), rows


def test_build_to_stdout_is_json_with_options():
    result = CliRunner().invoke(cli, ["strategy", "build", "allreduce", "-m", "bert-tiny", "-c", "local-2x2",
                                      "-O", "chunk=8"])
    assert result.exit_code == 0
    groups = {p["shards"][0]["synchronizer"]["group"] for p in json.loads(result.stdout)["plans"]}
    assert groups == set(range(6))  # 46 variables in chunks of 8


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["strategy", "validate", "missing.json", "-m", "lm1b", "-c", "B7"], "missing.json: no such strategy file"),
        (["strategy", "build", "nope", "-m", "lm1b", "-c", "B7"], "unknown builder 'nope'; valid: allreduce"),
        (["strategy", "build", "ps", "-m", "gpt5", "-c", "B7"], "unknown model 'gpt5'"),
        (["strategy", "build", "ps", "-m", "lm1b", "-c", "C3"], "unknown cluster 'C3'"),
        (["strategy", "build", "ps", "-m", "lm1b", "-c", "B7", "-O", "chunk=3"], "unknown option 'chunk'"),
        (["strategy", "build", "ps", "-m", "lm1b", "-c", "B7", "-O", "junk"], "expected KEY=VALUE"),
        (["strategy", "build", "ps", "-m", "lm1b", "-c", "B7", "-o", "/nonexistent/dir/s.json"], "does not exist"),
        (["clusters", "nothere.yaml"], "nothere.yaml: no such cluster spec file"),
        (["models", "bad.json"], "bad.json: no such model spec file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, fragment):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("synctune: error: ") and fragment in err[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "malformed JSON at line 1"),
    ('{"schema": 1}', "missing key 'model'"),
])
def test_malformed_strategy_file(tmp_path, content, fragment):
    path = tmp_path / "s.json"
    path.write_text(content)
    result = CliRunner().invoke(cli, ["strategy", "show", str(path)])
    assert result.exit_code == 2 and fragment in result.stderr


def test_malformed_cluster_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: c\nnodes:\n  - instance_type: g4dn.2xlarge\n    num_devices: zero\n")
    result = CliRunner().invoke(cli, ["strategy", "build", "ps", "-m", "cnn-small", "-c", str(path)])
    assert result.exit_code == 2
    assert "nodes[0]: node 'node0': num_devices: expected an integer from 1 to 1024, got 'zero'" in result.stderr


def test_models_and_clusters_listings(tmp_path):
    result = run("models")
    assert result.exit_code == 0 and "bert-large" in result.output and "340.0M" in result.output
    result = run("clusters")
    assert result.exit_code == 0 and "B12" in result.output and "local-2x2" in result.output
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(run("models", "cnn-small", "--json").stdout)
    result = run("strategy", "build", "ps-lb", "-m", str(spec_file), "-c", "local-1x2")
    assert result.exit_code == 0 and json.loads(result.stdout)["model"]["name"] == "cnn-small"
    yaml_file = tmp_path / "b12.yaml"
    yaml_file.write_text(run("clusters", "B12", "--yaml").stdout)
    result = run("clusters", str(yaml_file))
    assert result.exit_code == 0 and "g4dn.2xlarge" in result.output


def test_help_imports_no_heavy_library():
    """`synctune --help` must stay instant: the CLI modules import neither torch, ray nor mlflow."""
    code = ("import sys; from synctune.cli import main; rc = main(['--help']); "
            "heavy = [m for m in ('torch', 'ray', 'mlflow', 'pandas', 'pyarrow') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "HEAVY []" in out and "strategy" in out


def test_python_dash_m_entry_point_reports_errors_with_status_2():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"))
    proc = subprocess.run([sys.executable, "-m", "synctune", "strategy", "build", "nope", "-m", "cnn-small", "-c",
                           "y"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("synctune: error: unknown builder 'nope'; valid: allreduce, horovod, ps, ps-lb, "
                                   "partitioned-ps, uneven-partitioned-ps, ps-hierarchical, partitioned-allreduce, "
                                   "random-axis-allreduce, parallax, shard, megatron")


def test_written_files_follow_the_umask_and_keep_their_mode(tmp_path):
    """Atomic writes go through a temporary file; the result must not keep its private 0600."""
    out = tmp_path / "allreduce.json"
    old = os.umask(0o022)
    try:
        assert run("strategy", "build", "allreduce", "--model", "cnn-small", "--cluster", "local-1x2",
                   "-o", str(out)).exit_code == 0
        assert out.stat().st_mode & 0o777 == 0o644
        out.chmod(0o640)
        assert run("strategy", "build", "ps", "--model", "cnn-small", "--cluster", "local-1x2",
                   "-o", str(out)).exit_code == 0
        assert out.stat().st_mode & 0o777 == 0o640 and '"ps"' in out.read_text()
    finally:
        os.umask(old)
