"""Applying a strategy to a real training job (``synctune apply``, and the end of every search).

When the strategy is one torch DDP can express (all-reduce of whole variables, flat, even
batch split, no sparse gradient, one compressor), users can stay on plain DDP: the same
training (lossless strategies give DDP's parameters, the equivalence tests check it) with the
bucket size cap of the strategy's largest merge group, ``gradient_as_bucket_view`` and the comm
hook of its compressor (fp16, bf16, PowerSGD). DDP forms its buckets itself (greedily, and again
after its first iteration), so its bucket boundaries, and with them its timing, are DDP's own,
not the measured strategy's; PowerSGD's hook differs in its details (warm-up iterations, random
projections). Otherwise the training file runs the strategy itself with
:class:`synctune.engine.core.StrategyEngine`. Either way a runnable Python file is written:
launch it with ``torchrun`` (``python -m torch.distributed.run``), one process per replica.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import AllReduceSynchronizer, Strategy

__all__ = ["DDPConfig", "ddp_config", "wrap_ddp", "training_script", "write_training_file", "apply_search_result",
           "run_command", "FORMATS"]

FORMATS = ("auto", "ddp", "engine")


@dataclass(frozen=True)
class DDPConfig:
    """What reproduces a strategy in torch DDP."""

    bucket_cap_mb: float
    gradient_as_bucket_view: bool
    comm_hook: str  # "none", "fp16", "bf16", "powersgd"
    powersgd_rank: int | None
    num_groups: int

    def to_dict(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.bucket_cap_mb, "gradient_as_bucket_view": self.gradient_as_bucket_view,
                "comm_hook": self.comm_hook, "powersgd_rank": self.powersgd_rank, "num_groups": self.num_groups}


def ddp_config(strategy: Strategy, spec: ModelSpec) -> tuple[DDPConfig | None, str]:
    """The DDP configuration of ``strategy``, or None and the reason DDP cannot express it."""
    if len(set(strategy.batch_split)) > 1:
        return None, f"the batch split is uneven ({list(strategy.batch_split)}); DDP averages replicas equally"
    compressors = set()
    groups: dict[int, int] = {}
    for plan in strategy.plans:
        var = spec[plan.variable]
        if var.sparse:
            return None, f"variable {plan.variable!r} has sparse gradients; DDP all-reduces dense buckets only"
        if plan.is_partitioned:
            return None, f"variable {plan.variable!r} is partitioned into {plan.num_shards} shards"
        shard = plan.shards[0]
        sync = shard.synchronizer
        if not isinstance(sync, AllReduceSynchronizer):
            return None, f"variable {plan.variable!r} is synchronized by {sync.kind}"
        if sync.algorithm != "flat":
            return None, f"variable {plan.variable!r} is all-reduced {sync.algorithm}ly"
        compressors.add((shard.compressor.kind, shard.compressor.rank))
        groups[sync.group] = groups.get(sync.group, 0) + var.num_bytes
    if len(compressors) > 1:
        return None, f"it mixes compressors {sorted(c[0] for c in compressors)}; one DDP comm hook compresses all"
    (kind, rank), = compressors
    if kind not in ("none", "fp16", "bf16", "powersgd"):
        return None, f"DDP has no comm hook for compressor {kind!r}"
    largest = max(groups.values())
    # The cap is the largest merge group (rounded up to 10 KiB): buckets of the strategy's size.
    cap = math.ceil(largest / 2**20 * 100) / 100
    return DDPConfig(bucket_cap_mb=max(cap, 0.01), gradient_as_bucket_view=True, comm_hook=kind,
                     powersgd_rank=rank, num_groups=len(groups)), ""


def wrap_ddp(model: Any, config: DDPConfig | dict, device_ids: list[int] | None = None) -> Any:
    """``model`` in torch DDP as ``config`` says, its comm hook registered."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    c = config if isinstance(config, DDPConfig) else DDPConfig(**config)
    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=c.bucket_cap_mb,
              gradient_as_bucket_view=c.gradient_as_bucket_view)
    if c.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif c.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif c.comm_hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=c.powersgd_rank,
                                       start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp


