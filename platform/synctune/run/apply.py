"""Applying a strategy to a real training job (``synctune apply``, and the end of every search).

When the strategy is one torch DDP can express (all-reduce of whole variables, flat, even
batch split, no sparse gradient, one compressor), users can stay on plain DDP: the same
training (lossless strategies give DDP's parameters, the equivalence tests check it) with the
bucket size cap of the strategy's largest merge group, ``gradient_as_bucket_view`` and the comm
hook of its compressor (fp16, bf16, PowerSGD). DDP forms its buckets itself (greedily, and again
after its first iteration), so its bucket boundaries, and with them its timing, are DDP's own,
not the measured strategy's; PowerSGD's hook differs in its details (warm-up iterations, random
projections). A strategy with ``tensor_parallel`` becomes a file of torch's DTensor: the
("dp", "tp") mesh, ``parallelize_module`` with the plan written out module by module, then
``fully_shard`` per unit on the ``dp`` sub-mesh or an all-reduce of the local gradients over it
(:func:`tp_setup_code`), as the ``tp`` runtime runs it. A strategy whose plans are all ``shard``
with units at module
boundaries is what torch FSDP2 expresses: the file calls ``fully_shard`` per unit on the
strategy's mesh (1-D, or HSDP's 2-D), with each unit's ``reshard_after_forward``, reduce dtype
and prefetch, in plain PyTorch (:func:`fsdp_setup_code`). Otherwise the training file runs the
strategy itself with :class:`synctune.engine.core.StrategyEngine`. Either way a runnable Python file is written:
launch it with ``torchrun`` (``python -m torch.distributed.run``), one process per replica.

A strategy that checkpoints activations (its ``checkpoint`` field; FSDP2's ``checkpoint`` setting
reaches here through :meth:`~synctune.engine.runtime.Runtime.plans_of`) has the same blocks run
under ``torch.utils.checkpoint`` in the file, in plain PyTorch, right after the model is built and
before DDP, ``fully_shard`` or the engine wraps it (torch's order: checkpoint, then shard), so the
module paths ``fully_shard`` is given stay those of the model (:func:`checkpoint_setup_code`).
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any

from ..engine.ddp import DDPConfig, wrap_ddp
from ..engine.fsdp import FSDPPlan, has_shard_plans, loss_scales, plan_from_strategy
from ..engine.tensor_parallel import allreduce_gradients
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.checkpoint import SAVED_OPS, checkpoint_blocks, checkpoint_label
from ..strategy.schema import Strategy
from ..strategy.tensor_parallel import is_embedding

__all__ = ["DDPConfig", "ddp_config", "wrap_ddp", "fsdp_config", "fsdp_setup_code", "checkpoint_setup_code",
           "tp_setup_code",
           "training_script",
           "write_training_file", "apply_search_result", "run_command", "FORMATS", "FORMAT_NAMES"]

#: A training file's formats (``auto``: FSDP2 or plain DDP where one runs the strategy exactly).
FORMATS = ("auto", "ddp", "fsdp", "tp", "engine")
#: What a training file of each format trains with, in words.
FORMAT_NAMES = {"ddp": "plain torch DDP", "fsdp": "torch FSDP2", "tp": "torch DTensor tensor parallelism",
                "engine": "synctune engine"}


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
        if not sync.merge_groups:  # DDP's buckets are all-reduce merge groups
            return None, f"variable {plan.variable!r} is synchronized by {sync.kind}"
        departs = [what for what, _detail in sync.ddp_departures(var)]
        if departs:
            return None, f"variable {plan.variable!r} is all-reduced {departs[0]}ly"
        compressors.add((shard.compressor.kind, shard.compressor.rank))
        groups[sync.merge_id] = groups.get(sync.merge_id, 0) + var.num_bytes
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


def fsdp_config(strategy: Strategy, spec: ModelSpec, workload) -> tuple[FSDPPlan | None, str]:
    """The FSDP2 plan of ``strategy`` (every plan ``shard``, units at module boundaries, the
    module tree from ``workload``'s model built on the meta device), or None and the reason
    FSDP2 cannot express it."""
    import torch

    if not has_shard_plans(strategy):
        return None, "it has no shard plans"
    try:
        with torch.device("meta"):
            module = workload.build_model()
    except Exception as exc:  # noqa: BLE001 - the user's model code; the engine file needs no module tree
        return None, f"its model could not be built on the meta device to find its modules ({type(exc).__name__})"
    try:
        return plan_from_strategy(module, strategy, spec), ""
    except SpecError as exc:
        return None, str(exc)


def fsdp_setup_code(plan: FSDPPlan) -> str:
    """The training file's FSDP2 setup of ``plan``, in plain PyTorch: the mesh, one
    ``fully_shard`` call per unit (bottom-up, the root last) and the explicit prefetch lists."""
    lines = ["    from torch.distributed.device_mesh import init_device_mesh",
             "    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard", ""]
    if len(plan.mesh_shape) == 2:
        lines.append(f"    # HSDP: shard inside groups of {plan.mesh_shape[1]} consecutive ranks, all-reduce across the "
                     f"{plan.mesh_shape[0]} groups")
    lines.append(f"    mesh = init_device_mesh(device.type, {plan.mesh_shape!r}, mesh_dim_names={plan.mesh_dim_names!r})")
    lines.append("    # one fully_shard per unit, each before the module holding it; the root last takes the rest")
    for unit in plan.units:
        target = f"model.get_submodule({unit.module!r})" if unit.module else "model"
        policy = ("" if unit.reduce_dtype == "fp32" else
                  ", mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)")
        lines.append(f"    fully_shard({target}, mesh=mesh, reshard_after_forward={unit.reshard_after_forward!r}{policy})")
    depth = {u.module: u.prefetch for u in plan.units}
    order = list(plan.forward_order)
    explicit = [(i, p) for i, p in enumerate(order) if depth[p] >= 2]
    if explicit or depth[""] >= 2:
        lines.append("    # prefetch: all-gathers issued this many units ahead (FSDP2 overlaps one by itself)")
    for i, path in explicit:
        n = depth[path]
        ahead = ", ".join(f"model.get_submodule({p!r})" for p in order[i + 1:i + 1 + n])
        behind = ", ".join(f"model.get_submodule({p!r})" for p in order[max(0, i - n):i][::-1])
        # An empty list is FSDP2's default (nothing to write): the last unit in forward, the first in backward.
        if ahead:
            lines.append(f"    model.get_submodule({path!r}).set_modules_to_forward_prefetch([{ahead}])")
        if behind:
            lines.append(f"    model.get_submodule({path!r}).set_modules_to_backward_prefetch([{behind}])")
    if order and depth[""] >= 2:
        ahead = ", ".join(f"model.get_submodule({p!r})" for p in order[:depth[""]])
        lines.append(f"    model.set_modules_to_forward_prefetch([{ahead}])")
    lines.append("    # after fully_shard: the optimizer holds this rank's shards (DTensors), so its state is sharded too")
    lines.append("    optimizer = workload.make_optimizer([p for p in model.parameters() if p.requires_grad])")
    return "\n".join(lines)


_CHECKPOINT_HELPER = '''

def checkpoint_blocks(model, blocks):
    """Run each (module, mode) of ``blocks`` under torch.utils.checkpoint (non-reentrant), in place:
    only its inputs are saved, and backward recomputes its forward ("full"), or keeps the outputs
    of SAVED_OPS and recomputes the rest ("selective"). The module keeps its name and parameters."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, op) for op in SAVED_OPS if hasattr(torch.ops.aten, op)}

    def policy(ctx, op, *args, **kwargs):
        keep = getattr(op, "overloadpacket", op) in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    for name, mode in blocks:
        module = model.get_submodule(name)
        options = {}
        if mode == "selective":
            options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False, **options)
