"""Your own training job, end to end: a workload defined in a module outside the repository is
searched and every trial recorded; its best strategy becomes a training file (`synctune apply`)
that runs on 2 processes and trains; a strategy DDP can express becomes plain DDP whose
parameters equal the engine's; a broken workload is one line naming the step that failed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _engine_workers import ddp_apply_worker
from _searches import search_env
from synctune.cli import cli
from synctune.data import TrialDataset
from synctune.engine.local import run_local
from synctune.models import model_spec
from synctune.run.apply import ddp_config
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy

ROOT = Path(__file__).resolve().parents[1]

JOB = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

import synctune.workload as sw


class Net(nn.Module):
    """A small classifier with a sparse embedding and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8, sparse=True)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.emb(tokens).mean(1))))


def batch(batch_size, rank, generator):
    tokens = torch.randint(0, 64, (batch_size, 1), generator=generator)
    return tokens, tokens[:, 0] % 4  # learnable: the label is a function of the first token


def workload():
    return sw.define(name="tokens-net", model=Net, batch=batch, batch_size=16,
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                     loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]))
'''


def test_ddp_configuration_reproduces_the_engine():
    """Strategies torch DDP can express, run both ways: identical parameters (lossless), within
    fp16's rounding for the fp16 comm hook; and the DDP object holds the bucket cap and hook of
    the strategy (the numbers of a lossless run cannot tell one bucket cap from another)."""
    cluster = cluster_preset("local-1x2")
    spec = model_spec("cnn-small")
    # cnn-small's gradients in bytes (fp32): fc.bias 40, fc.weight 2,560, conv3.weight 73,728,
    # conv3.bias 256, norm2 128 + 128, conv2.weight 18,432, conv2.bias 128, norm1 64 + 64,
    # conv1.weight 1,728, conv1.bias 64; 97,320 in all. The cap is the largest merge group in MiB,
    # rounded up to 0.01 (apply.py's docstring).
    cases, expected = [], []
    for builder, options, tol, cap_mb, hook in [
        # chunks of 3 variables in backward order: the largest is fc.bias + fc.weight + conv3.weight
        # = 76,328 bytes = 0.0728 MiB
        ("allreduce", {"chunk": 3}, 1e-6, 0.08, ""),
        # conv3.weight alone (73,728 bytes = 0.0703 MiB) is over the 20,000-byte fusion threshold
        ("horovod", {"fusion_threshold_bytes": 20_000}, 1e-6, 0.08, ""),
        # one group, the whole model: 97,320 bytes = 0.0928 MiB
        ("allreduce", {"compressor": "fp16"}, 2e-3, 0.1, "fp16_compress_hook")]:
        strategy = build_strategy(builder, spec, cluster, **options)
        config, why = ddp_config(strategy, spec)
        assert config is not None, why
        cases.append({"strategy": strategy.to_dict(), "cluster": cluster.to_dict(), "config": config.to_dict(),
                      "lr": 0.1, "steps": 3, "tol": tol})
        # torch's conversion of a MiB cap to bytes (DistributedDataParallel's int(cap * 2**20))
        expected.append({"bucket_cap_bytes": int(cap_mb * 2**20), "comm_hook": hook, "gradient_as_bucket_view": True})
    outputs = run_local(ddp_apply_worker, cluster.num_devices, (cases,), timeout_s=600, threads=1)
    for case, want, out in zip(cases, expected, outputs[0]):
        assert out["settings"] == want, (case["config"], out["settings"])
        for k, v in out["engine"].items():
            torch.testing.assert_close(out["ddp"][k], v, rtol=case["tol"], atol=case["tol"] * 1e-2)


@pytest.mark.parametrize("builder, options, reason", [
    ("ps-lb", {}, "is synchronized by ps"),
    ("partitioned-allreduce", {}, "is partitioned into"),
    ("allreduce", {"algorithm": "hierarchical"}, "all-reduced hierarchically"),
])
def test_strategies_ddp_cannot_express_say_why(builder, options, reason):
    cluster = cluster_preset("local-2x2")
    spec = model_spec("cnn-small")
    config, why = ddp_config(build_strategy(builder, spec, cluster, **options), spec)
    assert config is None and reason in why
    sparse = model_spec("ncf-small")
    config, why = ddp_config(build_strategy("allreduce", sparse, cluster), sparse)
    assert config is None and "sparse gradients" in why
    even = build_strategy("allreduce", spec, cluster)
    config, why = ddp_config(type(even)(**{**even.__dict__, "batch_split": (1, 2, 3, 4)}), spec)
    assert config is None and "uneven" in why


def test_a_workload_outside_the_repository_is_searched_and_applied(tmp_path):
    job = tmp_path / "elsewhere" / "my_job.py"
    job.parent.mkdir()
    job.write_text(JOB)
    experiment = tmp_path / "elsewhere" / "search.yaml"
    experiment.write_text("name: mine\nworkload: my_job.py:workload\ncluster: local-1x2\nbudget: 5\n"
                          "simulator: analytic\nproposals: 30\ncandidates: 2\nwarmup: 1\niters: 3\n"
                          "baselines: [allreduce, parallax]\nddp_trials: 0\nconfirm_rounds: 0\n")
    home = tmp_path / "home"
    env = search_env(home)
    done = subprocess.run([sys.executable, "-m", "synctune", "search", str(experiment)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = TrialDataset(home / "dataset").read(search_id="mine-seed0")
    assert len(rows) == 5 and (rows["status"] == "ok").all()
    assert set(rows["workload_source"]) == {str(job.parent / "my_job.py") + ":workload"}
    assert set(rows["model_name"]) == {"tokens-net"}
    train = home / "searches" / "mine-seed0-best-train.py"
    assert train.is_file() and f"apply     {train}" in done.stdout
    # The same by hand, to a file of our choosing, then run on 2 processes: it trains.
    out = tmp_path / "train.py"
    result = CliRunner(env={"SYNCTUNE_HOME": str(home)}).invoke(cli, [
        "apply", str(home / "searches" / "mine-seed0-best.json"), "-w", f"{job}:workload", "-o", str(out)])
    assert result.exit_code == 0, result.output
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(out), "--steps", "60", "--log-every", "20", "--checkpoint", str(tmp_path / "ck.pt")],
                         env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", ran.stdout)]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], ran.stdout
    assert "model" in torch.load(tmp_path / "ck.pt", weights_only=False)


BROKEN = {
    "no such module": ("nowhere.at.all:workload", "cannot import module 'nowhere.at.all'"),
    "no such function": ("{job}:nothing", "has no function 'nothing'"),
    "factory raises": ("{job}:raises", "calling the factory: it raised RuntimeError: no data here"),
    "forward fails": ("{job}:bad_forward", "the forward and backward pass on a batch of 4 failed"),
    "wrong batch shape": ("{job}:wrong_shape", "the forward and backward pass on a batch of 4 failed"),
    "not a definition": ("{job}:not_a_definition", "the factory returned dict"),
}
BROKEN_JOB = JOB + '''