_SCRIPT = '''"""Train {name} with {what}.

Generated by `synctune apply` from strategy {strategy_hash} ({summary}).
{reason}
Run one process per replica ({replicas} here), e.g. on one machine:

    python -m torch.distributed.run --standalone --nproc-per-node {replicas} {filename} --steps 100

On several machines, start it on each with --nnodes, --node-rank and --rdzv-endpoint; ranks
follow the strategy's replicas in order ({devices}). Options: --steps, --checkpoint FILE.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from synctune.workload import ImportedWorkload, resolve_workload

WORKLOAD = {workload!r}
ROOT = {root!r}  # where relative workload paths are found
SEED = {seed}
BATCH_SPLIT = {batch_split!r}  # per rank, as the strategy was measured
{payload}

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint", help="where to save the trained state (rank 0 writes it)")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != len(BATCH_SPLIT):
        raise SystemExit(f"the strategy has {{len(BATCH_SPLIT)}} replicas: start {{len(BATCH_SPLIT)}} processes, not {{world}}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    workload = ImportedWorkload(WORKLOAD, ROOT) if ":" in WORKLOAD else resolve_workload(WORKLOAD)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = workload.build_model()
{setup}
    data = workload.batches(BATCH_SPLIT[rank], rank, world, SEED)
    for step in range(args.steps):
        batch = tuple(t.to(device) for t in next(data))
{train_step}
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {{step + 1}}: loss {{loss.item():.4f}}", flush=True)
{save}
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

_DDP_SETUP = '''    from synctune.run.apply import wrap_ddp

    ddp = wrap_ddp(model, DDP_CONFIG, device_ids=[device.index] if cuda else None)
    optimizer = workload.make_optimizer([p for p in ddp.parameters() if p.requires_grad])'''
_DDP_STEP = '''        optimizer.zero_grad()
        loss = workload.loss(ddp, batch)
        loss.backward()
        optimizer.step()'''
_DDP_SAVE = '''    if args.checkpoint and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.checkpoint)'''

_ENGINE_SETUP = '''    from synctune.engine.core import StrategyEngine
    from synctune.spec import ClusterSpec, ModelSpec
    from synctune.strategy import Strategy

    engine = StrategyEngine(model, Strategy.from_dict(STRATEGY), ModelSpec.from_dict(SPEC), ClusterSpec.from_dict(CLUSTER),
                            lambda params: workload.make_optimizer(params))'''
_ENGINE_STEP = '''        loss = workload.loss(model, batch)
        loss.backward()
        engine.step()
        engine.zero_grad()'''
_ENGINE_SAVE = '''    if args.checkpoint:
        state = engine.state_dict()  # every rank takes part; the state does not depend on the strategy
        if rank == 0:
            torch.save(state, args.checkpoint)'''


def _literal(value: Any) -> str:
    """``json.loads('...')`` of ``value``: plain data as Python source."""
    return f"json.loads({json.dumps(value, sort_keys=True, separators=(',', ':'))!r})"


def _plain(text: str) -> str:
    """``text`` safe inside the generated file's docstring."""
    return "".join(c if c.isprintable() and c not in '\\"' else "?" for c in text)


def training_script(strategy: Strategy, spec: ModelSpec, cluster: ClusterSpec, *, workload: str, root: str,
                    fmt: str = "auto", filename: str = "train.py", seed: int = 0) -> tuple[str, str]:
    """The training file for ``strategy`` and the format it uses (``ddp`` or ``engine``)."""
    if fmt not in FORMATS:
        raise SpecError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    config, why = ddp_config(strategy, spec)
    if fmt == "ddp" and config is None:
        raise SpecError(f"strategy {strategy.hash[:12]} cannot run as plain DDP: {why}; use --format engine")
    use_ddp = config is not None and fmt != "engine"
    if use_ddp:
        hook = "" if config.comm_hook == "none" else f", the {config.comm_hook} comm hook"
        what = (f"plain torch DDP: buckets up to {config.bucket_cap_mb:g} MiB (the strategy's largest merge "
                f"group){hook}, gradient_as_bucket_view")
        payload = f"DDP_CONFIG = {_literal(config.to_dict())}\n"
        setup, step, save = _DDP_SETUP, _DDP_STEP, _DDP_SAVE
        reason = ""
    else:
        what = "the synctune engine running the strategy"
        payload = (f"STRATEGY = {_literal(strategy.to_dict())}\nSPEC = {_literal(spec.to_dict())}\n"
                   f"CLUSTER = {_literal(cluster.to_dict())}\n")
        setup, step, save = _ENGINE_SETUP, _ENGINE_STEP, _ENGINE_SAVE
        reason = f"Plain DDP cannot run it: {_plain(why)}.\n" if why else ""
    text = _SCRIPT.format(name=_plain(spec.name), what=_plain(what), strategy_hash=strategy.hash[:12],
                          summary=_plain(strategy.summary()), reason=reason, replicas=len(strategy.replicas),
                          filename=_plain(filename), devices=_plain(", ".join(strategy.replicas[:6]) + (
                              ", ..." if len(strategy.replicas) > 6 else "")),
                          workload=workload, root=root, seed=seed, batch_split=list(strategy.batch_split),
                          payload=payload, setup=setup, train_step=step, save=save)
    return text, "ddp" if use_ddp else "engine"


def write_training_file(strategy: Strategy, workload, cluster: ClusterSpec, output, fmt: str = "auto",
                        seed: int = 0) -> str:
    """Write the training file of ``strategy`` for ``workload``; returns the format used."""
    from pathlib import Path

    from ..spec.files import write_text_atomic
    from ..strategy.validate import validate

    spec = workload.spec()
    validate(strategy, spec, cluster)
    text, used = training_script(strategy, spec, cluster, workload=workload.source.removeprefix("zoo:"),
                                 root=getattr(workload, "root", "") or "", fmt=fmt, filename=Path(output).name,
                                 seed=seed)
    write_text_atomic(output, text)
    return used


def run_command(strategy: Strategy, output) -> str:
    """How to run a training file: torchrun with one process per replica."""
    return f"python -m torch.distributed.run --standalone --nproc-per-node {len(strategy.replicas)} {output}"


def apply_search_result(best: dict, workload, cluster: ClusterSpec, best_path, *, seed: int = 0,
                        logger=None, parent_run_id: str = ""):
    """The best strategy of a search as a training file next to it (``<best>-train.py``), also
    attached to the search's MLflow run; returns (path, format used)."""
    from pathlib import Path

    path = Path(best_path).with_name(Path(best_path).stem + "-train.py")
    used = write_training_file(Strategy.from_dict(best), workload, cluster, path, seed=seed)
    if logger is not None and parent_run_id:
        logger.log_text(parent_run_id, path.read_text(), "train.py")
    return path, used
