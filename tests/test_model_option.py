"""One way to name a model on the command line: every command that takes a model accepts a zoo
model, a model spec file or a workload import path (``--model``/``-m``, also spelled
``--workload``/``-w``). A user's own model, written to a file outside the repository, gets its
spec printed, a strategy built, validated and shown, and scored, all checked against the torch
module itself; a bad name is one line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from synctune.cli import cli

ROOT = Path(__file__).resolve().parents[1]

JOB = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

import synctune.workload as sw


class Net(nn.Module):
    """A sparse embedding, two dense layers with a norm between them, and a frozen scale."""

    def __init__(self, width=10):
        super().__init__()
        self.emb = nn.Embedding(50, 6, sparse=True)
        self.hidden = nn.Linear(6, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 3)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, tokens):
        return self.out(self.norm(torch.relu(self.hidden(self.emb(tokens).mean(1))))) * self.scale


def batch(batch_size, rank, generator):
    tokens = torch.randint(0, 50, (batch_size, 2), generator=generator)
    return tokens, tokens[:, 0] % 3


def loss(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def workload():
    return sw.define(name="my-net", model=Net, batch=batch, batch_size=8, loss=loss)


def wider():
    return sw.define(name="my-net", model=lambda: Net(width=12), batch=batch, batch_size=8, loss=loss)


def raises():
    raise RuntimeError("no data here")
'''


def run(*args, cwd: Path | None = None):
    """The command in ``cwd`` (a workload file is looked up relative to it)."""
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        os.chdir(old)


def ok(result):
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


def assert_one_line(result, fragment: str) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synctune: error: "), result.stderr
    assert "Traceback" not in result.output
    assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "my_job.py"
    path.write_text(JOB)
    return path


def _reference(job: Path):
    """The torch module itself, by its own means: the trainable parameters (name, shape,
    sparse gradient or not) and the order its submodules run in the forward pass."""
    namespace: dict = {}
    exec(compile(JOB, str(job), "exec"), namespace)  # noqa: S102 - the test's own text
    net = namespace["Net"]()
    sparse = {f"{name}.weight" for name, mod in net.named_modules()
              if isinstance(mod, torch.nn.Embedding) and mod.sparse}
    params = {name: (list(p.shape), name in sparse) for name, p in net.named_parameters() if p.requires_grad}
    called: list[str] = []
    for name, mod in net.named_modules():
        if name and not list(mod.children()):
            mod.register_forward_pre_hook(lambda _m, _i, _n=name: called.append(_n))
    net(torch.randint(0, 50, (4, 2)))
    return params, called


def test_a_workloads_spec_is_its_modules_trainable_variables_in_backward_order(job):
    params, called = _reference(job)
    spec = json.loads(ok(run("models", "-w", f"{job.name}:workload", "--json", cwd=job.parent)).stdout)
    assert spec["name"] == "my-net" and spec["batch_size"] == 8
    got = {v["name"]: (v["shape"], v["sparse"]) for v in spec["variables"]}
    assert got == params  # the frozen scale left out, the embedding's gradient sparse
    assert {v["dtype"] for v in spec["variables"]} == {"float32"}
    # backward order: the layers in the reverse of the order the forward pass called them
    layers = [v["name"].rpartition(".")[0] for v in spec["variables"]]
    assert list(dict.fromkeys(layers)) == called[::-1]

    # every spelling names the same model: NAME, --model, -m, --workload, an absolute path
    for args in (["models", f"{job.name}:workload"], ["models", "--model", f"{job.name}:workload"],
                 ["models", "-m", f"{job}:workload"], ["models", "--workload", f"{job}:workload"]):
        assert json.loads(ok(run(*args, "--json", cwd=job.parent)).stdout) == spec, args
    table = ok(run("models", "-w", f"{job}:workload")).stdout
    assert "emb.weight" in table and "50x6" in table and "sparse" in table and "scale" not in table


def test_a_strategy_is_built_validated_shown_and_scored_for_a_workload(job, tmp_path):
    params, _called = _reference(job)
    workload = f"{job}:workload"
    out = tmp_path / "parallax.json"
    ok(run("strategy", "build", "parallax", "-w", workload, "-c", "local-1x2", "-o", out))
    strategy = json.loads(out.read_text())
    assert strategy["model"]["name"] == "my-net"
    kinds = {p["variable"]: p["shards"][0]["synchronizer"]["kind"] for p in strategy["plans"]}
    # Parallax: sparse gradients to a parameter server, dense ones all-reduced
    assert kinds == {name: "ps" if sparse else "allreduce" for name, (_shape, sparse) in params.items()}

    valid = ok(run("strategy", "validate", out, "--workload", workload, "-c", "local-1x2")).stdout
    assert valid.startswith("valid: my-net on local-1x2")

    # the spec written by `models --json`, as JSON and as YAML, stands for the workload
    spec_json = tmp_path / "my-net.json"
    spec_json.write_text(ok(run("models", "-w", workload, "--json")).stdout)
    spec_yaml = tmp_path / "my-net.yaml"
    spec_yaml.write_text(yaml.safe_dump(json.loads(spec_json.read_text())))
    for spec_file in (spec_json, spec_yaml):
        assert ok(run("strategy", "validate", out, "-m", spec_file, "-c", "local-1x2")).stdout == valid
    assert ok(run("strategy", "build", "parallax", "-m", spec_yaml, "-c", "local-1x2")).stdout == out.read_text()

    # a strategy for another model is refused, naming both
    wider = run("strategy", "validate", out, "-w", f"{job}:wider", "-c", "local-1x2")
    assert_one_line(wider, "built for 'my-net'")

    shown = ok(run("strategy", "show", out, "-w", workload)).stdout
    rows = {line.split()[0]: line.split() for line in shown.splitlines()[4:]}
    assert {name: rows[name][1] for name in params} == {name: "x".join(map(str, shape))
                                                        for name, (shape, _sparse) in params.items()}

    score = ok(run("sim", "score", "analytic", out, "-w", workload)).stdout
    assert str(out) in score
    assert_one_line(run("sim", "score", "analytic", out), "built for model 'my-net', which is not in the zoo: give "
                                                           "it with --model")


BROKEN = {
    "no such file": (["models", "-w", "nowhere.py:workload"], "workload 'nowhere.py:workload': no such file"),
    "no such function": (["models", "-w", "{job}:nothing"], "has no function 'nothing'"),
    "factory raises": (["strategy", "build", "ps", "-w", "{job}:raises", "-c", "local-1x2"],
                       "calling the factory: it raised RuntimeError: no data here"),
    "no such module": (["strategy", "validate", "{strategy}", "-m", "nowhere.at.all:workload", "-c", "local-1x2"],
                       "cannot import module 'nowhere.at.all'"),
    "no factory named": (["models", "-w", "{job}"], "name the factory in the file"),
    "empty factory": (["models", "-w", "{job}:"], "expected package.module:factory or path/to/file.py:factory"),
    "unknown name": (["strategy", "build", "ps", "-m", "gpt5", "-c", "local-1x2"], "unknown model 'gpt5'"),
    "missing spec file": (["strategy", "show", "{strategy}", "-m", "nothere.yaml"],
                          "nothere.yaml: no such model spec file"),
    "two models": (["models", "-m", "cnn-small", "-w", "{job}:workload"], "give one model, got 2"),
    "NAME and --model": (["models", "cnn-small", "-w", "{job}:workload"], "give the model once"),
    "a spec file cannot run": (["sim", "profile", "-m", "{spec}", "-c", "local-1x2"],
                               "a model spec file describes a model, it cannot run one"),
    "nor be applied": (["apply", "{strategy}", "-m", "{spec}"], "a model spec file describes a model"),
    "no model": (["strategy", "validate", "{strategy}", "-c", "local-1x2"], "Missing option '--model'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_bad_model_is_one_line_and_exit_2(job, tmp_path, case):
    strategy = tmp_path / "s.json"
    ok(run("strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", strategy))
    spec = tmp_path / "cnn-small.json"
    spec.write_text(ok(run("models", "cnn-small", "--json")).stdout)
    args, fragment = BROKEN[case]
    args = [a.format(job=job, strategy=strategy, spec=spec) for a in args]
    assert_one_line(run(*args, cwd=tmp_path), fragment)


def test_naming_a_model_imports_nothing_heavy(tmp_path):
    """Telling a zoo name, a spec file and an import path apart reads and imports nothing: a
    command checks its model before any slow work (and `--help` stays instant)."""
    code = ("import sys; from synctune.workload import model_source; "
            "kinds = [model_source(t).kind for t in ('cnn-small', 'spec.yaml', 'my_job.py:workload', 'pkg.mod:f')]; "
            "heavy = [m for m in ('torch', 'ray', 'mlflow') if m in sys.modules]; print(kinds, heavy)")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=tmp_path).stdout
    assert out.strip() == "['zoo', 'spec-file', 'import-path', 'import-path'] []"
