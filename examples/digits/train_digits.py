"""Your own model, end to end: search its synchronization, apply the best strategy, train it to a
target accuracy, and compare with plain torch DDP.

The data are scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the package:
nothing is downloaded); the model is a small MLP defined below, described to synctune by the
``workload`` factory. The script

1. searches the best strategy for that workload on ``local-2x2`` (4 CPU worker processes),
   every trial real and recorded (``synctune search`` with ``workload:``);
2. trains from the same start on the same data order twice, on 4 processes: with plain torch DDP
   (its defaults) and with what the search recommends (its best strategy when the interleaved
   confirmation found it faster than the best baseline, else that baseline: a builder's
   strategy or the tuned torch DDP configuration), applied as plain DDP when DDP can express
   it, else with the synctune engine, until the test accuracy reaches the target;
3. prints both accuracy curves, the wall-clock, and how far apart the final parameters are
   (equal up to rounding when the recommendation is lossless; a tuned DDP comm hook such as
   fp16 or PowerSGD compresses, and then only the accuracy is comparable).

    python examples/digits/train_digits.py                # budget 12, target 95%
    python examples/digits/train_digits.py --budget 6 --target 0.9 --max-epochs 15
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
TRAIN, TEST = 1500, 297  # of the 1,797 images
BATCH = 32  # per replica


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test split of scikit-learn's digits, pixels scaled to [0, 1], a fixed shuffle."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:TRAIN], y[:TRAIN], x[TRAIN:TRAIN + TEST], y[TRAIN:TRAIN + TEST]


class MLP(nn.Module):
    """64 pixels -> 128 -> 64 -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.layers(x)


def loader(batch_size: int, rank: int, world: int):
    """One epoch of this replica's batches: every global batch (world x batch_size images, in an
    order fixed per epoch) is cut into one slice per replica, as torch's DistributedSampler does."""
    x, y, _tx, _ty = digits()
    per_step = batch_size * world
    for start in range(0, TRAIN - per_step + 1, per_step):
        mine = slice(start + rank * batch_size, start + (rank + 1) * batch_size)
        yield x[mine], y[mine]


def workload():
    """What synctune needs to run trials of this model (``synctune.workload.define``)."""
    import synctune.workload as sw

    return sw.define(name="digits-mlp", model=MLP, loader=loader, batch_size=BATCH,
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                     loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))


# --------------------------------------------------------------------------------- training


