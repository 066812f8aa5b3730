"""The ``tp`` runtime: tensor parallelism by torch's DTensor on a ``("dp", "tp")`` mesh, composed
with data parallelism on the other axis (DESIGN.md "tensor parallelism"; torchtitan's
``parallelize`` functions; :mod:`synctune.strategy.tensor_parallel` for the language).

On each rank: the device mesh ``(replicas // t, t)`` named ``("dp", "tp")``; the model's
checkpointing already applied by the trial; ``parallelize_module`` on the ``tp`` sub-mesh with
``ColwiseParallel``/``RowwiseParallel`` per split module, a linear layer or an embedding
(parameters become DTensors, outputs local tensors); then the data-parallel axis as the strategy's plans say:

- all ``shard``: FSDP2's ``fully_shard`` of the strategy's units on the ``dp`` sub-mesh
  (:func:`~synctune.engine.fsdp.plan_from_strategy`: the same units, reshard, prefetch and reduce
  dtype as the ``fsdp-plans`` runtime), FSDP2 averaging gradients over the TP groups;
- all ``allreduce``: after backward, each merge group's local gradients (a DTensor's local
  shard, a replicated parameter's whole gradient) flattened and all-reduced over the ``dp``
  process group, one collective per group, then divided by the number of TP groups.

The replicas of one TP group train the same batch, the one rank g of data parallelism over the
groups trains for group g (:meth:`TensorParallelRuntime.batch_rank`); an
uneven split across the groups is weighted as FSDP2's is, by scaling each group's loss.

Before any worker starts, the trial's check runs the plan's forward once in the calling
process at a device's local shapes (:func:`check_local_forward`): a model that reshapes split
projections by the head count fails there and is refused, naming the module.
Before the first iteration every rank compares the model's loss on its batch unsplit (before
``parallelize_module``) and split, in eval mode without gradients: a plan whose split changes
what the model computes (a module between a column-wise and a row-wise one that mixes the split
features: a reshape by the head count, a norm over the features) is refused on every rank
together, naming the field and the fix, as is a split forward that fails, naming the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..spec.errors import SpecError
from ..strategy.tensor_parallel import SEQUENCE_STYLES, SPLIT_STYLES, check_tensor_parallel, local_shape
from .fsdp import check_plan, escaping_parameters, loss_scales, meta_model, plan_from_strategy, refuse_sparse
from .runtime import ArmContext, PlansRuntime, Stepper, per_world

__all__ = ["TensorParallelRuntime", "TP_RUNTIME", "STYLE_CODE", "STYLE_IMPORTS", "style_code", "embedding_modules",
           "gather_sequence", "tp_plan", "split_locally", "check_local_forward", "apply_tensor_parallel", "apply_data_parallel",
           "allreduce_gradients", "loss_tolerance"]

#: How far the split model's loss may be from the unsplit one's, relative (float32 sums in
#: another order: a row-wise layer adds its partial sums across the group).
loss_tolerance = 1e-4


#: Each style's torch expression, without and with sequence parallelism (the runtime builds its
#: plan from these texts, and training files carry them as they are): in a sequence-parallel plan
#: a column-wise module all-gathers its sequence-sharded input and a row-wise one reduce-scatters
#: its output onto the sequence; the region's tensors stay DTensors between modules. An embedding's
#: style has its own text where it differs, keyed ``(style, sequence_parallel, "embedding")``: a
#: row-wise embedding takes the whole token ids on every device (``RowwiseParallel``'s default input
#: is a linear's, a shard of the last dimension, which would all-gather the ids into a wider batch),
#: its partial sums all-reduced, or in a sequence-parallel plan reduce-scattered onto the sequence as
#: torchtitan does for its token embedding. A column-wise embedding is a column-wise linear's
#: ``ColwiseParallel()`` (whole ids in, the output split on the features).
STYLE_CODE = {
    ("colwise", False): "ColwiseParallel()",
    ("rowwise", False): "RowwiseParallel()",
    ("colwise", True): "ColwiseParallel(input_layouts=Shard(1))",
    ("rowwise", True): "RowwiseParallel(output_layouts=Shard(1), use_local_output=False)",
    ("logits", False): "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)",
    ("logits", True): "ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)",
    ("rowwise", False, "embedding"): "RowwiseParallel(input_layouts=Replicate())",
    ("rowwise", True, "embedding"): ("RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), "
                                     "use_local_output=False)"),
    ("sequence", True): "SequenceParallel()",
    ("scatter", True): ("PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), "
                        "use_local_output=False)"),
}


def gather_sequence(_module, args):
    """A ``gather`` module's forward pre-hook: each DTensor argument (sharded on the sequence)
    gathered whole into a plain tensor, whole ones passed as they are. (torch's
    ``PrepareModuleInput`` would take a plain argument for a shard: a module after the region
    may get either.) Written into training files as it is."""
    return tuple(a.full_tensor() if hasattr(a, "full_tensor") else a for a in args)


#: The names :data:`STYLE_CODE`'s texts use (what a training file imports).
STYLE_IMPORTS = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                 "PrepareModuleOutput")


def style_code(tp: Any, style: str, embedding: bool = False) -> str:
    """The torch expression of ``style`` in plan ``tp`` for a linear layer, or for an
    ``nn.Embedding`` with ``embedding`` (:data:`STYLE_CODE`; None for ``gather``, which is
    :func:`gather_sequence`)."""
    if embedding and (style, tp.sequence_parallel, "embedding") in STYLE_CODE:
        return STYLE_CODE[(style, tp.sequence_parallel, "embedding")]
    return STYLE_CODE.get((style, tp.sequence_parallel))


def embedding_modules(model: Any, strategy: Any) -> frozenset[str]:
    """The modules of ``strategy``'s tensor-parallel plan that are an ``nn.Embedding`` in ``model``."""
    import torch

    return frozenset(name for name, _style in strategy.tensor_parallel.styles
                     if isinstance(model.get_submodule(name), torch.nn.Embedding))