'''


def checkpoint_setup_code(checkpoint) -> tuple[str, str, str]:
    """The training file's activation checkpointing of ``checkpoint`` (``(module, mode)`` pairs, a
    strategy's field) in plain PyTorch: the constants, the helper function that runs each module
    under ``torch.utils.checkpoint`` (:func:`synctune.engine.checkpoint.apply_checkpointing`'s
    way: the ``forward`` replaced on the instance, so module paths and parameter names stay),
    and its call before the model is wrapped; three empty strings without checkpointing."""
    pairs = [list(p) for p in checkpoint]
    if not pairs:
        return "", "", ""
    payload = (f"# activation checkpointing: (block, mode); selective keeps the outputs of these aten ops\n"
               f"CHECKPOINT = {pairs!r}\nSAVED_OPS = {list(SAVED_OPS)!r}\n")
    call = ("    # activation checkpointing first, then the wrapping (torch's order: checkpoint, then shard)\n"
            "    checkpoint_blocks(model, CHECKPOINT)\n")
    return payload, _CHECKPOINT_HELPER, call


_SCRIPT = '''"""Train {name} with {what}.

Generated by `synctune apply` from strategy {strategy_hash} ({summary}).
{reason}
Run one process per replica ({replicas} here), e.g. on one machine:

    python -m torch.distributed.run --standalone --nproc-per-node {replicas} {filename} --steps 100

On several machines, start it on each with --nnodes, --node-rank and --rdzv-endpoint; ranks
follow the strategy's replicas in order ({devices}). Options: --steps, --checkpoint FILE,
--log-every N, --warmup W, --quiet.

Rank 0 prints every N steps the step, the loss, rank 0's mean iteration time and the global
samples per second over those steps, and at the end the mean iteration time over the steps
after the first W (warm-up), the figure to compare with the iteration time the search measured;
--quiet prints nothing.
"""

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from synctune.workload import ImportedWorkload, resolve_workload