def _train(rank: int, world: int, args: dict) -> dict:
    """Train on this rank until the test accuracy reaches the target (or the epochs run out)."""
    import torch.distributed as dist

    from synctune.engine.core import StrategyEngine
    from synctune.run.apply import wrap_ddp
    from synctune.spec import ClusterSpec
    from synctune.strategy import Strategy
    from synctune.workload import ImportedWorkload

    work = ImportedWorkload(f"{HERE / 'train_digits.py'}:workload")
    d = work.definition
    torch.manual_seed(0)
    model = d.model()
    if args["mode"] == "engine":
        engine = StrategyEngine(model, Strategy.from_dict(args["strategy"]), work.spec(),
                                ClusterSpec.from_dict(args["cluster"]), d.optimizer)
    else:
        wrapped = wrap_ddp(model, args["ddp"]) if args["ddp"] else torch.nn.parallel.DistributedDataParallel(model)
        optimizer = d.optimizer(list(wrapped.parameters()))
    _x, _y, tx, ty = digits()
    curve, start = [], time.perf_counter()
    for epoch in range(args["max_epochs"]):
        for batch in loader(BATCH, rank, world):
            if args["mode"] == "engine":
                d.loss(model, batch).backward()
                engine.step()
                engine.zero_grad()
            else:
                optimizer.zero_grad()
                d.loss(wrapped, batch).backward()
                optimizer.step()
        with torch.no_grad():
            accuracy = float((model(tx).argmax(1) == ty).float().mean())
        dist.barrier()
        curve.append((epoch + 1, round(time.perf_counter() - start, 3), accuracy))
        if accuracy >= args["target"]:
            break
    return {"curve": curve, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(mode: str, *, target: float, max_epochs: int, strategy: dict | None = None, cluster: dict | None = None,
          ddp: dict | None = None) -> dict:
    """Run :func:`_train` on 4 local processes; rank 0's result."""
    from synctune.engine.local import run_local

    args = {"mode": mode, "target": target, "max_epochs": max_epochs, "strategy": strategy, "cluster": cluster,
            "ddp": ddp}
    return run_local(_train, 4, (args,), timeout_s=1800, threads=1)[0]


# ------------------------------------------------------------------------------------- main


def search(budget: int, ddp_trials: int, home: Path) -> dict:
    """`synctune search` of this workload on local-2x2; what it recommends (a strategy, or a
    tuned DDP configuration) with its confirmation."""
    experiment = home / "digits.yaml"
    experiment.write_text(f"name: digits\nworkload: {HERE / 'train_digits.py'}:workload\ncluster: local-2x2\n"
                          f"budget: {budget}\nsimulator: analytic\nproposals: 200\ncandidates: 3\nwarmup: 2\n"
                          f"iters: 10\nbaselines: [allreduce, horovod, ps-lb, partitioned-ps]\nddp_trials: {ddp_trials}\n"
                          f"confirm_rounds: 6\nconfirm_iters: 3\n")
    env = dict(__import__("os").environ, SYNCTUNE_HOME=str(home))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "synctune", "search", str(experiment)], env=env, text=True,
                          capture_output=True)
    print(done.stdout, end="")
    if done.returncode != 0:
        sys.exit(f"the search failed:\n{done.stderr[-2000:]}")
    return json.loads((home / "searches" / "digits-seed0-best-result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=12, help="trials of the search")
    parser.add_argument("--ddp-trials", type=int, default=4, help="tuned torch DDP trials (a baseline)")
    parser.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--home", help="synctune data folder for the search (default: a temporary one)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from synctune.engine.ddp import DDPConfig
    from synctune.strategy.compressors import COMPRESSORS
    from synctune.run.apply import ddp_config
    from synctune.spec import cluster_preset
    from synctune.strategy import Strategy
    from synctune.workload import ImportedWorkload

    with tempfile.TemporaryDirectory() as scratch:
        home = Path(args.home or scratch)
        home.mkdir(parents=True, exist_ok=True)
        print(f"1. searching the synchronization of digits-mlp on local-2x2 ({args.budget} trials)")
        answer = search(args.budget, args.ddp_trials, home)
    chosen = answer["recommended"]
    best = chosen["strategy"]
    strategy = Strategy.from_dict(best)
    spec = ImportedWorkload(f"{HERE / 'train_digits.py'}:workload").spec()
    if chosen["ddp"]:  # tuned DDP won: it is what the user runs
        config, why = DDPConfig.from_dict(chosen["ddp"]), ""
    else:
        config, why = ddp_config(strategy, spec)
    print(f"   the search recommends {chosen['name']} ({chosen['why']})")
    applied = f"plain DDP {config.to_dict()}" if config else f"the synctune engine ({why})"
    print(f"\n2. training to {args.target:.0%} test accuracy: plain DDP, then the best strategy as {applied}")
    ddp = train("ddp", target=args.target, max_epochs=args.max_epochs)
    if config:
        tuned = train("ddp", target=args.target, max_epochs=args.max_epochs, ddp=config.to_dict())
    else:
        tuned = train("engine", target=args.target, max_epochs=args.max_epochs, strategy=best,
                      cluster=cluster_preset("local-2x2").to_dict())
    print(f"\n{'epoch':>5}  {'DDP acc':>8}  {'DDP s':>7}  {'best acc':>8}  {'best s':>7}")
    for i in range(max(len(ddp["curve"]), len(tuned["curve"]))):
        left = ddp["curve"][i] if i < len(ddp["curve"]) else None
        right = tuned["curve"][i] if i < len(tuned["curve"]) else None
        cells = [f"{(left or right)[0]:>5}"]
        for point in (left, right):
            cells += [f"{point[2]:>8.3f}", f"{point[1]:>7.2f}"] if point else [f"{'':>8}", f"{'':>7}"]
        print("  ".join(cells))
    diff = max(float((ddp["params"][k] - tuned["params"][k]).abs().max()) for k in ddp["params"])
    figures = {"strategy": strategy.summary(), "applied_as": "ddp" if config else "engine",
               "ddp_curve": ddp["curve"], "best_curve": tuned["curve"], "max_param_difference": diff,
               "target": args.target, "recommended": chosen["name"],
               # Lossless: the same training as plain DDP, up to float rounding.
               "lossless": (config.comm_hook == "none") if config else all(
                   COMPRESSORS[c].lossless for c in strategy.stats()["compressors"])}
    reached = {name: run["curve"][-1][2] >= args.target for name, run in (("ddp", ddp), ("best", tuned))}
    print(f"\nreached {args.target:.0%}: DDP {'yes' if reached['ddp'] else 'no'} after {ddp['curve'][-1][1]:.2f} s, "
          f"best strategy {'yes' if reached['best'] else 'no'} after {tuned['curve'][-1][1]:.2f} s; "
          f"largest parameter difference {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