def tp_plan(strategy: Any, embeddings: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``parallelize_module``'s plan for ``strategy``: each module's torch style
    (:data:`STYLE_CODE`; ``embeddings``: the modules that are an ``nn.Embedding``)."""
    import torch.distributed.tensor.parallel as parallel
    from torch.distributed.tensor import Replicate, Shard

    names = {name: getattr(parallel, name) for name in STYLE_IMPORTS}
    names.update(Shard=Shard, Replicate=Replicate)
    tp = strategy.tensor_parallel
    return {module: eval(style_code(tp, style, module in embeddings), {"__builtins__": {}},  # noqa: S307
                         names)  # constant texts above
            for module, style in tp.styles if style != "gather"}


def _dp_sharded(strategy: Any) -> bool:
    """Whether the data-parallel axis is FSDP2's (``shard`` plans; else an all-reduce: validation
    makes every plan one kind)."""
    from .fsdp import has_shard_plans

    return has_shard_plans(strategy)


def _mesh(device_type: str, dp: int, t: int) -> Any:
    """The ``("dp", "tp")`` mesh, made once per world (:func:`per_world`)."""
    from torch.distributed.device_mesh import init_device_mesh

    return per_world(("tp-mesh", device_type, dp, t),
                     lambda: init_device_mesh(device_type, (dp, t), mesh_dim_names=("dp", "tp")))


def _check_modules(module: Any, strategy: Any, spec: Any = None) -> None:
    """Every module of the plan is in ``module``; a column- or row-wise one is an ``nn.Linear`` or
    a dense ``nn.Embedding`` (which the model spec ``spec``, where given, marks as one: validation
    took the spec's word for the axes), a ``logits`` one an ``nn.Linear``, a sequence one holds no
    parameter of more than one dimension; and no other module shares the parameters of a split or
    sequence module (a tied weight, e.g. an embedding and an output layer: ``parallelize_module``
    gives the module a DTensor of its own, so the tie would be broken silently and the two copies
    trained apart)."""
    import torch

    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for name, style in strategy.tensor_parallel.styles:
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            raise SpecError(f"strategy: tensor_parallel: modules: the model has no module {name!r}") from None
        if style in SEQUENCE_STYLES:
            params = dict(sub.named_parameters())
            if style == "sequence" and any(p.dim() > 1 for p in params.values()):
                leaf = next(k for k, p in params.items() if p.dim() > 1)
                raise SpecError(f"strategy: tensor_parallel: modules: {name!r} (sequence) is a {type(sub).__name__} "
                                f"holding {name + '.' + leaf!r} of {params[leaf].dim()} dimensions; a sequence module "
                                f"computes per position with per-feature parameters (a norm, dropout)")
        elif type(sub) is torch.nn.Embedding and style in ("colwise", "rowwise"):
            if sub.sparse:
                raise SpecError(f"strategy: tensor_parallel: modules: {name!r} ({style}) is an nn.Embedding with a "
                                f"sparse gradient (sparse=True), which torch's DTensor cannot split; build it with "
                                f"sparse=False or leave it whole")
            if spec is not None and getattr(spec, "embedding_ties", lambda _m: None)(name) is None:
                raise SpecError(f"strategy: tensor_parallel: modules: {name!r} ({style}) is an nn.Embedding the model "
                                f"spec {spec.name!r} does not list among its embeddings (a spec extracted before "
                                f"it recorded them), so the plan was checked as a linear layer's; extract the spec "
                                f"again")
        elif type(sub) is not torch.nn.Linear:
            what = "an nn.Linear" if style == "logits" else "an nn.Linear or nn.Embedding"
            raise SpecError(f"strategy: tensor_parallel: modules: {name!r} ({style}) is a {type(sub).__name__}, "
                            f"not {what}, which torch's {'Rowwise' if style == 'rowwise' else 'Colwise'}Parallel "
                            f"splits; leave it whole")
        if style in ("scatter", "gather"):  # their parameters stay plain tensors
            continue
        for leaf, param in sub.named_parameters(recurse=False):
            shared = [n for n in names.get(id(param), []) if n != f"{name}.{leaf}"]
            if shared:
                raise SpecError(f"strategy: tensor_parallel: modules: {name!r} ({style}) holds {name + '.' + leaf!r}, "
                                f"which the model ties to {shared[0]!r}; splitting it would untie them and train two "
                                f"copies: leave {name!r} whole")


def _local_embedding(rows: int, dim: int, old: Any) -> Any:
    """An ``nn.Embedding`` of ``rows`` x ``dim`` (a device's share of ``old``) that takes the whole
    model's token ids: for a vocabulary split, ids beyond its rows are taken modulo them. Only the
    shapes a device computes with are checked with it (a device of a row-wise split looks up
    every id of the batch in its rows and zeros the others), so which row an id reads does not
    matter, and an id out of range must not stop the check."""
    import torch

    class LocalEmbedding(torch.nn.Embedding):
        def forward(self, ids):  # noqa: D102 - nn.Embedding's, on ids folded into the local rows
            return super().forward(ids.remainder(self.num_embeddings))

    return LocalEmbedding(rows, dim, device=old.weight.device, dtype=old.weight.dtype)


def split_locally(model: Any, tp: Any) -> Any:
    """``model`` with each linear layer and embedding a tensor-parallel plan ``tp`` splits replaced
    by one of the shape a device of its TP group holds
    (:func:`~synctune.strategy.tensor_parallel.local_shape`): what a device computes with,
    without the collectives, for :func:`check_local_forward`."""
    import torch

    for name, style in tp.styles:
        # Sequence parallelism splits no parameter; the output layer of a loss over the
        # vocabulary's shards stays whole here (the model's loss views the logits by the whole
        # vocabulary, its targets index it).
        if style not in SPLIT_STYLES or style == "logits":
            continue
        old = model.get_submodule(name)
        weight = tuple(old.weight.shape)
        if isinstance(old, torch.nn.Embedding):
            rows, dim = local_shape(tp, name + ".weight", weight, embedding=True)
            new = _local_embedding(rows, dim, old)
        else:
            out, inp = local_shape(tp, name + ".weight", weight)
            new = torch.nn.Linear(inp, out, bias=old.bias is not None, device=old.weight.device,
                                  dtype=old.weight.dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


#: Plans already run at a device's local shapes in this process (:func:`check_local_forward`).
_LOCAL_FORWARDS: dict[tuple[str, str], str | None] = {}


def check_local_forward(workload: Any, strategy: Any) -> None:
    """Refuse, before any worker starts, a plan whose forward fails at a device's local shapes:
    the workload's model built in this process with every split module at the shapes a device
    of its TP group holds (:func:`~synctune.engine.memory.split_locally`), one forward of one
    sample without gradients. A model that reshapes a column-wise module's output by the head
    count (``view(b, s, heads, head_dim)``) fails there, as it would on the workers, and the
    refusal names the module, the field and the fix. A forward that runs at local shapes may
    still compute something other than the unsplit model (``view(b, s, heads, -1)``): the
    workers' check compares the losses, on every rank together. Each (workload, plan) is run
    once per process; a model that fails unsplit too is left to the trial to report."""
    import torch

    from ..strategy.tensor_parallel import tp_key

    key = (str(getattr(workload, "source", None) or workload.name), tp_key(strategy.tensor_parallel))
    if key not in _LOCAL_FORWARDS:
        _LOCAL_FORWARDS[key] = None

        def loss_of(split: bool) -> None:
            torch.manual_seed(0)
            model = workload.build_model()
            if split:
                split_locally(model, strategy.tensor_parallel)
            cpu = torch.device("cpu")
            batch = workload.make_batch(1, rank=0, generator=torch.Generator(device=cpu).manual_seed(0), device=cpu)
            model.eval()
            running = _Running(model)
            try:
                with torch.no_grad():
                    workload.loss(model, batch)
            except Exception as exc:
                where = running.stack[-1] if running.stack else ""
                raise _LocalFailure(where, exc) from None
            finally:
                running.close()

        try:
            loss_of(split=True)
        except _LocalFailure as failure:
            try:
                loss_of(split=False)
            except _LocalFailure:
                return  # the model fails whole: the trial reports that
            first = str(failure.exc).strip().splitlines()[0] if str(failure.exc).strip() else type(failure.exc).__name__
            _LOCAL_FORWARDS[key] = (
                f"strategy: tensor_parallel: modules: at a device's local shapes (degree "
                f"{strategy.tensor_parallel.degree}) the model fails in module {failure.where or 'root'!r}: "
                f"{first[:300]}; a column-wise module's output must reach a row-wise one through per-feature "
                f"operations only: split attention and MLP pairs, reshape heads by their size "
                f"(view(..., -1, head_dim), not the head count), or leave the module whole")
    if _LOCAL_FORWARDS[key]:
        raise SpecError(_LOCAL_FORWARDS[key])


class _LocalFailure(Exception):
    """A forward at local shapes that failed inside module ``where``."""

    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(where)
        self.where, self.exc = where, exc


def apply_tensor_parallel(model: Any, strategy: Any, device_type: str) -> tuple[Any, Any]:
    """``parallelize_module`` on the ``tp`` sub-mesh; returns ``(model, mesh)``."""
    from torch.distributed.tensor.parallel import parallelize_module

    t = strategy.tensor_parallel.degree
    mesh = _mesh(device_type, len(strategy.replicas) // t, t)
    parallelize_module(model, mesh["tp"], tp_plan(strategy, embedding_modules(model, strategy)))
    for module, style in strategy.tensor_parallel.styles:
        if style == "gather":
            model.get_submodule(module).register_forward_pre_hook(gather_sequence)
    return model, mesh


def apply_data_parallel(model: Any, strategy: Any, spec: Any, mesh: Any, device_type: str) -> Any:
    """FSDP2 on the ``dp`` sub-mesh where the plans shard (after :func:`apply_tensor_parallel`)."""
    from .fsdp import apply_fsdp

    if _dp_sharded(strategy):
        plan = plan_from_strategy(model, strategy, spec)
        check_plan(plan, from_plans=True, checkpoint=strategy.checkpoint)
        apply_fsdp(model, plan, device_type, mesh=mesh["dp"])
    return model


def allreduce_gradients(groups, group):
    """Average each list of ``groups``' parameters' local gradients (a DTensor's shard, a whole
    tensor's gradient) over the process group ``group``: flattened into one buffer per list, one
    all-reduce each, copied back. (Written into tensor-parallel training files as it is: plain
    torch.)"""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    for params in groups:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class _Running:
    """The innermost module whose forward is running, for the message of a split forward that
    fails (forward pre- and post-hooks on every module)."""

    def __init__(self, model: Any) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, sub in model.named_modules():
            self.handles.append(sub.register_forward_pre_hook(self._enter(name)))
            self.handles.append(sub.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(_module, _args) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, _module, _args, _out) -> None:
        self.stack.pop()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _forward_loss(model: Any, loss_of: Any) -> float:
    """The loss of ``model`` in eval mode without gradients (dropout off), as a float."""
    import torch

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            loss = loss_of(model)
            return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    finally:
        model.train(was)


def _agree(problem: str | None, device: Any) -> None:
    """Raise on every rank when any rank found a ``problem`` (the lowest such rank's message)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0 if problem is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag.item()):
        messages: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, problem)
        raise SpecError(next(m for m in messages if m))


def _checked_split(ctx: ArmContext, model: Any) -> Any:
    """Split ``model`` (:func:`apply_tensor_parallel`) and compare its loss with the unsplit
    model's on this rank's batch (before FSDP2 wraps it: a forward outside autograd would leave
    its units gathered without their backward hooks); every rank refuses together when any
    rank's differs or fails."""
    before = _forward_loss(model, ctx.loss_of) if ctx.loss_of is not None else None
    model, mesh = apply_tensor_parallel(model, ctx.strategy, ctx.device.type)
    problem = None
    if before is not None:
        running = _Running(model)
        try:
            after = _forward_loss(model, ctx.loss_of)
            if abs(after - before) > loss_tolerance * max(1.0, abs(before)):
                problem = (f"strategy: tensor_parallel: modules: under this plan the model's loss is {after:.6g} where "
                           f"unsplit it is {before:.6g}: a module between a column-wise and a row-wise one mixes the "
                           f"split features (a reshape by the head count instead of the head size, a norm or "
                           f"softmax over the features), or a column-wise module's output reaches something other "
                           f"than a row-wise one; split attention (query, key, value column-wise, output row-wise) "
                           f"and MLP pairs only, and reshape heads by their size (view(..., -1, head_dim))")
        except Exception as exc:  # noqa: BLE001 - reported on every rank together, naming the module
            where = running.stack[-1] if running.stack else ""
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problem = (f"strategy: tensor_parallel: modules: the split model fails in module {where or 'root'!r}: "
                       f"{first[:300]}; a column-wise module's output must reach a row-wise one through per-feature "
                       f"operations only: split attention and MLP pairs, and reshape heads by their size")
        finally:
            running.close()
    _agree(problem, ctx.device)
    return model, mesh


@dataclass(frozen=True)
class TensorParallelRuntime(PlansRuntime):
    """Tensor parallelism by DTensor with data parallelism on the other mesh axis (see the module
    docstring). It has no settings: the strategy is its configuration."""

    name = "tp"
    label = "TP"
    runs_tensor_parallel = True

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, a plan the workers would not run as it says."""
        if strategy.tensor_parallel is None:
            raise SpecError(f"{self.name} runtime: the strategy has no tensor_parallel plan; run it with the engine")
        refuse_sparse(spec)
        try:
            check_tensor_parallel(strategy, spec, cluster)
        except Exception as exc:
            raise SpecError(str(exc)) from None
        module = meta_model(workload) if workload is not None else None
        if module is not None:
            _check_modules(module, strategy, spec)
            if _dp_sharded(strategy):
                check_plan(plan_from_strategy(module, strategy, spec), escaping_parameters(module, workload),
                           from_plans=True, checkpoint=strategy.checkpoint)
        if workload is not None and getattr(workload, "framework", "torch") == "torch":
            check_local_forward(workload, strategy)

    def plans_refusal(self, strategy: Any, cluster: Any, module: Any, spec: Any, workload: Any = None) -> str | None:
        """Why the plan cannot run on ``module`` (the workload's model on the meta device), or None;
        with the ``workload``, also a plan whose forward fails at a device's local shapes
        (:func:`check_local_forward`, run once per plan), which the workers would refuse."""
        try:
            self.check(strategy, spec, cluster)
            if module is not None:
                _check_modules(module, strategy, spec)
            if workload is not None and getattr(workload, "framework", "torch") == "torch":
                check_local_forward(workload, strategy)
        except SpecError as exc:
            return str(exc)
        return None

    def batch_rank(self, strategy: Any, rank: int) -> int:
        """The replicas of a TP group train one batch, the one data parallelism over the groups
        would give the group's index."""
        return rank // strategy.tensor_parallel.degree

    def training_format(self, strategy: Any) -> str:
        return "tp"

    def prepare(self, ctx: ArmContext) -> Stepper:
        _check_modules(ctx.model, ctx.strategy, ctx.spec)
        t = ctx.strategy.tensor_parallel.degree
        # A loss over vocabulary-split logits: torch's loss_parallel, entered for forward and
        # backward alike until the stepper closes (it changes only DTensor loss operations).
        losses = None
        if ctx.strategy.tensor_parallel.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            losses = loss_parallel()
            losses.__enter__()
        try:
            return self._prepare(ctx, t, losses)
        except BaseException:
            if losses is not None:
                losses.__exit__(None, None, None)
            raise

    def _prepare(self, ctx: ArmContext, t: int, losses: Any) -> Stepper:
        model, mesh = _checked_split(ctx, ctx.model)
        model = apply_data_parallel(model, ctx.strategy, ctx.spec, mesh, ctx.device.type)
        dp_index = ctx.rank // t
        scale = loss_scales(ctx.strategy.batch_split[::t])[dp_index]
        optimizer = ctx.make_optimizer([p for p in model.parameters() if p.requires_grad])
        groups: list[list[Any]] = []
        if not _dp_sharded(ctx.strategy) and mesh["dp"].size() > 1:
            merge = {p.variable: p.shards[0].synchronizer.merge_id or 0 for p in ctx.strategy.plans}
            by_group: dict[int, list[Any]] = {}
            for name, param in model.named_parameters():
                if param.requires_grad:
                    by_group.setdefault(merge.get(name, 0), []).append(param)
            groups = [by_group[g] for g in sorted(by_group)]
        dp_group = mesh["dp"].get_group()

        def step() -> None:
            allreduce_gradients(groups, dp_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def close() -> None:
            if losses is not None:
                losses.__exit__(None, None, None)

        return Stepper(forward_model=model, step=step, loss_scale=scale, close=close,
                       memory_parts=lambda: {"optimizer": optimizer, "units": []})

    def summary(self) -> str:
        return "tensor parallelism (DTensor) from the strategy's plan"

    def describe(self, strategy: Any) -> str:
        return f"torch DTensor tensor parallelism running {strategy.summary()}"


#: The ``tp`` runtime (no settings of its own: one value serves every trial).
TP_RUNTIME = TensorParallelRuntime()