WORKLOAD = {workload!r}
ROOT = {root!r}  # where relative workload paths are found
SEED = {seed}
BATCH_SPLIT = {batch_split!r}  # per rank, as the strategy was measured
{payload}{helpers}

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint", help="where to save the trained state (rank 0 writes it)")
    parser.add_argument("--log-every", type=int, default=0,
                        help="print every N steps (default: 10, or steps / 5 when fewer than 50 steps)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the final mean iteration time")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    train(args, cuda)
    # Every rank past its last step before the group goes: a rank that tears it down while a
    # peer's comm-hook work is still in flight aborts that peer (measured: 4 of 8 runs with fp16).
    # The model, the engine and their collectives went with train(): collected here, while the
    # interpreter is whole, not at its exit (measured: 2 exits in about 170 aborted, "terminate
    # called without an active exception", when they were left to the interpreter's teardown).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train(args, cuda):
    rank, world = dist.get_rank(), dist.get_world_size()
    data_rank = rank  # whose batches this rank trains (the replicas of a TP group share theirs)
    if world != len(BATCH_SPLIT):
        raise SystemExit(f"the strategy has {{len(BATCH_SPLIT)}} replicas: start {{len(BATCH_SPLIT)}} processes, not {{world}}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    workload = ImportedWorkload(WORKLOAD, ROOT) if ":" in WORKLOAD else resolve_workload(WORKLOAD)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = workload.build_model()
{checkpointing}{setup}
    data = workload.batches(BATCH_SPLIT[rank], data_rank, world, SEED)
    log_every = args.log_every if args.log_every > 0 else max(1, min(10, args.steps // 5))
    talk = rank == 0 and not args.quiet
    global_batch = {global_batch}
    times = []  # rank 0's seconds per step, whole iterations (batch to optimizer step)
    for step in range(args.steps):
        start = time.perf_counter()
        batch = tuple(t.to(device) for t in next(data))
{train_step}
        if talk:
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            if (step + 1) % log_every == 0:
                recent = sum(times[-log_every:]) / len(times[-log_every:])
                print(f"step {{step + 1}}/{{args.steps}}: loss {{loss.item():.4f}}, {{recent * 1e3:.1f}} ms/iteration, "
                      f"{{global_batch / recent:.1f}} samples/s", flush=True)
    if talk and times:
        warm = min(max(args.warmup, 0), len(times) - 1)
        mean = sum(times[warm:]) / len(times[warm:])
        print(f"done: {{args.steps}} steps on {{world}} processes; mean iteration {{mean * 1e3:.2f}} ms over steps "
              f"{{warm + 1}}-{{len(times)}} (rank 0, after {{warm}} warm-up), {{global_batch / mean:.1f}} samples/s "
              f"(compare with the iteration time the search measured)", flush=True)
{save}


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

_TP_STEP = '''        optimizer.zero_grad()
        loss = workload.loss(model, batch)
        {backward}
{reduce}        optimizer.step()'''
_TP_SAVE = '''    if args.checkpoint:
        # every rank takes part: each parameter and buffer whole (DTensor shards gathered), on the CPU
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                 for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"model": state}, args.checkpoint)'''


def tp_setup_code(strategy: Strategy, plan: FSDPPlan | None, embeddings: frozenset[str] = frozenset()) -> str:
    """The training file's tensor parallelism of ``strategy`` in plain PyTorch: the ("dp", "tp")
    mesh, ``parallelize_module`` with the plan written out module by module (``embeddings``: the
    split modules that are an ``nn.Embedding``, whose styles have texts of their own), then FSDP2
    on the ``dp`` sub-mesh (``plan``: the strategy's units) or nothing (the gradients are
    all-reduced over ``dp`` in the step), the optimizer, and the batch of the rank's TP group."""
    import inspect

    from ..engine.tensor_parallel import STYLE_IMPORTS, gather_sequence, style_code

    tp = strategy.tensor_parallel
    t = tp.degree
    dp = len(strategy.replicas) // t
    texts = {module: style_code(tp, style, module in embeddings) for module, style in tp.styles if style != "gather"}
    used = sorted({name for text in texts.values() for name in STYLE_IMPORTS if name + "(" in text})
    placements = [name for name in ("Replicate", "Shard") if any(name + "(" in text for text in texts.values())]
    lines = ["    from torch.distributed.device_mesh import init_device_mesh",
             f"    from torch.distributed.tensor.parallel import {', '.join(used)}, parallelize_module"]
    if placements:
        lines.append(f"    from torch.distributed.tensor import {', '.join(placements)}")
    if tp.sequence_parallel:
        lines.append("    # sequence parallelism: the norms run on slices of the sequence (dimension 1)")
    if embeddings:
        lines.append(f"    # split embeddings ({', '.join(sorted(embeddings))}): every device takes the whole token ids")
    lines += ["",
             f"    # TP groups of {t} consecutive ranks (inside a node), {dp} of them on the data-parallel axis",
             f"    mesh = init_device_mesh(device.type, ({dp}, {t}), mesh_dim_names=(\"dp\", \"tp\"))",
             "    parallelize_module(model, mesh[\"tp\"], {"]
    lines += [f"        {module!r}: {text}," for module, text in texts.items()]
    lines.append("    })")
    if tp.loss_parallel:
        lines.append("")
        lines.append("    # the loss over vocabulary-split logits, forward and backward: torch's loss_parallel")
        lines.append("    from torch.distributed.tensor.parallel import loss_parallel")
        lines.append("    loss_parallel().__enter__()")
    gathered = [module for module, style in tp.styles if style == "gather"]
    if gathered:
        lines.append("")
        lines += ["    " + line if line else "" for line in inspect.getsource(gather_sequence).splitlines()]
        lines.append("")
        lines.append("    # where the sequence leaves the split region: gathered whole before these modules")
        lines += [f"    model.get_submodule({module!r}).register_forward_pre_hook(gather_sequence)" for module in gathered]
    if plan is not None:
        lines.append("    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard")
        lines.append("")
        lines.append("    # FSDP2 over the TP groups: one fully_shard per unit on the dp sub-mesh, the root last")
        for unit in plan.units:
            target = f"model.get_submodule({unit.module!r})" if unit.module else "model"
            policy = ("" if unit.reduce_dtype == "fp32" else
                      ", mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)")
            lines.append(f"    fully_shard({target}, mesh=mesh[\"dp\"], "
                         f"reshard_after_forward={unit.reshard_after_forward!r}{policy})")
    lines.append(f"    data_rank = rank // {t}  # a TP group trains one batch: the one its index would in data parallelism")
    lines.append("    optimizer = workload.make_optimizer([p for p in model.parameters() if p.requires_grad])")
    return "\n".join(lines)


_FSDP_STEP = '''        optimizer.zero_grad()
        loss = workload.loss(model, batch)
        {backward}
        optimizer.step()'''
_FSDP_SAVE = '''    if args.checkpoint:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # every rank takes part: the whole (unsharded) model and optimizer state, gathered to the CPU
        model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": model_state, "optimizer": optimizer_state}, args.checkpoint)'''

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
                    fmt: str = "auto", filename: str = "train.py", seed: int = 0,
                    ddp: DDPConfig | None = None, fsdp: tuple[FSDPPlan | None, str] | None = None) -> tuple[str, str]:
    """The training file for ``strategy`` and the format it uses (``ddp``, ``fsdp`` or
    ``engine``). With ``ddp`` (a tuned DDP configuration that won a search), the file runs DDP so
    configured and ``strategy`` gives only replicas and batch split. ``fsdp``: the strategy's
    FSDP2 plan or None and why not (:func:`fsdp_config`; it needs the model)."""
    if fmt not in FORMATS:
        raise SpecError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    plan, fsdp_why = fsdp if fsdp is not None else (None, "the model was not given to work out its FSDP2 units")
    if strategy.tensor_parallel is not None:
        return _tp_script(strategy, spec, cluster, fmt=fmt, plan=plan, fsdp_why=fsdp_why, workload=workload,
                          root=root, filename=filename, seed=seed)
    if fmt == "tp":
        raise SpecError(f"strategy {strategy.hash[:12]} has no tensor_parallel plan to write as --format tp; use "
                        f"--format auto")
    if fmt == "fsdp" and (plan is None or ddp is not None):
        why = "the search's winner is tuned torch DDP" if ddp is not None else fsdp_why
        raise SpecError(f"strategy {strategy.hash[:12]} cannot run as torch FSDP2: {why}; use --format engine")
    use_fsdp = plan is not None and ddp is None and fmt in ("auto", "fsdp")
    config, why = (ddp, "") if ddp is not None else ddp_config(strategy, spec)
    if fmt == "ddp" and config is None:
        raise SpecError(f"strategy {strategy.hash[:12]} cannot run as plain DDP: {why}; use --format engine")
    if ddp is not None and fmt == "engine":
        raise SpecError("the search's winner is tuned torch DDP, not a strategy of the engine; use --format ddp or auto")
    use_ddp = config is not None and fmt in ("auto", "ddp") and not use_fsdp
    reason = ""
    if use_fsdp:
        mesh = " x ".join(str(n) for n in plan.mesh_shape)
        what = (f"torch FSDP2: fully_shard on {len(plan.units)} unit(s), mesh {mesh}"
                + (" (HSDP)" if len(plan.mesh_shape) == 2 else ""))
        scales = loss_scales(strategy.batch_split)
        payload = ""
        backward = "loss.backward()"
        if any(x != 1.0 for x in scales):
            payload = (f"# FSDP2 averages gradients over ranks equally; with an uneven split each rank's loss is scaled\n"
                       f"# by its share of the global batch times the number of ranks, which weights them as the strategy does\n"
                       f"LOSS_SCALE = {list(scales)!r}\n")
            backward = "(loss * LOSS_SCALE[rank]).backward()"
        setup, step, save = fsdp_setup_code(plan), _FSDP_STEP.format(backward=backward), _FSDP_SAVE
    elif use_ddp:
        hook = "" if config.comm_hook == "none" else f", the {config.comm_hook} comm hook"
        what = (f"plain torch DDP as tuned by the search ({ddp.summary()})" if ddp is not None else
                f"plain torch DDP: buckets up to {config.bucket_cap_mb:g} MiB (the strategy's largest merge "
                f"group){hook}, gradient_as_bucket_view")
        payload = f"DDP_CONFIG = {_literal(config.to_dict())}\n"
        setup, step, save = _DDP_SETUP, _DDP_STEP, _DDP_SAVE
    else:
        what = "the synctune engine running the strategy"
        payload = (f"STRATEGY = {_literal(strategy.to_dict())}\nSPEC = {_literal(spec.to_dict())}\n"
                   f"CLUSTER = {_literal(cluster.to_dict())}\n")
        setup, step, save = _ENGINE_SETUP, _ENGINE_STEP, _ENGINE_SAVE
        if has_shard_plans(strategy):
            reason = f"torch FSDP2 cannot run it: {_plain(fsdp_why)}.\n"
        elif why:
            reason = f"Plain DDP cannot run it: {_plain(why)}.\n"
    checkpoint_payload, helpers, checkpointing = checkpoint_setup_code(strategy.checkpoint)
    if strategy.checkpoint:
        what += f"; {checkpoint_label(strategy.checkpoint, len(checkpoint_blocks(v.name for v in spec.variables)))}"
    text = _SCRIPT.format(name=_plain(spec.name), what=_plain(what), strategy_hash=strategy.hash[:12],
                          summary=_plain(strategy.summary()), reason=reason, replicas=len(strategy.replicas),
                          filename=_plain(filename), devices=_plain(", ".join(strategy.replicas[:6]) + (
                              ", ..." if len(strategy.replicas) > 6 else "")),
                          workload=workload, root=root, seed=seed, batch_split=list(strategy.batch_split),
                          payload=payload + checkpoint_payload, helpers=helpers, checkpointing=checkpointing,
                          setup=setup, train_step=step, save=save, global_batch="sum(BATCH_SPLIT)")
    return text, "fsdp" if use_fsdp else "ddp" if use_ddp else "engine"


def _tp_script(strategy: Strategy, spec: ModelSpec, cluster: ClusterSpec, *, fmt: str, plan: FSDPPlan | None,
               fsdp_why: str, workload: str, root: str, filename: str, seed: int) -> tuple[str, str]:
    """The training file of a strategy with ``tensor_parallel`` (:func:`tp_setup_code`): torch's
    DTensor as the ``tp`` runtime runs it, the data-parallel axis FSDP2 (``plan``) or all-reduced."""
    if fmt not in ("auto", "tp"):
        raise SpecError(f"strategy {strategy.hash[:12]}: tensor_parallel: it splits modules across TP groups, which "
                        f"{FORMAT_NAMES.get(fmt, fmt)} would not do; use --format tp (or auto)")
    t = strategy.tensor_parallel.degree
    sharded = has_shard_plans(strategy)
    if sharded and plan is None:
        raise SpecError(f"strategy {strategy.hash[:12]} cannot run as torch FSDP2 over its TP groups: "
                        f"{_plain(fsdp_why)}")
    groups: dict[int, list[str]] = {}
    for p in strategy.plans:
        groups.setdefault(p.shards[0].synchronizer.merge_id or 0, []).append(p.variable)
    scales = loss_scales(strategy.batch_split[::t])
    payload = f"TP_DEGREE = {t}\n"
    backward = "loss.backward()"
    if any(x != 1.0 for x in scales):
        payload += (f"# the data-parallel axis averages the TP groups equally; with an uneven split each group's loss\n"
                    f"# is scaled by its share of the global batch times the number of groups\n"
                    f"LOSS_SCALE = {list(scales)!r}\n")
        backward = "(loss * LOSS_SCALE[rank // TP_DEGREE]).backward()"
    reduce = ""
    helpers = ""
    setup_extra = ""
    if not sharded and len(groups) and len(strategy.replicas) > t:
        payload += f"MERGE_GROUPS = {_literal([groups[g] for g in sorted(groups)])}  # all-reduced together\n"
        reduce = ("        allreduce_gradients([[params[n] for n in names if n in params] for names in MERGE_GROUPS],\n"
                  "                            mesh[\"dp\"].get_group())\n")
        helpers = "\n\n" + inspect.getsource(allreduce_gradients)
        setup_extra = "\n    params = dict(model.named_parameters())"
    dp_words = (f"FSDP2 over the {len(strategy.replicas) // t} TP groups" if sharded else
                "gradients all-reduced over the TP groups" if len(strategy.replicas) > t else "one TP group")
    what = f"torch DTensor tensor parallelism of degree {t} ({len(strategy.tensor_parallel.styles)} modules), {dp_words}"
    checkpoint_payload, checkpoint_helpers, checkpointing = checkpoint_setup_code(strategy.checkpoint)
    if strategy.checkpoint:
        what += f"; {checkpoint_label(strategy.checkpoint, len(checkpoint_blocks(v.name for v in spec.variables)))}"
    text = _SCRIPT.format(name=_plain(spec.name), what=_plain(what), strategy_hash=strategy.hash[:12],
                          summary=_plain(strategy.summary()), reason="", replicas=len(strategy.replicas),
                          filename=_plain(filename), devices=_plain(", ".join(strategy.replicas[:6]) + (
                              ", ..." if len(strategy.replicas) > 6 else "")),
                          workload=workload, root=root, seed=seed, batch_split=list(strategy.batch_split),
                          payload=payload + checkpoint_payload, helpers=helpers + checkpoint_helpers,
                          checkpointing=checkpointing, setup=tp_setup_code(strategy, plan if sharded else None, frozenset(
                              m for m, _s in strategy.tensor_parallel.styles if is_embedding(spec, m))) + setup_extra,
                          train_step=_TP_STEP.format(backward=backward, reduce=reduce), save=_TP_SAVE,
                          global_batch="sum(BATCH_SPLIT[::TP_DEGREE])")
    return text, "tp"


def write_training_file(strategy: Strategy, workload, cluster: ClusterSpec, output, fmt: str = "auto",
                        seed: int = 0, ddp: DDPConfig | None = None) -> str:
    """Write the training file of ``strategy`` for ``workload``; returns the format used."""
    from pathlib import Path

    from ..spec.files import write_text_atomic
    from ..strategy.validate import validate

    spec = workload.spec()
    validate(strategy, spec, cluster)
    fsdp = fsdp_config(strategy, spec, workload) if ddp is None and fmt in ("auto", "fsdp", "tp") else None
    text, used = training_script(strategy, spec, cluster, workload=workload.source.removeprefix("zoo:"),
                                 root=getattr(workload, "root", "") or "", fmt=fmt, filename=Path(output).name,
                                 seed=seed, ddp=ddp, fsdp=fsdp)
    write_text_atomic(output, text)
    return used


def run_command(strategy: Strategy, output) -> str:
    """How to run a training file: torchrun with one process per replica."""
    return f"python -m torch.distributed.run --standalone --nproc-per-node {len(strategy.replicas)} {output}"


def apply_search_result(best: dict, workload, cluster: ClusterSpec, best_path, *, seed: int = 0,
                        logger=None, parent_run_id: str = "", ddp: dict | None = None, fmt: str = "auto"):
    """The best strategy of a search (or, ``ddp`` given, the tuned DDP configuration that won)
    as a training file next to it (``<best>-train.py``), also attached to the search's MLflow
    run; returns (path, format used). ``fmt``: the training file's format (:data:`FORMATS`; the
    runtime the search measured the winner on, so the file runs what was measured)."""
    from pathlib import Path

    path = Path(best_path).with_name(Path(best_path).stem + "-train.py")
    used = write_training_file(Strategy.from_dict(best), workload, cluster, path, fmt, seed=seed,
                               ddp=DDPConfig.from_dict(ddp) if ddp else None)
    if logger is not None and parent_run_id:
        logger.log_text(parent_run_id, path.read_text(), "train.py")
    return path, used