def raises():
    raise RuntimeError("no data here")


def not_a_definition():
    return {"model": Net}


def bad_forward():
    return sw.define(name="bad", model=Net, batch=batch, batch_size=4, loss=lambda model, b: model(b[1].float()).sum())


def wrong_shape():
    return sw.define(name="shape", model=lambda: nn.Linear(3, 2), batch_size=4,
                     batch=lambda n, rank, g: (torch.randn(n, 5, generator=g),), loss=lambda m, b: m(b[0]).sum())
'''


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_workload_is_one_line_and_nothing_is_recorded(tmp_path, case):
    job = tmp_path / "broken.py"
    job.write_text(BROKEN_JOB)
    path, fragment = BROKEN[case]
    home = tmp_path / "home"
    result = CliRunner(env={"SYNCTUNE_HOME": str(home)}).invoke(cli, [
        "trial", "-w", path.format(job=job), "-c", "local-1x2", "-b", "allreduce"])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("synctune: error: workload ") and fragment in lines[0], lines
    assert not (home / "dataset").exists() or not TrialDataset(home / "dataset").files()


def _run_file(path: Path, cwd: Path, steps: int = 20) -> list[float]:
    env = search_env(cwd / "home")
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(path), "--steps", str(steps), "--log-every", "10"], env=env, cwd=str(cwd),
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", ran.stdout)]


def _ddp_config_of(text: str) -> dict:
    """The ``DDP_CONFIG = json.loads('...')`` literal of a training file, read without running it."""
    import ast

    (line,) = [ln for ln in text.splitlines() if ln.startswith("DDP_CONFIG = ")]
    call = ast.parse(line).body[0].value
    assert ast.unparse(call.func) == "json.loads", line
    return json.loads(ast.literal_eval(call.args[0]))


def test_applied_files_of_both_formats_run_for_zoo_models(tmp_path):
    """A strategy DDP can express becomes a plain-DDP file; one with an uneven batch split an
    engine file that trains each rank with its share of the batch. Both run on 2 processes."""
    runner = CliRunner(env={"SYNCTUNE_HOME": str(tmp_path / "home")})
    strategy = tmp_path / "s.json"
    assert runner.invoke(cli, ["strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-O",
                               "compressor=fp16", "-o", str(strategy)]).exit_code == 0
    result = runner.invoke(cli, ["apply", str(strategy), "-m", "cnn-small"])
    assert result.exit_code == 0 and "plain torch DDP" in result.output, result.output
    text = (tmp_path / "s-train.py").read_text()
    assert "DistributedDataParallel" not in text  # wrap_ddp does it, from DDP_CONFIG
    # one all-reduce group of cnn-small's 97,320 gradient bytes = 0.0928 MiB, rounded up to 0.01
    assert _ddp_config_of(text) == {"bucket_cap_mb": 0.1, "comm_hook": "fp16", "gradient_as_bucket_view": True,
                                    "first_bucket_mb": None, "num_groups": 1, "powersgd_rank": None}
    assert len(_run_file(tmp_path / "s-train.py", tmp_path)) == 2
    uneven = json.loads(strategy.read_text())
    uneven["batch_split"] = [3, 13]
    strategy.write_text(json.dumps(uneven))
    result = runner.invoke(cli, ["apply", str(strategy), "-m", "cnn-small", "-o", str(tmp_path / "uneven.py")])
    assert result.exit_code == 0 and "synctune engine" in result.output, result.output
    assert "BATCH_SPLIT = [3, 13]" in (tmp_path / "uneven.py").read_text()
    assert len(_run_file(tmp_path / "uneven.py", tmp_path)) == 2
    result = runner.invoke(cli, ["apply", str(strategy), "-m", "cnn-small", "--format", "ddp", "-o",
                                 str(tmp_path / "x.py")])
    assert result.exit_code == 2 and "cannot run as plain DDP: the batch split is uneven" in result.stderr


@pytest.mark.parametrize("split, fmt", [((4, 4), "ddp"), ((3, 5), "engine")])
def test_an_applied_file_checkpoints_the_strategys_blocks_and_trains_as_one_process(tmp_path, split, fmt):
    """A strategy that checkpoints blocks (transformer-small: full and selective) becomes a plain
    DDP file (even split) or an engine file (uneven) that runs those blocks under
    torch.utils.checkpoint before DDP or the engine wraps the model; run under torchrun on 2
    processes, its saved state equals single-process training WITHOUT checkpointing on the
    concatenated batches (the workload's SGD, lr 0.01), within the equivalence suite's bounds."""
    import dataclasses

    from _engine_workers import reference_training
    from synctune.run.apply import write_training_file
    from synctune.workload import zoo_workload

    workload, cluster = zoo_workload("transformer-small"), cluster_preset("local-1x2")
    checkpoint = (("decoder.0", "selective"), ("decoder.1", "full"), ("encoder.0", "full"),
                  ("encoder.1", "selective"))
    strategy = dataclasses.replace(build_strategy("allreduce", workload.spec(), cluster), batch_split=split,
                                   checkpoint=checkpoint)
    out = tmp_path / "train.py"
    assert write_training_file(strategy, workload, cluster, out) == fmt
    text = out.read_text()
    wrap = "wrap_ddp(model" if fmt == "ddp" else "StrategyEngine(model"
    assert text.index("checkpoint_blocks(model, CHECKPOINT)") < text.index(wrap)
    assert "from synctune.engine.checkpoint" not in text  # torch's own API, written out
    # The file's own checkpoint_blocks really recomputes: backward runs more ops after it.
    assert _backward_ops(out, workload, checkpoint) > _backward_ops(out, workload, ())
    steps = 3
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(out), "--steps", str(steps), "--log-every", "1", "--checkpoint", str(tmp_path / "ck.pt")],
                         env=search_env(tmp_path / "home"), cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)
    got = saved["model"]
    ref = reference_training("transformer-small", split, "sgd", 0.01, steps)
    exact = reference_training("transformer-small", split, "sgd", 0.01, steps, dtype=torch.float64)
    assert set(got) == set(ref)
    for k, v in got.items():
        rounding = 2 * (ref[k].double() - exact[k]).abs().max().item()
        torch.testing.assert_close(v.double(), exact[k], rtol=1e-5, atol=2e-6 + rounding, msg=lambda m: f"{k}: {m}")


def _backward_ops(path: Path, workload, blocks) -> int:
    """The aten ops one backward of ``workload`` runs after the training file at ``path`` (imported,
    not run) has checkpointed ``blocks`` with its own ``checkpoint_blocks``."""
    import importlib.util

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    spec = importlib.util.spec_from_file_location("applied_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = workload.build_model()
    module.checkpoint_blocks(model, [list(b) for b in blocks])
    batch = workload.make_batch(4, rank=0, generator=torch.Generator().manual_seed(0), device=torch.device("cpu"))
    loss = workload.loss(model, batch)
    with Count():
        loss.backward()
    return Count.ops


def test_a_tuned_ddp_winner_is_applied_with_its_own_configuration(tmp_path):
    """When tuned DDP wins a search, the training file runs DDP with the tuned bucket sizes and
    hook (not the configuration derived from a strategy), and it runs."""
    from synctune.engine.ddp import DDPConfig
    from synctune.run.apply import apply_search_result
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    workload, cluster = zoo_workload("cnn-small"), cluster_preset("local-1x2")
    skeleton = build_strategy("allreduce", workload.spec(), cluster)
    tuned = DDPConfig(bucket_cap_mb=3.5, first_bucket_mb=0.75, comm_hook="fp16")
    path, used = apply_search_result(skeleton.to_dict(), workload, cluster, tmp_path / "best.json",
                                     ddp=tuned.to_dict())
    text = path.read_text()
    assert used == "ddp" and "as tuned by the search" in text
    assert '"bucket_cap_mb":3.5' in text and '"first_bucket_mb":0.75' in text and '"comm_hook":"fp16"' in text
    assert len(_run_file(path, tmp_path)) == 2
    from synctune.spec.errors import SpecError

    with pytest.raises(SpecError, match="use --format ddp or auto"):
        from synctune.run.apply import training_script

        training_script(skeleton, workload.spec(), cluster, workload="cnn-small", root="", fmt="engine", ddp=tuned)


def test_applied_file_says_what_it_is_doing(tmp_path):
    """Run as the search's summary says (torchrun, a few steps), the training file prints from
    rank 0 the step, the loss, the iteration time and samples/s, then the mean iteration time
    after the warm-up; ``--quiet`` prints nothing. Every format shares the printing: the plain-DDP
    file is run talking, the engine's quiet."""
    strategy = tmp_path / "s.json"
    runner = CliRunner(env={"SYNCTUNE_HOME": str(tmp_path / "home")})
    built = runner.invoke(cli, ["strategy", "build", "allreduce", "-m", "cnn-small", "-c", "local-1x2", "-o", str(strategy)])
    assert built.exit_code == 0, built.output

    def apply(fmt):
        out = tmp_path / f"train_{fmt}.py"
        applied = runner.invoke(cli, ["apply", str(strategy), "-m", "cnn-small", "-c", "local-1x2", "--format", fmt,
                                      "-o", str(out)])
        assert applied.exit_code == 0, applied.output
        return out

    def run(out, *extra):
        ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(out), "--steps", "5", *extra], env=search_env(tmp_path / "home"), cwd=str(tmp_path),
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        return ran.stdout

    said = run(apply("ddp"))
    steps = re.findall(r"^step (\d+)/5: loss [0-9.]+, [0-9.]+ ms/iteration, [0-9.]+ samples/s$", said, re.M)
    assert steps == ["1", "2", "3", "4", "5"], said  # 5 steps: one line each (steps / 5)
    done = re.findall(r"^done: 5 steps on 2 processes; mean iteration ([0-9.]+) ms over steps 4-5 "
                      r"\(rank 0, after 3 warm-up\), ([0-9.]+) samples/s", said, re.M)
    assert len(done) == 1 and float(done[0][0]) > 0, said
    # samples/s is the global batch (2 replicas x the zoo batch) over the mean iteration time
    assert float(done[0][1]) == pytest.approx(2 * 16 * 1e3 / float(done[0][0]), rel=0.01)
    assert run(apply("engine"), "--quiet").strip() == ""
